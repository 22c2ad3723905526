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

``CacheManager`` is one class over four modules: this one (tiers, commit, finish
and its backups, drain, invariants), ``kvflow.planning`` (prefetch, plan, remote
ops), ``kvflow.eviction`` (room on a tier) and ``kvflow.completion`` (complete,
lost, found). Its data types live in ``kvflow.plans`` and are re-exported here.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvflow.belady import FutureUses
from kvflow.blocks import BlockPool
from kvflow.completion import CompletionMixin
from kvflow.cost import BlockCosts
from kvflow.errors import ConfigError
from kvflow.eviction import EvictionMixin
from kvflow.planning import FailedPlan, PlanningMixin

# The manager's data types live in kvflow.plans; importers get them from here too.
from kvflow.plans import (  # noqa: F401 (re-exported)
    DEVICE,
    HOST,
    REMOTE_KINDS,
    STORAGE,
    OpKind,
    Plan,
    Reservation,
    TransferOp,
)
from kvflow.policy import PrefetchPolicy, WritePolicy
from kvflow.radix import (
    ABSENT,
    COMPUTING,
    READY,
    Node,
    PrefixIndex,
    Tier,
    has_other_copy,
)


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


#: Eviction policies under which a failed plan that changed nothing is a fixed point:
#: its reference round trip puts the matched blocks back at the tail of the order
#: where the failure before it left them, and an eviction scan that takes nothing
#: rotates each order exactly once round (``kvflow.planning``, "Failed retries").
#: S3-FIFO (a reference raises a frequency), ARC, the ranked orders and Belady's
#: (the trace's clock) are left out: their retries always run.
RETRY_SKIP_POLICIES = frozenset({"lru", "lfu"})


class CacheManager(PlanningMixin, EvictionMixin, CompletionMixin):
    """Tiers, their pools, the prefix index and the policies, behind four verbs."""

    #: Skip a plan that would fail exactly as the last one did (see ``plan``);
    #: tests turn it off to compare.
    skip_failed_retries: bool = True

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
        # Bumped by every change of the pools, the index or the orders other than a
        # failed plan's reference round trip and its scans that took nothing.
        self.version = 0
        # The last plan call, where it failed having changed nothing (and the policy
        # makes that a fixed point): an identical call at the same version is skipped.
        self._failed_retry: FailedPlan | None = None
        self._plain_orders = eviction.lower() in RETRY_SKIP_POLICIES
        self._retry_skip = self._plain_orders and future is None
        self._short_tiers = 0  # bit t: the plan under way evicted (or tried to) on tier t
        # Tiers whose eviction asks the storage tier for room (itself, the one above it).
        self._storage_readers = sum(1 << t for t in (0, 1, 2)
                                    if t == STORAGE or self._lower[t] == STORAGE)
        self.skipped_plans = 0  # failed retries skipped (not a stat: reports stay as they were)

    def has_tier(self, tier: int) -> bool:
        return self.pools[tier].capacity > 0

    # ------------------------------------------------------------------ match
    def match(self, keys: Sequence[Hashable]) -> list[Node]:
        """Nodes of the longest cached prefix of ``keys`` (any tier); changes nothing."""
        return self.index.match(keys)

    # ----------------------------------------------------------------- commit
    def commit(self, plan: Plan) -> None:
        """The request's forward pass has written its new blocks: make them matchable."""
        if plan.committed:
            return
        if self._failed_retry is not None:
            self._commit_check(plan.computing)
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
            if self._failed_retry is not None:
                self._commit_check(done)
            self.index.mark_computed(done[::-1])  # tail-first, as commit
            ids = set(map(id, done))
            plan.computing[:] = [n for n in plan.computing if id(n) not in ids]
        return len(done)

    def _commit_check(self, nodes: list[Node]) -> None:
        """Forget the failed plan ``plan`` would skip if committing ``nodes`` could change it.

        A commit only turns referenced device copies from COMPUTING to READY (the
        orders that may skip it ignore referenced blocks). That matters to a failed
        plan in two ways: the block its match stopped at becomes matchable, or a
        copy on another tier of a recomputed block becomes droppable.
        """
        blocker = self._failed_retry.blocker  # type: ignore[union-attr]
        for n in nodes:
            st = n.state
            if n is blocker or st[1] or st[2]:
                self._failed_retry = None
                return

    # ----------------------------------------------------------------- finish
    def finish(self, plan: Plan) -> list[TransferOp]:
        """Release the request's blocks; returns the backups the write policy asks for.

        An uncommitted plan (an aborted request) leaves nothing of its own
        behind: its computing nodes and private blocks are freed.
        """
        self.version += 1
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
            min_hits = self.write_policy.backup_min_hits
            if min_hits is not None:
                self._backup(DEVICE, self.index.backups(plan.nodes, lower, DEVICE, min_hits),
                             ops)
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
        self.index.fill(nodes, dst, ids)
        self.stats.backups[src] += n
        self._op(OpKind.BACKUP, src, dst, nodes, ops, None)

    # ------------------------------------------------------------------ drain
    def drop_all(self) -> int:
        """Drop every unreferenced, settled copy on every tier (deepest first).

        With no request running and no op in flight this empties every pool;
        returns how many copies went.
        """
        self.version += 1
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
