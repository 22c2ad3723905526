"""Block store basics shared by every store: keys, namespaces, the blob format, MemoryStore."""

import os
import subprocess
import sys

import numpy as np
import pytest

from kvflow.layout import preset
from kvflow.stores import (
    BlockSizeError,
    MemoryStore,
    MissingDependencyError,
    Namespace,
    StoreClosedError,
    decode_blob,
    encode_blob,
    encode_key,
    layout_signature,
)
from kvflow.stores.base import HEADER_SIZE, MAX_PLAIN_KEY, storage_name

NS = Namespace("test-model", "raw")


# ------------------------------------------------------------------------------ keys


def test_key_encoding_is_stable_and_typed():
    assert encode_key(0) == "i0"
    assert encode_key(-42) == "i-42"
    assert encode_key(2**70) == f"i{2**70}"
    assert encode_key(b"\x01\xff") == "h01ff"
    assert encode_key(bytearray(b"\x01\xff")) == "h01ff"
    assert encode_key("ab") == "s6162"
    # the three key spaces never collide
    assert len({encode_key(1), encode_key(b"\x01"), encode_key("1")}) == 3


@pytest.mark.parametrize("bad", [True, 1.5, None, (1, 2)])
def test_unsupported_key_types_raise_a_clear_error(bad):
    with pytest.raises(TypeError, match="block keys must be int, bytes or str"):
        encode_key(bad)


def test_long_keys_get_a_digest_name():
    enc = encode_key(b"\xab" * 200)
    name = storage_name(enc)
    assert len(name) <= MAX_PLAIN_KEY and name.startswith("z")
    assert storage_name(encode_key(b"\xab" * 200)) == name
    assert storage_name(encode_key(b"\xab" * 201)) != name
    assert storage_name(encode_key(-5)) == "i-5"


# ------------------------------------------------------------------------ namespaces


def test_namespace_from_model_covers_layout_and_salt():
    spec = preset("llama-3-8b")
    ns = Namespace.for_model(spec)
    assert ns.block_bytes == spec.bytes_per_block
    assert "llama-3-8b" in ns.layout and f"bpb={spec.bytes_per_block}" in ns.layout
    assert ns.name.startswith("llama-3-8b-")
    others = [
        Namespace.for_model(spec, "tenant-a"),
        Namespace.for_model(spec, b"tenant-b"),
        Namespace.for_model(spec.replace(dtype="fp8")),
        Namespace.for_model(spec.replace(block_tokens=32)),
        Namespace.for_model(spec.replace(name="llama-3-8b-ft")),
        Namespace.for_model(preset("qwen2.5-7b")),
    ]
    names = {ns.name, *(o.name for o in others)}
    assert len(names) == 7
    # str and bytes salts mean the same tenant; the name is deterministic
    assert Namespace.for_model(spec, "t").name == Namespace.for_model(spec, b"t").name
    assert Namespace.for_model(spec, "t") == Namespace.for_model(spec, b"t")


def test_namespace_name_is_path_and_key_safe():
    ns = Namespace("org/model name:v1 ☃", "x")
    assert all(c.isalnum() or c in "._-" for c in ns.name)
    assert "/" not in ns.name and ":" not in ns.name


def test_layout_signature_names_roles():
    sig = layout_signature(preset("deepseek-v3.2"))
    assert "attn=mla" in sig and "latent:" in sig and "indexer:" in sig and "dtype=fp8" in sig


# ----------------------------------------------------------------------------- blobs


def test_blob_round_trip_and_every_single_byte_flip_is_caught():
    payload = os.urandom(64)
    blob = encode_blob("L", "i7", payload)
    assert blob.startswith(b"KVFB")
    assert len(blob) == HEADER_SIZE + len("L") + len("i7") + 64
    assert decode_blob(blob, "L", "i7") == payload
    assert decode_blob(blob, "L", "i7", block_bytes=64) == payload
    for pos in range(len(blob)):
        bad = bytearray(blob)
        bad[pos] ^= 0x40
        assert decode_blob(bytes(bad), "L", "i7") is None, f"flip at byte {pos} not caught"


def test_blob_mismatches_are_rejected():
    payload = b"x" * 32
    blob = encode_blob("L", "i7", payload)
    assert decode_blob(blob, "L2", "i7") is None  # another layout
    assert decode_blob(blob, "L", "i8") is None  # another key's blob
    assert decode_blob(blob, "L", "i7", block_bytes=33) is None  # wrong block size
    assert decode_blob(blob[:-1], "L", "i7") is None  # truncated
    assert decode_blob(blob + b"\0", "L", "i7") is None  # trailing garbage
    assert decode_blob(blob[:10], "L", "i7") is None  # shorter than a header
    assert decode_blob(b"", "L", "i7") is None
    future = bytearray(blob)
    future[4] = 2  # format version 2
    assert decode_blob(bytes(future), "L", "i7") is None


def test_empty_payload_round_trips():
    assert decode_blob(encode_blob("L", "i1", b""), "L", "i1") == b""


# ------------------------------------------------------------------------ MemoryStore


def test_memory_store_round_trip_and_stats():
    s = MemoryStore(NS)
    items = [(-1, b"a" * 10), (2**40, b"b" * 20), (b"\x00" * 32, b"")]
    assert s.put_many(items) == [True, True, True]
    got = s.get_many([k for k, _ in items] + [99])
    assert got == [v for _, v in items] + [None]
    st = s.stats
    assert (st.hits, st.misses, st.put_ok, st.bytes_read, st.bytes_written) == (3, 1, 3, 30, 30)
    assert s.contains_many([-1, 99]) == [True, False]
    assert s.delete(-1) and not s.delete(-1)


def test_memory_store_corruption_is_a_counted_miss():
    s = MemoryStore(NS)
    s.put(5, b"hello world")
    blob = bytearray(s.blob_for(5))
    blob[-1] ^= 1
    s.set_blob(5, bytes(blob))
    assert s.get(5) is None
    assert s.stats.corrupt == 1 and s.stats.misses == 1
    assert not s.contains(5)  # the bad entry was deleted


def test_memory_store_lru_capacity():
    blob_size = len(encode_blob(NS.layout, "i0", b"x" * 100))
    s = MemoryStore(NS, capacity_bytes=3 * blob_size)
    s.put_many([(i, b"x" * 100) for i in range(3)])
    assert s.get(0) is not None  # 0 becomes most recent
    s.put(3, b"x" * 100)
    assert s.contains_many([0, 1, 2, 3]) == [True, False, True, True]
    assert s.stats.evictions == 1
    assert s.put(9, b"x" * (4 * blob_size)) is False  # larger than the store
    assert s.stats.put_failed == 1 and len(s) == 3


def test_block_size_is_enforced_and_a_bad_batch_writes_nothing():
    spec = preset("llama-3-8b", num_layers=1)
    s = MemoryStore(Namespace.for_model(spec))
    good = bytes(spec.bytes_per_block)
    with pytest.raises(BlockSizeError, match="holds blocks of"):
        s.put_many([(1, good), (2, good[:-1])])
    assert s.contains_many([1, 2]) == [False, False]


def test_numpy_payloads_are_stored_as_raw_bytes():
    s = MemoryStore(NS)
    arr = np.arange(16, dtype=np.float32).reshape(4, 4)
    assert s.put(1, arr)
    assert s.get(1) == arr.tobytes()
    with pytest.raises(TypeError, match="bytes-like"):
        s.put(2, [1, 2, 3])  # type: ignore[arg-type]


def test_closed_store_refuses_calls():
    s = MemoryStore(NS)
    s.close()
    with pytest.raises(StoreClosedError):
        s.get(1)


def test_core_stores_import_neither_simpy_cupy_nor_redis():
    code = (
        "import sys, kvflow.stores, kvflow.stores.redis_store, kvflow.stores.redis_server;"
        "bad=[m for m in ('simpy','cupy','redis') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_redis_store_without_redis_package_says_which_extra(monkeypatch):
    from kvflow.stores import RedisStore

    monkeypatch.setitem(sys.modules, "redis", None)  # import redis -> ImportError
    with pytest.raises(MissingDependencyError, match=r"kvflow\[redis\]"):
        RedisStore(NS, "redis://127.0.0.1:1/0")


def test_default_get_many_into_copies_into_buffers():
    s = MemoryStore(NS)
    s.put_many([(1, b"abc"), (2, b"defg")])
    bufs = [bytearray(3), bytearray(3), bytearray(3)]
    assert s.get_many_into([1, 2, 3], bufs) == [True, False, False]  # 2: wrong size
    assert bufs[0] == b"abc"
