"""RedisStore against a real redis-server on a free loopback port: batching and faults.

Every test starts its own server (``--save '' --appendonly no``, ~20 ms) so
it can kill, pause or restart it. The module skips, saying why, only where
the ``redis-server`` binary is missing (``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvflow.errors import ConfigError, TransferError
from kvflow.layout import preset
from kvflow.stores import AsyncStore, Namespace, RedisStore, encode_key
from kvflow.stores.redis_server import LocalRedisServer, find_redis_server

if find_redis_server() is None:
    pytest.skip(
        "redis-server binary not found on PATH: apt-get install -y redis-server "
        "(.ci/run installs it)",
        allow_module_level=True,
    )
redis = pytest.importorskip("redis", reason="redis-py not installed: pip install 'kvflow[redis]'")

NS = Namespace("test-model", "raw")
#: The deployment key every store of these tests shares (a shared store needs one).
KEY = bytes(range(32))


@pytest.fixture
def server():
    srv = LocalRedisServer()
    srv.start()
    yield srv
    srv.close()


def make_store(server, ns=NS, **kw) -> RedisStore:
    kw.setdefault("mac_key", KEY)
    kw.setdefault("retry_interval_s", 0.05)
    kw.setdefault("socket_timeout", 0.5)
    return RedisStore(ns, server.url, **kw)


def raw_client(server):
    return redis.Redis(host=server.host, port=server.port)


def wait_until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_round_trip_int_bytes_negative_keys(server):
    s = make_store(server)
    items = [(0, b""), (-1, os.urandom(100)), (2**64, os.urandom(70_000)),
             (os.urandom(32), os.urandom(5000)), ("k", b"v")]
    assert s.put_many(items) == [True] * len(items)
    assert s.get_many([k for k, _ in items] + [404]) == [v for _, v in items] + [None]
    st = s.stats
    assert (st.hits, st.misses, st.put_ok, st.errors) == (5, 1, 5, 0)
    assert st.bytes_read == st.bytes_written == sum(len(v) for _, v in items)
    assert s.contains_many([-1, 404]) == [True, False]
    assert s.delete(-1) is True and s.delete(-1) is False
    assert s.get(-1) is None
    s.close()


def test_get_many_into(server):
    s = make_store(server)
    s.put_many([(1, b"a" * 100), (2, b"b" * 100)])
    bufs = [bytearray(100) for _ in range(3)]
    assert s.get_many_into([1, 2, 3], bufs) == [True, True, False]
    assert bufs[0] == b"a" * 100 and bufs[1] == b"b" * 100
    assert s.get_many_into([1], [bytearray(99)]) == [False]  # size mismatch: a plain miss
    assert s.stats.corrupt == 0 and s.contains(1)
    s.close()


def test_gets_and_sets_are_batched_into_round_trips(server):
    s = make_store(server, batch_size=4)
    items = [(i, bytes([i]) * 1000) for i in range(10)]
    assert all(s.put_many(items))
    assert s.get_many(range(10)) == [v for _, v in items]
    stats = raw_client(server).info("commandstats")
    assert stats["cmdstat_mget"]["calls"] == 3  # ceil(10 / 4) round trips, not 10 GETs
    assert stats["cmdstat_set"]["calls"] == 10
    assert "cmdstat_get" not in stats
    s.close()


def test_namespaces_isolate_tenants_and_models(server):
    spec = preset("llama-3-8b", num_layers=1)
    block = os.urandom(spec.bytes_per_block)
    a = make_store(server, Namespace.for_model(spec, "tenant-a"))
    b = make_store(server, Namespace.for_model(spec, "tenant-b"))
    c = make_store(server, Namespace.for_model(spec.replace(dtype="fp16")))
    assert a.put(b"h", block)
    assert a.get(b"h") == block
    assert b.get(b"h") is None and c.get(b"h") is None
    assert b.clear() == 0 and a.clear() == 1
    assert a.get(b"h") is None
    for s in (a, b, c):
        s.close()


def test_corrupt_or_foreign_value_is_a_counted_miss_and_deleted(server):
    s = make_store(server)
    s.put(1, b"good" * 100)
    r = raw_client(server)
    rkey = s._rkey(encode_key(1))
    blob = bytearray(r.get(rkey))
    blob[-3] ^= 0xFF
    r.set(rkey, bytes(blob))
    r.set(s._rkey(encode_key(2)), b"not a kvflow blob")
    assert s.get_many([1, 2]) == [None, None]
    assert s.stats.corrupt == 2 and s.stats.misses == 2
    assert r.exists(rkey) == 0
    s.close()


def test_ttl_is_set(server):
    s = make_store(server, ttl_s=30)
    s.put(1, b"x")
    pttl = raw_client(server).pttl(s._rkey(encode_key(1)))
    assert 0 < pttl <= 30_000
    with pytest.raises(ConfigError, match="ttl_s"):
        make_store(server, ttl_s=0)


def _count_connections(store: RedisStore) -> list[int]:
    """Count the connections the store's pool hands out (each one a try of the server)."""
    pool = store._client.connection_pool
    seen = [0]
    get = pool.get_connection

    def counted(*args, **kw):
        seen[0] += 1
        return get(*args, **kw)

    pool.get_connection = counted
    return seen


def test_killed_server_degrades_to_misses_and_recovers_on_restart(server):
    s = make_store(server)
    items = [(i, os.urandom(4096)) for i in range(32)]
    assert all(s.put_many(items))
    assert s.get_many(range(16)) == [v for _, v in items[:16]]
    # "No long stalls while the server is down", as behaviour rather than a stopwatch:
    # after one failed try, calls are answered without trying the server (a window
    # long enough that a slow machine cannot reopen it mid-test).
    held = make_store(server, retry_interval_s=600)
    assert held.get(0) == items[0][1]

    server.kill()  # crash: connections reset
    tries = _count_connections(held)
    assert held.get(0) is None and held.is_down and tries[0] >= 1
    first = tries[0]
    assert held.get_many(range(16, 32)) == [None] * 16
    assert held.put_many(items[:4]) == [False] * 4
    assert held.contains_many([1, 2]) == [False, False]
    assert held.delete(1) is False
    assert tries[0] == first  # answered at once: no connect tried, no timeout paid
    held.close()
    assert s.get_many(range(16, 32)) == [None] * 16
    assert s.put_many(items[:4]) == [False] * 4
    assert s.contains_many([1, 2]) == [False, False]
    assert s.delete(1) is False
    st = s.stats
    assert st.errors >= 4 and st.misses == 16 and st.put_failed == 4
    assert "onnect" in (s.last_error or "")  # ConnectionError: ... Connection refused

    server.start()  # back on the same port, empty (no persistence)
    assert wait_until(lambda: s.put_many(items[:4]) == [True] * 4)
    assert s.get_many(range(4)) == [v for _, v in items[:4]]
    assert s.get(20) is None  # lost with the server's memory: a plain miss
    s.close()


def test_kill_during_concurrent_traffic_never_raises_or_returns_wrong_data(server):
    s = make_store(server)
    value = {i: bytes([i]) * 65536 for i in range(64)}
    assert all(s.put_many(list(value.items())))
    problems: list[str] = []
    stop = threading.Event()

    def reader(seed: int) -> None:
        i = 0
        while not stop.is_set():
            keys = [(seed * 7 + i + j) % 64 for j in range(16)]
            try:
                got = s.get_many(keys)
                s.put_many([(keys[0], value[keys[0]])])
            except Exception as exc:  # the contract: never raises
                problems.append(repr(exc))
                return
            for k, v in zip(keys, got, strict=True):
                if v is not None and v != value[k]:
                    problems.append(f"wrong data for {k}")
            i += 1

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.15)
    server.kill()
    time.sleep(0.15)
    server.start()
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join()
    assert problems == []
    assert s.stats.errors > 0
    # serving again after the restart
    assert wait_until(lambda: s.put(1, value[1]) and s.get(1) == value[1])
    s.close()


def test_hung_server_is_bounded_by_socket_timeout_then_recovers(server):
    s = make_store(server, socket_timeout=0.2)
    s.put(1, b"x")
    server.pause()  # SIGSTOP: connected but silent, like a store slower than any deadline
    try:
        # answered while the server is still silent: the socket timeout bounded the call
        assert s.get_many([1]) == [None]
        assert s.stats.errors >= 1 and s.is_down
    finally:
        server.resume()
    assert wait_until(lambda: s.get(1) == b"x")
    s.close()


@pytest.mark.asyncio
async def test_async_deadline_over_a_paused_server(server):
    s = make_store(server, socket_timeout=1.0)
    s.put(1, b"x")
    async with AsyncStore(s, max_workers=2, timeout_s=0.1) as a:
        server.pause()
        try:
            with pytest.raises(TransferError, match="deadline"):
                await a.get_many([1])
        finally:
            server.resume()
        got = None
        for _ in range(100):
            try:
                got = await a.get_many([1], timeout_s=2.0)
            except Exception:  # pragma: no cover - retried
                got = None
            if got == [b"x"]:
                break
        assert got == [b"x"]
    s.close()


def test_full_server_memory_put_false_and_counted():
    with LocalRedisServer(extra_args=["--maxmemory", "3mb", "--maxmemory-policy",
                                      "noeviction"]) as srv:
        s = make_store(srv)
        block = os.urandom(512 * 1024)
        results = [s.put(i, block) for i in range(16)]
        assert True in results and False in results
        st = s.stats
        assert st.put_failed == results.count(False) and st.errors >= st.put_failed
        assert "OOM" in (s.last_error or "") or "maxmemory" in (s.last_error or "")
        stored = [i for i, ok in enumerate(results) if ok]
        assert s.get_many(stored) == [block] * len(stored)  # what was stored still reads
        assert not s.is_down  # a refused command is not a dead server
        assert s.delete(stored[0]) and s.put(100, b"small")  # room again: serving
        s.close()


def test_unreachable_server_from_the_start(server):
    port = server.port
    server.kill()
    s = RedisStore(NS, host="127.0.0.1", port=port, retry_interval_s=0.05, mac_key=KEY)
    assert s.get_many([1, 2]) == [None, None]
    assert s.put(1, b"x") is False
    assert s.ping() is False
    server.start()
    assert wait_until(s.ping)
    assert s.put(1, b"x") and s.get(1) == b"x"
    s.close()
