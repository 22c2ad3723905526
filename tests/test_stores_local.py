"""LocalDirStore: round trips, namespaces, corruption, atomic writes, LRU, restart, full disk."""

import errno
import os
import random
import subprocess
import sys
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.errors import ConfigError
from kvflow.layout import preset
from kvflow.stores import LocalDirStore, Namespace, StoreClosedError, encode_blob, encode_key
from kvflow.stores.base import storage_name
from kvflow.stores.local import TMP_PREFIX

NS = Namespace("test-model", "raw")


def blob_size(key, n, ns=NS):
    return len(encode_blob(ns.layout, encode_key(key), b"\0" * n))


def files_on_disk(store):
    return sorted(p for p in store.dir.rglob("*") if p.is_file() and p.name != ".lock")


def tmp_files(store):
    return [p for p in store.dir.rglob(f"{TMP_PREFIX}*")]


@pytest.fixture
def store(tmp_path):
    s = LocalDirStore(tmp_path, NS)
    yield s
    s.close()


# ------------------------------------------------------------------------ round trips


def test_round_trip_random_bytes_int_and_bytes_keys(store):
    rng = random.Random(7)
    keys = [0, 1, -1, -(2**63), 2**64 + 5, os.urandom(32), b"\x00" * 32, "text-key"]
    items = [(k, rng.randbytes(rng.randint(0, 5000))) for k in keys]
    assert store.put_many(items) == [True] * len(items)
    got = store.get_many([k for k, _ in items])
    assert got == [v for _, v in items]
    st_ = store.stats
    assert st_.hits == len(items) and st_.misses == 0 and st_.put_ok == len(items)
    assert st_.bytes_read == st_.bytes_written == sum(len(v) for _, v in items)
    assert store.contains_many([*keys, 12345]) == [True] * len(keys) + [False]
    assert store.get(12345) is None and store.stats.misses == 1


def test_files_live_under_namespace_and_fanout_dirs(store):
    store.put(-42, b"abc")
    p = store.path_for(-42)
    assert p.exists() and p.name == "i-42"
    assert p.parent.parent == store.dir and len(p.parent.name) == 2
    assert store.dir.name == NS.name


def test_overwrite_and_delete(store):
    store.put(1, b"old")
    store.put(1, b"newer")
    assert store.get(1) == b"newer"
    assert len(store) == 1 and store.used_bytes == blob_size(1, 5)
    assert store.delete(1) is True
    assert not store.path_for(1).exists()
    assert store.delete(1) is False
    assert store.get(1) is None and store.used_bytes == 0


def test_namespaces_isolate_tenants_and_models(tmp_path):
    spec = preset("llama-3-8b", num_layers=1)
    block = os.urandom(spec.bytes_per_block)
    nss = [
        Namespace.for_model(spec, "tenant-a"),
        Namespace.for_model(spec, "tenant-b"),
        Namespace.for_model(spec),
        Namespace.for_model(spec.replace(name="other-model")),
    ]
    stores = [LocalDirStore(tmp_path, ns) for ns in nss]
    try:
        assert stores[0].put(b"same-hash", block)
        assert stores[0].get(b"same-hash") == block
        for s in stores[1:]:
            assert s.get(b"same-hash") is None
            assert s.contains(b"same-hash") is False
    finally:
        for s in stores:
            s.close()


def test_one_store_object_per_directory(tmp_path):
    s = LocalDirStore(tmp_path, NS)
    with pytest.raises(ConfigError, match="already open"):
        LocalDirStore(tmp_path, NS)
    s.close()
    LocalDirStore(tmp_path, NS).close()  # free again after close


def test_closed_store_refuses_calls(tmp_path):
    s = LocalDirStore(tmp_path, NS)
    s.close()
    with pytest.raises(StoreClosedError):
        s.put(1, b"x")


def test_bad_capacity_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="capacity_bytes"):
        LocalDirStore(tmp_path, NS, capacity_bytes=0)


# ------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("where", ["payload", "header", "truncate", "empty", "append"])
def test_corrupt_file_is_a_counted_miss_and_removed(store, where):
    store.put(5, os.urandom(1000))
    store.put(6, b"fine")
    p = store.path_for(5)
    data = bytearray(p.read_bytes())
    if where == "payload":
        data[-10] ^= 0xFF
    elif where == "header":
        data[13] ^= 0x01  # payload length field
    elif where == "truncate":
        data = data[:500]
    elif where == "empty":
        data = bytearray()
    else:
        data += b"junk"
    p.write_bytes(bytes(data))
    assert store.get_many([5, 6]) == [None, b"fine"]
    st_ = store.stats
    assert st_.corrupt == 1 and st_.misses == 1 and st_.hits == 1 and st_.errors == 0
    assert not p.exists() and not store.contains(5)
    assert store.used_bytes == blob_size(6, 4)
    assert store.put(5, b"again") and store.get(5) == b"again"  # the slot is usable again


def test_layout_or_key_mismatch_is_a_corrupt_miss(tmp_path):
    ns_a = Namespace("m", "layout-A")
    ns_b = Namespace("m", "layout-B")
    with LocalDirStore(tmp_path, ns_a) as a:
        a.put(1, b"data of layout A")
        blob = a.path_for(1).read_bytes()
    with LocalDirStore(tmp_path, ns_b) as b:
        # a blob of another layout planted where B looks (a stale or misplaced file)
        b.path_for(1).parent.mkdir(parents=True, exist_ok=True)
        b.path_for(1).write_bytes(blob)
        # and key 1's blob planted under key 2's name
        b.path_for(2).parent.mkdir(parents=True, exist_ok=True)
        b.path_for(2).write_bytes(encode_blob(ns_b.layout, encode_key(1), b"for key 1"))
    with LocalDirStore(tmp_path, ns_b) as b:  # reopen: the index picks the files up
        assert b.contains_many([1, 2]) == [True, True]
        assert b.get_many([1, 2]) == [None, None]
        assert b.stats.corrupt == 2
        assert not b.path_for(1).exists() and not b.path_for(2).exists()


def test_unreadable_file_is_an_error_miss(store, monkeypatch):
    store.put(1, b"x")
    real_open = open

    def failing_open(path, *a, **kw):
        if str(path) == str(store.path_for(1)):
            raise OSError(errno.EIO, "Input/output error")
        return real_open(path, *a, **kw)

    monkeypatch.setattr("builtins.open", failing_open)
    assert store.get(1) is None
    assert store.stats.errors == 1 and store.stats.misses == 1
    assert "EIO" in store.last_error or "Input/output" in store.last_error


def test_file_removed_behind_the_store_is_a_plain_miss(store):
    store.put(1, b"x")
    os.unlink(store.path_for(1))
    assert store.get(1) is None
    assert store.stats.errors == 0 and not store.contains(1) and store.used_bytes == 0


# --------------------------------------------------------------------- atomic writes


def test_failed_write_midway_leaves_nothing_visible(store, monkeypatch):
    store.put(1, b"old value")
    real_write = os.write
    calls = {"n": 0}

    def half_then_enospc(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:  # the header goes through
            return real_write(fd, data)
        if calls["n"] == 2:  # half the payload
            return real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_enospc)
    assert store.put(1, os.urandom(10_000)) is False
    monkeypatch.undo()
    assert calls["n"] == 3
    assert tmp_files(store) == []
    # the key is absent: neither the half-written new value nor the stale old one
    assert not store.path_for(1).exists()
    assert store.get(1) is None
    st_ = store.stats
    assert st_.put_failed == 1 and st_.errors == 1 and store.used_bytes == 0
    assert "ENOSPC" in store.last_error or "No space" in store.last_error
    assert store.put(1, b"after") and store.get(1) == b"after"  # keeps serving


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT, errno.EACCES])
def test_full_disk_quota_put_false_and_counted(store, monkeypatch, err):
    store.put(1, b"kept")
    real_open = os.open

    def refuse_new_files(path, flags, *a, **kw):
        if os.path.basename(path).startswith(TMP_PREFIX):
            raise OSError(err, os.strerror(err))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", refuse_new_files)
    assert store.put_many([(2, b"a"), (3, b"b")]) == [False, False]
    assert store.get_many([1, 2, 3]) == [b"kept", None, None]  # reads still work
    monkeypatch.undo()
    st_ = store.stats
    assert st_.put_failed == 2 and st_.errors == 2 and st_.put_ok == 1
    assert store.put(2, b"a")  # the quota freed up: serving again


def test_failed_rename_removes_the_temp_file(store, monkeypatch):
    def no_replace(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "replace", no_replace)
    assert store.put(1, b"x") is False
    monkeypatch.undo()
    assert tmp_files(store) == [] and files_on_disk(store) == []


def test_fsync_mode_round_trips(tmp_path):
    with LocalDirStore(tmp_path, NS, fsync=True) as s:
        assert s.put(1, b"durable") and s.get(1) == b"durable"


# ------------------------------------------------------------------------------- LRU


def test_lru_capacity_eviction_order(tmp_path):
    size = blob_size(0, 1000)
    with LocalDirStore(tmp_path, NS, capacity_bytes=3 * size) as s:
        s.put_many([(i, bytes([i]) * 1000) for i in range(3)])
        assert s.get(0) is not None  # order now 1, 2, 0
        assert s.put(3, b"3" * 1000)  # evicts 1
        assert s.contains_many([0, 1, 2, 3]) == [True, False, True, True]
        s.put(2, b"2" * 1000)  # a put refreshes too: order 0, 3, 2
        s.put(4, b"4" * 1000)  # evicts 0
        assert s.lru_order() == [storage_name(encode_key(k)) for k in (3, 2, 4)]
        assert s.stats.evictions == 2
        assert s.used_bytes == 3 * size
        assert len(files_on_disk(s)) == 3 and not s.path_for(0).exists()


def test_block_larger_than_capacity_evicts_nothing(tmp_path):
    with LocalDirStore(tmp_path, NS, capacity_bytes=2 * blob_size(0, 100)) as s:
        s.put_many([(0, b"a" * 100), (1, b"b" * 100)])
        assert s.put(2, b"c" * 1000) is False
        assert s.contains_many([0, 1, 2]) == [True, True, False]
        assert s.stats.evictions == 0 and s.stats.put_failed == 1 and s.stats.errors == 0


# --------------------------------------------------------------------------- restart


def test_index_rebuilt_after_restart_keeps_lru_order(tmp_path):
    size = blob_size(0, 500)
    s = LocalDirStore(tmp_path, NS, capacity_bytes=4 * size)
    s.put_many([(i, bytes([i]) * 500) for i in range(4)])
    s.get_many([2, 0])  # order 1, 3, 2, 0
    order = s.lru_order()
    used = s.used_bytes
    s.close()
    # a crashed writer left a temp file behind
    stray = s.dir / "ab" / f"{TMP_PREFIX}i99-1-2-3"
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"partial")

    s2 = LocalDirStore(tmp_path, NS, capacity_bytes=4 * size)
    try:
        assert s2.lru_order() == order
        assert s2.used_bytes == used and len(s2) == 4
        assert s2.removed_tmp_files == 1 and not stray.exists()
        s2.put(9, b"9" * 500)  # evicts the least recent: 1
        assert s2.contains_many([1, 3, 9]) == [False, True, True]
        assert s2.get_many([0, 2, 3]) == [bytes([i]) * 500 for i in (0, 2, 3)]
    finally:
        s2.close()

    # reopening with a smaller capacity trims the oldest blobs
    s3 = LocalDirStore(tmp_path, NS, capacity_bytes=2 * size)
    try:
        # order was 9, 0, 2, 3 (the gets above touched 0, 2, 3 last)
        assert len(s3) == 2 and s3.stats.evictions == 2 and s3.used_bytes <= 2 * size
        assert s3.contains_many([9, 0, 2, 3]) == [False, False, True, True]
    finally:
        s3.close()


def test_restart_ignores_files_that_are_not_ours(tmp_path):
    with LocalDirStore(tmp_path, NS) as s:
        s.put(1, b"x")
        (s.dir / "README").write_text("not a block")
        (s.dir / "zz").mkdir()
        (s.dir / "zz" / "i1").write_text("not a fan-out dir")
    with LocalDirStore(tmp_path, NS) as s:
        assert len(s) == 1 and s.get(1) == b"x"
        assert (s.dir / "README").exists()


# ------------------------------------------------------------------------ concurrency


def test_threads_keep_index_and_disk_consistent(tmp_path):
    size = blob_size(0, 2000)
    with LocalDirStore(tmp_path, NS, capacity_bytes=20 * size) as s:
        errors = []

        def worker(seed):
            rng = random.Random(seed)
            try:
                for _ in range(150):
                    k = rng.randrange(40)
                    if rng.random() < 0.5:
                        s.put(k, bytes([k]) * 2000)
                    else:
                        v = s.get(k)
                        assert v is None or v == bytes([k]) * 2000
            except Exception as exc:  # pragma: no cover
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        on_disk = files_on_disk(s)
        assert {p.name for p in on_disk} == set(s.lru_order())
        assert s.used_bytes == sum(p.stat().st_size for p in on_disk) <= 20 * size
        assert tmp_files(s) == []
        assert s.stats.corrupt == 0 and s.stats.errors == 0


# ------------------------------------------------------- property test vs a dict model

keys_st = st.one_of(st.integers(-2, 3), st.sampled_from([b"\x01" * 32, b"\x02" * 32]))
ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("put"), keys_st, st.integers(0, 200)),
        st.tuples(st.just("get"), keys_st),
        st.tuples(st.just("delete"), keys_st),
        st.tuples(st.just("corrupt"), keys_st),
        st.tuples(st.just("reopen")),
    ),
    min_size=1,
    max_size=50,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_st, cap_blocks=st.integers(1, 6))
def test_property_local_store_matches_lru_dict_model(ops, cap_blocks):
    cap = cap_blocks * blob_size(0, 150)
    # model: key -> (value or None if corrupted on disk, blob size), least recent first
    model: OrderedDict = OrderedDict()
    evictions = corrupt = 0
    with tempfile.TemporaryDirectory() as root:
        s = LocalDirStore(root, NS, capacity_bytes=cap)
        try:
            for step, op in enumerate(ops):
                kind = op[0]
                if kind == "put":
                    _, k, n = op
                    value = bytes([step % 256]) * n
                    size = blob_size(k, n)
                    model.pop(k, None)
                    if size > cap:
                        assert s.put(k, value) is False
                        continue
                    while model and sum(sz for _, sz in model.values()) + size > cap:
                        model.popitem(last=False)
                        evictions += 1
                    model[k] = (value, size)
                    assert s.put(k, value) is True
                elif kind == "get":
                    k = op[1]
                    got = s.get(k)
                    if k in model and model[k][0] is not None:
                        assert got == model[k][0]
                        model.move_to_end(k)
                    else:
                        assert got is None
                        if k in model:  # corrupted: detected, removed
                            del model[k]
                            corrupt += 1
                elif kind == "delete":
                    k = op[1]
                    assert s.delete(k) == (k in model)
                    model.pop(k, None)
                elif kind == "corrupt":
                    k = op[1]
                    if k in model and model[k][0] is not None:  # twice would undo the flip
                        p = Path(s.path_for(k))
                        before = p.stat()  # keep the mtime: it is the LRU order on disk
                        data = bytearray(p.read_bytes())
                        data[len(data) // 2] ^= 0x5A
                        p.write_bytes(bytes(data))
                        os.utime(p, ns=(before.st_atime_ns, before.st_mtime_ns))
                        model[k] = (None, model[k][1])
                else:  # reopen: a restart rebuilds the index from disk
                    s.close()
                    s = LocalDirStore(root, NS, capacity_bytes=cap)
                assert s.lru_order() == [storage_name(encode_key(k)) for k in model]
                assert s.used_bytes == sum(sz for _, sz in model.values()) <= cap
            if not any(op[0] == "reopen" for op in ops):
                assert s.stats.evictions == evictions
                assert s.stats.corrupt == corrupt
        finally:
            s.close()


# ------------------------------------------------------------------- reads into buffers


def test_get_many_into_reads_into_caller_buffers(tmp_path):
    spec = preset("llama-3-8b", num_layers=1)
    ns = Namespace.for_model(spec)
    n = spec.bytes_per_block
    blocks = {k: os.urandom(n) for k in (1, -2)}
    with LocalDirStore(tmp_path, ns) as s:
        s.put_many(list(blocks.items()))
        host = np.zeros((3, n), dtype=np.uint8)  # like rows of a pinned host pool
        assert s.get_many_into([1, -2, 3], list(host)) == [True, True, False]
        assert host[0].tobytes() == blocks[1] and host[1].tobytes() == blocks[-2]
        assert not host[2].any()
        assert s.stats.hits == 2 and s.stats.misses == 1 and s.stats.bytes_read == 2 * n
        # corruption: False, counted, file gone
        p = s.path_for(1)
        data = bytearray(p.read_bytes())
        data[-1] ^= 1
        p.write_bytes(bytes(data))
        assert s.get_many_into([1], [bytearray(n)]) == [False]
        assert s.stats.corrupt == 1 and not p.exists()
        with pytest.raises(ValueError, match="block"):
            s.get_many_into([1], [bytearray(n - 1)])
        with pytest.raises(TypeError, match="read-only"):
            s.get_many_into([1], [bytes(n)])
        with pytest.raises(ValueError, match="2 keys but 1 buffers"):
            s.get_many_into([1, 2], [bytearray(n)])


def test_get_many_into_size_mismatch_is_a_plain_miss(store):
    store.put(1, b"12345")
    assert store.get_many_into([1], [bytearray(4)]) == [False]
    assert store.stats.corrupt == 0 and store.contains(1)  # not corrupt: kept
    buf = bytearray(5)
    assert store.get_many_into([1], [buf]) == [True] and buf == b"12345"


def test_real_write_failure_midway_file_size_limit(tmp_path):
    """A real kernel write error mid-blob (RLIMIT_FSIZE -> EFBIG), no mocks: in a child."""
    code = f"""
import os, resource, signal
from kvflow.stores import LocalDirStore, Namespace
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
s = LocalDirStore({str(tmp_path)!r}, Namespace("m", "raw"))
assert s.put(1, b"a" * 50_000)
assert s.put(2, b"b" * 150_000) is False  # the kernel cuts the write at 100 kB
st = s.stats
assert st.put_failed == 1 and st.errors == 1, st
assert "File too large" in s.last_error or "EFBIG" in s.last_error, s.last_error
assert s.get_many([1, 2]) == [b"a" * 50_000, None]
assert not any(p.name.startswith(".tmp-") for p in s.dir.rglob("*"))
assert not s.path_for(2).exists()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
