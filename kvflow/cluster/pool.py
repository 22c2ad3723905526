"""A KV pool shared by every instance of a cluster (the Mooncake Store / 3FS shape).

Without a pool, each instance has its own storage tier. With one, every
instance's storage tier is its *view* of one pool that all of them read and
write over their own network link (NIC), and the pool keeps one index, the
``PoolDirectory``: a block written by instance A is a hit for instance B once
A's write has completed, never before.

How the pieces meet, without reaching into an engine:

* **Writes.** An instance's manager (``PoolViewManager``) learns that a copy to
  its storage tier landed through ``complete`` (the runtime reports every op's
  end there); the blocks are then published in the directory.
* **Reads.** Before an instance matches a request (``prefetch`` at arrival,
  ``plan`` at admission), the blocks of the request that the directory holds
  and the instance's view does not are made known to its manager as storage
  copies (``CacheManager.found``), as far as the request's chain reaches into
  what the instance or the pool holds; the manager's own plan then reads them
  storage -> host -> device over the NIC like any storage hit. An instance
  never writes a block it knows the pool holds.
* **Evictions.** The directory holds ``capacity`` blocks. Past that it evicts
  the least recently used, leaves first: every publish or read moves a block
  and then all its ancestors to the recent end, so a parent is always more
  recent than its children and the oldest block is a leaf (a parent never
  goes before its children, whose reads would otherwise be stranded). An
  evicted block leaves every instance's view (``CacheManager.lost``); a read
  of it already in flight completes (the pool's lease on an object being read).
* **What an instance keeps** (``PoolViewManager.shed``). The view is the instance's
  knowledge, and it decides what the instance writes (never a block it knows the
  pool holds) and what it counts as imported; but a node for every pool block an
  instance has met would make the cluster hold up to instances x pool blocks
  nodes. So a block the instance holds in the pool and nowhere else, that nothing
  references, fills or hangs below, leaves its index: its node goes and the
  directory keeps one bit for it (``PoolDirectory.held``). The next ``sync`` that
  walks it makes it a node again (``recall``), a copy the instance knew, neither
  imported nor counted again; a pool eviction counts it as a dropped copy, as it
  would the node. An instance's index then holds its own tiers' blocks, what is
  referenced or in flight, and their ancestors; the pool's index holds each pool
  block once. Only for orders that see nothing of a node's past but its place in
  line (``lru``) and a write policy blind to hit counts: for the others a node
  recalled without its hit count would rank differently, so they keep every node.
  Every report is the same with or without it (``tests/test_cluster_pool_shed.py``)
  but in corners where the pool evicts, none seen to move a number. (One did, while
  ``publish`` could leave a parent older than its child, one write publishing
  siblings: the pool evicted the parent first, which took the child's copy out of
  a view with the parent's node, silently, where a shed child stayed known and was
  counted in ``dropped_copies`` when it went.) A shed block's storage id goes back to the tier,
  so ids are handed out in another order (the runtime orders a write after an
  in-flight read of the same id: a read of a block the pool evicted meanwhile can
  meet another write). And a view that filled the instance's storage tier used to
  forget its least recent blocks; shed ones take no id there.
* **Aggregate bandwidth** (``PoolGate``). Each instance's NIC is its own link in
  the simulated world (its storage links, FIFO with bandwidth and latency). The
  pool's aggregate limit is one FIFO per direction (reads, writes) shared by all
  instances, at op granularity: an op is admitted in submission order and
  occupies the pool for ``bytes / pool bandwidth``; its data goes on its
  instance's NIC so that it finishes no earlier than the pool has served it,
  i.e. it is issued at ``slot start + max(0, bytes / pool bw - bytes / NIC bw)``
  (``WorldSetup.admit``). An op then ends at the later of its pool slot's end
  and its NIC's own FIFO finish, plus the NIC latency: exact for this tandem
  model of whole ops. Within an op, layers land at the NIC's rate from that
  issue time (not paced by the pool), and an op cancelled after admission
  keeps its slot. With no aggregate limit the NICs alone bound the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from kvflow.cluster.instances import tier_hits
from kvflow.index_core import NO_INFLIGHT
from kvflow.manager import CacheManager, Capacities, Plan, Reservation, TransferOp
from kvflow.policy import PrefetchPolicy, WritePolicy
from kvflow.radix import ABSENT, READY, Node, Tier

__all__ = ["GlobalPool", "PoolDirectory", "PoolGate", "PoolViewManager"]

STORAGE = Tier.STORAGE
READ, WRITE = 0, 1


class PoolDirectory:
    """The pool's one index: the blocks whose write has completed, least recent first.

    ``entries`` maps a block's key to its parent's key (None for a root), in
    recency order. See the module docstring for the eviction order. ``held``: for
    a block some instances know without keeping a node for it, one bit per such
    instance (``PoolViewManager.shed``); a block leaves it when it leaves the pool.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) \
                or capacity_blocks < 1:
            raise ValueError(f"pool capacity must be an integer >= 1, got {capacity_blocks!r}")
        self.capacity = capacity_blocks
        self.entries: OrderedDict[Hashable, Hashable | None] = OrderedDict()
        self.held: dict[Hashable, int] = {}
        self.masks: dict[int, int] = {}  # one int object per distinct mask (they repeat)
        self.published = 0  # blocks that entered the pool
        self.rewritten = 0  # writes of blocks it held already
        self.evicted = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def publish(self, items: Sequence[tuple[Hashable, Hashable | None]]) -> list[Hashable]:
        """Writes of ``(key, parent key)`` blocks (parents first) have completed; returns
        the blocks evicted to make room for them."""
        entries = self.entries
        for key, parent in items:
            if key in entries:
                self.rewritten += 1
            else:
                entries[key] = parent
                self.published += 1
        # Each written block and its ancestors become most recent, parents after
        # children, as reading the blocks one by one from the last to the first would
        # leave them: walking up from each block in write order, a walk stops at a block
        # an earlier walk took (its ancestors are taken too), and the walks' blocks are
        # moved last walk first, each from the bottom up. (Moving a shared parent once,
        # on the first walk that met it, left a write of siblings with the parent older
        # than all but one of them, and the pool free to evict it first.)
        seen: set[Hashable] = set()
        walks: list[list[Hashable]] = []
        for key, _ in items:
            walk: list[Hashable] = []
            k: Hashable | None = key
            while k is not None and k not in seen and k in entries:
                seen.add(k)
                walk.append(k)
                k = entries[k]
            if walk:
                walks.append(walk)
        move = entries.move_to_end
        for walk in reversed(walks):
            for key in walk:
                move(key)
        return self._evict()

    def touch(self, key: Hashable) -> None:
        """``key`` and its ancestors were read: most recent, parents after children."""
        entries = self.entries
        seen: set[Hashable] = set()  # (keys whose parents loop: each moved once)
        k: Hashable | None = key
        while k is not None and k not in seen and k in entries:
            seen.add(k)
            entries.move_to_end(k)
            k = entries[k]

    def _evict(self) -> list[Hashable]:
        entries = self.entries
        out: list[Hashable] = []
        while len(entries) > self.capacity:
            out.append(entries.popitem(last=False)[0])
        self.evicted += len(out)
        return out


class PoolGate:
    """The pool's aggregate bandwidth: one FIFO per direction over every instance's ops.

    ``read_Bps`` / ``write_Bps``: bytes/s the pool serves in all, each way. See
    the module docstring for the model and how exact it is.
    """

    def __init__(self, read_Bps: float, write_Bps: float) -> None:
        self._bw = (read_Bps, write_Bps)
        self._free = [0.0, 0.0]
        #: Per direction: ops admitted, their bytes, and the seconds they were held back.
        self.ops = [0, 0]
        self.bytes = [0.0, 0.0]
        self.held_s = [0.0, 0.0]

    def admit(self, direction: int, nbytes: float, nic_Bps: float, now: float) -> float:
        """When an op of ``nbytes`` arriving ``now`` may go on a NIC of ``nic_Bps``."""
        free = self._free[direction]
        start = free if free > now else now
        pool_s = nbytes / self._bw[direction]
        self._free[direction] = start + pool_s
        lag = pool_s - nbytes / nic_Bps
        issue = start + lag if lag > 0 else start
        self.ops[direction] += 1
        self.bytes[direction] += nbytes
        self.held_s[direction] += issue - now
        return issue

    def for_instance(self, nic_Bps: float) -> Callable[[TransferOp, float, float], float]:
        """The gate as one instance's backend asks it (``WorldSetup.admit``); ``nic_Bps``:
        its NIC's bandwidth, each way."""
        admit = self.admit

        def gate(op: TransferOp, nbytes: float, now: float) -> float:
            if op.src_tier == STORAGE:
                return admit(READ, nbytes, nic_Bps, now)
            if op.dst_tier == STORAGE:
                return admit(WRITE, nbytes, nic_Bps, now)
            return now
        return gate

    def report(self) -> dict[str, Any]:
        return {d: {"ops": self.ops[i], "bytes": self.bytes[i], "held_s": self.held_s[i],
                    "bytes_per_s": self._bw[i]}
                for i, d in enumerate(("read", "write"))}


class PoolViewManager(CacheManager):
    """A ``CacheManager`` whose storage tier is its view of a ``GlobalPool``.

    Without a pool attached it is a plain ``CacheManager``. With one, the blocks of
    its view that it keeps nothing else of leave its index (``shed``) and come back
    when a request walks them (``recall``); see the module docstring.
    """

    pool: GlobalPool | None = None
    #: This instance's bit in ``PoolDirectory.held`` (set by ``GlobalPool.attach``).
    bit = 0
    #: ``shed`` runs once the index has grown by this many nodes since the last one
    #: (None: the local tiers' size, device + host blocks).
    shed_every: int | None = None

    def __init__(self, capacities: Capacities, eviction: str = "lru",
                 write_policy: WritePolicy | str = "write_through",
                 prefetch_policy: PrefetchPolicy | str = "best_effort",
                 index_core: str | None = None, **kw: Any) -> None:
        super().__init__(capacities, eviction, write_policy, prefetch_policy, index_core, **kw)
        #: Whether view blocks may leave the index: the order and the write policy must
        #: see nothing of a node but its place in line (a recalled node's hit count is 0).
        self.sheds = eviction.lower() == "lru" and \
            self.write_policy.name != "write_through_selective"
        self.shed_slack = self.shed_every or max(1, capacities.device + capacities.host)
        self.shed_at = self.shed_slack

    def prefetch(self, keys: Sequence[Hashable], blocks_per_op: int = 4) -> Reservation:
        if self.pool is not None:
            if len(self.index.nodes) > self.shed_at:
                self.shed()
            self.pool.sync(self, keys)
        return super().prefetch(keys, blocks_per_op)

    def plan(self, request_id: Hashable, keys: Sequence[Hashable], extra_blocks: int = 0,
             use_storage: bool = True, device_only: bool = False) -> Plan:
        if self.pool is not None and not device_only:  # (device_only loads nothing)
            if len(self.index.nodes) > self.shed_at:
                self.shed()
            self.pool.sync(self, keys)
        return super().plan(request_id, keys, extra_blocks, use_storage, device_only)

    def complete(self, op: TransferOp, ok: bool = True) -> list[TransferOp]:
        follow = super().complete(op, ok)
        if ok and op.dst_tier == STORAGE and self.pool is not None:
            self.pool.written(op)
        return follow

    def _adopt_private(self, plan: Plan) -> None:
        """As ``CacheManager._adopt_private``, with the view's shed blocks among the
        request's private ones recalled first: a block the index held when the plan
        was made (stored, not loaded under best effort) takes the request's device
        block as its copy, as it would have had its node stayed."""
        pool = self.pool
        if pool is not None and plan.private:
            held = pool.directory.held
            bit = self.bit
            get = self.index.get
            keys = plan.keys
            back = [(keys[i], keys[i - 1] if i else None) for i in plan.private
                    if held.get(keys[i], 0) & bit and get(keys[i]) is None]
            if back:
                self.recall(back)
        super()._adopt_private(plan)

    def shed(self) -> int:
        """Drop from the index the view blocks kept for nothing: a ready pool copy and
        no other, no reference, no op filling it, no node below it (then its parent
        may go too). The directory remembers that this instance knows each (its bit
        in ``held``); their storage block ids go back to the tier's pool. A question
        about such a block (match, sync, the router's view, a write) gets the answer
        it got before: the corners where it may not are in the module docstring.
        Returns how many nodes went."""
        pool = self.pool
        if pool is None or not self.sheds:
            return 0
        index = self.index
        nodes = index.nodes
        entries = pool.directory.entries
        held = pool.directory.held
        one = pool.directory.masks.setdefault
        bit = self.bit
        drop_copy = index.drop_copy
        ids: list[int] = []
        for node in [n for n in nodes.values() if n.children == 0 and n.ref == 0]:
            while _idle_in_pool(node) and node.key in entries:
                ids.append(drop_copy(node, STORAGE))  # its last copy: the node goes
                key = node.key
                mask = held.get(key, 0) | bit
                held[key] = one(mask, mask)
                parent = node.parent
                if parent is None or parent.children or parent.ref:
                    break
                node = parent
        if ids:
            self.pools[STORAGE].free(ids)
        self.shed_at = len(nodes) + self.shed_slack
        return len(ids)

    def recall(self, items: Sequence[tuple[Hashable, Hashable | None]]) -> int:
        """Blocks of the view that ``shed`` took out of the index (``(key, parent key)``,
        parents first) become nodes again, ready in storage, as they were; not
        imports. One whose parent is no longer indexed and matchable leaves the view
        instead (as its node would have gone with the parent's last copy). Returns
        how many came back."""
        pool = self.pool
        assert pool is not None
        held = pool.directory.held
        one = pool.directory.masks.setdefault
        keep = ~self.bit
        index = self.index
        get = index.get
        blocks = self.pools[STORAGE]
        ids = blocks.allocate(min(len(items), blocks.num_free))
        used = 0
        for key, parent_key in items:
            mask = held.pop(key, 0) & keep
            if mask:
                held[key] = one(mask, mask)
            if used == len(ids) or get(key) is not None:
                continue
            parent = None
            if parent_key is not None:
                parent = get(parent_key)
                if parent is None or not parent.matchable:
                    continue
            index.set_copy(index.insert(key, parent), STORAGE, ids[used], READY)
            used += 1
        blocks.free(ids[used:])
        return used


def _idle_in_pool(node: Node) -> bool:
    """Whether the pool holds all an instance keeps of ``node``: a ready storage copy,
    no other, and no op filling any of its copies (references and children: the caller)."""
    st = node.state
    return (st[2] == READY and st[0] == ABSENT and st[1] == ABSENT
            and node.inflight is NO_INFLIGHT)


class GlobalPool:
    """The directory, the instances' views of it, and the gate in front of it."""

    def __init__(self, capacity_blocks: int, gate: PoolGate | None = None) -> None:
        self.directory = PoolDirectory(capacity_blocks)
        self.gate = gate
        self.managers: list[PoolViewManager] = []

    def attach(self, managers: Iterable[PoolViewManager]) -> None:
        for m in managers:
            if not isinstance(m, PoolViewManager):
                raise TypeError(f"a pool's instances need a PoolViewManager, got {m!r}")
            m.pool = self
            m.bit = 1 << len(self.managers)
            self.managers.append(m)

    # -- what the managers tell the pool ------------------------------------------------------
    def written(self, op: TransferOp) -> None:
        """A copy to some instance's storage tier landed: the pool holds its blocks now."""
        items = [(key, None if node.parent is None else node.parent.key)
                 for key, node in zip(op.keys, op.nodes, strict=True)]
        evicted = self.directory.publish(items)
        if evicted:
            for m in self.managers:
                m.lost(STORAGE, evicted)
            held = self.directory.held
            for key in evicted:  # copies known without a node go as well (``shed``)
                mask = held.pop(key, 0)
                if mask:
                    for m in self.managers:
                        if mask & m.bit:
                            m.stats.lost_copies += 1

    def sync(self, manager: PoolViewManager, keys: Sequence[Hashable]) -> None:
        """Before ``manager`` matches ``keys``: what the pool holds of them becomes known to it.

        Walks the request's chain while the instance or the pool holds each block;
        blocks the pool holds and the view lacks become storage copies (``found``),
        blocks of the view that left the index become nodes again (``recall``).
        The deepest block the instance will read from the pool is touched, with its
        ancestors.
        """
        entries = self.directory.entries
        held = self.directory.held
        bit = manager.bit
        get = manager.index.get
        items: list[tuple[Hashable, Hashable | None]] = []
        back: list[tuple[Hashable, Hashable | None]] = []
        parent: Hashable | None = None
        deepest: Hashable | None = None  # of the blocks it will read from the pool
        for key in keys:
            node = get(key)
            if node is None:
                if key not in entries:
                    break
                if held.get(key, 0) & bit:
                    back.append((key, parent))
                else:
                    items.append((key, parent))
                deepest = key
            elif node.matchable:
                if node.state[STORAGE] == ABSENT and key in entries:
                    items.append((key, parent))  # known now, so never written again
                elif node.best_tier() == STORAGE:
                    deepest = key
            else:
                break  # being computed here: what lies below is not matchable yet
            parent = key
        if back:
            manager.recall(back)
        if items:
            manager.found(STORAGE, items)
        if deepest is not None:
            self.directory.touch(deepest)

    def tier_hits(self, manager: CacheManager, keys: Sequence[Hashable],
                  reads_storage: bool = True) -> tuple[int, int, int]:
        """A router's exact view of an instance: its own tiers' prefix, then what the pool
        holds beyond it (storage hits, as the instance would read them). An instance that
        reads no storage at admission (best effort: ``instances.reads_storage``) reads
        nothing from the pool either: the pool adds nothing to its view."""
        d, h, s = tier_hits(manager, keys, reads_storage)
        if not reads_storage:
            return d, h, s
        n = d + h + s
        entries = self.directory.entries
        while n < len(keys) and keys[n] in entries:
            s += 1
            n += 1
        return d, h, s

    def report(self) -> dict[str, Any]:
        d = self.directory
        return {
            "capacity_blocks": d.capacity, "blocks": len(d), "published": d.published,
            "rewritten": d.rewritten, "evicted": d.evicted,
            "imported_copies": sum(m.stats.found_copies for m in self.managers),
            "dropped_copies": sum(m.stats.lost_copies for m in self.managers),
            "gate": None if self.gate is None else self.gate.report(),
        }
