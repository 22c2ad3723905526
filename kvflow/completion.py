"""What the tiers report back to the manager: a transfer ended (``complete``), copies
a tier no longer holds (``lost``), copies someone else wrote to it (``found``).

Part of ``CacheManager`` (``kvflow.manager``); kept apart because this is where a
failure turns into a recompute instead of wrong data.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from kvflow.plans import DEVICE, HOST, STORAGE, OpKind, Plan, TransferOp
from kvflow.radix import ABSENT, COMPUTING, FILLING, READY, Node, Tier, set_inflight


class CompletionMixin:
    """``complete``, ``lost`` and ``found`` of ``CacheManager``."""

    # --------------------------------------------------------------- complete
    def complete(self, op: TransferOp, ok: bool = True) -> list[TransferOp]:
        """A transfer ended. Returns follow-up ops (backups one tier further down).

        On failure nothing is left pointing at bytes that were not written:
        a device copy some request is waiting for becomes that request's to
        recompute; any other copy being filled is dropped.
        """
        retry = self._failed_retry
        if not (ok and retry is not None and (
                # copies landing on the device for requests that hold them: they were
                # usable and unevictable before, and stay so (unless the plan takes
                # device-ready blocks only); copies landing in storage: the same for
                # the tiers above, and the plan did not look at storage's room
                (op.dst_tier == DEVICE and not retry.args[2] and all(n.ref for n in op.nodes))
                or (op.dst_tier == STORAGE and not retry.reads_storage))):
            self.version += 1
        if self.inflight.pop(op.op_id, None) is None:
            raise ValueError(f"op {op.op_id} is not in flight")
        index = self.index
        dst = op.dst_tier
        follow: list[TransferOp] = []
        if ok:
            # Tail-first, as requests release blocks: parents end up newer than
            # their children in the destination's eviction order.
            landed = index.land(op, op.nodes, dst)
            if dst == HOST and op.kind is OpKind.BACKUP and self.has_tier(STORAGE):
                min_hits = self.write_policy.backup_min_hits
                if min_hits is not None and landed:
                    self._backup(HOST, index.backups(landed, STORAGE, -1, min_hits), follow)
            return follow
        self.stats.failed_ops += 1
        for n in op.nodes:
            if n.state[dst] != FILLING or n.inflight[dst] is not op:
                continue
            owner = self._recompute_owner(op, n) if dst == DEVICE else None
            if owner is not None:
                n.state[dst] = COMPUTING
                set_inflight(n, dst, None)
                owner.computing.append(n)
                self.stats.recomputed_blocks += 1
                continue
            self._drop_with_subtree(n, dst)
        return follow

    def lost(self, tier: Tier, keys: Iterable[Hashable]) -> int:
        """``tier`` no longer holds these blocks (a store restarted, evicted them, found
        them corrupt): drop their ready copies there (with the subtree of a block left
        with no copy), so they are neither matched nor read again and a later backup
        writes them anew. Returns how many copies went."""
        self.version += 1
        dropped = 0
        for key in keys:
            node = self.index.get(key)
            if node is not None and node.state[tier] == READY:
                self._drop_with_subtree(node, tier)
                dropped += 1
        self.stats.lost_copies += dropped
        return dropped

    def found(self, tier: Tier, items: Iterable[tuple[Hashable, Hashable | None]]) -> int:
        """``tier`` holds these blocks now, written by someone else (a pool another
        instance shares): record ready copies there, so they are matched and read like
        the manager's own. The inverse of ``lost``.

        ``items`` are ``(key, parent key or None)`` pairs, parents before children. A
        block is recorded only where prefix closure allows it: a new node needs its parent
        indexed and matchable (or recorded by this call); a block already holding a copy
        on ``tier`` (ready or being written) stays as it is, and one being computed is
        skipped, its children with it. Copies take blocks of ``tier``'s pool, evicting
        per policy where it is full (never a block this call hangs a copy on or under),
        as many as can be had, parents first; copy-outs those evictions start wait in
        ``detached_ops``. Returns how many copies were recorded.
        """
        self.version += 1
        index = self.index
        get = index.get
        todo: list[tuple[Hashable, Hashable | None]] = []
        fresh: set[Hashable] = set()
        pinned: dict[int, Node] = {}
        for key, parent_key in items:
            if key in fresh:
                continue
            node = get(key)
            if node is not None:
                if node.state[tier] == ABSENT and node.matchable:
                    todo.append((key, parent_key))
                    pinned[id(node)] = node
                continue
            if parent_key is not None and parent_key not in fresh:
                parent = get(parent_key)
                if parent is None or not parent.matchable:
                    continue
                pinned[id(parent)] = parent
            todo.append((key, parent_key))
            fresh.add(key)
        if not todo:
            return 0
        held = list(pinned.values())
        for node in held:  # eviction below must not take what the copies hang on
            index.ref(node)
        ops: list[TransferOp] = []
        ids = self._make_room(tier, min(len(todo), self._room(tier)), ops)
        for node in reversed(held):
            index.unref(node)
        self.detached_ops.extend(ops)
        added: set[Hashable] = set()
        for (key, parent_key), block in zip(todo, ids, strict=False):
            node = get(key)
            if node is None:
                parent = None
                if parent_key is not None:
                    parent = get(parent_key)
                    if parent is None or not (parent.matchable or parent_key in added):
                        self.pools[tier].free([block])
                        continue
                node = index.insert(key, parent)
            index.set_copy(node, tier, block, READY)
            added.add(key)
        self.stats.found_copies += len(added)
        return len(added)

    @staticmethod
    def _recompute_owner(op: TransferOp, node: Node) -> Plan | None:
        """The live request that will recompute a block whose load failed.

        The loading request if it still runs, else one that shared the load;
        None when nobody waits for the block any more.
        """
        for plan in (op.plan, *op.sharers):
            if plan is not None and not plan.finished and not plan.committed and (
                node in plan.nodes
            ):
                return plan
        return None
