"""The per-unit link model as it was before issue 19: one simpy event per layer of
each op (``_Server._complete``), kept as the oracle the per-op model
(``sim.hierarchy``) is checked against, op by op and layer by layer, in
``tests/test_sim_hierarchy_equivalence.py``. Not used by kvflow itself.
"""
# ruff: noqa

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from heapq import heappush
from typing import Any

import simpy
from simpy.core import NORMAL

from kvflow.errors import TransferError
from kvflow.layout import ModelSpec
from kvflow.manager import TransferOp
from kvflow.profile import LINKS
from kvflow.radix import Tier
from sim.hierarchy import Hierarchy, _route
from kvflow.runtime import LINKS as ROUTES

class RefTransfer:
    """Handle of one op submitted to a ``RefBackend`` (what ``after`` and ``cancel`` take).

    Read-only for callers: ``layers_landed``, ``land_times`` (virtual time
    each layer landed, in order), ``finished``, ``cancelled``, ``error``,
    ``submitted_at``, ``finished_at``, ``link`` (its link's name).
    """

    __slots__ = (
        "_backend", "_server", "busy", "cancelled", "deps", "dur", "error", "fail_after",
        "finished", "finished_at", "first_unit", "land_times", "layers_landed", "link",
        "nbytes", "op", "shared_unit", "sink", "submitted_at", "unit", "waiters",
    )

    def __init__(self, backend: RefBackend, server: _Server, op: TransferOp, sink: Any,
                 deps: tuple[RefTransfer, ...], nbytes: int, now: float,
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
        return (f"<RefTransfer op={self.op.op_id} {self.op.kind.value} {self.link} "
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

    def __init__(self, backend: RefBackend, name: str, link: Link) -> None:
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
        self.queue: deque[RefTransfer] = deque()
        self.current: RefTransfer | None = None
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

    def _unit_time(self, h: RefTransfer) -> float:
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

    def _fail_error(self, h: RefTransfer) -> TransferError:
        op = h.op
        return TransferError(
            f"injected failure: op {op.op_id} ({op.kind.value}, "
            f"{Tier(op.src_tier).name.lower()} -> {Tier(op.dst_tier).name.lower()}) failed "
            f"after {h.layers_landed} of {self.num_layers} layers"
        )


def _wake(h: RefTransfer) -> None:
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


class RefBackend:
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

    def inject_failure(self, predicate: Callable[[TransferOp], bool | int | None] | None) -> None:
        """Set (or with ``None`` clear) the failure predicate for ops submitted from now on."""
        self._fail = predicate

    @property
    def inflight(self) -> int:
        """Ops submitted and not yet finished."""
        return self._inflight

    # ------------------------------------------------------------------ protocol
    def submit(self, op: TransferOp, sink: Any, after: Sequence[object] = ()) -> RefTransfer:
        """Queue ``op`` on its link; layer i moves once layer i of every op in ``after`` has.

        Raises ``TransferError`` at once for a tier pair no link serves.
        """
        server = self._routes.get((op.src_tier, op.dst_tier))
        if server is None:
            _route(op.src_tier, op.dst_tier, op)  # raises, naming the op
        assert server is not None
        deps: tuple[RefTransfer, ...] = ()
        if after:
            for d in after:
                if not isinstance(d, RefTransfer) or d._backend is not self:
                    raise TypeError(
                        f"op {op.op_id}: 'after' holds {d!r}, not a handle of this RefBackend"
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
        h = RefTransfer(self, server, op, sink, deps,
                        op.num_blocks * self._bytes_per_layer_block, self.env._now, fail_after)
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
        if not isinstance(handle, RefTransfer) or handle._backend is not self:
            raise TypeError(f"cancel: {handle!r} is not a handle of this RefBackend")
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
    def _cancel_error(h: RefTransfer) -> TransferError:
        return TransferError(f"op {h.op.op_id} ({h.op.kind.value}) was cancelled")

    def _abort(self, h: RefTransfer, error: TransferError, cancelled: bool) -> None:
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


