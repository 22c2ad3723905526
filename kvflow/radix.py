"""The prefix index: one node per full block, keyed by its chained hash.

Because a block's key already covers its whole prefix, the "radix tree" is a
flat dict plus parent pointers; walking a prompt's keys in order is the tree
walk. Each node records, per tier, the block id holding it and the state of
that copy:

* ``READY``: the bytes are there; matchable.
* ``FILLING``: a copy from another tier is writing them; matchable, because the
  runtime orders any reader after that write (one in-flight load, shared).
* ``COMPUTING``: a request's forward pass will write them; not matchable until
  the request commits, so nobody reads KV that does not exist yet.

Eviction is leaf-first per the policy's order: a node may lose its last
matchable copy only when no other node hangs below it, so a matchable node's
parent is always matchable (prefix closure). Referenced nodes never go.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from enum import IntEnum

from kvflow.policy import EvictionPolicy, make_eviction_policy


class Tier(IntEnum):
    DEVICE = 0
    HOST = 1
    STORAGE = 2


TIERS = (Tier.DEVICE, Tier.HOST, Tier.STORAGE)

ABSENT, READY, FILLING, COMPUTING = 0, 1, 2, 3
STATE_NAMES = {ABSENT: "absent", READY: "ready", FILLING: "filling", COMPUTING: "computing"}


class Node:
    """One full block of some prompt prefix."""

    __slots__ = ("children", "depth", "hits", "inflight", "key", "last_access", "loc", "parent",
                 "ref", "state")

    def __init__(self, key: Hashable, parent: Node | None) -> None:
        self.key = key
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.children = 0
        self.loc = [-1, -1, -1]
        self.state = [ABSENT, ABSENT, ABSENT]
        # The copy op writing each tier's block while FILLING (opaque to the index).
        self.inflight: list[object | None] = [None, None, None]
        self.ref = 0
        self.hits = 0
        self.last_access = 0

    def matchable_on(self, tier: int) -> bool:
        s = self.state[tier]
        return s in (READY, FILLING)

    @property
    def matchable(self) -> bool:
        """Some tier holds (or is being copied) the bytes, and nobody is recomputing them."""
        st = self.state
        if st[0] == COMPUTING:
            return False
        return st[0] in (READY, FILLING) or st[1] in (READY, FILLING) or st[2] in (READY, FILLING)

    def best_tier(self) -> int:
        """Fastest tier holding a matchable copy, or -1."""
        st = self.state
        if st[0] == COMPUTING:
            return -1
        for t in (0, 1, 2):
            if st[t] == READY or st[t] == FILLING:
                return t
        return -1

    def __repr__(self) -> str:
        st = "/".join(
            f"{Tier(t).name.lower()}:{self.loc[t]}:{STATE_NAMES[self.state[t]]}"
            for t in TIERS if self.state[t] != ABSENT
        )
        return f"Node({self.key!r}, depth={self.depth}, ref={self.ref}, {st or 'nowhere'})"


class PrefixIndex:
    """Nodes by key, residency per tier, and per-tier eviction order.

    The index never allocates or frees pool blocks itself: the manager owns the
    pools and tells the index where a node's copies live.
    """

    def __init__(self, capacities: Sequence[int], eviction: str = "lru") -> None:
        self.nodes: dict[Hashable, Node] = {}
        self.policies: list[EvictionPolicy] = [
            make_eviction_policy(eviction, cap) for cap in capacities
        ]
        # READY copies with ref == 0, per tier: what eviction could free at most.
        self.unreferenced = [0, 0, 0]
        self.clock = 0

    # -- lookup -------------------------------------------------------------
    def get(self, key: Hashable) -> Node | None:
        return self.nodes.get(key)

    def match(self, keys: Sequence[Hashable]) -> list[Node]:
        """Longest run of leading keys whose nodes are matchable on some tier."""
        out: list[Node] = []
        nodes = self.nodes
        for k in keys:
            n = nodes.get(k)
            if n is None or not n.matchable:
                break
            out.append(n)
        return out

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    # -- structure ----------------------------------------------------------
    def insert(self, key: Hashable, parent: Node | None) -> Node:
        """A new node with no copies yet (the caller adds one at once)."""
        if key in self.nodes:
            raise KeyError(f"block {key!r} already indexed")
        node = Node(key, parent)
        if parent is not None:
            parent.children += 1
        self.nodes[key] = node
        return node

    def _maybe_remove(self, node: Node) -> None:
        if node.state == [ABSENT, ABSENT, ABSENT]:
            assert node.children == 0 and node.ref == 0, node
            del self.nodes[node.key]
            if node.parent is not None:
                node.parent.children -= 1

    def descendants(self, node: Node) -> list[Node]:
        """All nodes below ``node``, deepest first. O(index): for failure paths only."""
        out = []
        for n in self.nodes.values():
            p = n.parent
            while p is not None and p.depth >= node.depth:
                if p is node:
                    out.append(n)
                    break
                p = p.parent
        out.sort(key=lambda n: -n.depth)
        return out

    # -- residency ----------------------------------------------------------
    def set_copy(self, node: Node, tier: int, block_id: int, state: int) -> None:
        """Record that ``tier``'s block ``block_id`` holds (or will hold) the node."""
        assert node.state[tier] == ABSENT, (node, tier)
        node.loc[tier] = block_id
        node.state[tier] = state
        if state == READY:
            self._became_ready(node, tier)

    def mark_ready(self, node: Node, tier: int) -> None:
        assert node.state[tier] in (FILLING, COMPUTING), (node, tier)
        node.state[tier] = READY
        node.inflight[tier] = None
        self._became_ready(node, tier)

    def _became_ready(self, node: Node, tier: int) -> None:
        self.policies[tier].insert(node)
        if node.ref == 0:
            self.unreferenced[tier] += 1

    def drop_copy(self, node: Node, tier: int) -> int:
        """Forget ``tier``'s copy; returns its block id for the caller to free.

        Removes the node when it is left with no copy at all.
        """
        state = node.state[tier]
        assert state != ABSENT, (node, tier)
        if state == READY:
            self.policies[tier].remove(node)
            if node.ref == 0:
                self.unreferenced[tier] -= 1
        block_id = node.loc[tier]
        node.loc[tier] = -1
        node.state[tier] = ABSENT
        node.inflight[tier] = None
        self._maybe_remove(node)
        return block_id

    # -- references -----------------------------------------------------------
    def ref(self, node: Node) -> None:
        if node.ref == 0:
            st = node.state
            for t in (0, 1, 2):
                if st[t] == READY:
                    self.unreferenced[t] -= 1
        node.ref += 1

    def unref(self, node: Node) -> None:
        if node.ref <= 0:
            raise AssertionError(f"ref count of {node!r} would go negative")
        node.ref -= 1
        if node.ref == 0:
            st = node.state
            for t in (0, 1, 2):
                if st[t] == READY:
                    self.unreferenced[t] += 1

    def touch(self, node: Node, hit: bool = False) -> None:
        """Record an access: call tail-first along a prompt so parents stay newer."""
        self.clock += 1
        node.last_access = self.clock
        if hit:
            node.hits += 1
        st = node.state
        for t in (0, 1, 2):
            if st[t] == READY:
                self.policies[t].access(node)

    # -- eviction ----------------------------------------------------------------
    def can_lose(self, node: Node, tier: int) -> bool:
        """Whether ``tier``'s copy may go without breaking refs or prefix closure."""
        if node.ref or node.state[tier] != READY:
            return False
        if node.children == 0:
            return True
        st = node.state
        return any(t != tier and (st[t] == READY or st[t] == FILLING) for t in (0, 1, 2))

    def victims(self, tier: int) -> Iterator[Node]:
        """Nodes whose ``tier`` copy may go, in the policy's order.

        The caller drops (or moves) each node it takes before asking for the
        next, which may turn the taken node's parent into a leaf.
        """
        for node in self.policies[tier].candidates():
            if self.can_lose(node, tier):
                yield node
