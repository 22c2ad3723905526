"""Replanning of ``sim.links`` schedules: from the present, when an input changes.

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

**Simultaneous events.** The per-unit model ordered events at one virtual
time by when they were scheduled. Here the units' own boundaries are not simpy
events, so the walk follows the order that gave:

* a unit boundary at the instant of a real event (a submit from a coroutine,
  a sampler's tick) counts as having happened first;
* ops ending at one instant end in the order they started (their events' key);
* a unit waiting on an op that ends at that instant starts during that op's
  end event, after the op's link has started its next op;
* at one landing, the landed unit's own op goes on before the ops waiting on
  it are woken; otherwise units starting at one instant go in the order the
  units whose landing starts them started.

Only exactly coinciding float times can tell these apart;
``tests/test_sim_hierarchy_equivalence.py`` checks the schedules against the
per-unit model on random workloads built to make such ties common.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim.links import Server, SimTransfer

_INF = float("inf")
#: An "after" op whose schedule the current walk has not reached yet.
_PENDING = object()
# What starts a unit, for ordering units that start at one instant: the landing of a unit
# (its start time, its op's key), or a kick (a real event: first) or nothing known (last).
_FIRST = (-_INF, 0)
_LAST = (_INF, 0)
#: Replans one change may set off before the model is declared broken (it settles in a few).
_MAX_REPLANS = 1_000_000


def ends_by(h: SimTransfer, now: float) -> bool:
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
            if h._units is None:
                land = s + (h.shared_unit if shared else h.unit)
            else:
                land = s + h._units[1 if shared else 0][best.k]
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
