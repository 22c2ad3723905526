"""The link servers of ``sim.hierarchy``: FIFO schedules computed per op, one event per op.

The model (FIFO units, latency, duplex share, ``after``, cancel, failure) is the
one ``sim.hierarchy``'s docstring describes; this module is how it is computed
without a simpy event per layer.

**A schedule per op.** When an op starts service on its link (becomes the
link's *current* op), the link computes every remaining unit's start and
landing time at once: FIFO, known bandwidth and latency, each unit's
dependencies (``after``) read from the schedules of the ops it follows. The
op then costs one simpy event — at its end — plus one for each layer that
something awaits: a sink that sets ``lazy_layers`` (the runtime's tasks) reads
landed layers from the handle (``layers_reported``) and asks for a report of
layer i only when it waits for it (``watch``); any other sink gets
``layer_done`` for every layer at its landing time, as before.

**Schedules are tentative past now, and recomputed when an input changes.**
A unit that has started keeps its times; units that start later are
recomputed ("replanned") from the present when:

* the opposite PCIe direction starts or stops carrying data (with
  ``duplex`` < 1, a unit's time depends on whether the other way has a unit on
  the wire when it starts; both directions' current ops are then walked
  together, unit by unit in order of their start times, exactly as the
  per-unit model processed them);
* an op this one follows (``after``) starts, is replanned, is cancelled or
  fails (its landing times are this op's start constraints);
* the op itself is cancelled (the unit in service is its last).

Every recomputation happens at a real event (a submit, a cancel, an op's end),
so a schedule is always right for the units that have started by now, and
each op's end event is (re)scheduled at its current end time.

**Simultaneous events.** The per-unit model ordered events at the same virtual
time by when they were scheduled. Here the units' own boundaries are not
simpy events, so a boundary at the very instant of a real event (a submit
from a coroutine, a sampler tick) counts as having happened first. Within a
walk, boundaries at the same instant are ordered by when their units started,
as the per-unit model's event ids ordered them. Only exactly coinciding float
times can tell the two apart; ``tests/test_sim_hierarchy_equivalence.py``
checks the schedules against the per-unit model on random workloads.

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

if TYPE_CHECKING:
    from sim.hierarchy import SimBackend

_INF = float("inf")
_PENDING = object()
# What starts a unit, for ordering units that start at one instant: the landing of a unit
# (its start time, its op's key), or a kick (a real event: first) or nothing known (last).
_FIRST = (-float("inf"), 0)
_LAST = (float("inf"), 0)  # an "after" op whose schedule the current walk has not reached yet
#: Replans one change may set off before the model is declared broken (it settles in a few).
_MAX_REPLANS = 1_000_000


class SimTransfer:
    """Handle of one op submitted to a ``SimBackend`` (what ``after`` and ``cancel`` take).

    Read-only for callers: ``layers_landed``, ``land_times`` (virtual time
    each layer landed by now, in order), ``finished``, ``cancelled``,
    ``error``, ``submitted_at``, ``finished_at``, ``link`` (its link's name),
    ``first_unit`` (how long its first unit took).
    """

    __slots__ = (
        "_acct", "_backend", "_key", "_kicked_at", "_lands", "_lazy", "_n", "_next_report",
        "_report_limit", "_server", "_shared", "_starts", "_tick", "_tick_at", "_walking",
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


def _ends_by(h: SimTransfer, now: float) -> bool:
    """Whether ``h``'s schedule is complete and its last unit has landed by ``now``."""
    lands = h._lands
    m = len(lands)
    return m == h._n and m > 0 and lands[-1] <= now


def _ends_now(h: SimTransfer, k: int, now: float, ending: SimTransfer | None) -> bool:
    """Whether unit ``k`` of ``h`` waits on the end of an op that ends at ``now`` and whose
    end event is being processed (``ending``) or has yet to be."""
    for d in h.deps:
        if d is ending or not d.finished:
            n = d._n
            if k >= n - 1 and len(d._lands) == n and d._lands[-1] == now:
                return True
    return False


def _avail(d: SimTransfer, k: int) -> Any:
    """When layer ``k`` of ``d`` is there for an op that follows it: its landing time, or
    ``d``'s end if it ends first; ``None`` if not known yet, ``_PENDING`` if the current
    walk has yet to compute it."""
    lands = d._lands
    if k < len(lands):
        return lands[k]
    if d.finished:
        return d.finished_at
    if d._walking:
        return _PENDING
    if d._kicked_at is not None and len(lands) == d._n and lands:
        return lands[-1]
    return None


class _Side:
    """One op being walked: its next unit, and when its link is free for it."""

    __slots__ = ("done", "h", "i", "k", "k0", "old", "t")

    def __init__(self, h: SimTransfer, i: int, now: float) -> None:
        self.h = h
        self.i = i
        starts = h._starts
        k = bisect_right(starts, now)  # units that have started keep their times ...
        if h.deps and h._shared is not None:
            # ... except those waiting on an op that ends now: they start during its
            # end event (the per-unit model's last-unit event), after its link has
            # started its next op, and whether the other way is busy is known then.
            ending = h._backend._ending
            while k and starts[k - 1] == now and _ends_now(h, k - 1, now, ending):
                k -= 1
        self.k0 = self.k = k
        self.old = h._lands[k:]
        del h._lands[k:], h._starts[k:]
        if h._shared is not None:
            del h._shared[k:]
        self.t: float = h._lands[k - 1] if k else h._kicked_at  # type: ignore[assignment]
        self.done = False
        h._walking = True


class Server:
    """The FIFO server of one link: its queue, its current op's schedule, its counters."""

    __slots__ = (
        "backend", "blocked", "busy_s", "bytes", "cancelled", "completed", "current", "duplex",
        "env", "failed", "latency", "link", "name", "num_layers", "ops", "overlap", "partner",
        "queue", "tick_cb",
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
                times = list(accumulate(repeat(h.unit, n - k), initial=t))[1:]
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
        ends = _ends_by(h, now)
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
        if _ends_by(h, now):
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
                for _ in range(k - j):
                    busy_s += busy
                self.busy_s = busy_s
                self.bytes += (k - j) * h.nbytes
                h._acct = 2 * k
            return
        busy_s = self.busy_s
        while i < end:
            j = i >> 1
            if i & 1:
                if lands[j] > until:
                    break
                self.bytes += h.nbytes
                busy_s += h.busy
            else:
                if starts[j] > until:
                    break
                if shared is not None and shared[j]:
                    busy_s += h.shared_unit - h.unit
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


# -------------------------------------------------------------------- replanning
def replan(roots: list[SimTransfer], now: float) -> None:
    """Recompute from ``now`` the schedules of these current ops, then of whatever their
    change affects (the other PCIe direction's current op, ops that follow them)."""
    work = list(roots)
    count = 0
    while work:
        h = work.pop()
        server = h._server
        if h.finished or server.current is not h:
            continue
        count += 1
        if count > _MAX_REPLANS:
            raise RuntimeError("sim link model: schedules did not settle (a cycle in 'after'?)")
        p = server.partner
        other = p.current if p is not None else None
        if other is None and not h.deps:
            changed = [h] if server.plan_alone(h, now) else []
        else:
            sides = [h] if other is None else [h, other] if server.name < p.name else [other, h]
            changed = _walk(sides, now)
        for g in changed:
            g._server.reschedule(g)
            for d in g.dependents:
                if not d.finished and d._server.current is d:
                    work.append(d)


def _walk(hs: list[SimTransfer], now: float) -> list[SimTransfer]:
    """Replan one op, or both PCIe directions' current ops together, unit by unit in order
    of start time (the general case: ``after`` constraints, duplex sharing)."""
    sides = [_Side(h, i, now) for i, h in enumerate(hs)]
    while True:
        best: _Side | None = None
        best_key: tuple[float, tuple[float, int], bool] = (_INF, _LAST, True)
        best_avail = -_INF
        for side in sides:
            if side.done:
                continue
            h, k = side.h, side.k
            if k >= h._n:
                side.done = True
                h._walking = False
                continue
            a = -_INF
            trig: tuple[float, int] = _LAST
            wait = False
            for d in h.deps:
                v = _avail(d, k)
                if v is _PENDING:
                    wait = True
                    break
                if v is None or (v == now and not d.finished and k >= d._n - 1):
                    side.done = True  # not known yet, or known at an end event to come
                    break
                if v > a:
                    a = v
                    trig = (d._starts[k], d._key) if k < len(d._starts) else _LAST
            if side.done:
                h._walking = False
                continue
            if wait:
                continue
            t = side.t
            if t >= a:
                s = t
                # a unit started by its own previous one's landing, or by a kick (a real
                # event, before whatever the virtual events it causes start)
                trig = (h._starts[k - 1], h._key) if k else _FIRST
            else:
                s = a
            # at one instant: by the event that starts each unit; at one event, the
            # landed unit's own op goes on before the ops waiting on it are woken
            key = (s, trig, s != t)
            if key < best_key:
                best, best_key, best_avail = side, key, a
        if best is None:
            break
        h = best.h
        server = h._server
        s, trig, _ = best_key
        if server.overlap:
            issued = best_avail if best_avail > h.submitted_at else h.submitted_at
            start = issued + server.latency
            land = (start if start > s else s) + h.dur
        else:
            other = sides[1 - best.i].h if len(sides) == 2 else None
            if other is None and server.partner is not None:
                other = server.partner.current
            shared = other is not None and _on_the_wire(other, s, trig)
            land = s + (h.shared_unit if shared else h.unit)
            if h._shared is not None:
                h._shared.append(shared)
            if best.k == 0:
                h.first_unit = land - s
        h._starts.append(s)
        h._lands.append(land)
        best.k += 1
        best.t = land
    changed = []
    for side in sides:
        h = side.h
        h._walking = False
        if h._lands[side.k0:] != side.old:
            changed.append(h)
    return changed


def _on_the_wire(p: SimTransfer, s: float, trig: tuple[float, int]) -> bool:
    """Whether ``p`` (the other PCIe direction's op) has a unit on the wire when a unit
    of ours starts at ``s``, our start following the landing of the unit ``trig`` names."""
    lands = p._lands
    if not lands:
        return False
    j = len(lands) - 1
    land = lands[j]
    if land != s:
        return land > s and p._starts[j] <= s
    # p's unit lands the instant ours starts: still on the wire unless its landing came
    # first (its unit started before the one whose event starts ours) and p goes idle
    if (p._starts[j], p._key) > trig:
        return True
    if j + 1 < p._n:
        return False  # its next unit, had it started now, would have been walked first
    return _starts_next_at(p._server, p, s)


def _starts_next_at(server: Server, cur: SimTransfer, s: float) -> bool:
    """Whether ``server`` starts another op the instant ``cur`` ends at ``s``."""
    for g in server.queue:
        if g is cur or g.finished or g.fail_after == 0:
            continue
        for d in g.deps:
            v = _avail(d, 0)
            if v is None or v is _PENDING or v > s:
                return False
        return True
    return False
