"""SimBackend on the virtual-time loop: exact per-layer landing times, FIFO links,
full duplex, layer-wise ``after``, cancel, failure injection, metrics."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import simpy

from kvflow.backend import TransferBackend
from kvflow.errors import ConfigError, TransferError
from kvflow.layout import ModelSpec
from kvflow.manager import OpKind, TransferOp
from kvflow.profile import PROFILES
from kvflow.radix import Tier
from sim.hierarchy import Hierarchy, Link, SimBackend, SimTransfer
from sim.loop import VirtualTimeLoop, run_sim
from sim.world import sim_service_s

pytestmark = pytest.mark.virtual_time

MiB = 2**20
GiB = 2**30
LAT = 10e-6
#: 4 layers; one block of one layer is exactly 1 MiB (k and v of 256 tokens x 8 heads x 128).
SPEC = ModelSpec("t", num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=256)
assert SPEC.bytes_per_layer_block == MiB

PCIE = Link(GiB, LAT)
DISK = Link(GiB / 2, 100e-6, overlap_latency=True)
HIER = Hierarchy(h2d=PCIE, d2h=PCIE, storage_read=DISK, storage_write=Link(GiB / 4, 1e-4, True))

_ids = itertools.count()


def op(src: Tier, dst: Tier, blocks: int, kind: OpKind = OpKind.SWAP_IN) -> TransferOp:
    ids = list(range(blocks))
    return TransferOp(next(_ids), kind, src, dst, ids, ids, [])


H2D = (Tier.HOST, Tier.DEVICE)
D2H = (Tier.DEVICE, Tier.HOST)


class Sink:
    """Records (what, virtual time) and checks the LayerSink contract as it goes."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.events: list[tuple[object, float]] = []
        self.layers: list[float] = []
        self.done_at: float | None = None
        self.error: BaseException | None = None
        loop = asyncio.get_running_loop()
        self.finished = loop.create_future()

    def layer_done(self, layer: int) -> None:
        assert self.done_at is None, "layer after done"
        assert layer == len(self.layers), f"layer {layer} out of order"
        self.layers.append(self.env.now)
        self.events.append((layer, self.env.now))

    def done(self, error: BaseException | None = None) -> None:
        assert self.done_at is None, "done twice"
        self.done_at = self.env.now
        self.error = error
        self.events.append(("done", self.env.now))
        self.finished.set_result(None)


def setup(hier: Hierarchy = HIER, **kw: object) -> tuple[VirtualTimeLoop, simpy.Environment,
                                                         SimBackend]:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop)
    return loop, loop.env, SimBackend(loop.env, SPEC, hier, **kw)  # type: ignore[arg-type]


def sums(start: float, unit: float, n: int) -> list[float]:
    """Landing times of n units back to back: the same float additions the backend does."""
    out = []
    t = start
    for _ in range(n):
        t = t + unit
        out.append(t)
    return out


# ---------------------------------------------------------------- timings
@pytest.mark.asyncio
async def test_one_op_lands_layer_by_layer_at_exact_times() -> None:
    _, env, be = setup()
    sink = Sink(env)
    be.submit(op(*H2D, blocks=2), sink, ())
    await sink.finished
    unit = LAT + 2 * MiB / GiB  # 10 us + 1/512 s per layer
    assert sink.layers == sums(0.0, unit, 4)
    assert sink.layers == pytest.approx([(i + 1) * (10e-6 + 2**-9) for i in range(4)], rel=1e-14)
    assert sink.done_at == sink.layers[-1] and sink.error is None
    assert [e for e, _ in sink.events] == [0, 1, 2, 3, "done"]


@pytest.mark.asyncio
async def test_dyadic_numbers_give_closed_form_times() -> None:
    hier = Hierarchy(Link(GiB, 2**-14), PCIE, DISK, DISK)
    _, env, be = setup(hier)
    sink = Sink(env)
    be.submit(op(*H2D, blocks=1), sink, ())
    await sink.finished
    assert sink.layers == [(i + 1) * (2**-14 + 2**-10) for i in range(4)]


@pytest.mark.asyncio
async def test_per_layer_awaits_resume_at_landing_times() -> None:
    loop, _, be = setup()

    class FutureSink:
        def __init__(self) -> None:
            self.futs = [loop.create_future() for _ in range(4)]
            self.end = loop.create_future()

        def layer_done(self, i: int) -> None:
            self.futs[i].set_result(i)

        def done(self, error: BaseException | None = None) -> None:
            self.end.set_result(error)

    s = FutureSink()
    await asyncio.sleep(1.0)
    be.submit(op(*D2H, blocks=3), s, ())
    seen = []
    for f in s.futs:
        await f
        seen.append(loop.time())
    assert seen == sums(1.0, LAT + 3 * MiB / GiB, 4)
    assert await s.end is None


@pytest.mark.asyncio
async def test_two_ops_on_one_link_are_fifo() -> None:
    _, env, be = setup()
    a, b = Sink(env), Sink(env)
    be.submit(op(*H2D, blocks=2), a, ())
    be.submit(op(*H2D, blocks=1), b, ())
    await asyncio.gather(a.finished, b.finished)
    ua, ub = LAT + 2 * MiB / GiB, LAT + MiB / GiB
    assert a.layers == sums(0.0, ua, 4)
    assert b.layers == sums(a.layers[-1], ub, 4)  # b starts after a's last layer


@pytest.mark.asyncio
async def test_h2d_and_d2h_are_independent_full_duplex() -> None:
    _, env, be = setup()
    load, store = Sink(env), Sink(env)
    be.submit(op(*H2D, blocks=2), load, ())
    be.submit(op(*D2H, blocks=2), store, ())
    await asyncio.gather(load.finished, store.finished)
    assert load.layers == store.layers == sums(0.0, LAT + 2 * MiB / GiB, 4)


@pytest.mark.asyncio
async def test_duplex_share_slows_units_started_while_the_other_way_is_busy() -> None:
    """With ``duplex`` < 1, a PCIe unit that starts while the opposite direction has a
    unit on the wire moves at that share of its bandwidth; alone, at full speed."""
    hier = Hierarchy(PCIE, PCIE, DISK, DISK, duplex=0.5)
    _, env, be = setup(hier)
    load, store = Sink(env), Sink(env)
    full, shared = LAT + 2 * MiB / GiB, LAT + 2 * MiB / GiB / 0.5
    h_load = be.submit(op(*H2D, blocks=2), load, ())   # starts alone: full speed
    h_store = be.submit(op(*D2H, blocks=2), store, ())  # starts beside the load: shared
    await asyncio.gather(load.finished, store.finished)
    # the load's units each start while the store is on the wire (it never is idle
    # at the load's unit boundaries: its units are twice as long), except the first
    assert load.layers[0] == full
    assert load.layers[1:] == pytest.approx(sums(full, shared, 3), rel=1e-12)
    assert store.layers[0] == pytest.approx(shared, rel=1e-12)
    # service time runs from the first unit's real start
    assert sim_service_s(h_load) == pytest.approx(load.layers[-1], rel=1e-12)
    assert sim_service_s(h_store) == pytest.approx(store.layers[-1], rel=1e-12)
    # the links were busy for the time their units really took
    m = be.metrics()
    assert m["h2d"]["busy_s"] == pytest.approx(load.layers[-1], rel=1e-12)
    assert m["d2h"]["busy_s"] == pytest.approx(store.layers[-1], rel=1e-12)
    # alone afterwards: full speed again
    alone = Sink(env)
    t0 = env.now
    be.submit(op(*H2D, blocks=2), alone, ())
    await alone.finished
    assert alone.layers == pytest.approx(sums(t0, full, 4), rel=1e-12)
    with pytest.raises(ConfigError, match=r"Hierarchy\.duplex"):
        Hierarchy(PCIE, PCIE, DISK, DISK, duplex=0.0)


@pytest.mark.asyncio
async def test_after_orders_layer_by_layer_with_head_of_line_blocking() -> None:
    _, env, be = setup()
    evict, load, other = Sink(env), Sink(env), Sink(env)
    ha = be.submit(op(*D2H, blocks=4, kind=OpKind.EVICT), evict, ())  # slow: 4 MiB a layer
    be.submit(op(*H2D, blocks=1), load, [ha])  # writes the blocks the evict reads
    be.submit(op(*H2D, blocks=1), other, ())  # queued behind the load on h2d
    await asyncio.gather(evict.finished, load.finished, other.finished)
    ua, ub = LAT + 4 * MiB / GiB, LAT + MiB / GiB
    assert evict.layers == sums(0.0, ua, 4)
    # layer i of the load starts once layer i of the evict has landed
    assert load.layers == [a + ub for a in evict.layers]
    # the op behind the load waits for it (one stream, in order)
    assert other.layers == sums(load.layers[-1], ub, 4)


@pytest.mark.asyncio
async def test_after_a_finished_op_does_not_wait() -> None:
    _, env, be = setup()
    first, second = Sink(env), Sink(env)
    h = be.submit(op(*D2H, blocks=1), first, ())
    await first.finished
    t0 = env.now
    be.submit(op(*H2D, blocks=1), second, [h])
    await second.finished
    assert second.layers == sums(t0, LAT + MiB / GiB, 4)


@pytest.mark.asyncio
async def test_storage_latency_overlaps_queued_requests() -> None:
    _, env, be = setup()
    a, b, w = Sink(env), Sink(env), Sink(env)
    be.submit(op(Tier.STORAGE, Tier.HOST, blocks=1, kind=OpKind.PREFETCH), a, ())
    be.submit(op(Tier.STORAGE, Tier.DEVICE, blocks=1), b, ())  # same read path
    be.submit(op(Tier.HOST, Tier.STORAGE, blocks=1, kind=OpKind.WRITE), w, ())  # write path
    await asyncio.gather(a.finished, b.finished, w.finished)
    dur = MiB / (GiB / 2)
    # latency once, then the read path streams back to back at full bandwidth
    assert a.layers == sums(100e-6, dur, 4)
    assert b.layers == sums(a.layers[-1], dur, 4)
    assert w.layers == sums(1e-4, MiB / (GiB / 4), 4)  # independent of the reads
    m = be.metrics()
    assert m["storage_read"]["busy_s"] == pytest.approx(8 * dur, rel=1e-12)
    assert m["storage_read"]["bytes"] == 8 * MiB


@pytest.mark.asyncio
async def test_storage_write_after_a_copy_out_issues_each_layer_as_it_lands() -> None:
    _, env, be = setup()
    evict, write = Sink(env), Sink(env)
    he = be.submit(op(*D2H, blocks=1, kind=OpKind.EVICT), evict, ())
    be.submit(op(Tier.HOST, Tier.STORAGE, blocks=1, kind=OpKind.WRITE), write, [he])
    await asyncio.gather(evict.finished, write.finished)
    lat, dur = 1e-4, MiB / (GiB / 4)
    expected, free = [], 0.0
    for landed in evict.layers:  # issued when the layer reaches host, data once free
        free = max(free, landed + lat) + dur
        expected.append(free)
    assert write.layers == expected
    assert write.layers[0] == evict.layers[0] + lat + dur


@pytest.mark.asyncio
async def test_storage_latency_is_paid_again_after_an_idle_gap() -> None:
    _, env, be = setup()
    a, b = Sink(env), Sink(env)
    be.submit(op(Tier.STORAGE, Tier.HOST, blocks=1), a, ())
    await a.finished
    await asyncio.sleep(1.0)
    t0 = env.now
    be.submit(op(Tier.STORAGE, Tier.HOST, blocks=1), b, ())
    await b.finished
    assert b.layers[0] == t0 + 100e-6 + MiB / (GiB / 2)


@pytest.mark.asyncio
async def test_routes_and_unroutable_ops() -> None:
    _, env, be = setup()
    sinks = {}
    for src, dst in [H2D, D2H, (Tier.STORAGE, Tier.HOST), (Tier.STORAGE, Tier.DEVICE),
                     (Tier.HOST, Tier.STORAGE), (Tier.DEVICE, Tier.STORAGE)]:
        sinks[(src, dst)] = Sink(env)
        h = be.submit(op(src, dst, blocks=1), sinks[(src, dst)], ())
        assert isinstance(h, SimTransfer)
    with pytest.raises(TransferError, match="host -> host"):
        be.submit(op(Tier.HOST, Tier.HOST, blocks=1), Sink(env), ())
    await asyncio.gather(*(s.finished for s in sinks.values()))
    m = be.metrics()
    assert [m[k]["ops"] for k in ("h2d", "d2h", "storage_read", "storage_write")] == [1, 1, 2, 2]
    assert HIER.link(Tier.DEVICE, Tier.STORAGE) is HIER.storage_write


@pytest.mark.asyncio
async def test_bad_after_handle_is_a_type_error() -> None:
    _, env, be = setup()
    with pytest.raises(TypeError, match="not a handle of this SimBackend"):
        be.submit(op(*H2D, blocks=1), Sink(env), [object()])
    other = SimBackend(env, SPEC, HIER)
    h = other.submit(op(*H2D, blocks=1), Sink(env), ())
    with pytest.raises(TypeError):
        be.submit(op(*H2D, blocks=1), Sink(env), [h])
    with pytest.raises(TypeError):
        be.cancel(h)
    await asyncio.sleep(1.0)


def test_backend_satisfies_the_protocol() -> None:
    be = SimBackend(simpy.Environment(), SPEC, HIER)
    assert isinstance(be, TransferBackend)
    assert be.num_layers == 4


# ----------------------------------------------------------------- cancel
@pytest.mark.asyncio
async def test_cancel_queued_op_ends_at_once_and_frees_its_turn() -> None:
    _, env, be = setup()
    a, b, c = Sink(env), Sink(env), Sink(env)
    be.submit(op(*H2D, blocks=1), a, ())
    hb = be.submit(op(*H2D, blocks=1), b, ())
    be.submit(op(*H2D, blocks=1), c, ())
    await asyncio.sleep(1e-4)
    be.cancel(hb)
    assert b.events == []  # never from inside cancel
    await asyncio.gather(a.finished, b.finished, c.finished)
    assert b.layers == [] and b.done_at == 1e-4 and isinstance(b.error, TransferError)
    assert "cancelled" in str(b.error)
    assert c.layers == sums(a.layers[-1], LAT + MiB / GiB, 4)  # c moved up
    be.cancel(hb)  # finished: no-op
    m = be.metrics()
    assert m["cancelled"] == 1 and m["h2d"]["cancelled"] == 1 and m["h2d"]["completed"] == 2


@pytest.mark.asyncio
async def test_cancel_in_service_finishes_the_unit_unreported() -> None:
    _, env, be = setup()
    a, b = Sink(env), Sink(env)
    unit = LAT + MiB / GiB
    ha = be.submit(op(*H2D, blocks=1), a, ())
    be.submit(op(*H2D, blocks=1), b, ())
    await asyncio.sleep(unit * 1.5)  # layer 0 landed, layer 1 in service
    be.cancel(ha)
    be.cancel(ha)  # twice: still one done
    await asyncio.gather(a.finished, b.finished)
    assert a.layers == [unit]
    assert a.done_at == unit + unit and isinstance(a.error, TransferError)
    assert b.layers == sums(a.done_at, unit, 4)
    m = be.metrics()
    assert m["h2d"]["bytes"] == 6 * MiB  # 2 units of a (one cancelled on the wire) + 4 of b


@pytest.mark.asyncio
async def test_dependent_of_a_cancelled_op_stops_waiting() -> None:
    _, env, be = setup()
    slow, dep = Sink(env), Sink(env)
    hs = be.submit(op(*D2H, blocks=8), slow, ())
    be.submit(op(*H2D, blocks=1), dep, [hs])
    first = LAT + 8 * MiB / GiB
    await asyncio.sleep(first / 2)
    be.cancel(hs)  # in service: ends when layer 0 lands
    await asyncio.gather(slow.finished, dep.finished)
    assert slow.layers == [] and slow.done_at == first
    assert dep.layers == sums(first, LAT + MiB / GiB, 4)


@pytest.mark.asyncio
async def test_cancel_op_blocked_at_head_unblocks_the_link() -> None:
    _, env, be = setup()
    slow, blocked, behind = Sink(env), Sink(env), Sink(env)
    hs = be.submit(op(*D2H, blocks=8), slow, ())
    hb = be.submit(op(*H2D, blocks=1), blocked, [hs])
    be.submit(op(*H2D, blocks=1), behind, ())
    await asyncio.sleep(1e-3)
    be.cancel(hb)
    await asyncio.gather(blocked.finished, behind.finished)
    assert blocked.done_at == 1e-3 and blocked.layers == []
    assert behind.layers == sums(1e-3, LAT + MiB / GiB, 4)
    del hs


# -------------------------------------------------------------- failures
@pytest.mark.asyncio
async def test_injected_failure_after_first_layer() -> None:
    _, env, be = setup(fail=lambda o: o.kind is OpKind.PREFETCH)
    bad, good = Sink(env), Sink(env)
    be.submit(op(Tier.STORAGE, Tier.HOST, blocks=1, kind=OpKind.PREFETCH), bad, ())
    be.submit(op(Tier.STORAGE, Tier.HOST, blocks=1, kind=OpKind.SWAP_IN), good, ())
    await asyncio.gather(bad.finished, good.finished)
    dur = MiB / (GiB / 2)
    assert bad.layers == [100e-6 + dur] and bad.done_at == bad.layers[0]
    assert isinstance(bad.error, TransferError) and "injected failure" in str(bad.error)
    assert "after 1 of 4 layers" in str(bad.error)
    assert good.layers == sums(bad.done_at, dur, 4) and good.error is None
    m = be.metrics()
    assert m["failed"] == 1 and m["storage_read"]["failed"] == 1


@pytest.mark.asyncio
async def test_injected_failure_at_start_and_mid_way() -> None:
    _, env, be = setup()
    be.inject_failure(lambda o: 0)
    s0 = Sink(env)
    be.submit(op(*H2D, blocks=1), s0, ())
    assert s0.events == []  # never from inside submit
    be.inject_failure(lambda o: 3)
    s3 = Sink(env)
    be.submit(op(*H2D, blocks=1), s3, ())
    be.inject_failure(lambda o: 99)  # capped: the op still fails, after 3 layers
    s99 = Sink(env)
    be.submit(op(*H2D, blocks=1), s99, ())
    be.inject_failure(None)
    ok = Sink(env)
    be.submit(op(*H2D, blocks=1), ok, ())
    await asyncio.gather(s0.finished, s3.finished, s99.finished, ok.finished)
    unit = LAT + MiB / GiB
    assert s0.layers == [] and s0.done_at == 0.0 and isinstance(s0.error, TransferError)
    assert s3.layers == sums(0.0, unit, 3) and s3.done_at == s3.layers[-1]
    assert len(s99.layers) == 3 and isinstance(s99.error, TransferError)
    assert ok.error is None and len(ok.layers) == 4
    assert be.metrics()["failed"] == 3 and be.inflight == 0


@pytest.mark.asyncio
async def test_bad_failure_predicate_value() -> None:
    _, env, be = setup(fail=lambda o: "yes")
    with pytest.raises(ValueError, match="failure predicate"):
        be.submit(op(*H2D, blocks=1), Sink(env), ())


# --------------------------------------------------------------- metrics
@pytest.mark.asyncio
async def test_metrics_bytes_busy_and_utilization() -> None:
    _, env, be = setup()
    s = Sink(env)
    be.submit(op(*H2D, blocks=2), s, ())
    await s.finished
    unit = LAT + 2 * MiB / GiB
    await asyncio.sleep(4 * unit)  # idle as long as it was busy (within rounding)
    m = be.metrics()
    h2d = m["h2d"]
    assert h2d["bytes"] == 8 * MiB and h2d["ops"] == 1 and h2d["completed"] == 1
    assert h2d["busy_s"] == pytest.approx(4 * unit, rel=1e-12)
    assert h2d["utilization"] == pytest.approx(0.5, rel=1e-9)
    assert m["d2h"]["bytes"] == 0 and m["d2h"]["utilization"] == 0.0
    assert m["elapsed_s"] == env.now and m["inflight"] == 0


def test_hierarchy_from_profiles() -> None:
    h = Hierarchy.from_profile(PROFILES["h100"])
    assert h.h2d.bandwidth_Bps == 55e9 and h.storage_read.overlap_latency
    assert Hierarchy.default("a100").h2d.bandwidth_Bps == 25e9
    with pytest.raises(ConfigError, match="bandwidth_Bps"):
        Link(0, 1e-6)
    with pytest.raises(ConfigError, match="latency_s"):
        Link(1e9, -1)
    assert Link(2.0, 0.5).unit_time(4) == 2.5


def test_sim_backend_runs_in_plain_simpy_too() -> None:
    """No asyncio needed: sinks are plain callbacks driven by env.run()."""
    env = simpy.Environment()
    be = SimBackend(env, SPEC, HIER)
    got: list[tuple[object, float]] = []

    class S:
        def layer_done(self, i: int) -> None:
            got.append((i, env.now))

        def done(self, error: BaseException | None = None) -> None:
            got.append(("done", env.now))

    be.submit(op(*H2D, blocks=1), S(), ())
    env.run()
    times = sums(0.0, LAT + MiB / GiB, 4)
    assert got == [*zip(range(4), times, strict=True), ("done", times[-1])]


def test_many_ops_stay_exact_and_in_order() -> None:
    """A random-ish mix on all links: every op's layers in order, FIFO per link."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        be = SimBackend(loop.env, SPEC, HIER)  # type: ignore[attr-defined]
        routes = [H2D, D2H, (Tier.STORAGE, Tier.HOST), (Tier.HOST, Tier.STORAGE)]
        sinks: list[tuple[str, Sink]] = []
        handles: list[SimTransfer] = []
        afters: list[list[SimTransfer]] = []
        for k in range(200):
            src, dst = routes[k % 4]
            after = [handles[k - 3]] if k % 5 == 0 and k >= 3 else []
            s = Sink(loop.env)  # type: ignore[attr-defined]
            h = be.submit(op(src, dst, blocks=1 + k % 3), s, after)
            handles.append(h)
            afters.append(after)
            sinks.append((h.link, s))
            if k % 7 == 0:
                await asyncio.sleep(1e-3)
        await asyncio.gather(*(s.finished for _, s in sinks))
        for link in ("h2d", "d2h", "storage_read", "storage_write"):
            ends = [s.done_at for name, s in sinks if name == link]
            assert ends == sorted(ends)
        n_deps = 0
        for (_, s), h, after in zip(sinks, handles, afters, strict=True):
            assert len(s.layers) == 4 and h.land_times == s.layers and h.deps == ()
            for d in after:
                n_deps += 1
                assert all(t > dt for t, dt in zip(s.layers, d.land_times, strict=True))
        assert n_deps == 39 and be.inflight == 0

    run_sim(main())
