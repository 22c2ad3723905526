"""Issue 7, end to end: real stores under faults, in real time, with real bytes.

Each test replays a small generated trace through the engine on the CPU world
(``kvflow.realtime``): device <-> host copies of real bytes, host <-> storage
through a real block store on a thread pool, and a compute that writes
key-derived bytes and checks every cached block it reads. Mid-replay the
store is broken — a corrupt blob file, a disk that fills up, a store evicting
behind the manager's back, Redis killed and restarted, a store slower than
its deadline — and in every case:

* every request completes, and no wrong byte is ever read (``corrupt_reads``
  stays 0: what could not be loaded was recomputed);
* the errors are counted in the report;
* nothing leaks: no transfer in flight, no reference held, every used block
  owned by the index, and after ``drop_all`` every pool is all free;
* with the store back, a second pass over the same trace hits storage again.

Write policies are checked through the store too: write_through writes at
insert, write_through_selective only after N hits, write_back only at host
eviction, and a block the store already holds is never written again.
"""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import pytest

import kvflow.stores.local as local_store
from kvflow.radix import ABSENT, COMPUTING, READY, Tier
from kvflow.realtime import RealtimeConfig, RealtimeStack, engine_requests, tiny_spec
from kvflow.stores import BlockStore, LocalDirStore, MemoryStore, Namespace
from traces.generate import multi_turn, shared_prefix

SPEC = tiny_spec()
NS = Namespace.for_model(SPEC)
#: 12 chat sessions x 3 turns over ~0.6 s: turn t re-reads turns < t, which small
#: device and host tiers have pushed out to storage by then.
REQS = engine_requests(multi_turn(sessions=12, turns=3, system_len=64, user_len=32,
                                  output_len=4, think_time_s=0.3, rate=30, block_tokens=16,
                                  seed=1), time_scale=0.2)
SMALL = dict(device_blocks=24, host_blocks=12, storage_blocks=512,
             prefetch_policy="wait_complete")


# ------------------------------------------------------------------------------ helpers
def assert_no_leak(stack: RealtimeStack) -> None:
    """Nothing in flight or referenced; every used block of every pool is a node's copy."""
    m = stack.manager
    assert not stack.runtime.tasks and not m.inflight and not m.detached_ops
    assert stack.copies.inflight == 0
    assert stack.storage is None or stack.storage.inflight == 0
    assert stack.astore is None or stack.astore.in_flight == 0
    m.check_invariants()
    assert all(n.ref == 0 and n.state[Tier.DEVICE] != COMPUTING for n in m.index)
    for t in (0, 1, 2):
        owned = sum(1 for n in m.index if n.state[t] != ABSENT)
        assert m.pools[t].num_used == owned, (Tier(t).name, m.pools[t].num_used, owned)


def assert_all_free_after_drop(stack: RealtimeStack) -> None:
    assert_no_leak(stack)
    stack.manager.drop_all()
    assert [p.num_used for p in stack.manager.pools] == [0, 0, 0]


def assert_served(report: dict[str, Any], n: int = len(REQS)) -> None:
    """Every request finished, none rejected, and no wrong byte was ever read."""
    assert report["requests"] == n and report["rejected"] == 0, report["errors"]
    assert report["errors"]["corrupt_reads"] == 0, report["compute"]["examples"]
    assert report["compute"]["blocks_verified"] > 0


def assert_hits_storage(report: dict[str, Any]) -> None:
    assert report["hit_rate"]["storage"] > 0, report["hit_rate"]
    assert report["store"]["stats"]["hits"] > 0 and report["store"]["backend"]["blocks_read"] > 0


async def two_passes(store: BlockStore, hook: Any = None, repair: Any = None,
                     **cfg: Any) -> tuple[RealtimeStack, dict[str, Any], dict[str, Any]]:
    """Pass 1 with ``hook`` breaking the store; ``repair`` it; pass 2 on the same stack."""
    stack = RealtimeStack(SPEC, RealtimeConfig(**{**SMALL, **cfg}), store)
    try:
        r1 = await stack.replay(REQS, on_arrival=hook)
        assert_no_leak(stack)
        if repair is not None:
            res = repair()
            if asyncio.iscoroutine(res):
                await res
        r2 = await stack.replay(REQS)
        assert_served(r1)
        assert_served(r2)
        assert_all_free_after_drop(stack)
    finally:
        stack.close()
    return stack, r1, r2


class DelayedStore(BlockStore):
    """Another store behind a delay on reads (and optionally writes): a slow store."""

    def __init__(self, inner: BlockStore, read_delay: float = 0.0,
                 write_delay: float = 0.0) -> None:
        super().__init__(inner.namespace)
        self.inner = inner
        self.read_delay = read_delay
        self.write_delay = write_delay

    def get_many(self, keys: Sequence[Hashable]) -> list[bytes | None]:
        time.sleep(self.read_delay)
        return self.inner.get_many(keys)

    def get_many_into(self, keys: Sequence[Hashable], buffers: Sequence[object]) -> list[bool]:
        time.sleep(self.read_delay)
        return self.inner.get_many_into(keys, buffers)

    def put_many(self, items: Sequence[tuple[Hashable, bytes]]) -> list[bool]:
        time.sleep(self.write_delay)
        return self.inner.put_many(items)

    def contains_many(self, keys: Sequence[Hashable]) -> list[bool]:
        return self.inner.contains_many(keys)

    def delete(self, key: Hashable) -> bool:
        return self.inner.delete(key)

    @property
    def stats(self) -> Any:
        return self.inner.stats


def flip_a_byte_of_every_blob(root: Path) -> int:
    n = 0
    for f in root.rglob("*"):
        if f.is_file() and not f.name.startswith(".") and f.stat().st_size > 64:
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0x5A
            f.write_bytes(bytes(data))
            n += 1
    return n


# ---------------------------------------------------------------------- LocalDirStore
@pytest.mark.asyncio
async def test_corrupt_block_files_mid_run_are_recomputed(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path, NS)
    flipped: list[int] = []

    def corrupt(i: int, req: Any) -> None:
        if i == len(REQS) // 2:
            flipped.append(flip_a_byte_of_every_blob(store.dir))

    try:
        _, r1, r2 = await two_passes(store, corrupt)
    finally:
        store.close()
    assert flipped and flipped[0] > 0
    e = r1["errors"]
    assert e["store_corrupt"] > 0 and e["store_read_misses"] >= e["store_corrupt"]
    assert e["store_lost_entries"] > 0  # the manager forgot the blobs the store deleted
    assert e["failed_transfers"] > 0 and e["recomputed_blocks"] > 0
    assert_hits_storage(r2)


@pytest.mark.asyncio
async def test_disk_full_mid_run_fails_writes_then_recovers(tmp_path: Path,
                                                           monkeypatch: Any) -> None:
    store = LocalDirStore(tmp_path, NS)
    full = threading.Event()
    real_write = local_store._write_all

    def write_all(fd: int, data: Any) -> None:
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fd, data)

    monkeypatch.setattr(local_store, "_write_all", write_all)

    def fill_disk(i: int, req: Any) -> None:
        if i == len(REQS) // 3:
            full.set()

    try:
        _, r1, r2 = await two_passes(store, fill_disk, full.clear)
    finally:
        store.close()
    e = r1["errors"]
    assert e["store_put_failed"] > 0 and e["store_errors"] > 0 and e["failed_transfers"] > 0
    assert "ENOSPC" in (store.last_error or "") or "No space" in (store.last_error or "")
    assert not list(store.dir.rglob(".tmp-*")), "a failed write left a temporary file"
    assert r2["store"]["backend"]["blocks_written"] > 0  # writes work again
    assert_hits_storage(r2)


@pytest.mark.asyncio
async def test_a_store_evicting_behind_the_manager_costs_misses_not_data(
        tmp_path: Path) -> None:
    """The store's own LRU (a quota far below the manager's storage tier) drops blocks
    the manager still believes stored: reads miss, requests recompute.

    No storage hits are asserted for the second pass: the store never comes back
    here, and the manager keeps its stale storage entries (a read miss does not
    drop them yet), so which of the few surviving blobs get read is luck."""
    blob = SPEC.bytes_per_block + 256
    store = LocalDirStore(tmp_path, NS, capacity_bytes=24 * blob)
    try:
        _, r1, r2 = await two_passes(store)
    finally:
        store.close()
    assert store.stats.evictions > 0
    assert r1["errors"]["store_read_misses"] + r2["errors"]["store_read_misses"] > 0
    assert r1["errors"]["recomputed_blocks"] + r2["errors"]["recomputed_blocks"] > 0


# -------------------------------------------------------------------------- slow store
@pytest.mark.asyncio
async def test_a_store_slower_than_the_deadline_times_out_into_recompute(
        tmp_path: Path) -> None:
    inner = LocalDirStore(tmp_path, NS)
    slow = DelayedStore(inner)

    def slow_down(i: int, req: Any) -> None:
        if i == len(REQS) // 3:
            slow.read_delay = 0.6  # far past read_timeout_s

    def speed_up() -> None:
        slow.read_delay = 0.0

    try:
        # The deadline leaves a wide margin over a normal read: on a loaded
        # 2-core CI machine a healthy local read can take tens of ms.
        _, r1, r2 = await two_passes(slow, slow_down, speed_up, prefetch_policy="timeout",
                                     read_timeout_s=0.2)
    finally:
        inner.close()
    e = r1["errors"]
    assert e["store_timeouts"] > 0 and e["failed_transfers"] > 0
    assert r1["store"]["async"]["timeouts"] > 0
    assert_hits_storage(r2)  # serving again once the store is fast again
    assert r2["errors"]["store_timeouts"] < e["store_timeouts"]


# ---------------------------------------------------------------------------- Redis
@pytest.mark.asyncio
async def test_redis_killed_mid_replay_then_restarted() -> None:
    from kvflow.stores.redis_server import LocalRedisServer, find_redis_server

    if find_redis_server() is None:
        pytest.skip("redis-server binary not found on PATH: apt-get install -y redis-server")
    pytest.importorskip("redis", reason="redis-py not installed: pip install 'kvflow[redis]'")
    from kvflow.stores import RedisStore

    server = LocalRedisServer().start()
    store = RedisStore(NS, server.url, mac_key=b"k" * 32, retry_interval_s=0.02,
                       socket_timeout=0.5, connect_timeout=0.5)
    seen: dict[str, Any] = {}

    async def chaos(i: int, req: Any) -> None:
        if i == len(REQS) // 3:
            server.kill()  # SIGKILL: connections reset, every block lost
            seen["killed"] = store.stats
        elif i == 2 * len(REQS) // 3:
            await asyncio.to_thread(server.start)  # same port, empty
            seen["restarted"] = store.stats

    try:
        _, r1, r2 = await two_passes(store, chaos)
    finally:
        store.close()
        server.close()
    e = r1["errors"]
    assert e["store_errors"] > 0 and e["failed_transfers"] > 0
    assert seen["restarted"].errors > seen["killed"].errors  # calls failed while it was down
    # after the restart, the last third of pass 1 wrote and read the store again
    end = r1["store"]["stats"]
    assert end["put_ok"] > 0 and store.stats.put_ok > seen["restarted"].put_ok
    assert_hits_storage(r2)


# ------------------------------------------------------------------------ the checker
class MixUpStore(MemoryStore):
    """Answers a read of one key with another key's block: data a checksum cannot catch."""

    def get_many_into(self, keys: Sequence[Hashable], buffers: Sequence[object]) -> list[bool]:
        others = [k for k in self.contains_keys if k not in keys] or list(keys)
        return super().get_many_into([others[0]] * len(keys), buffers)

    def put_many(self, items: Sequence[tuple[Hashable, bytes]]) -> list[bool]:
        self.contains_keys.extend(k for k, _ in items)
        return super().put_many(items)

    contains_keys: list[Hashable]


@pytest.mark.asyncio
async def test_the_checker_counts_wrong_bytes_a_store_hands_back() -> None:
    """The control for every ``corrupt_reads == 0`` above: wrong data is seen."""
    store = MixUpStore(NS)
    store.contains_keys = []
    stack = RealtimeStack(SPEC, RealtimeConfig(**SMALL), store)
    try:
        r = await stack.replay(REQS)
    finally:
        stack.close()
    assert r["store"]["backend"]["blocks_read"] > 0
    assert r["errors"]["corrupt_reads"] > 0


# ---------------------------------------------------------------------- write policies
#: Two system prompts of 4 full blocks, 6 questions each (2 blocks of their own).
SHARED = engine_requests(shared_prefix(groups=2, prompts_per_group=6, system_len=64,
                                       question_len=32, output_len=2, rate=200,
                                       block_tokens=16, seed=2))
KEY_USES: dict[Hashable, int] = {}
for _r in SHARED:
    for _k in _r.keys:
        KEY_USES[_k] = KEY_USES.get(_k, 0) + 1


async def one_pass(store: MemoryStore, **cfg: Any) -> tuple[RealtimeStack, dict[str, Any]]:
    base = dict(device_blocks=64, host_blocks=64, storage_blocks=512,
                prefetch_policy="wait_complete", max_running=2)
    stack = RealtimeStack(SPEC, RealtimeConfig(**{**base, **cfg}), store)
    try:
        r = await stack.replay(SHARED)
        assert_served(r, len(SHARED))
        assert_no_leak(stack)
    finally:
        stack.close()
    return stack, r


def stored_keys(store: MemoryStore) -> set[Hashable]:
    return {k for k in KEY_USES if store.contains(k)}


def manager_stored(stack: RealtimeStack) -> set[Hashable]:
    return {n.key for n in stack.manager.index if n.state[Tier.STORAGE] == READY}


@pytest.mark.asyncio
async def test_write_through_writes_every_block_once_at_insert() -> None:
    store = MemoryStore(NS)
    stack, r = await one_pass(store, write_policy="write_through")
    assert r["evictions"] == {"device": 0, "host": 0, "storage": 0}  # no eviction needed
    assert stored_keys(store) == manager_stored(stack) == set(KEY_USES)
    assert store.stats.put_ok == len(KEY_USES)  # each block written exactly once
    assert stack.runtime.metrics.ops["write"] == 0
    # a fresh engine over the same store: everything is already there, nothing is rewritten;
    # one that does not index the store at start asks it before each write
    _, r2 = await one_pass(store, write_policy="write_through", rediscover=False)
    assert store.stats.put_ok == len(KEY_USES)
    assert r2["store"]["backend"]["write_skipped"] == len(KEY_USES)
    # one that does (the default) knows them from the start: it does not even ask
    _, r3 = await one_pass(store, write_policy="write_through")
    assert store.stats.put_ok == len(KEY_USES)
    assert r3["store"]["rediscovered"]["indexed"] == len(KEY_USES)
    assert r3["store"]["backend"]["write_ops"] == 0 and r3["hit_rate"]["storage"] > 0


@pytest.mark.asyncio
async def test_write_through_selective_writes_only_blocks_hit_often_enough() -> None:
    store = MemoryStore(NS)
    stack, _ = await one_pass(store, write_policy="write_through_selective", write_threshold=2)
    stored = stored_keys(store)
    assert stored == manager_stored(stack)
    hits = {n.key: n.hits for n in stack.manager.index}
    assert stored and all(hits[k] >= 2 for k in stored)
    assert not any(KEY_USES[k] == 1 for k in stored)  # a block used once is never written
    assert store.stats.put_ok == len(stored)


@pytest.mark.asyncio
async def test_write_back_writes_only_what_host_evicts() -> None:
    store = MemoryStore(NS)
    stack, _ = await one_pass(store, write_policy="write_back")
    assert store.stats.put_ok == 0  # nothing evicted from host: nothing written
    store2 = MemoryStore(NS)
    stack, r = await one_pass(store2, write_policy="write_back", device_blocks=12,
                              host_blocks=6)
    m = stack.runtime.metrics
    assert m.ops["backup"] == 0 and r["evictions"]["host"] > 0
    assert store2.stats.put_ok == m.blocks["write"] > 0
    assert store2.stats.put_ok == stack.manager.stats.copy_outs[Tier.HOST]


# ------------------------------------------------------------------ the manager side
def test_a_failed_write_under_a_waiting_requests_prefetch_leaves_no_dangling_node() -> None:
    """Found by the Redis test: a store write fails while a waiting request's arrival
    prefetch reads what it was writing. The blocks then have no copy left but are
    still held by the reservation; they must leave the index (recompute), not trip
    an assertion half-way through dropping the subtree."""
    from kvflow.manager import CacheManager, Capacities, OpKind

    m = CacheManager(Capacities(2, 2, 8), write_policy="write_through")

    def land(ops: list[Any]) -> list[Any]:
        """Complete ops and follow-ups, except host -> storage writes (returned, in flight)."""
        writes, queue = [], list(ops)
        while queue:
            op = queue.pop(0)
            if op.kind is OpKind.BACKUP and op.dst_tier == Tier.STORAGE:
                writes.append(op)
            else:
                queue += m.complete(op, True)
        return writes

    a = m.plan("a", [1, 2])
    land(a.ops)
    m.commit(a)
    writes = land(m.finish(a))     # host copies landed; their writes to storage in flight
    b = m.plan("b", [3, 4])        # evicts a's device copies
    land(b.ops)
    m.commit(b)
    writes += land(m.finish(b))    # evicts a's host copies: 1, 2 only in storage, FILLING
    assert [m.index.get(k).best_tier() for k in (1, 2)] == [Tier.STORAGE, Tier.STORAGE]
    held = m.prefetch([1, 2, 5])   # a waiting request reads them back as they are written
    assert held.ops and len(held.nodes) == 2
    for w in writes:               # the store was down: the writes fail ...
        m.complete(w, False)
    for op in held.ops:            # ... and so does the prefetch reading what they wrote
        m.complete(op, False)
    assert m.index.get(1) is None and m.index.get(2) is None
    m.release(held)
    m.check_invariants()
    plan = m.plan("c", [1, 2])     # recomputed from scratch
    assert plan.num_cached == 0


def test_copies_a_store_lost_are_forgotten_then_written_again() -> None:
    """A read that misses tells the manager (``StoreMissError.keys`` -> ``lost``): the
    entries go, with their subtree, even under a waiting request's reservation, and
    the next backup writes the blocks again instead of trusting a dead entry."""
    from kvflow.manager import CacheManager, Capacities

    m = CacheManager(Capacities(2, 2, 8), write_policy="write_through")

    def land(ops: list[Any]) -> None:
        queue = list(ops)
        while queue:
            queue += m.complete(queue.pop(0), True)

    a = m.plan("a", [1, 2])
    land(a.ops)
    m.commit(a)
    land(m.finish(a))               # on all three tiers
    b = m.plan("b", [3, 4])
    land(b.ops)
    m.commit(b)
    land(m.finish(b))               # 1, 2 pushed out to storage only
    assert [m.index.get(k).best_tier() for k in (1, 2)] == [Tier.STORAGE, Tier.STORAGE]
    held = m.prefetch([1, 2])       # a waiting request reads them back ...
    for op in held.ops:
        m.complete(op, False)       # ... the store misses: the store lost them
    assert m.lost(Tier.STORAGE, [1, 2]) == 1  # 1 goes, and 2 with it (no copy left above)
    assert m.index.get(1) is None and m.index.get(2) is None and m.stats.lost_copies == 1
    m.release(held)
    m.check_invariants()
    c = m.plan("c", [1, 2])         # computed again ...
    assert c.num_cached == 0
    land(c.ops)
    m.commit(c)
    ops = m.finish(c)
    land(ops)                       # ... and written again (write_through)
    assert all(m.index.get(k).state[Tier.STORAGE] == READY for k in (1, 2))
    m.check_invariants()


# ---------------------------------------------------------------------- prefetch policies
@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["wait_complete", "best_effort"])
async def test_prefetch_policies_through_a_real_store(policy: str) -> None:
    """With reads taking 60 ms: wait_complete waits for them and serves storage hits;
    best_effort schedules at once, cancels what has not landed and recomputes it.

    (Its TTFT is not asserted: a plan still reads the host copy a cancelled but
    running read is filling, so the request waits for that read to end before
    its swap-in fails into the recompute.)"""
    slow = DelayedStore(MemoryStore(NS))
    stack = RealtimeStack(SPEC, RealtimeConfig(**{**SMALL, "prefetch_policy": policy}), slow)
    try:
        await stack.replay(REQS)        # fills the store, fast
        slow.read_delay = 0.06
        r = await stack.replay(REQS)
        assert_served(r)
        assert_all_free_after_drop(stack)
    finally:
        stack.close()
    if policy == "wait_complete":
        # (0.087 of blocks from storage: since recomputed blocks stay on the device
        # as their nodes' copies, fewer of this pass's blocks are left only in storage)
        assert r["hit_rate"]["storage"] > 0.05 and r["ttft_s"]["p99"] >= 0.06
    else:
        # only what landed while its request queued (rarely 60 ms here) is served
        assert r["hit_rate"]["storage"] < 0.05 and r["prefetch"]["cancelled"] > 0
