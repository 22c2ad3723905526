"""ARC, the Adaptive Replacement Cache, as a per-tier eviction order.

Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache",
FAST'03. Two LRU lists split the tier: T1 holds blocks used once since they
arrived, T2 blocks used again. Two ghost lists remember the keys recently
evicted from each (B1, B2). A block that returns while its key is in B1 says
T1 was too small: the target size ``p`` of T1 grows; one returning from B2
shrinks it. The victim is T1's least recent block while T1 is larger than
``p``, else T2's. vLLM's CPU KV offloading added ARC as an eviction policy.

Fitted to kvflow's protocol: the index decides when to evict and asks for the
order, so ARC's REPLACE becomes the choice of list in ``first``/``pop_front``;
a block enters a list when its last reference goes (referenced blocks are in
no order, as in LRU), T1 the first time it does on this tier, T2 after a hit
or a ghost hit. ``p`` is compared with T1's unreferenced blocks.

Leaves first: within a list, a request releases its blocks tail-first, so a
parent is more recent than its children. Across lists a T2 parent can come
before its T1 child; the index declines it, and ``candidates`` moves a
declined block behind the rest of its list, as LRU does, and offers the
other list's next.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from itertools import islice
from typing import Any

__all__ = ["ARC", "LinkedARC"]


class ARC:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03) over one tier's blocks.

    ``p`` is compared with T1's unreferenced blocks (the replaceable ones; a
    referenced block is pinned and in no list). A referenced block remembers
    only that it was in a list, since its next release puts it in T2 anyway.
    """

    orders_referenced = False

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = max(1, capacity)
        self.p = 0.0  # target size of T1, in blocks
        self._t1: OrderedDict[Any, None] = OrderedDict()
        self._t2: OrderedDict[Any, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._held: dict[Any, int] = {}  # referenced blocks that were in T1 (1) or T2 (2)
        self._popped: list[tuple[Any, int]] = []

    # -- arrivals --------------------------------------------------------------------
    def insert(self, node: Any) -> None:
        if node.ref == 0:
            self.unref_all([node])

    def unref(self, node: Any) -> None:
        self.unref_all([node])

    def unref_all(self, nodes: list[Any]) -> None:
        held, t1, t2, b1, b2 = self._held, self._t1, self._t2, self._b1, self._b2
        for node in nodes:
            if node in held:  # used again: frequent
                del held[node]
                t2[node] = None
                continue
            key = node.key
            if key in b1:  # a ghost hit: T1 was too small
                self.p = min(float(self.capacity), self.p + max(1.0, len(b2) / len(b1)))
                del b1[key]
                t2[node] = None
            elif key in b2:  # T2 was
                self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
                del b2[key]
                t2[node] = None
            else:
                t1[node] = None

    def ref(self, node: Any) -> None:
        t1 = self._t1
        if node in t1:
            del t1[node]
            self._held[node] = 1
        else:
            del self._t2[node]
            self._held[node] = 2

    # -- departures ------------------------------------------------------------------
    def remove(self, node: Any) -> None:
        if node in self._t1:
            del self._t1[node]
            where = 1
        elif node in self._t2:
            del self._t2[node]
            where = 2
        else:
            where = self._held.pop(node, 0)
            if not where:
                return
        (self._b1 if where == 1 else self._b2)[node.key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        """Ghosts are kept to the tier's capacity in all, B1 trimmed first while
        T1 and B1 together exceed it (ARC's |T1| + |B1| <= c)."""
        b1, b2 = self._b1, self._b2
        over = len(b1) + len(b2) - self.capacity
        if over <= 0:
            return
        from_b1 = min(over, len(b1), max(0, len(self._t1) + len(b1) - self.capacity))
        if len(b2) < over - from_b1:
            from_b1 = over - len(b2)
        for _ in range(from_b1):
            b1.popitem(last=False)
        for _ in range(over - from_b1):
            b2.popitem(last=False)

    def _victim_list(self) -> OrderedDict[Any, None] | None:
        """ARC's REPLACE: T1's LRU end while T1 is over its target, else T2's."""
        t1, t2 = self._t1, self._t2
        if t1 and (len(t1) > self.p or not t2):
            return t1
        return t2 or None

    def first(self) -> Any | None:
        od = self._victim_list()
        return None if od is None else next(iter(od))

    def pop_front(self, k: int) -> list[Any]:
        """Remove and return up to ``k`` victims, each chosen as REPLACE would."""
        out: list[Any] = []
        popped: list[tuple[Any, int]] = []
        t1, t2 = self._t1, self._t2
        while len(out) < k:
            od = self._victim_list()
            if od is None:
                break
            # A run from the chosen list, as long as REPLACE would keep choosing it.
            run = k - len(out)
            if od is t1 and t2:
                run = min(run, max(1, math.ceil(len(t1) - self.p)))
            take = list(islice(od, run))
            for node in take:
                del od[node]
            where = 1 if od is t1 else 2
            (self._b1 if where == 1 else self._b2).update(dict.fromkeys([n.key for n in take]))
            out += take
            popped += [(n, where) for n in take]
        self._trim_ghosts()
        self._popped = popped
        return out

    def push_front(self, nodes: list[Any]) -> None:
        """Undo the last ``pop_front`` for ``nodes`` (its tail, in its order)."""
        if not nodes:
            return
        where_of = dict(self._popped[len(self._popped) - len(nodes):])
        for node in reversed(nodes):
            where = where_of[node]
            od = self._t1 if where == 1 else self._t2
            od[node] = None
            od.move_to_end(node, last=False)
            (self._b1 if where == 1 else self._b2).pop(node.key, None)

    def candidates(self) -> Iterator[Any]:
        """Victims in REPLACE's order; a declined one moves behind the rest of its list,
        and the next candidate comes from the other list (else a list of pinned
        parents, T2's shared prefixes say, is scanned whole at every eviction)."""
        offered: set[Any] = set()
        t1, t2 = self._t1, self._t2
        switch = False
        for _ in range(len(t1) + len(t2)):
            od = self._victim_list()
            if od is None:
                return
            alt = t2 if od is t1 else t1
            if switch and alt:
                od, alt = alt, od
            node = next(iter(od))
            if node in offered:
                node = next(iter(alt), None) if alt else None
                if node is None or node in offered:
                    break
                od = alt
            offered.add(node)
            yield node
            if node in od:
                od.move_to_end(node)
                switch = not switch
            else:
                switch = False
        for node in [*t1, *t2]:
            if node not in offered:
                offered.add(node)
                yield node

    def tracked(self) -> set[Any]:
        return set(self._t1) | set(self._t2)


def _native_arc() -> type | None:
    """The extension's ``LinkedARC``, where the built one has it."""
    import warnings

    try:
        from kvflow import _index_core
    except ImportError:
        return None
    cls = getattr(_index_core, "LinkedARC", None)
    if cls is None:
        warnings.warn("kvflow._index_core predates kvflow/_index_core.c (no LinkedARC): "
                      "rebuild it (pip install, or build_ext); arc runs in Python",
                      RuntimeWarning, stacklevel=2)
    return cls


_LINKED_ARC = _native_arc()

if _LINKED_ARC is not None:

    class LinkedARC(_LINKED_ARC):  # type: ignore[misc,valid-type]
        """``ARC`` for the native core's nodes: T1 and T2 linked through the nodes,
        the ghost lists and ``p`` kept as ``ARC`` keeps them, in C. The Python class
        costs ~3-5x LRU's time in cache mode, a dict operation or two per block and
        ghost upkeep per victim (``benchmarks/results/policies.md``); this one gives
        the same victims in the same order (``tests/test_index_core_equivalence.py``
        runs both side by side)."""

        def __new__(cls, tier: int, capacity: int = 0) -> LinkedARC:
            return super().__new__(cls, tier, capacity)

        def candidates(self) -> Iterator[Any]:
            """As ``ARC.candidates``, on the native lists (1: T1, 2: T2)."""
            offered: set[Any] = set()
            switch = False
            head, where, move = self.head, self.where, self.move_to_end
            for _ in range(len(self)):
                w = self.victim_list()
                if not w:
                    return
                alt = 3 - w
                if switch and head(alt) is not None:
                    w, alt = alt, w
                node = head(w)
                if node in offered:
                    node = head(alt)
                    if node is None or node in offered:
                        break
                    w = alt
                offered.add(node)
                yield node
                if where(node) == w:
                    move(node)
                    switch = not switch
                else:
                    switch = False
            for node in [*self.list(1), *self.list(2)]:
                if node not in offered:
                    offered.add(node)
                    yield node

        @property
        def _t1(self) -> list[Any]:
            return self.list(1)

        @property
        def _t2(self) -> list[Any]:
            return self.list(2)

        def __iter__(self) -> Iterator[Any]:
            """T1 then T2, each LRU end first."""
            return iter([*self.list(1), *self.list(2)])

else:  # a source tree without the extension (or an old build): ARC serves
    LinkedARC = None  # type: ignore[assignment,misc]
