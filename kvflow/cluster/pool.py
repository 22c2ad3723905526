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
from kvflow.manager import CacheManager, Plan, Reservation, TransferOp
from kvflow.radix import ABSENT, Tier

__all__ = ["GlobalPool", "PoolDirectory", "PoolGate", "PoolViewManager"]

STORAGE = Tier.STORAGE
READ, WRITE = 0, 1


class PoolDirectory:
    """The pool's one index: the blocks whose write has completed, least recent first.

    ``entries`` maps a block's key to its parent's key (None for a root), in
    recency order. See the module docstring for the eviction order.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) \
                or capacity_blocks < 1:
            raise ValueError(f"pool capacity must be an integer >= 1, got {capacity_blocks!r}")
        self.capacity = capacity_blocks
        self.entries: OrderedDict[Hashable, Hashable | None] = OrderedDict()
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
        seen: set[Hashable] = set()
        for key, _ in reversed(items):
            self._touch_up(key, seen)
        return self._evict()

    def touch(self, key: Hashable) -> None:
        """``key`` and its ancestors were read: most recent, parents after children."""
        self._touch_up(key, set())

    def _touch_up(self, key: Hashable | None, seen: set[Hashable]) -> None:
        entries = self.entries
        while key is not None and key not in seen and key in entries:
            seen.add(key)
            entries.move_to_end(key)
            key = entries[key]

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

    Without a pool attached it is a plain ``CacheManager``.
    """

    pool: GlobalPool | None = None

    def prefetch(self, keys: Sequence[Hashable], blocks_per_op: int = 4) -> Reservation:
        if self.pool is not None:
            self.pool.sync(self, keys)
        return super().prefetch(keys, blocks_per_op)

    def plan(self, request_id: Hashable, keys: Sequence[Hashable], extra_blocks: int = 0,
             use_storage: bool = True, device_only: bool = False) -> Plan:
        if self.pool is not None and not device_only:  # (device_only loads nothing)
            self.pool.sync(self, keys)
        return super().plan(request_id, keys, extra_blocks, use_storage, device_only)

    def complete(self, op: TransferOp, ok: bool = True) -> list[TransferOp]:
        follow = super().complete(op, ok)
        if ok and op.dst_tier == STORAGE and self.pool is not None:
            self.pool.written(op)
        return follow


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

    def sync(self, manager: CacheManager, keys: Sequence[Hashable]) -> None:
        """Before ``manager`` matches ``keys``: what the pool holds of them becomes known to it.

        Walks the request's chain while the instance or the pool holds each block;
        blocks the pool holds and the view lacks become storage copies (``found``).
        The deepest block the instance will read from the pool is touched, with its
        ancestors.
        """
        entries = self.directory.entries
        get = manager.index.get
        items: list[tuple[Hashable, Hashable | None]] = []
        parent: Hashable | None = None
        deepest: Hashable | None = None  # of the blocks it will read from the pool
        for key in keys:
            node = get(key)
            if node is None:
                if key not in entries:
                    break
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
