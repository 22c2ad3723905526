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

**Cost.** One simpy queue entry per unit; the link object itself is the
event it schedules (one unit in service per link), so a unit allocates
nothing but the heap entry. ``python -m sim.hierarchy`` measures ops/s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from heapq import heappush
from typing import TYPE_CHECKING, Any

import simpy
from simpy.core import NORMAL

from kvflow.errors import ConfigError, TransferError
from kvflow.layout import ModelSpec
from kvflow.manager import TransferOp
from kvflow.profile import LINKS, Link
from kvflow.radix import Tier
from kvflow.runtime import LINKS as ROUTES  # (src tier, dst tier) -> link name

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


class SimTransfer:
    """Handle of one op submitted to a ``SimBackend`` (what ``after`` and ``cancel`` take).

    Read-only for callers: ``layers_landed``, ``land_times`` (virtual time
    each layer landed, in order), ``finished``, ``cancelled``, ``error``,
    ``submitted_at``, ``finished_at``, ``link`` (its link's name).
    """

    __slots__ = (
        "_backend", "_server", "busy", "cancelled", "deps", "dur", "error", "fail_after",
        "finished", "finished_at", "first_unit", "land_times", "layers_landed", "link",
        "nbytes", "op", "shared_unit", "sink", "submitted_at", "unit", "waiters",
    )

    def __init__(self, backend: SimBackend, server: _Server, op: TransferOp, sink: Any,
                 deps: tuple[SimTransfer, ...], nbytes: int, now: float,
                 fail_after: int) -> None:
        self._backend = backend
        self._server = server
        self.op = op
        self.sink = sink
        self.link = server.name
        self.deps = deps
        self.nbytes = nbytes
        link = server.link
        self.dur = nbytes / link.bandwidth_Bps
        self.unit = link.latency_s + self.dur
        #: A unit started while the opposite PCIe direction is busy (see ``Hierarchy.duplex``).
        self.shared_unit = link.latency_s + self.dur / server.duplex
        #: How long the first unit took (service time runs from its start).
        self.first_unit = self.unit
        self.busy = self.dur if link.overlap_latency else self.unit
        self.layers_landed = 0
        self.land_times: list[float] = []
        self.submitted_at = now
        self.finished = False
        self.finished_at: float | None = None
        self.cancelled = False
        self.error: BaseException | None = None
        self.fail_after = fail_after
        self.waiters: list[tuple[int, _Server]] = []

    def __repr__(self) -> str:
        state = "finished" if self.finished else "running"
        return (f"<SimTransfer op={self.op.op_id} {self.op.kind.value} {self.link} "
                f"{self.layers_landed} layers landed, {state}>")


class _Call:
    """A bare simpy event (what ``Environment.step`` needs, nothing more) that runs ``fn``."""

    __slots__ = ("_ok", "callbacks")

    def __init__(self, fn: Callable[[], None]) -> None:
        self._ok = True
        self.callbacks = [lambda _ev: fn()]


class _Server:
    """The FIFO server of one link. It is itself the simpy event of its unit in service."""

    __slots__ = (
        "_cbs", "_ok", "backend", "blocked", "busy_s", "bytes", "callbacks", "cancelled",
        "completed", "current", "duplex", "env", "failed", "link", "name", "num_layers", "ops",
        "overlap", "partner", "queue",
    )

    def __init__(self, backend: SimBackend, name: str, link: Link) -> None:
        self.backend = backend
        self.env = backend.env
        self.name = name
        self.link = link
        self.overlap = link.overlap_latency
        #: The opposite PCIe direction (set by the backend) and the bandwidth share
        #: a unit gets while that one is busy.
        self.partner: _Server | None = None
        self.duplex = backend.hierarchy.duplex if name in ("h2d", "d2h") else 1.0
        self.num_layers = backend.num_layers
        self.queue: deque[SimTransfer] = deque()
        self.current: SimTransfer | None = None
        self.blocked = False
        self._ok = True
        self._cbs = [self._complete]
        self.callbacks: list[Callable[[Any], None]] | None = None
        self.bytes = 0
        self.busy_s = 0.0
        self.ops = 0
        self.completed = 0
        self.failed = 0
        self.cancelled = 0

    def kick(self) -> None:
        """Start the head unit if the link is idle and the unit's ``after`` layers have landed.

        Never calls a sink (it runs inside ``submit`` and ``cancel``).
        """
        if self.current is not None:
            return
        self.blocked = False
        queue = self.queue
        env = self.env
        while queue:
            h = queue[0]
            if h.finished:  # cancelled while queued
                queue.popleft()
                continue
            i = h.layers_landed
            if i == h.fail_after:  # injected failure before this unit
                queue.popleft()
                self.backend._abort(h, self._fail_error(h), cancelled=False)
                continue
            issued = h.submitted_at
            for d in h.deps:
                if d.layers_landed > i:
                    t = d.land_times[i]
                elif d.finished:
                    t = d.finished_at  # type: ignore[assignment]
                else:
                    d.waiters.append((i, self))
                    self.blocked = True
                    return
                if t > issued:
                    issued = t
            now = env._now
            if self.overlap:
                start = issued + self.link.latency_s
                when = (start if start > now else now) + h.dur
            else:
                when = now + self._unit_time(h)
                if i == 0:
                    h.first_unit = when - now
            self.current = h
            self.callbacks = self._cbs
            heappush(env._queue, (when, NORMAL, next(env._eid), self))
            return

    def _unit_time(self, h: SimTransfer) -> float:
        """A PCIe unit's time: slower while the opposite direction has one on the wire."""
        p = self.partner
        if p is None or p.current is None:
            return h.unit
        self.busy_s += h.shared_unit - h.unit  # (``_complete`` adds the unit's own ``busy``)
        return h.shared_unit

    def _complete(self, _event: object) -> None:
        """The unit in service has landed: account, start the next, then report."""
        h = self.current
        assert h is not None
        env = self.env
        now = env._now
        self.bytes += h.nbytes
        self.busy_s += h.busy
        i = h.layers_landed
        h.layers_landed = i + 1
        h.land_times.append(now)
        if i + 1 < self.num_layers and not h.deps and not h.cancelled and i + 1 != h.fail_after:
            # Fast path (most units): the same op's next layer goes on the wire now.
            if self.overlap:
                start = h.submitted_at + self.link.latency_s
                when = (start if start > now else now) + h.dur
            else:  # (the common case inline: ~10^6 units per replay come through here)
                p = self.partner
                when = now + (h.unit if p is None or p.current is None else self._unit_time(h))
            self.callbacks = self._cbs
            heappush(env._queue, (when, NORMAL, next(env._eid), self))
            if h.waiters:
                _wake(h)
            h.sink.layer_done(i)
            return
        self.current = None
        report = True
        done = False
        if h.cancelled:
            report = False
            done = True
            h.error = self.backend._cancel_error(h)
            self.cancelled += 1
            self.backend.cancelled += 1
        elif i + 1 == self.num_layers:
            done = True
            self.completed += 1
        elif i + 1 == h.fail_after:
            done = True
            h.error = self._fail_error(h)
            self.failed += 1
            self.backend.failed += 1
        if done:
            h.finished = True
            h.finished_at = now
            h.deps = ()  # let finished predecessors go (a long chain would pin them all)
            self.queue.popleft()
            self.backend._inflight -= 1
        self.kick()
        if h.waiters:
            _wake(h)
        sink = h.sink
        if report:
            sink.layer_done(i)
        if done:
            sink.done(h.error)

    def _fail_error(self, h: SimTransfer) -> TransferError:
        op = h.op
        return TransferError(
            f"injected failure: op {op.op_id} ({op.kind.value}, "
            f"{Tier(op.src_tier).name.lower()} -> {Tier(op.dst_tier).name.lower()}) failed "
            f"after {h.layers_landed} of {self.num_layers} layers"
        )


def _wake(h: SimTransfer) -> None:
    """Kick the links waiting on a layer of ``h`` that has now landed (or on ``h`` ending)."""
    waiters = h.waiters
    h.waiters = []
    landed = h.layers_landed
    done = h.finished
    for layer, server in waiters:
        if done or layer < landed:
            server.kick()
        else:
            h.waiters.append((layer, server))


class SimBackend:
    """``kvflow.backend.TransferBackend`` on a simulated hierarchy, in simpy virtual time.

    Each op moves ``op.num_blocks * spec.bytes_per_layer_block`` bytes per
    layer over the link its tiers pick (``ROUTES``); ``sink.layer_done(i)`` is
    called at the virtual time layer i lands, in order, then ``sink.done(None)``.

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
        self._servers = {name: _Server(self, name, getattr(hierarchy, name)) for name in LINKS}
        if hierarchy.duplex < 1.0:
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
            deps = tuple(d for d in after if not d.finished)
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
        server.ops += 1
        self._inflight += 1
        server.queue.append(h)
        if server.current is None and not server.blocked:
            server.kick()
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
        if handle._server.current is handle:
            return  # ends when its unit in service lands
        self._abort(handle, self._cancel_error(handle), cancelled=True)

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, Any]:
        """Per link: bytes, busy_s, utilization (busy_s / elapsed), ops, completed,
        failed, cancelled, queued; plus totals and ``elapsed_s``."""
        now = self.env._now
        out: dict[str, Any] = {}
        for name, s in self._servers.items():
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
        h.finished = True
        h.finished_at = self.env._now
        h.error = error
        h.deps = ()
        self._inflight -= 1
        server = h._server
        if cancelled:
            server.cancelled += 1
            self.cancelled += 1
        else:
            server.failed += 1
            self.failed += 1

        def report() -> None:
            server.kick()  # it may have been the head, or blocked behind a dep of it
            if h.waiters:
                _wake(h)
            h.sink.done(error)

        env = self.env
        heappush(env._queue, (env._now, NORMAL, next(env._eid), _Call(report)))


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
