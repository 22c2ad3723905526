"""The simulated memory hierarchy: links with bandwidth and latency, and ``SimBackend``.

Four links, independent of each other except for PCIe's two directions:

* ``h2d`` and ``d2h`` — PCIe host -> device and device -> host. PCIe is full
  duplex and a GPU has a copy engine per direction, so a load never waits for
  a store (DESIGN.md: 55 GB/s each way on an H100). Both ways at once, each
  direction gets somewhat less (device->host data and host->device read
  requests share the upstream lanes; measured ~0.9 of one-way on an H100):
  ``Hierarchy.duplex`` is that fraction, applied to a unit whose link starts
  it while the opposite direction has a unit on the wire.
* ``storage_read`` and ``storage_write`` — storage -> (host or device) and
  (host or device) -> storage.

**Link sharing: FIFO, one unit at a time.** Each link serves *units* in the
order they were submitted; a unit is one layer of one op (all of the op's
blocks in that layer), so an op's layers go one after another and the next op
starts after the previous one's last layer. Why FIFO rather than fair share:

* it is what the real world does: the real backend (``kernels.CudaBackend``)
  enqueues an op's per-layer copies on one CUDA stream per direction, and a
  stream runs its work in order, one copy after the other;
* it keeps the scheduler's intent: the runtime submits the load a request
  needs now before the prefetch it may need later; fair share would slow the
  urgent op down by the number of ops in flight;
* completion times are exactly computable (a sum of service times), which the
  tests use and which fair share (rates changing at every arrival) loses.

A unit waiting on ``after`` blocks its link (head-of-line), exactly like a
CUDA stream waiting on another stream's event.

**Latency.** A ``Link`` has ``latency_s`` and ``overlap_latency``:

* ``overlap_latency=False`` (PCIe): the latency is per-unit overhead that
  occupies the link (a kernel launch / DMA set-up in the stream's order). A
  unit that starts at ``s`` lands at ``s + latency_s + bytes / bandwidth_Bps``
  and the link is free again at that moment.
* ``overlap_latency=True`` (storage): an NVMe drive keeps many requests in
  flight, so the latency of one request overlaps the data of the previous one.
  Unit i of an op is *issued* at ``r = max(submit time, landing of layer i of
  every op in after)``; its data moves once the link is free and the latency
  has passed, ``s = max(link free, r + latency_s)``, and it lands at ``s +
  bytes / bandwidth_Bps``. A stream of back-to-back requests pays the latency
  once and then runs at full bandwidth. A backend given an admission gate
  (``SimBackend.admit``: a cluster's shared pool) takes the gate's time as the
  op's submit time, so its units are issued no earlier.

``busy_s`` in ``metrics()`` counts the time a link spends on units (latency
included only where it occupies the link), so ``busy_s / elapsed`` is its
utilisation.

**Cancel and failure.** A unit in service completes (the copy is on the wire),
is not reported, and the op then ends with ``TransferError``; units not yet
started are dropped. An op waiting in the queue ends at once. Either way the
sink gets ``done(TransferError)`` exactly once (the error matches the real
backend's), never from inside ``submit``/``cancel`` (it comes from a simpy
event at the same virtual time), and ops ordered after a cancelled or failed
op stop waiting for it when it ends. Injected failures (``fail=`` or
``inject_failure``) end an op with ``TransferError`` after a given number of
landed layers (see ``SimBackend``).

**Cost.** One simpy event per op, not one per layer: a link computes every
unit's times when the op starts service and recomputes them only when an
input changes (``sim.links`` says how, and how simultaneous events are
ordered). A sink that awaits individual layers asks for them
(``lazy_layers``); others are told every layer. ``python -m sim.hierarchy``
measures ops/s.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from heapq import heappush
from typing import TYPE_CHECKING, Any

import simpy
from simpy.core import NORMAL

from kvflow.errors import ConfigError, TransferError
from kvflow.host_layout import HostLayout
from kvflow.layout import ModelSpec
from kvflow.manager import TransferOp
from kvflow.profile import LINKS, Link
from kvflow.radix import Tier
from kvflow.runtime import LINKS as ROUTES  # (src tier, dst tier) -> link name
from sim.links import Server, SimTransfer, _Tick, replan

if TYPE_CHECKING:
    from kvflow.profile import GpuProfile

__all__ = ["LINKS", "Hierarchy", "Link", "SimBackend", "SimTransfer"]


@dataclass(frozen=True)
class Hierarchy:
    """The four links of one GPU's node, and how PCIe shares itself both ways.

    ``duplex``: the fraction of its bandwidth each PCIe direction keeps while
    the other one also carries data (1.0: fully independent).
    """

    h2d: Link
    d2h: Link
    storage_read: Link
    storage_write: Link
    duplex: float = 1.0

    def __post_init__(self) -> None:
        d = self.duplex
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
            raise ConfigError(f"Hierarchy.duplex must be in (0, 1], got {d!r}")

    @classmethod
    def from_profile(cls, profile: GpuProfile) -> Hierarchy:
        """The links of a ``kvflow.profile.GpuProfile``."""
        return cls(profile.h2d, profile.d2h, profile.storage_read, profile.storage_write,
                   profile.pcie_duplex)

    @classmethod
    def default(cls, profile: str = "h100") -> Hierarchy:
        """The links of a preset profile or a profile TOML file (``kvflow.profile``)."""
        from kvflow.profile import load_profile

        return cls.from_profile(load_profile(profile))

    def link(self, src: int, dst: int) -> Link:
        """The link an op from tier ``src`` to tier ``dst`` uses."""
        return getattr(self, _route(src, dst, None))


def _route(src: int, dst: int, op: TransferOp | None) -> str:
    try:
        return ROUTES[(src, dst)]
    except KeyError:
        what = f"op {op.op_id} ({op.kind.value}) goes" if op is not None else "a transfer going"
        raise TransferError(
            f"{what} {Tier(src).name.lower()} -> {Tier(dst).name.lower()}: "
            "no link in the hierarchy moves blocks that way"
        ) from None


class SimBackend:
    """``kvflow.backend.TransferBackend`` on a simulated hierarchy, in simpy virtual time.

    Each op moves ``op.num_blocks * spec.bytes_per_layer_block`` bytes per
    layer over the link its tiers pick (``ROUTES``). A sink is told
    ``layer_done(i)`` at the virtual time layer i lands, in order, then
    ``done(None)``; a sink that sets ``lazy_layers = True`` is told a layer only
    when it asks (``SimTransfer.watch``) and reads the rest from the handle
    (``SimTransfer.layers_reported``), so an op costs one simpy event, not one
    per layer (``sim.links``).

    Failure injection: ``fail(op)`` is asked once per op at submit. ``None`` or
    ``False``: the op runs normally. ``True``: it fails after its first layer
    has landed (and been reported). An ``int`` k (not a bool): it fails after k
    layers, ``0`` meaning before it moves anything (when it reaches the head
    of its link's queue). k is capped at ``num_layers - 1``, so a failing op
    always fails. The sink then gets ``done(TransferError)``.

    Call ``submit`` and ``cancel`` from the simulation's thread (a coroutine
    on ``VirtualTimeLoop`` or a simpy process); sinks are called from simpy
    events, never from inside ``submit`` or ``cancel``.
    """

    def __init__(
        self,
        env: simpy.Environment,
        spec: ModelSpec,
        hierarchy: Hierarchy,
        fail: Callable[[TransferOp], bool | int | None] | None = None,
    ) -> None:
        self.env = env
        self.spec = spec
        self.hierarchy = hierarchy
        self.num_layers: int = spec.num_layers
        self._bytes_per_layer_block = spec.bytes_per_layer_block
        duplex = hierarchy.duplex
        self._servers = {
            name: Server(self, name, getattr(hierarchy, name),
                         duplex if name in ("h2d", "d2h") else 1.0)
            for name in LINKS
        }
        if duplex < 1.0:
            h2d, d2h = self._servers["h2d"], self._servers["d2h"]
            h2d.partner, d2h.partner = d2h, h2d
        self._routes = {key: self._servers[name] for key, name in ROUTES.items()}
        self._fail = fail
        self._inflight = 0
        self.failed = 0
        self.cancelled = 0
        #: Admission gate (``kvflow.world.WorldSetup.admit``): ``admit(op, bytes, now)`` gives
        #: the earliest time an op's data may be issued (its ``submitted_at``); a pool shared
        #: with other backends limits them all this way. None: issued at submit.
        self.admit: Callable[[TransferOp, float, float], float] | None = None
        self.host_layout = "layer_major"
        self.set_host_layout(self.host_layout)
        #: The op whose end is being processed (``sim.links.Server._end``).
        self._ending: SimTransfer | None = None

    def set_host_layout(self, layout: str) -> None:
        """Model the PCIe links' pieces per the host pool's layout (``kvflow.host_layout``):
        ``grouped:G`` and ``block_major`` move G layers (all roles) of a block as one piece,
        so an op's layers land a group at a time, paying the link's latency once per group
        and its ``piece_s`` once per block; ``layer_major`` pays ``piece_s`` per block and
        role of every layer. Set before the first submit."""
        lay = HostLayout.parse(layout)
        roles = len(self.spec.layout.roles)
        for name in ("h2d", "d2h"):
            s = self._servers[name]
            s.group = lay.group_size(self.num_layers)
            s.groups = lay.groups(self.num_layers)
            s.piece_s = s.link.piece_s
            s.pieces_per_block = roles if not lay.block_contiguous else 1
        self.host_layout = str(lay)

    def inject_failure(self, predicate: Callable[[TransferOp], bool | int | None] | None) -> None:
        """Set (or with ``None`` clear) the failure predicate for ops submitted from now on."""
        self._fail = predicate

    @property
    def inflight(self) -> int:
        """Ops submitted and not yet finished."""
        return self._inflight

    # ------------------------------------------------------------------ protocol
    def submit(self, op: TransferOp, sink: Any, after: Sequence[object] = ()) -> SimTransfer:
        """Queue ``op`` on its link; layer i moves once layer i of every op in ``after`` has.

        Raises ``TransferError`` at once for a tier pair no link serves.
        """
        server = self._routes.get((op.src_tier, op.dst_tier))
        if server is None:
            _route(op.src_tier, op.dst_tier, op)  # raises, naming the op
        assert server is not None
        deps: tuple[SimTransfer, ...] = ()
        if after:
            for d in after:
                if not isinstance(d, SimTransfer) or d._backend is not self:
                    raise TypeError(
                        f"op {op.op_id}: 'after' holds {d!r}, not a handle of this SimBackend"
                    )
            deps = tuple(d for d in after if not d.finished)  # type: ignore[union-attr]
        fail_after = -1
        if self._fail is not None:
            k = self._fail(op)
            if k is not None and k is not False:
                if k is True:
                    k = 1
                elif not isinstance(k, int) or k < 0:
                    raise ValueError(
                        f"failure predicate returned {k!r} for op {op.op_id}: "
                        "expected None, a bool or an int >= 0"
                    )
                fail_after = min(k, self.num_layers - 1)
        nbytes = op.num_blocks * self._bytes_per_layer_block
        now = self.env._now
        if self.admit is not None:
            now = self.admit(op, nbytes * self.num_layers, now)
        h = SimTransfer(self, server, op, sink, deps, nbytes, now, fail_after)
        for d in deps:
            d.dependents.append(h)
        server.ops += 1
        self._inflight += 1
        server.queue.append(h)
        if server.current is None and not server.blocked:
            server.kick()
        elif server.partner is not None and server.partner.current is not None:
            # whether this link goes on at its current op's end decides how fast the
            # other way's units starting at that instant run
            replan([server.partner.current], self.env._now)
        return h

    def cancel(self, handle: object) -> None:
        """Stop ``handle``'s op; its sink gets ``done(TransferError)`` once.

        A unit in service still completes (unreported) and ``done`` comes when
        it lands; otherwise ``done`` comes at the current virtual time. Layers
        not landed are never reported. No-op on a finished op.
        """
        if not isinstance(handle, SimTransfer) or handle._backend is not self:
            raise TypeError(f"cancel: {handle!r} is not a handle of this SimBackend")
        if handle.finished or handle.cancelled:
            return
        handle.cancelled = True
        server = handle._server
        if server.current is handle:
            now = self.env._now
            k = bisect_right(handle._starts, now) - 1
            if k >= 0 and handle._lands[k] > now:
                # Unit k is on the wire: it is the op's last, and goes unreported.
                del handle._lands[k + 1:], handle._starts[k + 1:]
                if handle._shared is not None:
                    del handle._shared[k + 1:]
                handle._n = k + 1
                handle._report_limit = k
                server.reschedule(handle)
                roots = [d for d in handle.dependents
                         if not d.finished and d._server.current is d]
                p = server.partner
                if p is not None and p.current is not None:
                    roots.append(p.current)
                if roots:
                    replan(roots, now)
                return
        self._abort(handle, self._cancel_error(handle), cancelled=True)

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, Any]:
        """Per link: bytes, busy_s, utilization (busy_s / elapsed), ops, completed,
        failed, cancelled, queued; plus totals and ``elapsed_s``."""
        now = self.env._now
        out: dict[str, Any] = {}
        for name, s in self._servers.items():
            if s.current is not None:
                s.account(s.current, now)
            out[name] = {
                "bytes": s.bytes,
                "busy_s": s.busy_s,
                "utilization": s.busy_s / now if now > 0 else 0.0,
                "ops": s.ops,
                "completed": s.completed,
                "failed": s.failed,
                "cancelled": s.cancelled,
                "queued": sum(1 for h in s.queue if not h.finished),
            }
        out["failed"] = self.failed
        out["cancelled"] = self.cancelled
        out["inflight"] = self._inflight
        out["elapsed_s"] = now
        return out

    # ---------------------------------------------------------------- internals
    @staticmethod
    def _cancel_error(h: SimTransfer) -> TransferError:
        return TransferError(f"op {h.op.op_id} ({h.op.kind.value}) was cancelled")

    def _abort(self, h: SimTransfer, error: TransferError, cancelled: bool) -> None:
        """End an op that has no unit in service; report from a simpy event at this time."""
        env = self.env
        now = env._now
        server = h._server
        roots: list[SimTransfer] = []
        if server.current is h:  # waiting on an 'after' op between (or before) its units
            server.account(h, now)
            m = bisect_right(h._starts, now)
            del h._lands[m:], h._starts[m:]
            if h._shared is not None:
                del h._shared[m:]
            if not m:
                h.first_unit = h.unit  # planned, never started
            server.current = None
            server.blocked = True  # the report starts the next op, as for a queued one
        p = server.partner
        if p is not None and p.current is not None:
            roots.append(p.current)  # this link's busy time or its queue changed
        h.finished = True
        h.finished_at = now
        h.error = error
        h.deps = ()
        if h._tick is not None:
            h._tick.callbacks = []
            h._tick = None
        self._inflight -= 1
        if cancelled:
            server.cancelled += 1
            self.cancelled += 1
        else:
            server.failed += 1
            self.failed += 1
        roots += [d for d in h.dependents if not d.finished and d._server.current is d]
        h.dependents = []
        if roots:
            replan(roots, now)

        def report(_event: object) -> None:
            server.kick()  # it may have been the head, or blocked behind a dep of it
            sink = h.sink
            if not h._lazy:  # layers that landed the instant it was cancelled
                for j in range(h._next_report, len(h._lands)):
                    h._next_report = j + 1
                    sink.layer_done(j)
            h.sink = None  # told everything: let the sink (which may hold this handle) go
            sink.done(error)

        heappush(env._queue, (now, NORMAL, next(env._eid), _Tick(report, None)))


# ------------------------------------------------------------------ benchmark
def _bench(n_ops: int = 20_000, model: str = "llama-3-8b", repeat: int = 3) -> None:
    """Ops/s and layer-units/s of SimBackend (best of ``repeat``).

    ``env.run, null sink``: the backend alone. ``VirtualTimeLoop, awaited
    futures``: inside the virtual loop, a sink resolving one future per layer
    and a coroutine awaiting every one of them (the worst case a runtime sees).
    Ops are 2 blocks each; "chained" makes every other op an h2d load ``after``
    the previous d2h copy-out.
    """
    import asyncio
    import time as _time

    from kvflow.layout import preset
    from kvflow.manager import OpKind
    from sim.loop import run_sim

    class NullSink:
        __slots__ = ()

        def layer_done(self, layer: int) -> None:
            pass

        def done(self, error: BaseException | None = None) -> None:
            pass

    class FutureSink:
        __slots__ = ("done_fut", "layers")

        def __init__(self, loop: asyncio.AbstractEventLoop, n: int) -> None:
            self.layers = [loop.create_future() for _ in range(n)]
            self.done_fut = loop.create_future()

        def layer_done(self, layer: int) -> None:
            self.layers[layer].set_result(None)

        def done(self, error: BaseException | None = None) -> None:
            self.done_fut.set_result(error)

    spec = preset(model)
    hier = Hierarchy.default("h100")
    layers = spec.num_layers

    def make_op(k: int, chained: bool) -> tuple[TransferOp, bool]:
        if chained and k % 2:
            return TransferOp(k, OpKind.SWAP_IN, Tier.HOST, Tier.DEVICE, [1, 2], [3, 4], []), True
        return TransferOp(k, OpKind.EVICT, Tier.DEVICE, Tier.HOST, [1, 2], [3, 4], []), False

    def plain(chained: bool) -> None:
        env = simpy.Environment()
        be = SimBackend(env, spec, hier)
        sink = NullSink()
        prev = None
        for k in range(n_ops):
            op, dep = make_op(k, chained)
            h = be.submit(op, sink, (prev,) if dep and prev is not None else ())
            if not dep:
                prev = h
            if k % 64 == 63:
                env.run()
        env.run()

    async def in_loop(chained: bool) -> None:
        loop = asyncio.get_running_loop()
        be = SimBackend(loop.env, spec, hier)  # type: ignore[attr-defined]
        prev = None
        for k0 in range(0, n_ops, 64):
            sinks = []
            for k in range(k0, min(n_ops, k0 + 64)):
                op, dep = make_op(k, chained)
                s = FutureSink(loop, layers)
                h = be.submit(op, s, (prev,) if dep and prev is not None else ())
                if not dep:
                    prev = h
                sinks.append(s)
            for s in sinks:
                for f in s.layers:
                    await f
                await s.done_fut

    for label, run in (
        ("env.run, null sink", plain),
        ("VirtualTimeLoop, awaited futures", lambda c: run_sim(in_loop(c))),
    ):
        for kind, chained in (("independent", False), ("chained", True)):
            best = float("inf")
            for _ in range(repeat):
                t0 = _time.perf_counter()
                run(chained)
                best = min(best, _time.perf_counter() - t0)
            print(
                f"{label:>33}, {kind:>11} ({layers} layers): {n_ops / best:>8,.0f} ops/s, "
                f"{n_ops * layers / best:>10,.0f} layer-units/s"
            )


if __name__ == "__main__":
    import sys

    _bench(model=sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b")
