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
#: States whose bytes a reader may use (FILLING: after the copy, ordered by the runtime).
USABLE = (READY, FILLING)
#: For each tier, the other two.
OTHER_TIERS = ((1, 2), (0, 2), (0, 1))


def has_other_copy(node: Node, tier: int) -> bool:
    """Whether a tier other than ``tier`` holds a usable copy of the node."""
    st = node.state
    a, b = OTHER_TIERS[tier]
    return st[a] in USABLE or st[b] in USABLE

NO_INFLIGHT = (None, None, None)


def set_inflight(node: Node, tier: int, op: object | None) -> None:
    """Record (or clear, with None) the op filling ``tier``'s copy of ``node``."""
    if node.inflight is NO_INFLIGHT:
        if op is None:
            return
        node.inflight = [None, None, None]
    node.inflight[tier] = op  # type: ignore[index]


class Node:
    """One full block of some prompt prefix."""

    __slots__ = ("children", "depth", "hits", "inflight", "key", "last_access", "loc", "parent",
                 "ref", "state")

    def __init__(self, key: Hashable, parent: Node | None, device_id: int = -1,
                 device_state: int = ABSENT) -> None:
        self.key = key
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.children = 0
        self.loc = [device_id, -1, -1]
        self.state = [device_state, ABSENT, ABSENT]
        # The copy op writing each tier's block while FILLING (opaque to the
        # index); a shared empty tuple until the first op, to keep nodes cheap.
        self.inflight: list[object | None] | tuple[None, None, None] = NO_INFLIGHT
        self.ref = 0
        self.hits = 0
        self.last_access = 0  # the manager's plan count when a request last used it

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
    pools and tells the index where a node's copies live. The per-node methods
    here sit on the hot path of every request, hence the inlined loops.
    """

    def __init__(self, capacities: Sequence[int], eviction: str = "lru") -> None:
        self.nodes: dict[Hashable, Node] = {}
        self.policies: list[EvictionPolicy] = [
            make_eviction_policy(eviction, cap) for cap in capacities
        ]
        # Tiers that can hold copies at all: bulk paths skip the others.
        self.tiers = tuple(t for t in TIERS if capacities[t] > 0)
        # READY copies with ref == 0, per tier: what eviction could free at most.
        self.unreferenced = [0, 0, 0]

    # -- lookup -------------------------------------------------------------
    def get(self, key: Hashable) -> Node | None:
        return self.nodes.get(key)

    def match(self, keys: Sequence[Hashable]) -> list[Node]:
        """Longest run of leading keys whose nodes are matchable on some tier.

        Every indexed node has a copy somewhere, so it is matchable unless a
        request is (re)computing it on the device.
        """
        out: list[Node] = []
        nodes = self.nodes
        for k in keys:
            n = nodes.get(k)
            if n is None or n.state[0] == COMPUTING:
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

    def _remove(self, node: Node) -> None:
        """Forget a node left with no copy (only leaves ever are).

        It may still be referenced, by a waiting request's reservation only
        (plans always hold a device copy): a failed copy took its last copy,
        e.g. a store write failing under the arrival prefetch reading it back.
        Releasing the reservation then unrefs a node no longer indexed: harmless.
        """
        assert node.children == 0, node
        del self.nodes[node.key]
        if node.parent is not None:
            node.parent.children -= 1

    def add_computing(self, parent: Node | None, keys: Sequence[Hashable],
                      device_ids: Sequence[int], now: int) -> list[Node]:
        """Index a chain of new blocks below ``parent``, one per key, that a request
        will compute into ``device_ids``: COMPUTING on the device, referenced once.

        None of ``keys`` may be indexed yet. Bulk and inlined because every
        missed block of every request comes through here.
        """
        out: list[Node] = []
        if not keys:
            return out
        append = out.append
        new = object.__new__
        depth = 0 if parent is None else parent.depth + 1
        up = parent
        for key, d in zip(keys, device_ids, strict=True):
            node = new(Node)  # (Node.__init__, skipped: its call costs more than the stores)
            node.key = key
            node.parent = up
            node.depth = depth
            node.children = 1  # the next node of the chain; the last is fixed below
            node.loc = [d, -1, -1]
            node.state = [COMPUTING, ABSENT, ABSENT]
            node.inflight = NO_INFLIGHT
            node.ref = 1
            node.hits = 0
            node.last_access = now
            append(node)
            up = node
            depth += 1
        out[-1].children = 0
        if parent is not None:
            parent.children += 1
        nodes = self.nodes
        size = len(nodes)
        nodes.update(zip(keys, out, strict=True))
        if len(nodes) != size + len(out):
            raise AssertionError(f"add_computing: some of {keys!r} were already indexed")
        return out

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

    def mark_computed(self, nodes: Sequence[Node]) -> None:
        """The device copies of these COMPUTING, referenced nodes were written: READY."""
        policy = self.policies[Tier.DEVICE]
        if policy.orders_referenced:
            insert = policy.insert
            for node in nodes:
                node.state[0] = READY
                insert(node)
        else:  # the policy would ignore them until unref: skip the calls
            for node in nodes:
                node.state[0] = READY

    def mark_ready(self, node: Node, tier: int) -> None:
        assert node.state[tier] in (FILLING, COMPUTING), (node, tier)
        node.state[tier] = READY
        set_inflight(node, tier, None)
        self._became_ready(node, tier)

    def _became_ready(self, node: Node, tier: int) -> None:
        self.policies[tier].insert(node)
        if node.ref == 0:
            self.unreferenced[tier] += 1

    def drop_copy(self, node: Node, tier: int) -> int:
        """Forget ``tier``'s copy; returns its block id for the caller to free.

        Removes the node when it is left with no copy at all.
        """
        st = node.state
        state = st[tier]
        if state == READY:
            self.policies[tier].remove(node)
            if node.ref == 0:
                self.unreferenced[tier] -= 1
        elif state == ABSENT:
            raise AssertionError(f"{node!r} has no copy on tier {tier}")
        loc = node.loc
        block_id = loc[tier]
        loc[tier] = -1
        st[tier] = ABSENT
        set_inflight(node, tier, None)
        if st[0] == ABSENT and st[1] == ABSENT and st[2] == ABSENT:
            self._remove(node)
        return block_id

    # -- references -----------------------------------------------------------
    def ref(self, node: Node) -> None:
        if node.ref == 0:
            st = node.state
            for t in (0, 1, 2):
                if st[t] == READY:
                    self.unreferenced[t] -= 1
                    self.policies[t].ref(node)
        node.ref += 1

    def unref(self, node: Node) -> None:
        """Drop a reference: call tail-first along a prompt so parents stay newer."""
        if node.ref <= 0:
            raise AssertionError(f"ref count of {node!r} would go negative")
        node.ref -= 1
        if node.ref == 0:
            st = node.state
            for t in (0, 1, 2):
                if st[t] == READY:
                    self.unreferenced[t] += 1
                    self.policies[t].unref(node)

    def release(self, nodes: Sequence[Node]) -> list[Node]:
        """``unref`` each node, in the given order (tail-first along a prompt);
        returns those whose count reached zero, in that order."""
        released: list[Node] = []
        append = released.append
        for node in nodes:
            r = node.ref - 1
            node.ref = r
            if r == 0:
                append(node)
            elif r < 0:
                node.ref = 0
                raise AssertionError(f"ref count of {node!r} would go negative")
        if released:
            for t in self.tiers:
                ready = [n for n in released if n.state[t] == READY]
                if ready:
                    self.unreferenced[t] += len(ready)
                    self.policies[t].unref_all(ready)
        return released

    # -- eviction ----------------------------------------------------------------
    def drop_front(self, tier: int, count: int) -> list[int]:
        """Drop up to ``count`` copies from the front of ``tier``'s policy order,
        stopping at the first that may not go; returns their block ids.

        The common case of eviction, in bulk: victims come from the policy's
        O(1) order and are dropped inline (``drop_copy`` plus ``_remove``). A
        policy without one hands out nothing and the caller scans ``victims``.
        """
        policy = self.policies[tier]
        taken = policy.pop_front(count)
        ids: list[int] = []
        if not taken:
            return ids
        append = ids.append
        a, b = OTHER_TIERS[tier]
        nodes = self.nodes
        for node in taken:
            st = node.state
            if node.ref or st[tier] != READY:
                break
            sa = st[a]
            sb = st[b]
            if sa == ABSENT and sb == ABSENT:  # its last copy: the node goes
                if node.children:
                    break
                del nodes[node.key]
                parent = node.parent
                if parent is not None:
                    parent.children -= 1
            elif node.children and sa not in USABLE and sb not in USABLE:
                break  # an inner node whose only other copy is being computed
            loc = node.loc
            append(loc[tier])
            loc[tier] = -1
            st[tier] = ABSENT
            if node.inflight is not NO_INFLIGHT:
                node.inflight[tier] = None  # type: ignore[index]
        if len(ids) < len(taken):
            policy.push_front(taken[len(ids):])
        self.unreferenced[tier] -= len(ids)
        return ids

    def can_lose(self, node: Node, tier: int, copy_down: bool = False) -> bool:
        """Whether ``tier``'s copy may go without breaking refs or prefix closure.

        ``copy_down``: the copy will be written one tier down first, so the
        node stays matchable even if it is an inner node.
        """
        if node.ref or node.state[tier] != READY:
            return False
        return node.children == 0 or copy_down or has_other_copy(node, tier)

    def victims(self, tier: int, copy_down: bool = False) -> Iterator[Node]:
        """Nodes whose ``tier`` copy may go, in the policy's order.

        The caller drops (or moves) each node it takes before asking for the
        next, which may turn the taken node's parent into a leaf. The policy's
        O(1) ``first`` answers while it can; a full scan only when it cannot.
        """
        policy = self.policies[tier]
        first = policy.first
        can_lose = self.can_lose
        while True:
            node = first()
            if node is None or not can_lose(node, tier, copy_down):
                break
            yield node
            if node.state[tier] == READY and node.ref == 0:
                break  # the caller declined it: let the full scan go on past it
        for node in policy.candidates():
            if can_lose(node, tier, copy_down):
                yield node
