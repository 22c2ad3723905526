"""A new process rediscovers what a persistent store holds (issue 23, storage bullet).

``StoreBackend`` records each block's parent in the store as it writes it
(``BlockStore.put_links``); at start ``kvflow.store_index.rediscover`` lists
those links, keeps the blocks still present and hands them, parents first, to
the manager as ready storage copies. Checksums (and Redis MACs) are checked
lazily, at read: a bad block is a miss, counted, recomputed — never wrong data.

All with real stores: a local directory, and a real ``redis-server`` the tests
start themselves. "A new process" is a new store object, a new manager and a
new stack over the same directory or server (nothing carried over in memory);
one test runs the first half in a real child process.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.host_memory import HostArrays
from kvflow.manager import CacheManager, Capacities, OpKind, TransferOp
from kvflow.radix import READY, Tier
from kvflow.realtime import RealtimeConfig, RealtimeStack, engine_requests, tiny_spec
from kvflow.realtime.cpu import block_bytes
from kvflow.store_backend import StoreBackend, store_key
from kvflow.store_index import manager_key, prefix_order, rediscover
from kvflow.stores import BlockStore, LocalDirStore, MemoryStore, Namespace, decode_key, encode_key
from traces.generate import multi_turn

SPEC = tiny_spec()
NS = Namespace.for_model(SPEC)
#: 10 sessions x 2 turns; turn 2 re-reads turn 1, and every block is written through.
REQS = engine_requests(multi_turn(sessions=10, turns=2, system_len=48, user_len=32,
                                  output_len=3, think_time_s=0.2, rate=40, block_tokens=16,
                                  seed=7), time_scale=0.2)
CFG = dict(device_blocks=24, host_blocks=12, storage_blocks=4096,
           prefetch_policy="wait_complete", write_policy="write_through")
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ pure parts
@given(st.one_of(st.integers(), st.binary(max_size=40), st.text(max_size=40)))
def test_decode_key_inverts_encode_key(key: Any) -> None:
    assert decode_key(encode_key(key)) == key


@given(st.tuples(st.text(max_size=8), st.integers()))
def test_manager_key_inverts_store_key(key: tuple[str, int]) -> None:
    assert manager_key(store_key(key)) == key
    assert manager_key(store_key(key[1])) == key[1]


def test_decode_key_rejects_what_is_not_a_key() -> None:
    for bad in ("", "x12", "i12a", "hzz", "s" + b"\xff".hex()):
        with pytest.raises(ValueError, match="not an encoded block key"):
            decode_key(bad)


def test_prefix_order_puts_parents_first_and_leaves_orphans_out() -> None:
    links = {"c": "b", "b": "a", "a": None, "y": "x", "z": "y", "d": "a"}
    ordered, orphans = prefix_order(links)
    assert orphans == 2  # "y" and "z" hang under "x", which nobody holds
    pos = {k: i for i, (k, _) in enumerate(ordered)}
    assert set(pos) == {"a", "b", "c", "d"}
    assert all(pos[p] < pos[k] for k, p in ordered if p is not None)
    assert dict(ordered) == {k: links[k] for k in pos}


# ---------------------------------------------------------------------------- the stores
def redis_server() -> Iterator[Any]:
    from kvflow.stores.redis_server import LocalRedisServer, find_redis_server

    if find_redis_server() is None:
        pytest.skip("redis-server binary not found on PATH: apt-get install -y redis-server")
    pytest.importorskip("redis", reason="redis-py not installed: pip install 'kvflow[redis]'")
    server = LocalRedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(params=["local", "redis"])
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A factory of store objects over one persistent place: each call is "a new process"
    opening it (the previous object must be closed first, as a process exit would)."""
    if request.param == "local":
        yield lambda ns=NS: LocalDirStore(tmp_path, ns)
        return
    from kvflow.stores import RedisStore

    gen = redis_server()
    server = next(gen)
    yield lambda ns=NS: RedisStore(ns, server.url, mac_key=b"m" * 32)
    gen.close()


def corrupt_one_block(store: BlockStore, key: Any) -> None:
    """Flip one payload byte of ``key``'s stored blob, behind the store's back."""
    if isinstance(store, LocalDirStore):
        path = store.path_for(key)
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x5A
        path.write_bytes(bytes(data))
        return
    rkey = store._rkey(encode_key(key))  # type: ignore[attr-defined]
    data = bytearray(store._client.get(rkey))  # type: ignore[attr-defined]
    data[-7] ^= 0x5A
    store._client.set(rkey, bytes(data))  # type: ignore[attr-defined]


def test_links_persist_skip_gone_blocks_and_stay_in_their_namespace(reopen: Any) -> None:
    payload = bytes(range(256)) * (SPEC.bytes_per_block // 256)
    s = reopen()
    try:
        assert s.links() == []
        assert s.put_many([(k, payload) for k in (1, 2, 3)]) == [True] * 3
        assert s.put_links([(1, None), (2, 1), (3, 2), (store_key(("t", 9)), 3)])
        s.delete(3)
    finally:
        s.close()
    s = reopen()
    try:
        m = CacheManager(Capacities(4, 4, 16))
        found = rediscover(m, s)
        # 3's blob is gone and ("t", 9) was never stored: only 1 <- 2 are indexed (a
        # directory lists only the links of blobs it holds; Redis lists all it has)
        local = isinstance(s, LocalDirStore)
        assert (found.listed, found.present, found.indexed) == (2 if local else 4, 2, 2)
        assert [n.key for n in m.match([1, 2, 3])] == [1, 2]
        assert all(n.state[Tier.STORAGE] == READY for n in m.match([1, 2]))
        m.check_invariants()
        if not isinstance(s, LocalDirStore):
            assert {k for k, _ in s.links()} == {1, 2}  # the gone ones were forgotten
    finally:
        s.close()
    other = reopen(Namespace.for_model(SPEC, tenant_salt="someone else"))
    try:
        assert other.links() == []
    finally:
        other.close()


def test_a_torn_last_line_is_skipped_and_the_file_compacted(tmp_path: Path) -> None:
    s = LocalDirStore(tmp_path, NS)
    s.put_many([(7, bytes(SPEC.bytes_per_block))])
    s.put_links([(7, None), (8, 7)])
    with open(s.dir / "links", "a") as f:
        f.write("i9 i")  # a crash mid-append
    assert s.links() == [(7, None)]
    assert (s.dir / "links").read_text() == "i7 \n"
    s.close()


def test_host_store_host_round_trip_across_a_restart(reopen: Any) -> None:
    """host -> store (one process) -> a new store object -> host: bit-exact."""
    layout = SPEC.layout
    keys = [("tenant", 1), ("tenant", 2), ("tenant", 3)]

    async def write(store: BlockStore) -> np.ndarray:
        host = HostArrays.for_layout(layout, 4)
        for b, k in enumerate(keys):
            host.block_view(b)[:] = block_bytes(k, layout.num_layers,
                                                layout.bytes_per_layer_block).reshape(-1)
        be = StoreBackend(store, host, layout.num_layers)
        done = asyncio.get_running_loop().create_future()
        sink = type("S", (), {"layer_done": lambda self, i: None,
                              "done": lambda self, e=None: done.set_result(e)})()
        be.submit(TransferOp(1, OpKind.BACKUP, Tier.HOST, Tier.STORAGE, [0, 1, 2], [0, 1, 2],
                             list(keys)), sink)
        assert await done is None
        await be.drain()
        be.close()
        return host.array[:3].copy()

    async def read(store: BlockStore) -> np.ndarray:
        host = HostArrays.for_layout(layout, 4)
        be = StoreBackend(store, host, layout.num_layers)
        done = asyncio.get_running_loop().create_future()
        sink = type("S", (), {"layer_done": lambda self, i: None,
                              "done": lambda self, e=None: done.set_result(e)})()
        be.submit(TransferOp(2, OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [0, 1, 2],
                             [3, 1, 0], list(keys)), sink)
        assert await done is None
        await be.drain()
        be.close()
        return host.array[[3, 1, 0]]

    s = reopen()
    try:
        wrote = asyncio.run(write(s))
    finally:
        s.close()
    s = reopen()
    try:
        assert np.array_equal(asyncio.run(read(s)), wrote)
    finally:
        s.close()


# ------------------------------------------------------------------ a new engine, warm
async def one_stack(store: BlockStore, **cfg: Any) -> tuple[RealtimeStack, dict[str, Any]]:
    stack = RealtimeStack(SPEC, RealtimeConfig(**{**CFG, **cfg}), store)
    try:
        report = await stack.replay(REQS)
        stack.manager.check_invariants()
    finally:
        stack.close()
    assert report["requests"] == len(REQS) and report["rejected"] == 0
    assert report["errors"]["corrupt_reads"] == 0, report["compute"]["examples"]
    return stack, report


@pytest.mark.asyncio
async def test_a_new_engine_starts_warm_from_the_store(reopen: Any) -> None:
    s = reopen()
    try:
        _, r1 = await one_stack(s)
    finally:
        s.close()
    written = r1["store"]["backend"]["blocks_written"]
    assert written > 0 and r1["store"]["backend"]["links_written"] >= written
    # a new process, cold: it recomputes what the store holds, whose writes are skipped
    s = reopen()
    try:
        _, rc = await one_stack(s, rediscover=False)
    finally:
        s.close()
    # a new process, warm: the index is rebuilt from the store at start
    s = reopen()
    try:
        _, rw = await one_stack(s)
    finally:
        s.close()
    found = rw["store"]["rediscovered"]
    assert found["present"] == found["indexed"] >= written, found
    hw, hc = rw["hit_rate"], rc["hit_rate"]
    assert hw["storage"] > hc["storage"] + 0.15 and hw["total"] > hc["total"] + 0.1, (hw, hc)
    assert rw["errors"]["failed_transfers"] == 0 and rw["errors"]["recomputed_blocks"] == 0
    assert rc["store"]["backend"]["write_skipped"] > 0  # cold: writes of what was there
    assert rw["store"]["backend"]["write_skipped"] == 0  # warm: known, never written
    assert rw["store"]["stats"]["hits"] > 0


@pytest.mark.asyncio
async def test_a_corrupt_block_is_found_at_read_counted_and_recomputed(reopen: Any) -> None:
    s = reopen()
    try:
        await one_stack(s)
        victim = REQS[0].keys[0]  # the first block of a prompt every turn of it reads
        corrupt_one_block(s, victim)
    finally:
        s.close()
    s = reopen()
    try:
        _, rw = await one_stack(s)
    finally:
        s.close()
    assert rw["store"]["rediscovered"]["indexed"] > 0  # checked lazily: indexed all the same
    e = rw["errors"]
    assert e["store_corrupt"] == 1 and e["store_read_misses"] >= 1, e
    assert e["failed_transfers"] >= 1 and e["recomputed_blocks"] >= 1
    assert e["corrupt_reads"] == 0  # the executor checked every cached block it read
    # the bad copy was dropped, then written again from the recomputed block
    s = reopen()
    try:
        assert s.get(store_key(victim)) is not None
    finally:
        s.close()


def test_rediscovery_in_a_real_child_process(tmp_path: Path) -> None:
    """The writer is another OS process; this one rebuilds its index from the directory."""
    child = textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.test_store_rediscover import NS, one_stack
        from kvflow.stores import LocalDirStore
        s = LocalDirStore({str(tmp_path)!r}, NS)
        try:
            _, r = asyncio.run(one_stack(s))
        finally:
            s.close()
        print(r["store"]["backend"]["blocks_written"])
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    written = int(out.stdout.split()[-1])
    s = LocalDirStore(tmp_path, NS)
    try:
        m = CacheManager(Capacities(24, 12, 4096))
        found = rediscover(m, s)
        assert found.indexed == found.present >= written > 0
        assert m.match(REQS[-1].keys)  # a prompt of the trace matches from storage
        m.check_invariants()
    finally:
        s.close()


def test_a_store_without_links_and_a_manager_without_storage_start_cold() -> None:
    m = CacheManager(Capacities(4, 4, 16))
    s = MemoryStore(NS)
    assert rediscover(m, s).listed == 0
    s.put_links([(1, None)])
    assert rediscover(CacheManager(Capacities(4, 4)), s).listed == 0  # no storage tier
