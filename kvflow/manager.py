"""The scheduler side of the cache: match -> plan -> commit -> finish.

The manager owns one block pool per tier and the prefix index. It decides; it
never moves bytes. Its decisions come out as data — a ``Plan`` holding
``TransferOp``s — which the runtime turns into transfers in either world.

Ordering between transfers is the runtime's job: an op lists the block ids it
reads and writes, and the runtime makes a write to a block wait for in-flight
reads of it (and the other way round). That is what lets a device block whose
KV is being copied out be handed at once to the plan that evicted it: the
plan's ops come after the copy-out in the plan, and the runtime will not
overwrite the block before the copy-out has read it.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvflow.belady import FutureUses
from kvflow.blocks import BlockPool
from kvflow.cost import BlockCosts
from kvflow.errors import ConfigError, NotEnoughBlocks
from kvflow.index_core import NO_INFLIGHT
from kvflow.policy import PrefetchPolicy, WritePolicy
from kvflow.radix import (
    ABSENT,
    COMPUTING,
    FILLING,
    READY,
    Node,
    PrefixIndex,
    Tier,
    has_other_copy,
    set_inflight,
)

# Enum member lookups cost ~0.1 us each on CPython 3.11; these aliases keep
# them off every request's path.
DEVICE, HOST, STORAGE = Tier.DEVICE, Tier.HOST, Tier.STORAGE


class OpKind(str, Enum):
    SWAP_IN = "swap_in"      # host (or storage) -> device, for a request about to run
    EVICT = "evict"          # device -> host copy-out of an evicted block (write_back)
    BACKUP = "backup"        # a copy down one tier of a block that stays (write_through)
    PREFETCH = "prefetch"    # storage -> host, ahead of a swap-in
    WRITE = "write"          # host -> storage copy-out of a block evicted from host
    # Prefill/decode disaggregation (kvflow.pd): one side of the op is another instance's.
    SEND = "send"            # device -> a peer: reads local device blocks for a decode instance
    RECEIVE = "receive"      # a peer -> device: writes local device blocks from a prefill instance


#: Op kinds with only one local side: SEND's destinations and RECEIVE's sources are
#: positions in the request's prompt on the peer, not blocks of this instance.
REMOTE_KINDS = frozenset({OpKind.SEND, OpKind.RECEIVE})


@dataclass(eq=False)
class TransferOp:
    """Copy ``src_ids`` on ``src_tier`` to ``dst_ids`` on ``dst_tier``, block by block."""

    op_id: int
    kind: OpKind
    src_tier: Tier
    dst_tier: Tier
    src_ids: list[int]
    dst_ids: list[int]
    keys: list[Hashable]
    nodes: list[Node] = field(repr=False, default_factory=list)
    plan: Plan | None = field(repr=False, default=None)
    # Plans that read what this op writes instead of loading it again.
    sharers: list[Plan] = field(repr=False, default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.src_ids)

    @property
    def reads_local(self) -> bool:
        """Whether ``src_ids`` are blocks of this instance (not a peer's positions)."""
        return self.kind is not OpKind.RECEIVE

    @property
    def writes_local(self) -> bool:
        """Whether ``dst_ids`` are blocks of this instance (not a peer's positions)."""
        return self.kind is not OpKind.SEND


@dataclass(eq=False)
class Plan:
    """What one request needs before and while it computes.

    ``device_ids[i]`` holds prompt block i; blocks ``[0, num_cached)`` come
    from the cache (some through ``ops``, some through loads of other plans in
    ``shared``), the rest are computed by the request (``computing`` nodes,
    plus ``private`` blocks whose key another request is computing right now).
    ``nodes`` lists the indexed blocks the plan holds, cached ones first.
    """

    request_id: Hashable
    keys: tuple[Hashable, ...]
    nodes: list[Node]
    device_ids: list[int]
    source_tiers: list[int]
    ops: list[TransferOp]
    shared: list[TransferOp]
    computing: list[Node]
    private: list[int]
    extra_ids: list[int]
    committed: bool = False
    finished: bool = False

    @property
    def num_cached(self) -> int:
        return len(self.source_tiers)

    def hits(self, tier: Tier) -> int:
        return sum(1 for t in self.source_tiers if t == tier)


@dataclass(eq=False)
class Reservation:
    """A waiting request's prefetch: its ops, and the blocks held until it is planned."""

    ops: list[TransferOp]
    nodes: list[Node]


@dataclass
class ManagerStats:
    plans: int = 0
    prompt_blocks: int = 0
    hits: list[int] = field(default_factory=lambda: [0, 0, 0])
    evictions: list[int] = field(default_factory=lambda: [0, 0, 0])
    copy_outs: list[int] = field(default_factory=lambda: [0, 0, 0])
    backups: list[int] = field(default_factory=lambda: [0, 0, 0])
    failed_ops: int = 0
    recomputed_blocks: int = 0
    rejected_plans: int = 0
    lost_copies: int = 0  # copies a tier reported gone (see ``lost``)
    found_copies: int = 0  # copies another party wrote to a tier (see ``found``)


@dataclass(frozen=True)
class Capacities:
    """Blocks per tier; 0 means the tier is absent.

    Storage without a host tier is a real configuration (``--host-blocks 0``
    in a sweep): blocks then go down device -> storage (write_through backups,
    write_back evictions) and storage hits are read straight to the device at
    admission, since there is no host tier to prefetch into.
    """

    device: int
    host: int = 0
    storage: int = 0

    def __post_init__(self) -> None:
        for name in ("device", "host", "storage"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"capacity of tier {name!r} must be an integer >= 0, got {v!r}")
        if self.device == 0:
            raise ConfigError("the device tier needs a capacity > 0")

    def __getitem__(self, tier: int) -> int:
        return (self.device, self.host, self.storage)[tier]


class CacheManager:
    """Tiers, their pools, the prefix index and the policies, behind four verbs."""

    def __init__(
        self,
        capacities: Capacities,
        eviction: str = "lru",
        write_policy: WritePolicy | str = "write_through",
        prefetch_policy: PrefetchPolicy | str = "best_effort",
        index_core: str | None = None,
        *,
        future: FutureUses | None = None,
        costs: BlockCosts | None = None,
    ) -> None:
        """``index_core``: "native", "python" or "auto" (None: ``KVFLOW_INDEX_CORE``,
        else auto); see ``kvflow.radix``. ``future``: the trace's next uses, for the
        offline ``belady`` policy (``plan`` moves its clock to each request it
        plans); ``costs``: what a block costs to get back, for ``cost_aware``."""
        self.capacities = capacities
        self.pools = [
            BlockPool(capacities[t], Tier(t).name.lower()) for t in (0, 1, 2)
        ]
        self.future = future
        self.index = PrefixIndex([capacities[t] for t in (0, 1, 2)], eviction, index_core,
                                 future=future, costs=costs)
        self.write_policy = (
            WritePolicy(write_policy) if isinstance(write_policy, str) else write_policy
        )
        self.prefetch_policy = (
            PrefetchPolicy(prefetch_policy) if isinstance(prefetch_policy, str) else prefetch_policy
        )
        self.stats = ManagerStats()
        # The tier each tier's copies go down to: the next one that exists (the
        # device writes straight to storage when there is no host tier).
        self._lower: list[Tier | None] = [
            next((Tier(u) for u in range(t + 1, 3) if capacities[u]), None) for t in (0, 1, 2)
        ]
        self._op_ids = itertools.count()
        self.inflight: dict[int, TransferOp] = {}
        # Copy-outs started by a plan that then failed; the runtime runs them.
        self.detached_ops: list[TransferOp] = []

    def has_tier(self, tier: int) -> bool:
        return self.pools[tier].capacity > 0

    # ------------------------------------------------------------------ match
    def match(self, keys: Sequence[Hashable]) -> list[Node]:
        """Nodes of the longest cached prefix of ``keys`` (any tier); changes nothing."""
        return self.index.match(keys)

    # ------------------------------------------------------------------- plan
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
        """
        keys = tuple(keys)
        if self.future is not None:
            self.future.advance(request_id)
        index = self.index
        matched = index.match(keys)
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
            for n in matched:
                index.unref(n)
            self.detached_ops.extend(ops)
            self.stats.rejected_plans += 1
            raise NotEnoughBlocks(needed, len(dev_ids))
        plan = Plan(request_id, keys, matched, [], tiers, ops, [], [], [], [])

        # Three swap-in groups, one op each, so that a prefetch cut short only
        # fails the blocks that depended on it: host hits, storage hits staged
        # through host, and storage hits read straight to device (no host tier).
        from_host: list[Node] = []
        staged: list[Node] = []
        direct: list[Node] = []
        device_ids = plan.device_ids
        shared = plan.shared
        now = self.stats.plans + 1
        for n, t in zip(matched, tiers, strict=True):
            n.hits += 1
            n.last_access = now
            if t == DEVICE:
                device_ids.append(n.loc[0])
                op = n.inflight[0]
                if n.state[0] == FILLING and op is not None and op not in shared:
                    shared.append(op)  # type: ignore[arg-type]
                    op.sharers.append(plan)  # type: ignore[attr-defined]
                continue
            d = dev_ids.pop()
            device_ids.append(d)
            index.set_copy(n, DEVICE, d, FILLING)
            if t == HOST:
                from_host.append(n)
                # A host copy still being filled by another plan's op: ours reads after it.
                op = n.inflight[1]
                if op is not None and op not in shared:
                    shared.append(op)  # type: ignore[arg-type]
                    op.sharers.append(plan)  # type: ignore[attr-defined]
            elif host_ids:
                index.set_copy(n, HOST, host_ids.pop(), FILLING)
                staged.append(n)
            else:
                direct.append(n)
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

        st = self.stats
        st.plans += 1
        st.prompt_blocks += len(keys)
        if tiers:
            hits = st.hits
            for t in (0, 1, 2):
                hits[t] += tiers.count(t)
        return plan

    def _room(self, tier: int) -> int:
        """Blocks a tier could hand out now: free ones plus unreferenced ready ones."""
        return self.pools[tier].num_free + self.index.unreferenced[tier]

    def _op(self, kind: OpKind, src: Tier, dst: Tier, nodes: list[Node],
            ops: list[TransferOp], plan: Plan | None) -> TransferOp:
        op = TransferOp(next(self._op_ids), kind, src, dst,
                        [n.loc[src] for n in nodes], [n.loc[dst] for n in nodes],
                        [n.key for n in nodes], nodes, plan)
        for n in nodes:  # set_inflight, inline (every block of every op comes through here)
            inflight = n.inflight
            if inflight is NO_INFLIGHT:
                n.inflight = inflight = [None, None, None]
            inflight[dst] = op
        self.inflight[op.op_id] = op
        ops.append(op)
        return op

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

    # ----------------------------------------------------------------- commit
    def commit(self, plan: Plan) -> None:
        """The request's forward pass has written its new blocks: make them matchable."""
        if plan.committed:
            return
        # Tail-first, as requests release blocks: a policy that orders blocks from
        # the moment they are ready (S3-FIFO's queues) then meets a request's leaf
        # before its parents. Root-first, every eviction scanned past the inner
        # nodes the index must decline (S3-FIFO at ~90x LRU's time in cache mode).
        self.index.mark_computed(plan.computing[::-1])
        plan.computing.clear()
        plan.committed = True

    def commit_received(self, plan: Plan, first: int) -> int:
        """A transfer (a PD receive) wrote the plan's blocks from prompt position
        ``first`` on, instead of its compute: those still ``COMPUTING`` become
        matchable now; returns how many. The plan itself stays uncommitted, so a
        load of its cached prefix that fails later is still its to recompute."""
        position = {id(n): i for i, n in enumerate(plan.nodes)}
        done = [n for n in plan.computing if position.get(id(n), -1) >= first]
        if done:
            self.index.mark_computed(done[::-1])  # tail-first, as commit
            ids = set(map(id, done))
            plan.computing[:] = [n for n in plan.computing if id(n) not in ids]
        return len(done)

    # ----------------------------------------------------------------- finish
    def finish(self, plan: Plan) -> list[TransferOp]:
        """Release the request's blocks; returns the backups the write policy asks for.

        An uncommitted plan (an aborted request) leaves nothing of its own
        behind: its computing nodes and private blocks are freed.
        """
        if plan.finished:
            raise ValueError(f"plan of request {plan.request_id!r} finished twice")
        plan.finished = True
        plan.ops = []  # its ops keep it (op.plan) while in flight; it need not keep them
        dev = self.pools[DEVICE]
        if plan.committed:
            self._adopt_private(plan)
        else:
            dev.free([plan.device_ids[i] for i in plan.private])
        plan.private.clear()
        if plan.extra_ids:
            dev.free(plan.extra_ids)
            plan.extra_ids = []
        if plan.committed:
            index = self.index
            released = index.release(plan.nodes[::-1])  # tail-first
            # A shared load failed and nobody recomputed the block: it goes.
            for node in index.computing_on_device(released):
                if node.key in index.nodes and node.state[0] == COMPUTING:
                    self._drop_with_subtree(node, DEVICE)
        else:
            computing = set(map(id, plan.computing))
            for node in sorted(plan.nodes, key=lambda n: -n.depth):  # children first
                self._release(node)  # a block left "computing" by nobody goes
            plan.nodes = [n for n in plan.nodes if id(n) not in computing]
            plan.computing.clear()
        ops: list[TransferOp] = []
        lower = self._lower[DEVICE]
        if lower is not None and plan.committed:
            wp = self.write_policy
            todo = [n for n in plan.nodes
                    if n.state[lower] == ABSENT and n.state[DEVICE] == READY
                    and wp.backup_on_insert(n.hits)]
            self._backup(DEVICE, todo, ops)
        return ops

    def _release(self, node: Node) -> None:
        """Drop one reference; a block nobody will compute any more goes."""
        self.index.unref(node)
        if node.state[DEVICE] == COMPUTING and node.ref == 0:
            self._drop_with_subtree(node, DEVICE)

    def _adopt_private(self, plan: Plan) -> None:
        """Index the private blocks the request computed, where prefix closure allows.

        A key still unknown becomes a new node on the device. A key indexed already
        with no device copy (its copy is on host or in storage, perhaps still on its
        way up for a prefetch given up at admission) takes our block as its device
        copy: the KV is the same, and dropping it would make the next request that
        needs the block load or recompute it again. Any other (another request is
        computing it, or it is on the device already) frees our block.
        """
        index = self.index
        dev = self.pools[DEVICE]
        keys = plan.keys
        for i in plan.private:
            key = keys[i]
            parent = index.get(keys[i - 1]) if i else None
            if i and (parent is None or not parent.matchable):
                dev.free([plan.device_ids[i]])
                continue
            node = index.get(key)
            if node is None:
                node = index.insert(key, parent)
            elif node.state[DEVICE] != ABSENT or node.parent is not parent:
                dev.free([plan.device_ids[i]])
                continue
            index.set_copy(node, DEVICE, plan.device_ids[i], READY)
            index.ref(node)
            plan.nodes.append(node)

    def _backup(self, src: Tier, nodes: list[Node], ops: list[TransferOp]) -> None:
        """Copy ``nodes`` one tier down where it has room (never evicting a referenced block)."""
        dst = self._lower[src]
        if not nodes or dst is None:
            return
        ids = self._make_room(dst, min(len(nodes), self._room(dst)), ops)
        if not ids:
            return
        n = len(ids)
        nodes = nodes[:n]  # parents first: a backed-up prefix stays a prefix
        for node, i in zip(nodes, ids, strict=True):  # PrefixIndex.set_copy, inline
            st = node.state
            assert st[dst] == ABSENT, (node, dst)
            node.loc[dst] = i
            st[dst] = FILLING
        self.stats.backups[src] += n
        self._op(OpKind.BACKUP, src, dst, nodes, ops, None)

    # --------------------------------------------------------------- complete
    def complete(self, op: TransferOp, ok: bool = True) -> list[TransferOp]:
        """A transfer ended. Returns follow-up ops (backups one tier further down).

        On failure nothing is left pointing at bytes that were not written:
        a device copy some request is waiting for becomes that request's to
        recompute; any other copy being filled is dropped.
        """
        if self.inflight.pop(op.op_id, None) is None:
            raise ValueError(f"op {op.op_id} is not in flight")
        index = self.index
        dst = op.dst_tier
        follow: list[TransferOp] = []
        if ok:
            landed = []
            # Tail-first, as requests release blocks: parents end up newer than
            # their children in the destination's eviction order.
            insert = index.policies[dst].insert
            unreferenced = index.unreferenced
            for n in reversed(op.nodes):  # PrefixIndex.mark_ready, inline
                st = n.state
                if st[dst] == FILLING and n.inflight[dst] is op:
                    st[dst] = READY
                    n.inflight[dst] = None
                    insert(n)
                    if n.ref == 0:
                        unreferenced[dst] += 1
                    landed.append(n)
            landed.reverse()
            if dst == HOST and self.has_tier(STORAGE) and op.kind in (
                OpKind.BACKUP, OpKind.EVICT
            ):
                wp = self.write_policy
                todo = [n for n in landed if n.state[STORAGE] == ABSENT
                        and (op.kind == OpKind.BACKUP and wp.backup_on_insert(n.hits))]
                self._backup(HOST, todo, follow)
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

    # ------------------------------------------------------------------ drain
    def drop_all(self) -> int:
        """Drop every unreferenced, settled copy on every tier (deepest first).

        With no request running and no op in flight this empties every pool;
        returns how many copies went.
        """
        index = self.index
        dropped = 0
        for node in sorted(index, key=lambda n: -n.depth):
            if node.ref:
                continue
            for t in (0, 1, 2):
                if node.state[t] == READY and node.key in index.nodes and (
                    node.children == 0 or has_other_copy(node, t)
                ):
                    self.pools[t].free([index.drop_copy(node, t)])
                    dropped += 1
        return dropped

    # ------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Assert every invariant of DESIGN.md; for tests and debugging."""
        index = self.index
        owners: list[dict[int, object]] = [{}, {}, {}]
        for node in index:
            assert node.ref >= 0, node
            assert any(s != ABSENT for s in node.state), f"copyless node kept: {node}"
            if node.matchable and node.parent is not None:
                assert node.parent.matchable or node.parent.state[0] == COMPUTING, (
                    f"prefix closure broken: {node} under {node.parent}")
            for t in (0, 1, 2):
                if node.state[t] != ABSENT:
                    b = node.loc[t]
                    assert self.pools[t].is_used(b), f"{node} holds free block {t}:{b}"
                    assert b not in owners[t], f"block {t}:{b} owned twice"
                    owners[t][b] = node
        for t in (0, 1, 2):
            ready_unref = sum(1 for n in index if n.state[t] == READY and n.ref == 0)
            assert index.unreferenced[t] == ready_unref, (t, index.unreferenced[t], ready_unref)
            # The policy orders exactly the copies eviction may consider.
            policy = index.policies[t]
            want = {n for n in index
                    if n.state[t] == READY and (policy.orders_referenced or n.ref == 0)}
            got = policy.tracked()
            assert got == want, (t, got ^ want)
