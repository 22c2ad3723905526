"""Eviction policies that rank blocks by a score: length-aware LFU and cost-aware GDSF.

Both keep blocks in buckets by an integer rank, lowest first, oldest first
within a bucket (an ``OrderedDict`` per rank, and a heap of the ranks that have
a bucket). Every per-block step is a few dict operations, as in LFU; the heap
moves only when a bucket appears or empties. Like LRU and LFU, referenced
blocks are in no bucket (``orders_referenced`` is false): a block is ranked
when its last reference goes, with what is known then.

Prefix closure wants leaves first: a parent must rank at least as high as
its cached children, or the index has to scan past it (correct, but slower).
Each policy says how its rank keeps that.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import islice
from typing import Any

from kvflow.cost import DEFAULT_COSTS, BlockCosts
from kvflow.errors import ConfigError

#: Depth fits in the low bits of an integer rank (prompts of < 2**20 blocks).
DEPTH_BITS = 20

_heappush = heapq.heappush
_heappop = heapq.heappop


class BucketedPolicy:
    """Buckets by integer rank, lowest first; subclasses say how nodes are ranked.

    A bucket's values are tags: what the rank assumed that may change without
    the node being touched. Where ``checks_tags`` is set, ``_fresh`` looks at a
    node's tag when it comes up for eviction, and a stale node is ranked again.
    A rank is in ``_buckets`` exactly when it is on the ``_ranks`` heap (once).
    """

    orders_referenced = False
    checks_tags = False

    def __init__(self, capacity: int = 0) -> None:
        self._buckets: dict[int, OrderedDict[Any, Any]] = {}
        self._ranks: list[int] = []
        self._popped: dict[Any, tuple[int, Any]] = {}  # the last pop_front's: rank, tag

    # -- what subclasses define ------------------------------------------------------
    def _place(self, node: Any) -> None:
        """Rank a node whose last reference went (or whose copy became ready)."""
        raise NotImplementedError

    def _rank_of(self, node: Any) -> int | None:
        """The bucket a ranked node is in (None: in none)."""
        raise NotImplementedError

    def _forget(self, node: Any) -> None:
        """A node left its bucket."""

    def _fresh(self, node: Any, tag: Any) -> bool:
        return True

    def _taken(self, rank: int) -> None:
        """A node of bucket ``rank`` was handed out as a victim."""

    # -- buckets -----------------------------------------------------------------------
    def _add(self, node: Any, rank: int, tag: Any = None) -> None:
        b = self._buckets.get(rank)
        if b is None:
            b = self._buckets[rank] = OrderedDict()
            _heappush(self._ranks, rank)
        b[node] = tag

    def _front(self) -> tuple[int, OrderedDict[Any, Any]] | None:
        """The lowest non-empty bucket; empty ones met on the way are dropped."""
        ranks, buckets = self._ranks, self._buckets
        while ranks:
            r = ranks[0]
            b = buckets[r]
            if b:
                return r, b
            _heappop(ranks)
            del buckets[r]
        return None

    # -- the protocol ------------------------------------------------------------------
    def insert(self, node: Any) -> None:
        if node.ref == 0:
            self._place(node)

    def unref(self, node: Any) -> None:
        self._place(node)

    def unref_all(self, nodes: list[Any]) -> None:
        place = self._place
        for node in nodes:
            place(node)

    def remove(self, node: Any) -> None:
        r = self._rank_of(node)
        if r is not None:
            b = self._buckets.get(r)
            if b is not None and node in b:
                del b[node]
                self._forget(node)

    def ref(self, node: Any) -> None:
        r = self._rank_of(node)
        del self._buckets[r][node]  # type: ignore[index]
        self._forget(node)

    def first(self) -> Any | None:
        """The first candidate (stale ones ranked again on the way)."""
        while True:
            front = self._front()
            if front is None:
                return None
            b = front[1]
            node = next(iter(b))
            if not self.checks_tags or self._fresh(node, b[node]):
                return node
            del b[node]
            self._forget(node)
            self._place(node)

    def pop_front(self, k: int) -> list[Any]:
        """Remove and return up to ``k`` first candidates, in order."""
        out: list[Any] = []
        popped: dict[Any, tuple[int, Any]] = {}
        self._popped = popped
        checks = self.checks_tags
        while len(out) < k:
            front = self._front()
            if front is None:
                break
            r, b = front
            for node in list(islice(b, k - len(out))):
                tag = b.pop(node)
                self._forget(node)
                if checks and not self._fresh(node, tag):
                    self._place(node)
                    continue
                out.append(node)
                popped[node] = (r, tag)
                self._taken(r)
        return out

    def push_front(self, nodes: list[Any]) -> None:
        """Undo the last ``pop_front`` for ``nodes`` (its tail, in its order)."""
        popped = self._popped
        for node in reversed(nodes):
            r, tag = popped.pop(node)
            self._add(node, r, tag)
            self._buckets[r].move_to_end(node, last=False)
            self._restored(node, r)

    def _restored(self, node: Any, rank: int) -> None:
        """``push_front`` put a node back in bucket ``rank``."""

    def candidates(self) -> Iterator[Any]:
        """Every node once, lowest bucket first; a node the caller declines goes
        behind the rest (``_declined``), so that the next scan does not meet it first."""
        offered: set[Any] = set()
        for r in sorted(self._buckets):
            b = self._buckets.get(r)
            for _ in range(len(b) if b else 0):
                node = next(iter(b), None)  # type: ignore[arg-type]
                if node is None or node in offered:
                    break
                offered.add(node)
                yield node
                if node in b:  # type: ignore[operator]
                    self._declined(node, r, b)  # type: ignore[arg-type]
                else:
                    self._taken(r)

    def _declined(self, node: Any, rank: int, bucket: OrderedDict[Any, Any]) -> None:
        """The index declined ``node`` (pinned by a child): behind the rest of its bucket."""
        bucket.move_to_end(node)

    def tracked(self) -> set[Any]:
        out: set[Any] = set()
        for b in self._buckets.values():
            out.update(b)
        return out

    def __iter__(self) -> Iterator[Any]:
        """The order, front (next victim) first."""
        return iter([n for r in sorted(self._buckets) for n in self._buckets[r]])


class LengthAware(BucketedPolicy):
    """Fewest hits first; among equally frequent blocks the deepest in its request
    first; then least recently released.

    Mooncake's length-aware cache (Qin et al., "Mooncake: Trading More Storage
    for Less Computation", FAST'25, the cache-eviction comparison on its
    traces): an LFU that prefers evicting blocks that occur later in requests,
    since a block deep in a prompt is only ever reused together with everything
    before it. A parent has at least its children's hits and is shallower, so
    it ranks after them: the first candidate is a leaf. A node's rank is read
    off the node itself (hits do not change while it is ranked: only a plan,
    holding a reference, counts a hit), so there is no per-node map.
    """

    def _rank_of(self, node: Any) -> int:
        return (node.hits << DEPTH_BITS) - node.depth

    def _place(self, node: Any) -> None:
        self._add(node, (node.hits << DEPTH_BITS) - node.depth)

    def unref_all(self, nodes: list[Any]) -> None:
        buckets = self._buckets
        for node in nodes:
            r = (node.hits << DEPTH_BITS) - node.depth
            b = buckets.get(r)
            if b is None:
                b = buckets[r] = OrderedDict()
                _heappush(self._ranks, r)
            b[node] = None

    def ref(self, node: Any) -> None:
        b = self._buckets.get((node.hits << DEPTH_BITS) - node.depth)
        if b is None:
            raise KeyError(node)  # (as LRU and the native order: the node is not ordered)
        del b[node]

    def pop_front(self, k: int) -> list[Any]:
        """As ``BucketedPolicy.pop_front``, lean: no tags, no per-node map."""
        out: list[Any] = []
        ranks, buckets = self._ranks, self._buckets
        n = 0
        while n < k and ranks:
            r = ranks[0]
            b = buckets[r]
            take = list(islice(b, k - n))
            for node in take:
                del b[node]
            out += take
            n += len(take)
            if not b:
                _heappop(ranks)
                del buckets[r]
        return out

    def push_front(self, nodes: list[Any]) -> None:
        """Undo ``pop_front`` for ``nodes`` (its tail): each to the front of its bucket."""
        buckets = self._buckets
        for node in reversed(nodes):
            r = (node.hits << DEPTH_BITS) - node.depth
            b = buckets.get(r)
            if b is None:
                b = buckets[r] = OrderedDict()
                _heappush(self._ranks, r)
            b[node] = None
            b.move_to_end(node, last=False)


#: Cost-aware ranks are kept on a grid of this fraction of the smallest nonzero worth.
COST_GRID = 1 / 16


class CostAware(BucketedPolicy):
    """GreedyDual-Size-Frequency over what a block saves, per byte.

    A block's worth on a tier is the time its copy there saves when a request
    needs it: against the next route if the copy were gone (a load from a
    lower tier that also holds it, else a recompute under the cost model),
    minus the time of its own route. A device block that also sits on host is
    worth only the host -> device load; one nowhere else, a prefill. Its rank
    is ``clock + hits * worth / bytes``; a victim's rank advances ``clock``, so
    blocks not used for a while lose to newly ranked ones (GDSF: Cherkasova,
    "Improving WWW proxies performance with Greedy-Dual-Size-Frequency
    caching policy", HP Labs 1998; after Cao & Irani's GreedyDual-Size,
    USITS'97). LMCache ships a cost-aware policy of this family for KV blocks.
    Ranks are rounded down to a grid (``COST_GRID`` of the smallest worth) so
    that they fall in buckets; within one, oldest first.

    Tier-aware both ways: when a lower copy appears (``insert`` on the tier
    below) the block is ranked again above at once; when it goes, the rank
    above is found stale (its tag names the route it assumed) when the block
    comes up for eviction, and raised then. Leaves first: deeper blocks cost
    more to recompute (attention over a longer prefix), so within one release
    (tail-first) a parent takes the larger of its own rank and its child's.
    """

    checks_tags = True

    def __init__(self, capacity: int = 0, tier: int = 0,
                 costs: BlockCosts | None = None) -> None:
        super().__init__(capacity)
        if tier not in (0, 1, 2):
            raise ConfigError(f"CostAware: tier must be 0, 1 or 2, got {tier!r}")
        self.capacity = capacity
        self.tier = tier
        self.costs = c = costs or DEFAULT_COSTS
        self.clock = 0.0
        self._clock_before = 0.0
        self._above: CostAware | None = None  # the tier above's policy, told of our copies
        self._where: dict[Any, int] = {}  # node -> its bucket
        self._last: tuple[Any, float] | None = None  # the node placed last, and its rank
        own = c.load_s[tier]
        worth = [max(c.load_s[t] - own, 0.0) for t in (1, 2)]
        worth.append(max(c.recompute_s - own, 0.0))
        grid = COST_GRID * min([w for w in worth if w > 0] or [1.0])
        #: Worth in grid units by route: index 1, 2: a load from there; a recompute at
        #: depth d: ``re0 + re1 * d``. (Per byte: every block of a tier has the same size.)
        self._load_worth = [0.0] + [w / grid for w in worth[:2]]
        self._re0 = (c.recompute_s - own) / grid
        self._re1 = c.recompute_per_depth_s / grid
        self._lower = tuple(range(tier + 1, 3))

    def bind(self, policies: Sequence[Any]) -> None:
        """Learn the other tiers' policies: a lower copy changes what ours is worth;
        tiers of no capacity never hold one (then no rank can go stale)."""
        self._lower = tuple(t for t in range(self.tier + 1, 3)
                            if getattr(policies[t], "capacity", 1) > 0)
        self.checks_tags = bool(self._lower)
        if self.tier < 2:
            below = policies[self.tier + 1]
            if isinstance(below, CostAware):
                below._above = self

    def _route(self, node: Any) -> int:
        """The tier a lost copy would come back from (READY or FILLING there), or -1."""
        st = node.state
        for t in self._lower:
            s = st[t]
            if s == 1 or s == 2:
                return t
        return -1

    def _place(self, node: Any, floor: float = 0.0) -> float:
        route = self._route(node)
        worth = self._re0 + self._re1 * node.depth if route < 0 else self._load_worth[route]
        rank = self.clock + (node.hits + 1) * (worth if worth > 0.0 else 0.0)
        last = self._last
        if last is not None and last[0].parent is node and last[1] > rank:
            rank = last[1]  # copies land tail-first too: the child placed just before
        if rank < floor:
            rank = floor
        r = int(rank)
        self._add(node, r, route)
        self._where[node] = r
        self._last = (node, rank)
        return rank

    def _declined(self, node: Any, rank: int, bucket: OrderedDict[Any, Any]) -> None:
        """A parent pinned by its children: ranked again, behind this bucket (GDSF's
        "used now" rank, at least), as LRU moves a declined block to its end."""
        del bucket[node]
        del self._where[node]
        self._place(node, floor=rank + 1)

    def _rank_of(self, node: Any) -> int | None:
        return self._where.get(node)

    def _forget(self, node: Any) -> None:
        del self._where[node]

    def unref_all(self, nodes: list[Any]) -> None:
        buckets, where = self._buckets, self._where
        clock, re0, re1, load = self.clock, self._re0, self._re1, self._load_worth
        lower = self._lower
        prev = None
        rank = 0.0
        route = -1
        for node in nodes:
            if lower:
                st = node.state
                route = -1
                for t in lower:
                    if st[t] == 1 or st[t] == 2:  # READY or FILLING: a load from there
                        route = t
                        break
            worth = re0 + re1 * node.depth if route < 0 else load[route]
            x = clock + (node.hits + 1) * (worth if worth > 0.0 else 0.0)
            if prev is not None and prev.parent is node and rank > x:
                x = rank  # a parent ranks no lower than the child released before it
            r = int(x)
            b = buckets.get(r)
            if b is None:
                b = buckets[r] = OrderedDict()
                _heappush(self._ranks, r)
            b[node] = route
            where[node] = r
            prev, rank = node, x

    def ref(self, node: Any) -> None:
        del self._buckets[self._where.pop(node)][node]

    def insert(self, node: Any) -> None:
        if node.ref == 0:
            self._place(node)
        above = self._above
        if above is not None and node in above._where:
            above.remove(node)  # a cheaper route back: worth less up there now
            above._place(node)

    def _fresh(self, node: Any, tag: Any) -> bool:
        return tag == self._route(node)

    def _taken(self, rank: int) -> None:
        if rank > self.clock:
            self.clock = float(rank)

    def pop_front(self, k: int) -> list[Any]:
        """As ``BucketedPolicy.pop_front``, inlined (the hot path)."""
        self._clock_before = self.clock
        out: list[Any] = []
        popped: dict[Any, tuple[int, Any]] = {}
        self._popped = popped
        ranks, buckets, where = self._ranks, self._buckets, self._where
        checks = self.checks_tags
        route_of = self._route
        while len(out) < k and ranks:
            r = ranks[0]
            b = buckets[r]
            if not b:  # (emptied buckets go when they surface: ranking again may add one)
                _heappop(ranks)
                del buckets[r]
                continue
            for node in list(islice(b, k - len(out))):
                route = b.pop(node)
                del where[node]
                if checks and route != route_of(node):
                    self._place(node)  # its route back changed: ranked again
                    continue
                out.append(node)
                popped[node] = (r, route)
                if r > self.clock:
                    self.clock = float(r)
        return out

    def push_front(self, nodes: list[Any]) -> None:
        super().push_front(nodes)
        self.clock = self._clock_before  # only the victims kept age the order
        for r, _ in self._popped.values():
            self._taken(r)

    def _restored(self, node: Any, rank: int) -> None:
        self._where[node] = rank


def _native_cost() -> type | None:
    """The extension's ``LinkedCost``, where the built one has it."""
    try:
        from kvflow import _index_core
    except ImportError:
        return None
    return getattr(_index_core, "LinkedCost", None)


_LINKED_COST = _native_cost()

if _LINKED_COST is not None:

    class LinkedCostAware(_LINKED_COST):  # type: ignore[misc,valid-type]
        """``CostAware`` for the native core's nodes: its buckets linked through the
        nodes, every rank computed in C by the same expressions, the same victims in
        the same order (``tests/test_native_orders.py``,
        ``tests/test_index_core_equivalence.py``). The Python class costs ~4x LRU's
        time in cache mode, a rank per released block and a route check per victim
        in the interpreter (``benchmarks/results/policies.md``). Made from a
        ``CostAware`` (``like``): its constants come from the cost model there."""

        def __new__(cls, tier: int, capacity: int = 0,
                    like: CostAware | None = None) -> LinkedCostAware:
            p = like if like is not None else CostAware(capacity, tier)
            return super().__new__(cls, tier, capacity, p._load_worth[1], p._load_worth[2],
                                   p._re0, p._re1, p._lower)

        def bind(self, policies: Sequence[Any]) -> None:
            """As ``CostAware.bind``."""
            lower = tuple(t for t in range(self.tier + 1, 3)
                          if getattr(policies[t], "capacity", 1) > 0)
            self._configure(lower, bool(lower))
            if self.tier < 2:
                below = policies[self.tier + 1]
                if isinstance(below, LinkedCostAware):
                    below._set_above(self)

        def __iter__(self) -> Iterator[Any]:
            """The order, front (next victim) first."""
            return iter([n for _, b in self.buckets() for n, _ in b])

else:
    LinkedCostAware = None  # type: ignore[assignment,misc]
