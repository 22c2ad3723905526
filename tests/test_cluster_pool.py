"""The KV pool a cluster shares (``kvflow.cluster.pool``): one directory, the instances'
views of it, its aggregate bandwidth gate, and a replay's exact times through it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

import sim.world
from kvflow.cluster.pool import GlobalPool, PoolDirectory, PoolGate, PoolViewManager
from kvflow.cost import CostModel
from kvflow.errors import ConfigError
from kvflow.layout import preset
from kvflow.manager import Capacities, OpKind, TransferOp
from kvflow.profile import Link, load_profile
from kvflow.radix import READY, Tier
from kvflow.replay import ReplayConfig, run_replay
from kvflow.replay.config import DEFAULT_NIC_GB_PER_S, DEFAULT_NIC_LATENCY_S
from sim.hierarchy import Hierarchy, SimBackend
from traces import Request, write_generic

S = Tier.STORAGE


def chain(keys):
    return [(k, keys[i - 1] if i else None) for i, k in enumerate(keys)]


# -- the directory -----------------------------------------------------------------------------
def test_directory_evicts_least_recent_leaves_first():
    d = PoolDirectory(4)
    assert d.publish(chain("abc")) == []
    assert list(d.entries) == ["c", "b", "a"]  # parents more recent than children
    assert d.publish(chain("xy")) == ["c"]  # the oldest is a leaf: 'c', never 'a'
    d.touch("b")  # read: 'b', then 'a', most recent
    assert list(d.entries) == ["y", "x", "b", "a"]
    # 'z' under 'y' refreshes 'y' and 'x': the oldest is now 'b', a leaf since 'c' went.
    assert d.publish([("z", "y")]) == ["b"]
    assert list(d.entries) == ["a", "z", "y", "x"] and d.evicted == 2 and d.published == 6


def test_directory_rewrite_counts_once():
    d = PoolDirectory(8)
    d.publish(chain("ab"))
    d.publish(chain("ab"))
    assert len(d) == 2 and d.published == 2 and d.rewritten == 2


prompts = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(
    lambda s: tuple(tuple(s[: i + 1]) for i in range(len(s))))


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), prompts, st.integers(0, 6)), max_size=30),
       capacity=st.integers(1, 12))
def test_directory_parents_always_newer_than_children(steps, capacity):
    """Whatever is published and read, a parent in the pool is more recent than each of
    its children there, so eviction (oldest first) never strands a child."""
    d = PoolDirectory(capacity)
    for write, keys, cut in steps:
        if write:
            evicted = d.publish([(k, k[:-1] or None) for k in keys[:cut + 1]])
            assert all(e not in d for e in evicted)
        elif keys[min(cut, len(keys) - 1)] in d:
            d.touch(keys[min(cut, len(keys) - 1)])
        assert len(d) <= capacity
        order = {k: i for i, k in enumerate(d.entries)}
        for k, parent in d.entries.items():
            if parent in order:
                assert order[parent] > order[k], (k, parent, list(d.entries))


def test_directory_a_write_of_siblings_leaves_their_parent_newest():
    """One write publishing two children of a block refreshes the parent after both (it
    used to be moved once, on the first child's walk, and end up older than the other)."""
    d = PoolDirectory(3)
    d.publish([("a", None)])
    d.publish([("b", "a"), ("c", "a")])
    assert list(d.entries)[-1] == "a", list(d.entries)
    # the oldest block is a leaf: a fourth block evicts a child, never 'a'
    assert d.publish([("x", None)]) in (["b"], ["c"])
    assert "a" in d


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.lists(prompts, min_size=1, max_size=4),
                                st.integers(0, 6)), max_size=25),
       capacity=st.integers(1, 12))
def test_directory_parents_newer_than_children_when_a_write_holds_several_chains(
        steps, capacity):
    """As above, with one write publishing blocks of several prompts at once (siblings,
    cousins; parents before children, as a write's blocks come): every block's parent in
    the pool is more recent than it, and no eviction takes a block whose child stays."""
    d = PoolDirectory(capacity)
    for write, many, cut in steps:
        if write:
            keys = sorted({k for keys in many for k in keys[:cut + 1]}, key=len)
            evicted = d.publish([(k, k[:-1] or None) for k in keys])
            assert all(e not in d for e in evicted)
            assert not any(k[:-1] in evicted for k in d.entries), (evicted, list(d.entries))
        else:
            keys = many[0]
            if keys[min(cut, len(keys) - 1)] in d:
                d.touch(keys[min(cut, len(keys) - 1)])
        assert len(d) <= capacity
        order = {k: i for i, k in enumerate(d.entries)}
        for k, parent in d.entries.items():
            if parent in order:
                assert order[parent] > order[k], (k, parent, list(d.entries))


# -- views of it ---------------------------------------------------------------------------------
def _manager(storage=8):
    return PoolViewManager(Capacities(8, 8, storage))


def _written(m: PoolViewManager, keys: str) -> None:
    """``m`` computes ``keys``, backs them up to host, then to its storage view (the pool)."""
    p = m.plan(keys, keys)
    m.commit(p)
    ops = m.finish(p)
    while ops:
        ops += m.complete(ops.pop(0), True)


def test_a_write_is_a_hit_for_another_instance_once_it_lands():
    a, b = _manager(), _manager()
    pool = GlobalPool(16)
    pool.attach([a, b])
    p = a.plan(1, "abc")
    a.commit(p)
    backups = a.finish(p)  # device -> host
    to_storage = []
    for op in backups:
        to_storage += a.complete(op, True)  # host -> pool, in flight
    assert [op.dst_tier for op in to_storage] == [S]
    assert b.match("abc") == [] and len(pool.directory) == 0
    assert b.prefetch("abc").ops == []  # before the write lands: nothing to find
    assert b.match("abc") == []
    for op in to_storage:
        a.complete(op, True)
    assert list(pool.directory.entries) == ["c", "b", "a"]
    assert pool.tier_hits(b, "abcd") == (0, 0, 3)
    plan = b.plan(2, "abcd", use_storage=True)
    assert plan.source_tiers == [S, S, S] and b.stats.found_copies == 3
    b.check_invariants()
    a.check_invariants()


def test_a_failed_write_is_never_published():
    a, b = _manager(), _manager()
    pool = GlobalPool(16)
    pool.attach([a, b])
    p = a.plan(1, "ab")
    a.commit(p)
    to_storage = []
    for op in a.finish(p):
        to_storage += a.complete(op, True)
    for op in to_storage:
        a.complete(op, False)
    assert len(pool.directory) == 0 and b.plan(2, "ab").source_tiers == []


def test_an_instance_never_writes_what_it_knows_the_pool_holds():
    a, b = _manager(), _manager()
    pool = GlobalPool(16)
    pool.attach([a, b])
    _written(a, "ab")
    _written(b, "abc")  # 'a', 'b' read from the pool, only 'c' written
    assert pool.directory.published == 3 and pool.directory.rewritten == 0


def test_pool_eviction_leaves_every_view():
    a, b = _manager(), _manager()
    pool = GlobalPool(3)
    pool.attach([a, b])
    _written(a, "ab")
    b.prefetch("ab")  # b learns of them (its view of the pool)
    assert [n.state[S] for n in b.match("ab")] == [READY, READY]
    _written(a, "xy")  # 'b' then 'a' go from the pool (leaf first), and from both views
    assert pool.directory.evicted == 1 and "b" not in pool.directory
    for m in (a, b):
        node = m.index.get("b")
        assert node is None or node.state[S] != READY
        m.check_invariants()


def test_the_router_credits_the_pool_only_to_instances_that_read_storage():
    """A best-effort instance with a host tier recomputes at admission what has not
    reached host (``Engine._admit``): the pool's blocks, and its own storage-only ones,
    are no hits it would use, so the router's exact view must not credit them (it did:
    the prefix router then spread each conversation over instances that recomputed it,
    total hit rate 0.300 with local storage, 0.275 with the pool, full conversation
    trace at 16 instances)."""
    from kvflow.cluster.instances import reads_storage, tier_hits

    writer = _manager()
    effort = PoolViewManager(Capacities(8, 8, 8), prefetch_policy="best_effort")
    waits = PoolViewManager(Capacities(8, 8, 8), prefetch_policy="wait_complete")
    no_host = PoolViewManager(Capacities(8, 0, 8), prefetch_policy="best_effort")
    pool = GlobalPool(16)
    pool.attach([writer, effort, waits, no_host])
    _written(writer, "abc")
    assert [reads_storage(m) for m in (effort, waits, no_host)] == [False, True, True]
    for m, want in ((effort, (0, 0, 0)), (waits, (0, 0, 3)), (no_host, (0, 0, 3))):
        assert pool.tier_hits(m, "abcd", reads_storage(m)) == want
    # What the instance holds itself counts up to its first block below host: 'a' is on
    # the writer's device and host, 'b', 'c' only on its storage once evicted from both.
    for key in "cb":
        node = writer.index.get(key)
        for t in (Tier.DEVICE, Tier.HOST):
            writer.pools[t].free([writer.index.drop_copy(node, t)])
    writer.check_invariants()
    assert tier_hits(writer, "abcd") == (1, 0, 2)
    assert tier_hits(writer, "abcd", reads_storage=False) == (1, 0, 0)
    # A host copy still landing for a prefetch is cut too, as the best-effort plan cuts it.
    writer.prefetch("abc")
    assert writer.index.get("b").state[Tier.HOST] != READY
    assert tier_hits(writer, "abcd") == (1, 2, 0)
    assert tier_hits(writer, "abcd", reads_storage=False) == (1, 0, 0)


def test_attach_needs_pool_view_managers():
    from kvflow.manager import CacheManager

    with pytest.raises(TypeError):
        GlobalPool(4).attach([CacheManager(Capacities(4, 4, 4))])


# -- the aggregate bandwidth ---------------------------------------------------------------
def test_gate_arithmetic():
    g = PoolGate(10e9, 5e9)
    # Pool as fast as the NIC: the first op goes at once, the next waits for its slot.
    assert g.admit(0, 1e9, 10e9, 0.0) == 0.0
    assert g.admit(0, 1e9, 10e9, 0.0) == 0.1
    # A NIC faster than the pool: issued so that it ends with its pool slot.
    assert g.admit(1, 1e9, 10e9, 0.0) == pytest.approx(0.2 - 0.1)
    assert g.held_s == pytest.approx([0.1, 0.1])
    # An idle pool faster than the NIC holds nothing back.
    assert PoolGate(100e9, 100e9).admit(0, 1e9, 10e9, 3.0) == 3.0


def test_gate_serializes_concurrent_pool_reads_exactly():
    """Two instances read one op each at t=0 through a pool whose aggregate bandwidth is one
    NIC's: the second op's layers land one op's pool time after the first's."""
    spec = preset("llama-3-8b")
    nic = Link(50e9, 10e-6, overlap_latency=True)
    h100 = load_profile("h100")
    hier = Hierarchy(h100.h2d, h100.d2h, nic, nic)
    env = simpy.Environment()
    gate = PoolGate(50e9, 50e9)
    backends = [SimBackend(env, spec, hier) for _ in range(2)]
    for be in backends:
        be.admit = gate.for_instance(50e9)
    lands: list[list[float]] = [[], []]

    class Sink:
        def __init__(self, i):
            self.i = i

        def layer_done(self, layer):
            lands[self.i].append(env.now)

        def done(self, error=None):
            assert error is None

    blocks = 4
    for i, be in enumerate(backends):
        op = TransferOp(i, OpKind.PREFETCH, S, Tier.HOST, list(range(blocks)),
                        list(range(blocks)), [])
        be.submit(op, Sink(i))
    env.run()
    layer_bytes = blocks * spec.bytes_per_layer_block
    dur = layer_bytes / 50e9
    slot = layer_bytes * spec.num_layers / 50e9  # the first op's whole time on the pool
    for i in range(2):
        want = [i * slot + 10e-6 + (k + 1) * dur for k in range(spec.num_layers)]
        assert lands[i] == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert gate.ops == [2, 0] and gate.held_s[0] == pytest.approx(slot)


# -- a replay through the pool: exact times ------------------------------------------------------
BT = 16  # tokens per block of the hand-built traces


def _trace(tmp_path: Path, arrivals: list[float], name: str) -> str:
    path = tmp_path / name
    reqs = [Request(i, t, 4 * BT, 1, block_hashes=(1, 2, 3, 4)) for i, t in enumerate(arrivals)]
    write_generic(reqs, path, block_tokens=BT)
    return str(path)


def _cfg(trace: str, instances: int = 2, **kw) -> ReplayConfig:
    return ReplayConfig(trace=trace, instances=instances, router="round_robin", device_blocks=64,
                        host_blocks=64, pool_blocks=64, prefetch_policy="wait_complete", **kw)


def _publish_time() -> tuple[float, float]:
    """When request 0 (4 blocks, alone on instance 0 at t=0) has its blocks in the pool,
    by the cost model and the link model; and its prefill time."""
    spec = preset("llama-3-8b", block_tokens=BT)
    h100 = load_profile("h100")
    prefill = CostModel(spec, h100).step_time([(4 * BT, 0)], [])
    layer = 4 * spec.bytes_per_layer_block
    t = prefill  # first token = finish: the backup device -> host starts
    for _ in range(spec.num_layers):  # PCIe: latency occupies the link, layer after layer
        t = t + (h100.d2h.latency_s + layer / h100.d2h.bandwidth_Bps)
    t = t + DEFAULT_NIC_LATENCY_S  # then host -> pool over the NIC (latency overlapped)
    for _ in range(spec.num_layers):
        t = t + layer / (DEFAULT_NIC_GB_PER_S * 1e9)
    return t, prefill


def test_a_block_in_the_pool_is_a_hit_for_another_instance_only_after_the_write(
        tmp_path, monkeypatch):
    monkeypatch.setattr(sim.world.SimSite, "keep_transfer_records", True)  # read below
    published, prefill = _publish_time()
    logs = []

    def keep(manager, runtime):
        logs.append(runtime.backend.records)

    base = run_replay(_cfg(_trace(tmp_path, [0.0, 100.0], "far.jsonl")), inspect=keep)
    writes = [r for r in logs[0] if r[1] == "storage_write"]
    assert len(writes) == 1 and writes[0][4] == pytest.approx(published, rel=1e-12)
    assert base["pool"]["published"] == 4

    before = run_replay(_cfg(_trace(tmp_path, [0.0, published - 1e-9], "before.jsonl")))
    after = run_replay(_cfg(_trace(tmp_path, [0.0, published + 1e-9], "after.jsonl")))
    # Arriving a nanosecond before the write lands: computed again; after: read from the pool.
    assert before["hit_rate"]["storage"] == 0.0
    assert before["instances"][1]["ttft_s"]["mean"] == pytest.approx(prefill, rel=1e-12)
    assert after["hit_rate"]["storage"] == 0.5  # all 4 of request 1's blocks, of 8
    assert after["instances"][1]["hit_rate"]["storage"] == 1.0
    # Its first token: the pool read and the swap-in pipelined layer by layer under a
    # one-token prefill that waits for layer 0 only (each layer's compute outlasts a load).
    spec = preset("llama-3-8b", block_tokens=BT)
    h100 = load_profile("h100")
    layer = 4 * spec.bytes_per_layer_block
    cost = CostModel(spec, h100)
    first = (DEFAULT_NIC_LATENCY_S + layer / (DEFAULT_NIC_GB_PER_S * 1e9)
             + h100.h2d.latency_s + layer / h100.h2d.bandwidth_Bps)
    want = first + cost.step_time([(1, 4 * BT - 1)], [])
    assert after["instances"][1]["ttft_s"]["mean"] == pytest.approx(want, rel=1e-9)


def test_pool_replay_report_and_gate(tmp_path):
    trace = _trace(tmp_path, [0.0, 1.0, 1.0], "three.jsonl")
    r = run_replay(_cfg(trace, 3, pool_gb_per_s=1.0))
    gate = r["pool"]["gate"]
    # Two instances read the same blocks at t=1: the second waits for the first's slot.
    assert gate["read"]["ops"] == 2 and gate["read"]["held_s"] > 0
    assert r["hit_rate"]["storage"] == pytest.approx(8 / 12)
    assert r["config"]["pool_blocks"] == 64 and r["config"]["storage_blocks"] == 64
    assert math.isclose(gate["read"]["bytes_per_s"], 1e9)


# -- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, msg", [
    ({"pool_blocks": 0}, "pool_blocks must be an integer >= 1"),
    ({"pool_gb": -1.0}, "pool_gb must be a finite number > 0"),
    ({"pool_gb": 1.0, "pool_blocks": 4}, "give pool_blocks or pool_gb, not both"),
    ({"nic_gb_per_s": 25.0}, "nic_gb_per_s need a shared pool"),
    ({"pool_gb_per_s": 25.0}, "pool_gb_per_s need a shared pool"),
    ({"pool_blocks": 4, "nic_latency_s": -1.0}, "nic_latency_s must be a finite number >= 0"),
    ({"pool_blocks": 4, "storage_blocks": 9}, "storage_blocks and a shared pool"),
    ({"pool_blocks": 4, "mode": "cache"}, "a shared pool runs in full mode"),
    ({"pool_blocks": 4, "backend": "cuda"}, "a shared pool runs in full mode"),
])
def test_pool_config_errors(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        ReplayConfig(**kw)
