"""Eviction: making room on a tier for a plan, a backup or a found copy, and dropping
a copy with the subtree that only it held up.

Part of ``CacheManager`` (``kvflow.manager``). Prefix closure is what makes this
long: an inner block may go only where its children have a copy elsewhere, so a
victim is copied down, dropped, or passed over, round after round.
"""

from __future__ import annotations

from kvflow.plans import DEVICE, OpKind, TransferOp
from kvflow.radix import ABSENT, FILLING, READY, Node, Tier, has_other_copy, set_inflight


class EvictionMixin:
    """Room on a tier (``_make_room`` and its helpers) and ``_drop_with_subtree`` of
    ``CacheManager``."""

    def _room(self, tier: int) -> int:
        """Blocks a tier could hand out now: free ones plus unreferenced ready ones."""
        return self.pools[tier].num_free + self.index.unreferenced[tier]

    def _make_room(self, tier: Tier, n: int, ops: list[TransferOp]) -> list[int]:
        """Allocate up to ``n`` blocks on ``tier``, evicting per policy if short.

        Returns as many as can be had (evictions can fall short of the
        unreferenced count when closure pins inner nodes). Copy-outs that
        evictions start are appended to ``ops`` *before* any op that will
        overwrite the freed blocks.
        """
        pool = self.pools[tier]
        short = n - pool.num_free
        if short <= 0:
            return pool.allocate(n)
        self._short_tiers |= 1 << tier
        # Victims' blocks go straight to the caller, not through the free list.
        ids = self._evict(tier, short, ops)
        ids += pool.allocate(pool.num_free)
        return ids

    def _evict(self, tier: Tier, count: int, ops: list[TransferOp]) -> list[int]:
        """Take up to ``count`` blocks of ``tier`` from victims; returns their ids,
        now the caller's (still allocated in the pool).

        A victim with no copy elsewhere is copied one tier down under
        write_back (where that tier has room), else dropped — and only leaves
        are ever dropped, which the index's victim order guarantees.
        """
        index = self.index
        lower = self._lower[tier]
        copy_out = lower is not None and self.write_policy.copy_on_evict
        freed_ids: list[int] = []
        if not copy_out:
            # Fast path (no copy-outs): droppable victims from the front of the
            # policy's order, in bulk; the general loop below handles the rest.
            freed_ids = index.drop_front(tier, count)
            if freed_ids:
                self.version += 1
            if len(freed_ids) >= count:
                self.stats.evictions[tier] += len(freed_ids)
                return freed_ids
        copies: list[Node] = []
        src_ids: list[int] = []
        budget = self._room(lower) if copy_out else 0  # type: ignore[arg-type]
        self._take_victims(tier, count, budget, copy_out, freed_ids, copies, src_ids)
        unfunded = self._fund_copies(tier, copies, src_ids, freed_ids, ops)
        if len(freed_ids) < count and lower is not None:
            self._evict_pinned(tier, count, copy_out, unfunded > 0, freed_ids, copies, src_ids,
                               ops)
        if freed_ids or copies:
            self.version += 1
        self.stats.evictions[tier] += len(freed_ids)
        self.stats.copy_outs[tier] += len(copies)
        if copies:
            kind = OpKind.EVICT if tier == DEVICE else OpKind.WRITE
            op = TransferOp(next(self._op_ids), kind, tier, lower, src_ids,  # type: ignore[arg-type]
                            [n.loc[lower] for n in copies], [n.key for n in copies], copies)
            for n in copies:
                set_inflight(n, lower, op)  # type: ignore[arg-type]
            self.inflight[op.op_id] = op
            ops.append(op)
        return freed_ids

    def _take_victims(self, tier: Tier, count: int, budget: int, copy_leaves: bool,
                      freed_ids: list[int], copies: list[Node], src_ids: list[int]) -> None:
        """Drop victims' ``tier`` copies until ``freed_ids`` holds ``count``; up to
        ``budget`` victims with no copy elsewhere are marked for a copy one tier
        down instead (inner ones always; leaves only if ``copy_leaves``).

        Copies down get their lower blocks from one allocation after the victims
        are chosen (``_fund_copies``: one op, not one per block); until then a
        FILLING placeholder keeps each copied node indexed.
        """
        index = self.index
        if budget <= len(copies):  # no copy down: every victim is a droppable one
            index.take_victims(tier, count, freed_ids)
            return
        lower = self._lower[tier]
        while len(freed_ids) < count:
            progress = False
            for node in index.victims(tier, copy_down=len(copies) < budget):
                other = has_other_copy(node, tier)
                if not other and len(copies) < budget and (copy_leaves or node.children):
                    node.state[lower] = FILLING  # type: ignore[index]
                    copies.append(node)
                    src_ids.append(node.loc[tier])
                elif node.children and not other:
                    continue  # no room below after all: an inner node must stay
                freed_ids.append(index.drop_copy(node, tier))
                progress = True
                if len(freed_ids) >= count:
                    break
            if not progress:
                break

    def _fund_copies(self, tier: Tier, copies: list[Node], src_ids: list[int],
                     freed_ids: list[int], ops: list[TransferOp]) -> int:
        """Give the victims marked for a copy down their lower blocks; returns how
        many got none and went back to ``tier``, as they were.

        The room ``_room`` promised can fall short: an unreferenced ready copy
        below is not evictable while prefix closure pins it (an inner node whose
        children have no other copy).
        """
        if not copies:
            return 0
        lower: Tier = self._lower[tier]  # type: ignore[assignment]
        index = self.index
        lids = self._make_room(lower, len(copies), ops)
        for node, src in zip(copies[len(lids):], src_ids[len(lids):], strict=True):
            node.state[lower] = ABSENT
            freed_ids.remove(src)
            index.set_copy(node, tier, src, READY)
        unfunded = len(copies) - len(lids)
        if unfunded:
            self.version += 1  # back on the tier, at the end of its order
        del copies[len(lids):], src_ids[len(lids):]
        for node, lid in zip(copies, lids, strict=True):
            node.loc[lower] = lid
        return unfunded

    def _evict_pinned(self, tier: Tier, count: int, copy_leaves: bool, drop_only: bool,
                      freed_ids: list[int], copies: list[Node], src_ids: list[int],
                      ops: list[TransferOp]) -> None:
        """Eviction from ``tier`` (device or host) fell short: get past what prefix
        closure pins.

        An unreferenced block can be stuck behind blocks of the tier below: an
        inner node whose children live only there cannot be dropped
        (write_through never copies down on eviction; write_back found no room),
        and the room below can itself be pinned by children one tier up — a
        storage block under a host leaf, a host block under a device leaf. With
        nothing running, a request the device can hold would then be refused
        for good. So, only when short: copy such inner nodes down whatever the
        write policy, and where the room below was promised but not had, drop
        what may go instead (a leaf; write_back keeps no copy of it then) —
        which in turn unpins more, round after round, until a round frees
        nothing. The host needs this as much as the device: a device inner node
        can only go down to host, and host room pinned this way never frees.
        """
        lower: Tier = self._lower[tier]  # type: ignore[assignment]
        while len(freed_ids) < count:
            before = len(freed_ids)
            budget = 0 if drop_only else self._room(lower)
            more: list[Node] = []
            more_src: list[int] = []
            self._take_victims(tier, count, budget, copy_leaves, freed_ids, more, more_src)
            unfunded = self._fund_copies(tier, more, more_src, freed_ids, ops)
            copies += more
            src_ids += more_src
            if len(freed_ids) > before:
                drop_only = False
            elif unfunded and not drop_only:
                drop_only = True
            else:
                break

    def _drop_with_subtree(self, node: Node, tier: Tier) -> None:
        """Drop a copy; if it was the node's last, every descendant goes too.

        Descendants are unreferenced (a reference on a block implies one on
        its parent). Copies of theirs still being filled are dropped as well:
        the op's completion then finds nothing to mark, and the runtime orders
        any new writer of a freed block after the old one.
        """
        index = self.index
        a, b = (t for t in (0, 1, 2) if t != tier)
        if node.children and node.state[a] == ABSENT and node.state[b] == ABSENT:
            for d in index.descendants(node):
                for t in (0, 1, 2):
                    if d.state[t] != ABSENT:
                        self.pools[t].free([index.drop_copy(d, t)])
        self.pools[tier].free([index.drop_copy(node, tier)])
