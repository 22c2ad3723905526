"""Planning: what a request needs before it computes (``plan``), what a waiting one
starts loading at arrival (``prefetch``), and a prefill/decode transfer (``remote_op``).

Part of ``CacheManager`` (``kvflow.manager``); kept apart because it is the one
path every request takes, and the longest.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvflow.errors import NotEnoughBlocks
from kvflow.plans import DEVICE, HOST, REMOTE_KINDS, STORAGE, OpKind, Plan, Reservation, TransferOp
from kvflow.radix import FILLING, READY, Node, Tier


class FailedPlan:
    """A plan that failed without changing anything (``PlanningMixin.plan``).

    Failed retries: a request that does not fit waits at the head of the queue
    and is planned again at every engine step. A failed plan is not a no-op in
    general: it evicts what it can, starts copy-outs, and puts copies it could not
    fund back on their tier. But when it did none of that (the manager's
    ``version`` did not move), all it did was take a reference on its matched
    blocks and give it back, and scan orders that yielded nothing. Under LRU and
    LFU that leaves each order as it was except for the matched blocks, now at its
    tail (of their bucket) in the order they were given back; the scans went once
    round each order they touched, which leaves it as it was. The same plan run
    again on that state gives the same blocks back in the same order to the same
    place: nothing moves, and it fails the same way. So while nothing it reads has
    changed (``version``, bumped by every other change that could matter;
    ``CacheManager._commit_check`` and ``complete`` spell out the changes that
    cannot; and the index's ``mutations``, for changes others make through it),
    the retry is skipped: counted as rejected, with the same error.
    """

    __slots__ = ("args", "available", "blocker", "keys", "mutations", "needed",
                 "reads_storage", "request_id", "version")

    def __init__(self, version: int, mutations: int, request_id: Hashable,
                 keys: tuple[Hashable, ...], args: tuple[int, bool, bool], needed: int,
                 available: int, blocker: Node | None, reads_storage: bool) -> None:
        self.version = version
        self.mutations = mutations  # the index's count of changes made through it
        self.request_id = request_id
        self.keys = keys
        self.args = args  # extra_blocks, use_storage, device_only
        self.needed = needed
        self.available = available
        self.blocker = blocker  # the node the match stopped at, if indexed (COMPUTING)
        self.reads_storage = reads_storage  # whether it asked the storage tier for room


class PlanningMixin:
    """``prefetch``, ``release``, ``plan`` and ``remote_op`` of ``CacheManager``."""

    def prefetch(self, keys: Sequence[Hashable], blocks_per_op: int = 4) -> Reservation:
        """Start bringing a waiting request's storage hits up to host.

        Called at arrival, long before the request gets device blocks, so its
        storage reads overlap its time in the queue. Ops are small so that a
        request scheduled mid-way can use the part that has landed.

        The returned reservation references the blocks of the cached prefix
        that are not on the device, so that what is on host (or on its way)
        stays there while the request waits — even a queue of minutes;
        ``release`` it once the request is planned. Device blocks are never held for a waiting
        request (that could keep the head of the queue from ever fitting).
        """
        if not self.has_tier(HOST):
            return Reservation([], [])
        matched = self.index.match(keys)
        held = [n for n in matched if n.best_tier() != DEVICE]
        if held:
            self.version += 1
        for n in held:
            self.index.ref(n)
        todo = [n for n in held if n.best_tier() == STORAGE]
        ops: list[TransferOp] = []
        if not todo:
            return Reservation(ops, held)
        host_ids = self._make_room(HOST, min(len(todo), self._room(HOST)), ops)
        todo = todo[:len(host_ids)]
        for n, h in zip(todo, reversed(host_ids), strict=True):
            self.index.set_copy(n, HOST, h, FILLING)
        for i in range(0, len(todo), blocks_per_op):
            self._op(OpKind.PREFETCH, STORAGE, HOST, todo[i:i + blocks_per_op], ops,
                     None)
        return Reservation(ops, held)

    def release(self, reservation: Reservation) -> None:
        """Drop a prefetch reservation (tail-first, as requests release blocks)."""
        if reservation.nodes:
            self.version += 1
        for n in reversed(reservation.nodes):
            self._release(n)
        reservation.nodes = []

    def plan(self, request_id: Hashable, keys: Sequence[Hashable], extra_blocks: int = 0,
             use_storage: bool = True, device_only: bool = False) -> Plan:
        """Reserve device blocks for a request and say which copies it needs.

        ``use_storage=False`` stops the cached prefix at the first block that
        is only in storage or still on its way up from it (best-effort
        prefetch: what has not reached host by now is recomputed rather than
        waited for). ``device_only=True`` stops it at the first block not
        ready on the device: the plan loads nothing (a request whose KV comes
        from another instance takes from this one only what its device holds,
        so no load of its own can fail under it).

        Raises ``NotEnoughBlocks`` when the device cannot hold the request now,
        even after evicting every block that may go. References and the
        request's own blocks are given back; evictions made stay made, their
        copy-outs in ``detached_ops``. A block that a copy in flight is filling
        becomes evictable only once it lands, so the same plan may fit then.
        A call identical to the last one, which failed having changed nothing, is
        not run again while nothing it reads has changed (``FailedPlan``): it
        raises the same error at once.
        """
        keys = tuple(keys)
        last = self._failed_retry
        if last is not None:
            if (last.version == self.version and last.mutations == self.index.mutations
                    and last.request_id == request_id
                    and last.args == (extra_blocks, use_storage, device_only)
                    and last.keys == keys):
                # This plan failed last, changing nothing, and nothing it reads has
                # changed since: it would fail again the same way, changing nothing.
                self.stats.rejected_plans += 1
                self.skipped_plans += 1
                raise NotEnoughBlocks(last.needed, last.available)
            self._failed_retry = None
        if self.future is not None:
            self.future.advance(request_id)
        version = self.version
        self._short_tiers = 0
        index = self.index
        matched = index.match(keys)
        stop = len(matched)
        if not use_storage:  # only what has landed: no storage read, none still in flight
            for i, n in enumerate(matched):
                t = n.best_tier()
                if t == STORAGE or (t == HOST and n.state[HOST] == FILLING
                                         and n.inflight[HOST].kind is OpKind.PREFETCH):  # type: ignore[union-attr]
                    del matched[i:]
                    break
        if device_only:
            for i, n in enumerate(matched):
                if n.state[DEVICE] != READY:
                    del matched[i:]
                    break
        index.ref_all(matched)
        tiers = index.best_tiers(matched)
        ops: list[TransferOp] = []
        # Storage hits need a host block to land in (where there is a host tier);
        # those that cannot get one are recomputed instead. Prefetch room comes
        # first: device evictions below may want host room too.
        host_ids: list[int] = []
        if self.has_tier(HOST) and STORAGE in tiers:
            host_ids = self._make_room(HOST, tiers.count(STORAGE), ops)
            cut = [i for i, t in enumerate(tiers) if t == STORAGE][len(host_ids):]
            if cut:
                for n in matched[cut[0]:]:
                    index.unref(n)
                del matched[cut[0]:], tiers[cut[0]:]
                keep = tiers.count(STORAGE)
                self.pools[HOST].free(host_ids[keep:])
                del host_ids[keep:]
        n_new = len(keys) - len(matched)
        needed = len(tiers) - tiers.count(DEVICE) + n_new + extra_blocks
        dev_ids = self._make_room(DEVICE, needed, ops)
        if len(dev_ids) < needed:
            # Not even evicting every unreferenced block makes room: undo what is
            # ours; copy-outs already started stay valid and are handed out apart.
            self.pools[DEVICE].free(dev_ids)
            self.pools[HOST].free(host_ids)
            if self._plain_orders:  # one order per tier: the core's bulk release is the loop
                index.release(matched)
            else:
                for n in matched:
                    index.unref(n)
            self.detached_ops.extend(ops)
            self.stats.rejected_plans += 1
            if self.version == version and self._retry_skip and self.skip_failed_retries:
                self._failed_retry = FailedPlan(
                    version, index.mutations, request_id, keys,
                    (extra_blocks, use_storage, device_only), needed, len(dev_ids),
                    # the block the match stopped at: absent, or being computed
                    index.nodes.get(keys[stop]) if stop < len(keys) else None,
                    bool(self._short_tiers & self._storage_readers))
            raise NotEnoughBlocks(needed, len(dev_ids))
        # Three swap-in groups, one op each, so that a prefetch cut short only
        # fails the blocks that depended on it: host hits, storage hits staged
        # through host, and storage hits read straight to device (no host tier).
        # The core counts and stamps each hit and gives those off the device their
        # copies (FILLING); the plan shares the loads other plans have in flight.
        now = self.stats.plans + 1
        device_ids, from_host, staged, direct, waits = index.admit(matched, tiers, now,
                                                                   dev_ids, host_ids)
        plan = Plan(request_id, keys, matched, device_ids, tiers, ops, [], [], [], [])
        shared = plan.shared
        for i in waits:  # a copy still being filled by another plan's op: ours reads after it
            op = matched[i].inflight[0 if tiers[i] == DEVICE else 1]
            if op is not None and op not in shared:
                shared.append(op)  # type: ignore[arg-type]
                op.sharers.append(plan)  # type: ignore[attr-defined]
        if staged:
            self._op(OpKind.PREFETCH, STORAGE, HOST, staged, ops, plan)
        for src, nodes in ((HOST, from_host), (HOST, staged),
                           (STORAGE, direct)):
            if nodes:
                self._op(OpKind.SWAP_IN, src, DEVICE, nodes, ops, plan)

        # New blocks: indexed as COMPUTING up to the first key that is indexed
        # already (someone else is computing it) or repeated; ours stay private from there.
        start = len(matched)
        new_keys = keys[start:]
        new_ids = dev_ids[extra_blocks:]
        new_ids.reverse()
        device_ids += new_ids
        plan.extra_ids = dev_ids[:extra_blocks]
        created = index.add_computing(matched[-1] if matched else None, new_keys, new_ids, now)
        if len(created) < len(new_keys):
            plan.private.extend(range(start + len(created), len(keys)))
        plan.nodes += created
        plan.computing += created

        self.version += 1
        st = self.stats
        st.plans += 1
        st.prompt_blocks += len(keys)
        if tiers:
            hits = st.hits
            for t in (0, 1, 2):
                hits[t] += tiers.count(t)
        return plan

    def _op(self, kind: OpKind, src: Tier, dst: Tier, nodes: list[Node],
            ops: list[TransferOp], plan: Plan | None) -> TransferOp:
        index = self.index  # (every block of every op comes through here: the core's loops)
        src_ids, dst_ids, keys = index.columns(nodes, src, dst)
        op = TransferOp(next(self._op_ids), kind, src, dst, src_ids, dst_ids, keys, nodes, plan)
        index.set_inflight_all(nodes, dst, op)
        self.inflight[op.op_id] = op
        ops.append(op)
        return op

    # ------------------------------------------------------------ remote ops
    def remote_op(self, kind: OpKind, plan: Plan, block_ids: Sequence[int],
                  positions: Sequence[int]) -> TransferOp:
        """A prefill/decode transfer of a planned request's prompt blocks (``kvflow.pd``).

        ``SEND`` reads ``block_ids`` (this device's) for a peer; ``RECEIVE`` writes
        them from one; ``positions`` are the blocks' places in the prompt, which is
        all the two instances share. The op is in flight like any copy, so the
        runtime orders it against copies of the same blocks and ``complete`` settles
        it. It changes no node: a received block stays ``COMPUTING`` (not matchable)
        until the request commits, and a failed receive leaves it the request's to
        compute, exactly as if no transfer had been tried.
        """
        self.version += 1
        if kind not in REMOTE_KINDS:
            raise ValueError(f"remote_op takes SEND or RECEIVE, not {kind}")
        if len(block_ids) != len(positions):
            raise ValueError(f"remote_op: {len(block_ids)} blocks, {len(positions)} positions")
        local, remote = list(block_ids), list(positions)
        src, dst = (local, remote) if kind is OpKind.SEND else (remote, local)
        keys = [plan.keys[p] if p < len(plan.keys) else None for p in positions]
        op = TransferOp(next(self._op_ids), kind, DEVICE, DEVICE, src, dst, keys, [], plan)
        self.inflight[op.op_id] = op
        return op
