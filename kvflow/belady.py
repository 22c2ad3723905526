"""The offline optimum as an eviction policy: Belady's MIN over a known trace.

OFFLINE: it reads the future (every later request's block keys), so it is a
yardstick for the online policies on a replayed trace, never a policy to
deploy. Belady, "A study of replacement algorithms for a virtual-storage
computer", IBM Systems Journal 5(2), 1966: evicting the block whose next use
is farthest in the future minimises misses.

How it learns the future and "now": ``FutureUses`` is a first pass over the
trace that records, for each block key, the positions of the requests using
it; the manager tells it which request it is planning (``advance``, from
``CacheManager.plan``), so a block ranked when its last reference goes is
ranked by its first use after that request. The tiers' policies share one
``FutureUses``; each ranks the copies on its own tier (per tier, in cache and
full mode; in full mode requests overlap and "now" is the latest planned).

Prefix closure comes for free: every request using a block uses its parent,
so a parent's next use is never later than its child's, and ties go to the
deeper block: the farthest block is always a leaf. A block whose next use
passes without it being used (its request stopped matching before it) is
ranked again when its stale entry surfaces.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

from kvflow.ranked import DEPTH_BITS

__all__ = ["Belady", "FutureUses", "HeapOrder"]

_heappush = heapq.heappush
_heappop = heapq.heappop


class FutureUses:
    """For each block key, the positions of the requests that use it, and a clock.

    ``requests[i]`` are the keys request ``i`` will ask for (as the manager will
    see them: truncated where the replay truncates). ``ids[i]``, when given, is
    the request id ``CacheManager.plan`` receives for it (else the id is ``i``).
    A request it does not know (a probe, a warm-up) leaves the clock where it is.
    """

    def __init__(self, requests: Iterable[Sequence[Hashable]],
                 ids: Iterable[Hashable] | None = None) -> None:
        uses: dict[Hashable, list[int]] = {}
        n = 0
        for pos, keys in enumerate(requests):
            n = pos + 1
            for k in keys:
                lst = uses.get(k)
                if lst is None:
                    uses[k] = [pos]
                elif lst[-1] != pos:
                    lst.append(pos)
        self._uses = uses
        self._cursor: dict[Hashable, int] = {}
        #: The "next use" of a block never used again: after every request.
        self.never = n
        self.requests = n
        self.now = -1
        self._pos: dict[Hashable, int] | None = None
        if ids is not None:
            self._pos = {rid: i for i, rid in enumerate(ids)}

    def advance(self, request_id: Hashable) -> None:
        """The manager is planning ``request_id``: the clock moves up to its position."""
        if self._pos is not None:
            pos = self._pos.get(request_id)
        else:
            pos = request_id if type(request_id) is int and 0 <= request_id < self.never else None
        if pos is not None and pos > self.now:
            self.now = pos

    def next_use(self, key: Hashable) -> int:
        """Position of the first request after ``now`` using ``key``; ``never`` if none.
        Amortized O(1): the clock only moves forward, and so does each key's cursor."""
        lst = self._uses.get(key)
        if lst is None:
            return self.never
        now = self.now
        if lst[0] > now:
            return lst[0]
        cur = self._cursor
        i = cur.get(key, 0)
        n = len(lst)
        while i < n and lst[i] <= now:
            i += 1
        cur[key] = i
        return lst[i] if i < n else self.never


class HeapOrder:
    """Nodes on a heap by rank, lowest first (ranks too many for buckets).

    An entry is ``(rank, seq, node, tag)``: ``tag`` is what the rank assumed that
    may change without the node being touched; where ``checks_tags`` is set,
    ``_fresh`` looks at it when the entry surfaces, and a stale entry is ranked
    again. Subclasses define ``_push_ranked`` (one node) and ``unref_all`` (a
    release, inlined: it is the hot path).
    """

    orders_referenced = False
    checks_tags = False

    def __init__(self, capacity: int = 0) -> None:
        self._heap: list[tuple[Any, int, Any, Any]] = []
        self._live: dict[Any, int] = {}  # node -> seq of its live entry
        self._seq = 0
        self._popped: dict[Any, tuple[Any, int, Any, Any]] = {}  # the last pop_front's
        # The index refs only nodes in the order: a plain dict delete, called from C.
        self.ref = self._live.__delitem__

    # -- what subclasses define ------------------------------------------------------
    def _push_ranked(self, node: Any) -> None:
        raise NotImplementedError

    def _fresh(self, entry: tuple[Any, int, Any, Any]) -> bool:
        """Whether ``entry``'s rank still holds (only where ``checks_tags``)."""
        return True

    # -- the protocol ------------------------------------------------------------------
    def _push(self, node: Any, rank: Any, tag: Any = None) -> None:
        s = self._seq
        self._seq = s + 1
        self._live[node] = s
        _heappush(self._heap, (rank, s, node, tag))

    def _compact(self) -> None:
        """Drop dead entries once they outnumber the live ones (amortized O(1))."""
        if len(self._heap) > 2 * len(self._live) + 4096:
            live = self._live
            self._heap = [e for e in self._heap if live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def insert(self, node: Any) -> None:
        if node.ref == 0:
            self._push_ranked(node)

    def unref(self, node: Any) -> None:
        self._push_ranked(node)

    def unref_all(self, nodes: list[Any]) -> None:
        push = self._push_ranked
        for node in nodes:
            push(node)
        self._compact()

    def remove(self, node: Any) -> None:
        self._live.pop(node, None)

    def _top(self) -> tuple[Any, int, Any, Any] | None:
        """The live entry with the lowest rank, left on the heap (re-ranked if stale)."""
        heap, live = self._heap, self._live
        while heap:
            e = heap[0]
            node = e[2]
            if live.get(node) != e[1]:
                _heappop(heap)
            elif not self.checks_tags or self._fresh(e):
                return e
            else:
                _heappop(heap)
                self._push_ranked(node)
        return None

    def first(self) -> Any | None:
        """The first candidate, in O(log n) amortized."""
        e = self._top()
        return None if e is None else e[2]

    def pop_front(self, k: int) -> list[Any]:
        """Remove and return up to ``k`` first candidates, in order."""
        out: list[Any] = []
        popped: dict[Any, tuple[Any, int, Any, Any]] = {}
        self._popped = popped
        heap, live = self._heap, self._live
        checks = self.checks_tags
        n = 0
        while n < k and heap:
            e = _heappop(heap)
            node = e[2]
            if live.get(node) != e[1]:
                continue
            if checks and not self._fresh(e):
                self._push_ranked(node)
                continue
            del live[node]
            out.append(node)
            popped[node] = e
            n += 1
        self._compact()
        return out

    def push_front(self, nodes: list[Any]) -> None:
        """Undo the last ``pop_front`` for ``nodes`` (its tail): the same entries go back."""
        popped = self._popped
        for node in nodes:
            e = popped.pop(node)
            self._live[node] = e[1]
            _heappush(self._heap, e)

    def candidates(self) -> Iterator[Any]:
        """Every node once, lowest rank first; those the caller declines go back as
        they were (the heap is restored when the scan ends or is dropped)."""
        back: list[tuple[Any, int, Any, Any]] = []
        live = self._live
        try:
            while True:
                e = self._top()
                if e is None:
                    return
                _heappop(self._heap)
                back.append(e)
                yield e[2]
        finally:
            for e in back:
                if live.get(e[2]) == e[1]:
                    _heappush(self._heap, e)

    def tracked(self) -> set[Any]:
        return set(self._live)

    def __iter__(self) -> Iterator[Any]:
        """The order, front (next victim) first (for tests: O(n log n))."""
        live = self._live
        return iter([e[2] for e in sorted(self._heap, key=lambda e: (e[0], e[1]))
                     if live.get(e[2]) == e[1]])


class Belady(HeapOrder):
    """Farthest next use first; ties: deepest first, then least recently released.

    OFFLINE (reads the future; see the module docstring). Belady 1966.
    """

    def __init__(self, capacity: int = 0, future: FutureUses | None = None) -> None:
        super().__init__(capacity)
        if future is None:
            from kvflow.errors import ConfigError

            raise ConfigError("eviction 'belady' is offline: it needs the trace's future "
                              "(a kvflow.belady.FutureUses; the replay builds one)")
        self.future = future

    def _push_ranked(self, node: Any) -> None:
        nu = self.future.next_use(node.key)
        self._push(node, -((nu << DEPTH_BITS) | node.depth), nu)

    def unref_all(self, nodes: list[Any]) -> None:
        heap = self._heap
        next_use = self.future.next_use
        s0 = s = self._seq
        for node in nodes:
            nu = next_use(node.key)
            _heappush(heap, (-((nu << DEPTH_BITS) | node.depth), s, node, nu))
            s += 1
        self._seq = s
        self._live.update(zip(nodes, range(s0, s), strict=True))
        self._compact()

    checks_tags = True

    def _fresh(self, entry: tuple[Any, int, Any, Any]) -> bool:
        return entry[3] > self.future.now
