"""The link servers of ``sim.hierarchy``: FIFO schedules computed per op, one event per op.

The model (FIFO units, latency, duplex share, ``after``, cancel, failure) is the
one ``sim.hierarchy``'s docstring describes; this module is how it is computed
without a simpy event per layer.

How schedules are recomputed when an input changes, and how simultaneous events
are ordered, is ``sim.schedule``.

**A schedule per op.** When an op starts service on its link (becomes the
link's *current* op), the link computes every remaining unit's start and
landing time at once: FIFO, known bandwidth and latency, each unit's
dependencies (``after``) read from the schedules of the ops it follows. The
op then costs one simpy event — at its end — plus one for each layer that
something awaits: a sink that sets ``lazy_layers`` (the runtime's tasks) reads
landed layers from the handle (``layers_reported``) and asks for a report of
layer i only when it waits for it (``watch``); any other sink gets
``layer_done`` for every layer at its landing time, as before.

**Accounting** (``bytes``, ``busy_s``) is added unit by unit in time order, as
the per-unit model added it, but lazily: when the op ends or when
``metrics()`` is read, for the units that have landed by then.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from heapq import heappush
from itertools import accumulate, repeat
from typing import TYPE_CHECKING, Any

from simpy.core import NORMAL

from kvflow.errors import TransferError
from kvflow.manager import TransferOp
from kvflow.profile import Link
from kvflow.radix import Tier
from sim.schedule import ends_by, replan

if TYPE_CHECKING:
    from sim.hierarchy import SimBackend

_INF = float("inf")

class SimTransfer:
    """Handle of one op submitted to a ``SimBackend`` (what ``after`` and ``cancel`` take).

    Read-only for callers: ``layers_landed``, ``land_times`` (virtual time
    each layer landed by now, in order), ``finished``, ``cancelled``,
    ``error``, ``submitted_at``, ``finished_at``, ``link`` (its link's name),
    ``first_unit`` (how long its first unit took).
    """

    __slots__ = (
        "_acct", "_backend", "_key", "_kicked_at", "_lands", "_lazy", "_n", "_next_report",
        "_report_limit", "_server", "_shared", "_starts", "_tick", "_tick_at", "_units", "_walking",
        "_watch", "busy", "cancelled", "dependents", "deps", "dur", "error", "fail_after",
        "finished", "finished_at", "first_unit", "link", "nbytes", "op", "shared_unit", "sink",
        "submitted_at", "unit",
    )

    def __init__(self, backend: SimBackend, server: Server, op: TransferOp, sink: Any,
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
        #: Per-unit (time, time while the other way is busy, busy time) where units differ:
        #: a grouped host layout (``kvflow.host_layout``) moves a group of layers as one
        #: piece per block, so its first layer's unit carries the group's time and the
        #: others land with it, at no cost of their own.
        self._units: tuple[list[float], list[float], list[float]] | None = None
        if server.group > 1:
            self._units = server.group_units(self.dur, op.num_blocks)
            self.unit, self.shared_unit = self._units[0][0], self._units[1][0]
            self.first_unit = self.unit
        elif server.piece_s:
            extra = op.num_blocks * server.pieces_per_block * server.piece_s
            self.unit += extra
            self.shared_unit += extra
            self.first_unit = self.unit
            self.busy += extra
        self.submitted_at = now
        self.finished = False
        self.finished_at: float | None = None
        self.cancelled = False
        self.error: BaseException | None = None
        self.fail_after = fail_after
        #: Ops whose schedule reads this one's (they were submitted ``after`` it).
        self.dependents: list[SimTransfer] = []
        self._lazy = getattr(sink, "lazy_layers", False) is True
        layers = server.num_layers
        #: Units this op runs if nothing changes (fewer for an injected failure or a cancel).
        self._n = fail_after if fail_after >= 0 else layers
        self._report_limit = layers  # layers at or past it are never reported (cancel)
        self._starts: list[float] = []  # per unit: when it went on the wire (started)
        self._lands: list[float] = []   # per unit: when it landed (tentative past now)
        self._shared: list[bool] | None = [] if server.partner is not None else None
        self._kicked_at: float | None = None  # when it became its link's current op
        #: Its events' place among simpy events at the same instant (taken when it starts).
        self._key = 0
        self._acct = 0          # accounting cursor: 2 * unit (+1 once landed) accounted
        self._next_report = 0   # eager sinks: the next layer to report
        self._watch: list[int] = []  # lazy sinks: layers something waits for
        self._tick: _Tick | None = None
        self._tick_at = _INF
        self._walking = False

    # -- what callers read --------------------------------------------------------
    @property
    def land_times(self) -> list[float]:
        lands = self._lands
        if self.finished:
            return list(lands)
        return lands[:bisect_right(lands, self._server.env._now)]

    @property
    def layers_landed(self) -> int:
        if self.finished:
            return len(self._lands)
        return bisect_right(self._lands, self._server.env._now)

    @property
    def lazy_layers(self) -> bool:
        """Whether this op reports layers only on request (its sink set ``lazy_layers``)."""
        return self._lazy

    def layers_reported(self) -> int:
        """Layers landed and reported by now (a cancelled op's last unit is not reported)."""
        lands = self._lands
        m = len(lands) if self.finished else bisect_right(lands, self._server.env._now)
        limit = self._report_limit
        return m if m < limit else limit

    def watch(self, layer: int) -> None:
        """A lazy sink waits for ``layer``: report it (``layer_done``) when it lands."""
        if self.finished or not self._lazy:
            return
        self._watch.append(layer)
        self._server.reschedule(self)

    def __repr__(self) -> str:
        state = "finished" if self.finished else "running"
        return (f"<SimTransfer op={self.op.op_id} {self.op.kind.value} {self.link} "
                f"{self.layers_landed} layers landed, {state}>")


class _Tick:
    """A bare simpy event (what ``Environment.step`` needs): the next report or end of an op."""

    __slots__ = ("_ok", "callbacks", "h")

    def __init__(self, fn: Callable[[Any], None], h: SimTransfer | None) -> None:
        self._ok = True
        self.callbacks = [fn]
        self.h = h

    def __lt__(self, other: object) -> bool:
        return False  # a stale tick beside its op's new one at the same instant: either order


class Server:
    """The FIFO server of one link: its queue, its current op's schedule, its counters."""

    __slots__ = (
        "backend", "blocked", "busy_s", "bytes", "cancelled", "completed", "current", "duplex",
        "env", "failed", "group", "groups", "latency", "link", "name", "num_layers", "ops",
        "overlap", "partner", "piece_s", "pieces_per_block", "queue", "tick_cb",
    )

    def __init__(self, backend: SimBackend, name: str, link: Link, duplex: float) -> None:
        self.backend = backend
        self.env = backend.env
        self.name = name
        self.link = link
        self.overlap = link.overlap_latency
        self.latency = link.latency_s
        #: The opposite PCIe direction (set by the backend where ``duplex`` < 1).
        self.partner: Server | None = None
        self.duplex = duplex
        self.num_layers = backend.num_layers
        self.queue: deque[SimTransfer] = deque()
        self.current: SimTransfer | None = None
        #: Set while an aborted current op's report is pending: that report starts the next.
        self.blocked = False
        self.tick_cb = self._on_tick
        self.bytes = 0
        self.busy_s = 0.0
        self.ops = 0
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        #: The host layout's pieces on this link (``SimBackend.set_host_layout``): layers
        #: per group, the groups, time per piece and pieces per block in a unit.
        self.group = 1
        self.groups: tuple[tuple[int, int], ...] = ()
        self.piece_s = 0.0
        self.pieces_per_block = 1

    def group_units(self, layer_dur: float, blocks: int
                    ) -> tuple[list[float], list[float], list[float]]:
        """Per-unit (time, shared time, busy) of an op moving ``blocks`` a group at a time."""
        lat, per = self.latency, blocks * self.piece_s
        units: list[float] = []
        shared: list[float] = []
        busy: list[float] = []
        for _, count in self.groups:
            d = count * layer_dur
            zeros = [0.0] * (count - 1)
            units += [lat + d + per, *zeros]
            shared += [lat + d / self.duplex + per, *zeros]
            busy += [(d if self.overlap else lat + d) + per, *zeros]
        return units, shared, busy

    # -- starting ops ---------------------------------------------------------------
    def kick(self) -> None:
        """Start the head op if the link has none; never calls a sink."""
        if self.current is not None:
            return
        self.blocked = False
        queue = self.queue
        now = self.env._now
        while queue:
            h = queue[0]
            if h.finished:  # cancelled while queued
                queue.popleft()
                continue
            if h.fail_after == 0:  # injected failure before it moves anything
                queue.popleft()
                self.backend._abort(h, self.fail_error(h, 0), cancelled=False)
                continue
            self.current = h
            h._kicked_at = now
            # Ends at one instant go in the order their ops started (as the per-unit
            # model's event ids ordered their last units).
            h._key = next(self.env._eid)
            replan([h], now)
            return
        p = self.partner
        if p is not None and p.current is not None:
            replan([p.current], now)  # the other way may run faster from now

    # -- schedules --------------------------------------------------------------------
    def plan_alone(self, h: SimTransfer, now: float) -> bool:
        """Replan ``h`` on a link whose units nothing else affects; True if it changed."""
        starts, lands = h._starts, h._lands
        k = bisect_right(starts, now)  # units that have started keep their times
        old = lands[k:]
        if old:
            del starts[k:], lands[k:]
            if h._shared is not None:
                del h._shared[k:]
        t: float = lands[k - 1] if k else h._kicked_at  # type: ignore[assignment]
        n = h._n
        if k < n:
            # Unit after unit, each starting as the last lands: the same additions, in
            # the same order, as one event per unit made.
            if self.overlap:
                s0 = h.submitted_at + self.latency
                t1 = (s0 if s0 > t else t) + h.dur  # later units start past s0
                times = list(accumulate(repeat(h.dur, n - k - 1), initial=t1))
            else:
                each = repeat(h.unit, n - k) if h._units is None else h._units[0][k:n]
                times = list(accumulate(each, initial=t))[1:]
                if k == 0:
                    h.first_unit = times[0] - t
            starts.append(t)
            starts += times[:-1]
            lands += times
            if h._shared is not None:
                h._shared.extend([False] * (n - k))
        return lands[k:] != old

    def reschedule(self, h: SimTransfer) -> None:
        """(Re)schedule ``h``'s one pending event: its next report or its end."""
        lands = h._lands
        m = len(lands)
        when = lands[-1] if m == h._n and m and h._kicked_at is not None else _INF
        limit = m if m < h._report_limit else h._report_limit
        if h._lazy:
            if h._watch:
                w = min(h._watch)
                if w < limit and lands[w] < when:
                    when = lands[w]
        else:
            j = h._next_report
            if j < limit and lands[j] < when:
                when = lands[j]
        tick = h._tick
        if tick is not None:
            if h._tick_at == when:
                return
            tick.callbacks = []  # stale: does nothing when it comes up
            h._tick = None
        if when == _INF:
            return
        env = self.env
        if when < env._now:
            when = env._now
        h._tick = tick = _Tick(self.tick_cb, h)
        h._tick_at = when
        heappush(env._queue, (when, NORMAL, h._key, tick))

    # -- events -------------------------------------------------------------------------
    def _on_tick(self, tick: _Tick) -> None:
        h = tick.h
        assert h is not None
        if h._tick is not tick:
            return
        h._tick = None
        now = self.env._now
        lands = h._lands
        sink = h.sink
        ends = ends_by(h, now)
        if h._lazy:
            if h._watch and not ends:  # (an end settles every waiter)
                j = bisect_right(lands, now)
                if j > h._report_limit:
                    j = h._report_limit
                if j:
                    rest = [w for w in h._watch if w >= j]
                    if len(rest) != len(h._watch):
                        h._watch = rest
                        sink.layer_done(j - 1)
        else:
            last = h._n - 1 if ends else h._n  # the end reports the last layer itself
            while not h.finished:
                j = h._next_report
                if j >= last or j >= h._report_limit or j >= len(lands) or lands[j] > now:
                    break
                h._next_report = j + 1
                sink.layer_done(j)
        if h.finished or h._tick is not None:
            return  # a sink cancelled it, or asked for another report
        if ends_by(h, now):
            self._end(h, now)
        else:
            self.reschedule(h)

    def _end(self, h: SimTransfer, now: float) -> None:
        """``h``'s last unit has landed: account, start the next op, then report."""
        backend = self.backend
        self.account(h, now)
        n = h._n
        error: TransferError | None = None
        if h.cancelled:
            error = backend._cancel_error(h)
            self.cancelled += 1
            backend.cancelled += 1
        elif n == self.num_layers:
            self.completed += 1
        else:
            error = self.fail_error(h, n)
            self.failed += 1
            backend.failed += 1
        h.error = error
        h.finished = True
        h.finished_at = now
        h.deps = ()  # let finished predecessors go (a long chain would pin them all)
        self.queue.popleft()
        backend._inflight -= 1
        self.current = None
        backend._ending = h
        try:
            self.kick()
            waiting = [d for d in h.dependents if not d.finished and d._server.current is d]
            h.dependents = []
            if waiting:
                replan(waiting, now)
        finally:
            backend._ending = None
        sink = h.sink
        limit = n if n < h._report_limit else h._report_limit
        if not h._lazy:
            for j in range(h._next_report, limit):
                h._next_report = j + 1
                sink.layer_done(j)
        elif error is not None and limit and h._watch and min(h._watch) < limit:
            sink.layer_done(limit - 1)  # what landed before the failure did land
        h.sink = None  # told everything: let the sink (which may hold this handle) go
        sink.done(error)

    # -- accounting ---------------------------------------------------------------------
    def account(self, h: SimTransfer, until: float) -> None:
        """Add the bytes and busy time of ``h``'s units up to ``until``, in time order."""
        i = h._acct
        lands = h._lands
        m = len(lands)
        end = 2 * m
        if i >= end:
            return
        starts, shared = h._starts, h._shared
        if shared is None:  # no start adds anything: the landed units, in one go
            j = i >> 1
            k = m if lands[-1] <= until else bisect_right(lands, until)
            if k > j:
                busy_s, busy = self.busy_s, h.busy
                if h._units is not None:
                    for b in h._units[2][j:k]:
                        busy_s += b
                else:
                    for _ in range(k - j):
                        busy_s += busy
                self.busy_s = busy_s
                self.bytes += (k - j) * h.nbytes
                h._acct = 2 * k
            return
        busy_s = self.busy_s
        units = h._units
        while i < end:
            j = i >> 1
            if i & 1:
                if lands[j] > until:
                    break
                self.bytes += h.nbytes
                busy_s += h.busy if units is None else units[2][j]
            else:
                if starts[j] > until:
                    break
                if shared is not None and shared[j]:
                    busy_s += (h.shared_unit - h.unit if units is None
                               else units[1][j] - units[0][j])
            i += 1
        self.busy_s = busy_s
        h._acct = i

    def fail_error(self, h: SimTransfer, landed: int) -> TransferError:
        op = h.op
        return TransferError(
            f"injected failure: op {op.op_id} ({op.kind.value}, "
            f"{Tier(op.src_tier).name.lower()} -> {Tier(op.dst_tier).name.lower()}) failed "
            f"after {landed} of {self.num_layers} layers"
        )


