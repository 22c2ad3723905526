"""The prefix index: one node per full block, keyed by its chained hash.

Because a block's key already covers its whole prefix, the "radix tree" is a
flat dict plus parent pointers; walking a prompt's keys in order is the tree
walk. Each node records, per tier, the block id holding it and the state of
that copy (``READY``, ``FILLING``, ``COMPUTING``: see ``kvflow.index_core``).

Eviction is leaf-first per the policy's order: a node may lose its last
matchable copy only when no other node hangs below it, so a matchable node's
parent is always matchable (prefix closure). Referenced nodes never go.

The per-request loops run in a core: the native one (``kvflow._index_core``,
built by ``pip install``) where it was built, else the plain-Python reference
(``kvflow.index_core.Core``). Both take the same calls and give the same
results; ``core=`` or the ``KVFLOW_INDEX_CORE`` environment variable picks one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterator, Sequence
from enum import IntEnum
from typing import Any

from kvflow import index_core
from kvflow.arc import LinkedARC
from kvflow.belady import FutureUses
from kvflow.cost import BlockCosts
from kvflow.errors import ConfigError
from kvflow.index_core import (
    ABSENT,
    COMPUTING,
    FILLING,
    NO_INFLIGHT,
    OTHER_TIERS,
    READY,
    STATE_NAMES,
    USABLE,
    Node,
)
from kvflow.policy import (
    NATIVE_CORE,
    EvictionPolicy,
    LinkedLengthAware,
    LinkedLFU,
    LinkedLRU,
    LinkedS3FIFO,
    make_eviction_policy,
)
from kvflow.ranked import LinkedCostAware

__all__ = [
    "ABSENT", "COMPUTING", "CORES", "FILLING", "NATIVE_CORE", "READY", "STATE_NAMES", "TIERS",
    "USABLE", "Node", "PrefixIndex", "Tier", "has_other_copy", "set_inflight",
]


class Tier(IntEnum):
    DEVICE = 0
    HOST = 1
    STORAGE = 2


TIERS = (Tier.DEVICE, Tier.HOST, Tier.STORAGE)
#: Names of the index cores ``PrefixIndex(core=...)`` takes.
CORES = ("auto", "native", "python")
#: Policies the native core keeps in its own nodes (the same order as their Python
#: classes, which the Python core uses; ``tests/test_index_core_equivalence.py``).
#: Each is made from the tier, its capacity and the Python policy it stands for.
NATIVE_ORDERS: dict[str, Callable[[int, int, Any], EvictionPolicy]] = {
    name: make for name, make in (
        ("lru", LinkedLRU and (lambda t, cap, py: LinkedLRU(t))),
        ("lfu", LinkedLFU and (lambda t, cap, py: LinkedLFU(t))),
        ("length_aware", LinkedLengthAware and (lambda t, cap, py: LinkedLengthAware(t))),
        ("arc", LinkedARC and (lambda t, cap, py: LinkedARC(t, cap))),
        ("s3fifo", LinkedS3FIFO and (lambda t, cap, py: LinkedS3FIFO(t, cap))),
        ("cost_aware", LinkedCostAware and (lambda t, cap, py: LinkedCostAware(t, cap, py))))
    if make is not None}


def has_other_copy(node: Node, tier: int) -> bool:
    """Whether a tier other than ``tier`` holds a usable copy of the node."""
    st = node.state
    a, b = OTHER_TIERS[tier]
    return st[a] in USABLE or st[b] in USABLE


def set_inflight(node: Node, tier: int, op: object | None) -> None:
    """Record (or clear, with None) the op filling ``tier``'s copy of ``node``."""
    if node.inflight is NO_INFLIGHT:
        if op is None:
            return
        node.inflight = [None, None, None]
    fl = node.inflight
    fl[tier] = op  # type: ignore[index]
    if op is None and fl[0] is None and fl[1] is None and fl[2] is None:
        node.inflight = NO_INFLIGHT  # a node keeps no list once nothing is in flight


def _pick_core(core: str | None) -> bool:
    """Whether to run the native core for ``core`` (None: the environment's choice)."""
    if core is None:
        core = os.environ.get("KVFLOW_INDEX_CORE", "auto") or "auto"
    if core not in CORES:
        raise ConfigError(f"unknown index core {core!r}; valid: {', '.join(CORES)}")
    if core == "native" and NATIVE_CORE is None:
        raise ConfigError("the native index core (kvflow._index_core) is not built here: "
                          "install kvflow with pip (it compiles it), or use core='python'")
    return core != "python" and NATIVE_CORE is not None


class PrefixIndex:
    """Nodes by key, residency per tier, and per-tier eviction order.

    The index never allocates or frees pool blocks itself: the manager owns the
    pools and tells the index where a node's copies live. The per-request bulk
    calls (``match``, ``ref_all``, ``best_tiers``, ``add_computing``,
    ``mark_computed``, ``release``, ``computing_on_device``, ``drop_front``) and the
    per-op ones (``land``, ``backups``, ``fill``, ``columns``, ``set_inflight_all``,
    ``admit``) are the core's, documented in ``kvflow.index_core.Core``; the rest, per node
    and off the common path, are here and work on either core's nodes. The
    core takes ``policies`` at construction: they are fixed for the index's life.
    """

    def __init__(self, capacities: Sequence[int], eviction: str = "lru",
                 core: str | None = None, *, future: FutureUses | None = None,
                 costs: BlockCosts | None = None) -> None:
        """``future`` and ``costs``: what ``belady`` and ``cost_aware`` need (see
        ``kvflow.policy.make_eviction_policy``)."""
        native = _pick_core(core)
        self.native = native
        self.node_type: Callable[..., Node] = NATIVE_CORE.Node if native else Node  # type: ignore[union-attr]
        self.nodes: dict[Hashable, Node] = {}
        self.policies: list[EvictionPolicy] = [
            make_eviction_policy(eviction, cap, t, future=future, costs=costs)
            for t, cap in zip(TIERS, capacities, strict=True)
        ]
        linked = NATIVE_ORDERS.get(eviction.lower()) if native else None
        if linked is not None:  # the same order, linked through the nodes
            self.policies = [linked(t, cap, py) for t, cap, py
                             in zip(TIERS, capacities, self.policies, strict=True)]
        for p in self.policies:  # policies that weigh the other tiers' copies meet them
            bind = getattr(p, "bind", None)
            if bind is not None:
                bind(self.policies)
        # Tiers that can hold copies at all: bulk paths skip the others.
        self.tiers = tuple(t for t in TIERS if capacities[t] > 0)
        # READY copies with ref == 0, per tier: what eviction could free at most.
        self.unreferenced = [0, 0, 0]
        #: Nodes inserted and copies set or dropped through the calls below (not the
        #: core's bulk ones): what a manager's failed-retry skip must see of changes
        #: made by others (a pool view's ``shed`` and ``recall``).
        self.mutations = 0
        make_core: Any = NATIVE_CORE.Core if native else index_core.Core  # type: ignore[union-attr]
        c = make_core(self.nodes, self.policies, self.unreferenced, self.tiers)
        self.match: Callable[[Sequence[Hashable]], list[Node]] = c.match
        self.ref_all: Callable[[Sequence[Node]], None] = c.ref_all
        self.best_tiers: Callable[[Sequence[Node]], list[int]] = c.best_tiers
        self.computing_on_device: Callable[[Sequence[Node]], list[Node]] = c.computing_on_device
        self.add_computing: Callable[..., list[Node]] = c.add_computing
        self.mark_computed: Callable[[Sequence[Node]], None] = c.mark_computed
        self.release: Callable[[Sequence[Node]], list[Node]] = c.release
        self.drop_front: Callable[[int, int], list[int]] = c.drop_front
        #: ``take_victims(tier, count, ids)``: drop victims (no copy down) until ``ids``
        #: holds ``count``, pass after pass of ``victims`` while one drops any; the
        #: native core's runs the passes in C (the policy's ``first``/``candidates``
        #: are all it calls back), the Python one is ``_take_victims``.
        #: (A native core built before it falls back to the Python loop.)
        self.take_victims: Callable[[int, int, list[int]], None] = (
            getattr(c, "take_victims", None) or self._take_victims)
        # The per-op loops (``land``, ``backups``, ``fill``, ``columns``,
        # ``set_inflight_all``, ``admit``: see ``kvflow.index_core.Core``); a native
        # core built before them runs the Python ones over its nodes.
        py = c if not native else index_core.Core(self.nodes, self.policies,
                                                  self.unreferenced, self.tiers)
        self.land: Callable[[object, Sequence[Node], int], list[Node]] = \
            getattr(c, "land", None) or py.land
        self.backups: Callable[[Sequence[Node], int, int, int], list[Node]] = \
            getattr(c, "backups", None) or py.backups
        self.fill: Callable[[Sequence[Node], int, Sequence[int]], None] = \
            getattr(c, "fill", None) or py.fill
        self.columns: Callable[[Sequence[Node], int, int],
                               tuple[list[int], list[int], list[Hashable]]] = \
            getattr(c, "columns", None) or py.columns
        self.set_inflight_all: Callable[[Sequence[Node], int, object], None] = \
            getattr(c, "set_inflight_all", None) or py.set_inflight_all
        self.admit: Callable[..., tuple[list[int], list[Node], list[Node], list[Node],
                                        list[int]]] = getattr(c, "admit", None) or py.admit

    # -- lookup -------------------------------------------------------------
    def get(self, key: Hashable) -> Node | None:
        return self.nodes.get(key)

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    # -- structure ----------------------------------------------------------
    def insert(self, key: Hashable, parent: Node | None) -> Node:
        """A new node with no copies yet (the caller adds one at once)."""
        if key in self.nodes:
            raise KeyError(f"block {key!r} already indexed")
        self.mutations += 1
        node = self.node_type(key, parent)
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
        self.mutations += 1
        node.loc[tier] = block_id
        node.state[tier] = state
        if state == READY:
            self._became_ready(node, tier)

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
        self.mutations += 1
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

    def can_lose(self, node: Node, tier: int, copy_down: bool = False) -> bool:
        """Whether ``tier``'s copy may go without breaking refs or prefix closure.

        ``copy_down``: the copy will be written one tier down first, so the
        node stays matchable even if it is an inner node.
        """
        if node.ref or node.state[tier] != READY:
            return False
        return node.children == 0 or copy_down or has_other_copy(node, tier)

    def _take_victims(self, tier: int, count: int, ids: list[int]) -> None:
        """``take_victims`` in Python (the native core's is held to it)."""
        drop_copy = self.drop_copy
        while len(ids) < count:
            progress = False
            for node in self.victims(tier):
                ids.append(drop_copy(node, tier))
                progress = True
                if len(ids) >= count:
                    break
            if not progress:
                break

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
