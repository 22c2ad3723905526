"""The prefix index's nodes and per-request loops, in plain Python.

Every block of every request passes through these loops (match, ref, index
new blocks, commit, release, evict from the front of the order), so
``kvflow/_index_core.c`` (its parts in ``kvflow/csrc/``) implements the same API
natively: nodes as C structs and an LRU order linked through them. This module is the reference: the
fallback where the extension was not built, and the oracle the tests hold the
native core to. Change one, change both; ``tests/test_index_core_equivalence.py``
runs them side by side.

A node records, per tier, the block id holding it and the state of that copy:

* ``READY``: the bytes are there; matchable.
* ``FILLING``: a copy from another tier is writing them; matchable, because the
  runtime orders any reader after that write (one in-flight load, shared).
* ``COMPUTING``: a request's forward pass will write them; not matchable until
  the request commits, so nobody reads KV that does not exist yet.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

ABSENT, READY, FILLING, COMPUTING = 0, 1, 2, 3
STATE_NAMES = {ABSENT: "absent", READY: "ready", FILLING: "filling", COMPUTING: "computing"}
TIER_NAMES = ("device", "host", "storage")
#: States whose bytes a reader may use (FILLING: after the copy, ordered by the runtime).
USABLE = (READY, FILLING)
#: For each tier, the other two.
OTHER_TIERS = ((1, 2), (0, 2), (0, 1))
#: A node's ``inflight`` until an op first fills one of its copies (keeps nodes cheap).
NO_INFLIGHT = (None, None, None)


class Node:
    """One full block of some prompt prefix."""

    __slots__ = ("children", "depth", "hits", "inflight", "key", "last_access", "loc", "parent",
                 "ref", "state")

    def __init__(self, key: Hashable, parent: Node | None = None, device_id: int = -1,
                 device_state: int = ABSENT) -> None:
        self.key = key
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.children = 0
        self.loc = [device_id, -1, -1]
        self.state = [device_state, ABSENT, ABSENT]
        # The copy op writing each tier's block while FILLING (opaque to the index).
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
        return st[0] in USABLE or st[1] in USABLE or st[2] in USABLE

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
            f"{TIER_NAMES[t]}:{self.loc[t]}:{STATE_NAMES[self.state[t]]}"
            for t in (0, 1, 2) if self.state[t] != ABSENT
        )
        return f"Node({self.key!r}, depth={self.depth}, ref={self.ref}, {st or 'nowhere'})"


class Core:
    """The per-request loops over an index's nodes, policies and counts.

    It shares (does not copy) the index's ``nodes`` dict and its
    ``unreferenced`` counts, and updates them in place; it takes the policies
    once (an index's policies are fixed for its life).
    """

    def __init__(self, nodes: dict[Hashable, Any], policies: list[Any],
                 unreferenced: list[int], tiers: Sequence[int]) -> None:
        self.nodes = nodes
        self.policies = tuple(policies)
        self.unreferenced = unreferenced
        self.tiers = tuple(tiers)

    def match(self, keys: Sequence[Hashable]) -> list[Node]:
        """Nodes of the longest run of leading keys indexed and not being computed.

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

    def ref_all(self, nodes: Sequence[Node]) -> None:
        """Take a reference on each; copies of a node leaving 0 leave the policies'
        orders that skip referenced nodes."""
        unreferenced = self.unreferenced
        policies = self.policies
        for node in nodes:
            if node.ref == 0:
                st = node.state
                for t in (0, 1, 2):
                    if st[t] == READY:
                        unreferenced[t] -= 1
                        policies[t].ref(node)
            node.ref += 1

    def best_tiers(self, nodes: Sequence[Node]) -> list[int]:
        return [n.best_tier() for n in nodes]

    def computing_on_device(self, nodes: Sequence[Node]) -> list[Node]:
        """Those of ``nodes`` whose device copy is still to be computed."""
        return [n for n in nodes if n.state[0] == COMPUTING]

    def add_computing(self, parent: Node | None, keys: Sequence[Hashable],
                      device_ids: Sequence[int], now: int) -> list[Node]:
        """Index a chain of new blocks below ``parent``, one per key, that a request
        will compute into ``device_ids``: COMPUTING on the device, referenced once.

        Stops at the first key that is indexed already (another request is
        computing it, or it repeats a key of this chain): from there on the
        request's blocks stay its own. Returns the nodes made. On an error (a key
        that cannot be hashed) it leaves the index as it was.
        """
        if len(keys) != len(device_ids):
            raise ValueError(f"add_computing: {len(keys)} keys but {len(device_ids)} block ids")
        out: list[Node] = []
        append = out.append
        nodes = self.nodes
        new = object.__new__
        depth = 0 if parent is None else parent.depth + 1
        up = parent
        try:
            for key, d in zip(keys, device_ids, strict=True):  # (lengths checked above)
                if key in nodes:
                    break
                node = new(Node)  # (Node.__init__, skipped: its call costs more than the stores)
                node.key = key
                node.parent = up
                node.depth = depth
                node.children = 0
                node.loc = [d, -1, -1]
                node.state = [COMPUTING, ABSENT, ABSENT]
                node.inflight = NO_INFLIGHT
                node.ref = 1
                node.hits = 0
                node.last_access = now
                nodes[key] = node
                if up is not None:
                    up.children += 1
                append(node)
                up = node
                depth += 1
        except BaseException:  # undo the chain made so far, tail first (as the native core)
            for node in reversed(out):
                del nodes[node.key]
                if node.parent is not None:
                    node.parent.children -= 1
            raise
        return out

    def mark_computed(self, nodes: Sequence[Node]) -> None:
        """The device copies of these COMPUTING, referenced nodes were written: READY."""
        policy = self.policies[0]
        if policy.orders_referenced:
            insert = policy.insert
            for node in nodes:
                node.state[0] = READY
                insert(node)
        else:  # the policy would ignore them until unref: skip the calls
            for node in nodes:
                node.state[0] = READY

    def release(self, nodes: Sequence[Node]) -> list[Node]:
        """Drop a reference on each node, in the given order (tail-first along a
        prompt, so parents end up newer than their children); returns those whose
        count reached zero, in that order."""
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

    def drop_front(self, tier: int, count: int) -> list[int]:
        """Drop up to ``count`` copies from the front of ``tier``'s policy order,
        stopping at the first that may not go; returns their block ids.

        A copy may go when its node is unreferenced and READY there, and either
        another tier holds the node or no node hangs below it (prefix closure).
        A node left with no copy leaves the index. A policy without an O(1)
        order hands out nothing, and the caller scans ``PrefixIndex.victims``.
        A ``count`` of 0 or less drops nothing.
        """
        if count <= 0:  # (the policies' pop_front would raise or not, each its own way)
            return []
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

    # -- per-op loops (the native core's are in csrc/core_bulk.c) ------------------------
    def land(self, op: object, nodes: Sequence[Node], dst: int) -> list[Node]:
        """``op`` wrote its copies: each of ``nodes`` whose ``dst`` copy is FILLING by
        ``op`` becomes READY there (no longer in flight) and enters ``dst``'s order,
        tail-first (as requests release blocks: parents end up newer than their
        children). Returns those, in the given order. Others (dropped or refilled by
        another op since) are left alone."""
        if op is None:
            raise ValueError("land takes an op, not None")
        landed: list[Node] = []
        insert = self.policies[dst].insert
        unreferenced = self.unreferenced
        for n in reversed(nodes):
            st = n.state
            fl = n.inflight
            if st[dst] == FILLING and fl[dst] is op:
                st[dst] = READY
                fl[dst] = None  # type: ignore[index]
                if fl[0] is None and fl[1] is None and fl[2] is None:
                    n.inflight = NO_INFLIGHT  # (its list would stay for the node's life)
                insert(n)
                if n.ref == 0:
                    unreferenced[dst] += 1
                landed.append(n)
        landed.reverse()
        return landed

    def backups(self, nodes: Sequence[Node], lower: int, ready: int,
                min_hits: int) -> list[Node]:
        """Those of ``nodes`` with no copy on ``lower``, a READY one on ``ready`` (-1:
        any) and at least ``min_hits`` hits: what a write policy copies down."""
        return [n for n in nodes if n.state[lower] == ABSENT
                and (ready < 0 or n.state[ready] == READY) and n.hits >= min_hits]

    def fill(self, nodes: Sequence[Node], tier: int, ids: Sequence[int]) -> None:
        """Give each node a FILLING copy on ``tier`` in the matching block of ``ids``
        (a copy on its way there). All or nothing: a node with a copy there already
        is an AssertionError."""
        if len(ids) != len(nodes):
            raise ValueError(f"fill: {len(nodes)} nodes but {len(ids)} block ids")
        for n in nodes:
            if n.state[tier] != ABSENT:
                raise AssertionError(f"fill: {n!r} already has a copy on tier {tier}")
        ids = [int(i) for i in ids]
        for n, i in zip(nodes, ids, strict=True):
            n.loc[tier] = i
            n.state[tier] = FILLING

    def columns(self, nodes: Sequence[Node], src: int, dst: int
                ) -> tuple[list[int], list[int], list[Hashable]]:
        """An op's columns: the nodes' block ids on ``src`` and ``dst``, and keys."""
        return [n.loc[src] for n in nodes], [n.loc[dst] for n in nodes], [n.key for n in nodes]

    def set_inflight_all(self, nodes: Sequence[Node], tier: int, op: object) -> None:
        """Record ``op`` as the copy filling each node's ``tier`` block."""
        if op is None:
            raise ValueError("set_inflight_all marks an op, not None")
        for n in nodes:
            inflight = n.inflight
            if inflight is NO_INFLIGHT:
                n.inflight = inflight = [None, None, None]
            inflight[tier] = op  # type: ignore[index]

    def admit(self, nodes: Sequence[Node], tiers: Sequence[int], now: int,
              dev_ids: list[int], host_ids: list[int]
              ) -> tuple[list[int], list[Node], list[Node], list[Node], list[int]]:
        """A plan takes its cached prefix ``nodes`` (``tiers``: each one's best tier):
        one more hit each, last used at ``now``; each not on the device gets a FILLING
        device copy in a block popped from ``dev_ids``, and each only in storage a
        FILLING host copy from ``host_ids`` while it lasts (staged through host).

        Returns the plan's device block per node; the host hits (loaded from host),
        the staged storage hits and the rest of them (read straight to the device);
        and the positions of the nodes whose copy is being filled by an op another
        plan started (a device copy, or the host copy a host hit reads), for the
        plan to share, in order. A node with a copy already where it gets one is an
        AssertionError (raised before its block is popped).
        """
        if len(tiers) != len(nodes):
            raise ValueError(f"admit: {len(nodes)} nodes but {len(tiers)} tiers")
        device_ids: list[int] = []
        from_host: list[Node] = []
        staged: list[Node] = []
        direct: list[Node] = []
        waits: list[int] = []

        def fill(n: Node, tier: int, ids: list[int]) -> int:
            if n.state[tier] != ABSENT:
                raise AssertionError(f"admit: {n!r} already has a copy on tier {tier}")
            b = ids.pop()
            n.loc[tier] = b
            n.state[tier] = FILLING
            return b

        for i, (n, t) in enumerate(zip(nodes, tiers, strict=True)):
            n.hits += 1
            n.last_access = now
            if t == 0:
                device_ids.append(n.loc[0])
                if n.state[0] == FILLING:
                    waits.append(i)
                continue
            device_ids.append(fill(n, 0, dev_ids))
            if t == 1:
                from_host.append(n)
                if n.inflight[1] is not None:
                    waits.append(i)
            elif host_ids:
                fill(n, 1, host_ids)
                staged.append(n)
            else:
                direct.append(n)
        return device_ids, from_host, staged, direct, waits
