"""StoreBackend, RoutedBackend, HostCopyBackend and the keyed-bytes executor, op by op.

The end-to-end fault scenarios (a store killed, corrupted, full or slow in the
middle of a replay) are in ``test_storage_faults.py``; this file pins the
contracts they rely on: bytes round-trip, failures are ``done(TransferError)``,
``done`` never comes while a store worker may still touch a host block, and
ordering across backends.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from kernels.host_blocks import CudaHostBlocks
from kvflow.backends import RoutedBackend
from kvflow.errors import ConfigError, TransferError
from kvflow.host_memory import HostArrays, HostMemory
from kvflow.manager import OpKind, TransferOp
from kvflow.radix import Tier
from kvflow.realtime.cpu import HostCopyBackend, KeyedBlockExecutor, block_bytes
from kvflow.store_backend import StoreBackend, StoreMissError, store_key
from kvflow.stores import AsyncStore, MemoryStore, Namespace, StoreDeadlineError, StoreStats

L, LB = 3, 64            # layers, bytes per layer of a block
BPB = L * LB
NS = Namespace("unit", "raw", block_bytes=BPB)


class Sink:
    """Records what a backend reports; ``finished`` resolves at ``done``."""

    def __init__(self) -> None:
        self.layers: list[int] = []
        self.error: BaseException | None = None
        self.calls = 0
        self.finished = asyncio.get_running_loop().create_future()

    def layer_done(self, layer: int) -> None:
        assert not self.finished.done(), "layer reported after done"
        self.layers.append(layer)

    def done(self, error: BaseException | None = None) -> None:
        self.calls += 1
        assert self.calls == 1, "done reported twice"
        self.error = error
        self.finished.set_result(None)


_ids = iter(range(10**9))


def op(kind: OpKind, src: Tier, dst: Tier, src_ids: list[int], dst_ids: list[int],
       keys: list[Any]) -> TransferOp:
    return TransferOp(next(_ids), kind, src, dst, src_ids, dst_ids, keys)


def fill(host: HostArrays, block: int, key: Any) -> None:
    host.block_view(block)[:] = block_bytes(key, L, LB).reshape(-1)


class SlowStore(MemoryStore):
    """A MemoryStore whose calls take ``delay`` seconds; ``running`` counts calls in a worker."""

    def __init__(self, delay: float) -> None:
        super().__init__(NS)
        self.delay = delay
        self.running = 0
        self.ended: list[float] = []
        self._lock = threading.Lock()

    def _slow(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            self.running += 1
        try:
            time.sleep(self.delay)
            return fn(*args)
        finally:
            with self._lock:
                self.running -= 1
            self.ended.append(time.monotonic())

    def get_many_into(self, keys: Any, buffers: Any) -> list[bool]:
        return self._slow(super().get_many_into, keys, buffers)

    def put_many(self, items: Any) -> list[bool]:
        return self._slow(super().put_many, items)


# ---------------------------------------------------------------------------- StoreBackend
@pytest.mark.asyncio
async def test_round_trip_and_already_stored_blocks_cost_no_write() -> None:
    host = HostArrays(8, L, LB)
    store = MemoryStore(NS)
    be = StoreBackend(store, host, L)
    for b, k in enumerate([10, 11, 12]):
        fill(host, b, k)
    s = Sink()
    be.submit(op(OpKind.BACKUP, Tier.HOST, Tier.STORAGE, [0, 1, 2], [0, 1, 2], [10, 11, 12]),
              s, [])
    await s.finished
    assert s.error is None and s.layers == [0, 1, 2]
    assert store.stats.put_ok == 3 and be.stats.blocks_written == 3
    # the same keys again (another manager, an earlier run...): nothing is written
    s = Sink()
    be.submit(op(OpKind.WRITE, Tier.HOST, Tier.STORAGE, [0, 1], [5, 6], [10, 11]), s, [])
    await s.finished
    assert s.error is None
    assert store.stats.put_ok == 3 and be.stats.write_skipped == 2
    # read back into other host blocks: bit-exact
    s = Sink()
    be.submit(op(OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [0, 1, 2], [5, 6, 7],
                 [10, 11, 12]), s, [])
    await s.finished
    assert s.error is None and s.layers == [0, 1, 2]
    for src, dst in ((0, 5), (1, 6), (2, 7)):
        assert np.array_equal(host.block_view(src), host.block_view(dst))
    await be.drain()
    be.close()


@pytest.mark.asyncio
async def test_a_miss_or_a_corrupt_block_fails_the_op() -> None:
    host = HostArrays(4, L, LB)
    store = MemoryStore(NS)
    be = StoreBackend(AsyncStore(store), host, L)
    fill(host, 0, 1)
    fill(host, 1, 2)
    s = Sink()
    be.submit(op(OpKind.BACKUP, Tier.HOST, Tier.STORAGE, [0, 1], [0, 1], [1, 2]), s, [])
    await s.finished
    s = Sink()
    be.submit(op(OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [0, 1], [2, 3], [1, 99]), s, [])
    await s.finished
    assert isinstance(s.error, StoreMissError) and s.layers == []
    assert s.error.missing == s.error.keys == [99]  # gone: the manager may forget it
    blob = bytearray(store.blob_for(2))
    blob[-1] ^= 0xFF
    store.set_blob(2, bytes(blob))
    s = Sink()
    be.submit(op(OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [1], [3], [2]), s, [])
    await s.finished
    assert isinstance(s.error, TransferError)
    assert store.stats.corrupt == 1 and be.stats.read_misses == 2 and be.stats.failed == 2


class DownStore(MemoryStore):
    """Answers every read with misses and counts an error, as a Redis store that is down."""

    def get_many(self, keys: Any) -> list[bytes | None]:
        self._count(StoreStats(errors=1, misses=len(keys)))
        return [None] * len(keys)


@pytest.mark.asyncio
async def test_misses_while_the_store_reports_errors_are_not_losses() -> None:
    host = HostArrays(2, L, LB)
    be = StoreBackend(DownStore(NS), host, L)
    s = Sink()
    be.submit(op(OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [0], [1], [7]), s, [])
    await s.finished
    assert isinstance(s.error, StoreMissError)
    assert s.error.missing == [7] and s.error.keys == []  # down, not lost: keep the entry
    be.close()


@pytest.mark.asyncio
async def test_a_failed_put_fails_the_op_naming_the_cause() -> None:
    host = HostArrays(2, L, LB)
    store = MemoryStore(NS, capacity_bytes=BPB // 2)  # no blob fits
    be = StoreBackend(store, host, L)
    s = Sink()
    be.submit(op(OpKind.WRITE, Tier.HOST, Tier.STORAGE, [0], [0], [5]), s, [])
    await s.finished
    assert isinstance(s.error, TransferError) and be.stats.put_failed == 1
    be.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["read", "write"])
async def test_past_the_deadline_done_waits_for_the_late_call(kind: str) -> None:
    host = HostArrays(2, L, LB)
    store = SlowStore(0.3)
    store.put(7, bytes(BPB))
    be = StoreBackend(AsyncStore(store), host, L, read_timeout_s=0.05, write_timeout_s=0.05,
                      skip_stored=False)
    if kind == "read":
        o = op(OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [0], [1], [7])
    else:
        o = op(OpKind.WRITE, Tier.HOST, Tier.STORAGE, [1], [0], [8])
    s = Sink()
    be.submit(o, s, [])
    await s.finished
    assert isinstance(s.error, StoreDeadlineError)
    # done came only once the worker had let go of the host block
    assert store.running == 0 and store.ended and store.ended[-1] <= time.monotonic()
    assert be.stats.timeouts == 1


class FailingStore(MemoryStore):
    """Raises ``OSError`` (a full disk, a refused connection) from the calls named in ``fail``."""

    def __init__(self, *fail: str) -> None:
        super().__init__(NS)
        self.fail = set(fail)

    def _check(self, call: str) -> None:
        if call in self.fail:
            raise OSError(f"{call}: no space left on device")

    def get_many_into(self, keys: Any, buffers: Any) -> list[bool]:
        self._check("get_many_into")
        return super().get_many_into(keys, buffers)

    def put_many(self, items: Any) -> list[bool]:
        self._check("put_many")
        return super().put_many(items)

    def contains_many(self, keys: Any) -> list[bool]:
        self._check("contains_many")
        return super().contains_many(keys)


@pytest.mark.asyncio
async def test_a_store_error_fails_reads_and_puts_but_a_failed_probe_writes_all() -> None:
    host = HostArrays(2, L, LB)
    fill(host, 0, 5)
    store = FailingStore("get_many_into", "contains_many")
    be = StoreBackend(store, host, L)
    s = Sink()
    be.submit(op(OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [0], [1], [5]), s, [])
    await s.finished
    assert isinstance(s.error, TransferError) and not isinstance(s.error, StoreMissError)
    assert "no space left" in str(s.error) and s.layers == []
    assert (be.stats.errors, be.stats.failed) == (1, 1)
    # the probe failing is no failure: the write goes ahead with every block
    s = Sink()
    be.submit(op(OpKind.WRITE, Tier.HOST, Tier.STORAGE, [0], [0], [5]), s, [])
    await s.finished
    assert s.error is None and s.layers == list(range(L))
    assert MemoryStore.contains_many(store, [5]) == [True]
    assert (be.stats.errors, be.stats.blocks_written, be.stats.write_skipped) == (1, 1, 0)
    # a put failing is: counted once, however the probe went
    store.fail = {"contains_many", "put_many"}
    s = Sink()
    be.submit(op(OpKind.WRITE, Tier.HOST, Tier.STORAGE, [0], [0], [6]), s, [])
    await s.finished
    assert isinstance(s.error, TransferError) and "no space left" in str(s.error)
    assert (be.stats.errors, be.stats.failed, be.stats.blocks_written) == (2, 2, 1)
    be.close()


@pytest.mark.asyncio
async def test_a_closed_store_fails_the_op() -> None:
    host = HostArrays(2, L, LB)
    astore = AsyncStore(MemoryStore(NS))
    astore.close()
    be = StoreBackend(astore, host, L)
    for o in (op(OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [0], [1], [5]),
              op(OpKind.WRITE, Tier.HOST, Tier.STORAGE, [0], [0], [5])):
        s = Sink()
        be.submit(o, s, [])
        await s.finished
        assert isinstance(s.error, TransferError) and "closed" in str(s.error)
    # the write's probe failed too, uncounted; its put counted
    assert (be.stats.errors, be.stats.failed, be.stats.timeouts) == (2, 2, 0)


@pytest.mark.asyncio
async def test_a_probe_past_the_deadline_fails_the_write_once_the_late_call_ends() -> None:
    host = HostArrays(2, L, LB)

    class SlowProbe(SlowStore):
        def contains_many(self, keys: Any) -> list[bool]:
            return self._slow(super().contains_many, keys)

    store = SlowProbe(0.3)
    be = StoreBackend(AsyncStore(store), host, L, write_timeout_s=0.05)
    s = Sink()
    be.submit(op(OpKind.WRITE, Tier.HOST, Tier.STORAGE, [1], [0], [8]), s, [])
    await s.finished
    assert isinstance(s.error, StoreDeadlineError)
    assert store.running == 0 and store.ended  # done waited for the late probe to end
    assert (be.stats.timeouts, be.stats.errors, be.stats.blocks_written) == (1, 0, 0)
    assert MemoryStore.contains_many(store, [8]) == [False]  # no put after the probe timed out
    be.close()


@pytest.mark.asyncio
async def test_cancel_before_start_is_immediate_and_running_ends_with_the_call() -> None:
    host = HostArrays(4, L, LB)
    store = SlowStore(0.2)
    be = StoreBackend(AsyncStore(store, max_workers=1), host, L, skip_stored=False)
    first, second = Sink(), Sink()
    h1 = be.submit(op(OpKind.WRITE, Tier.HOST, Tier.STORAGE, [0], [0], [1]), first, [])
    # writes host block 0 after the write reading it: must wait for it
    h2 = be.submit(op(OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [0], [0], [1]), second, [h1])
    await asyncio.sleep(0.05)
    assert h1.started and not h2.started
    be.cancel(h2)
    await second.finished
    assert isinstance(second.error, TransferError) and not first.finished.done()
    be.cancel(h1)  # its put is running: done only when the call returns
    await asyncio.sleep(0.05)
    assert not first.finished.done()
    await first.finished
    assert isinstance(first.error, TransferError) and store.running == 0
    assert be.stats.cancelled == 2


@pytest.mark.asyncio
async def test_storage_to_device_is_refused_and_layouts_must_agree() -> None:
    host = HostArrays(2, L, LB)
    be = StoreBackend(MemoryStore(NS), host, L)
    with pytest.raises(TransferError, match="host tier"):
        be.submit(op(OpKind.SWAP_IN, Tier.STORAGE, Tier.DEVICE, [0], [0], [1]), Sink(), [])
    with pytest.raises(ConfigError, match="bytes"):
        StoreBackend(MemoryStore(Namespace("unit", "raw", block_bytes=BPB + 16)), host, L)
    be.close()


def test_store_keys() -> None:
    assert store_key(5) == 5 and store_key(b"x") == b"x" and store_key("a") == "a"
    assert store_key(("tenant", 3)) == "t('tenant', 3)"
    with pytest.raises(TypeError):
        store_key(1.5)


# --------------------------------------------------------------------- the CUDA host adapter
class FakePinnedPool:
    """What CudaHostBlocks reads of a CudaBackend: host_kv(layer, role) rows."""

    def __init__(self, blocks: int) -> None:
        self.num_layers, self.num_host_blocks = L, blocks
        self.roles, self.role_bytes = ("k", "v"), (LB // 2, LB // 2)
        self._host = [np.zeros((L, blocks, b), dtype=np.uint8) for b in self.role_bytes]

    def host_kv(self, layer: int, role: str) -> np.ndarray:
        return self._host[self.roles.index(role)][layer]


def test_cuda_host_blocks_use_the_store_byte_order() -> None:
    pool = FakePinnedPool(3)
    hb = CudaHostBlocks(pool)
    assert isinstance(hb, HostMemory) and hb.bytes_per_block == BPB
    data = np.arange(BPB, dtype=np.uint8)
    hb.scatter(2, data)
    assert np.array_equal(pool.host_kv(1, "v")[2], data[LB + LB // 2: 2 * LB])
    out = np.empty(BPB, dtype=np.uint8)
    hb.gather(2, out)
    assert np.array_equal(out, data) and hb.block_view(2) is None


@pytest.mark.asyncio
async def test_store_backend_stages_through_a_non_contiguous_host() -> None:
    pool = FakePinnedPool(4)
    hb = CudaHostBlocks(pool)
    be = StoreBackend(MemoryStore(NS), hb, L)
    data = block_bytes("k", L, LB).reshape(-1)
    hb.scatter(0, data)
    for o in (op(OpKind.BACKUP, Tier.HOST, Tier.STORAGE, [0], [0], ["k"]),
              op(OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [0], [3], ["k"])):
        s = Sink()
        be.submit(o, s, [])
        await s.finished
        assert s.error is None
    out = np.empty(BPB, dtype=np.uint8)
    hb.gather(3, out)
    assert np.array_equal(out, data)
    be.close()


# ------------------------------------------------------------------- Routed + HostCopy
@pytest.mark.asyncio
async def test_routed_backend_orders_across_backends_and_copies_are_layerwise() -> None:
    host = HostArrays(4, L, LB)
    store = SlowStore(0.1)
    store.put(42, block_bytes(42, L, LB).reshape(-1))
    copies = HostCopyBackend(host, 4)
    storage = StoreBackend(AsyncStore(store), host, L)
    be = RoutedBackend({(Tier.HOST, Tier.DEVICE): copies, (Tier.DEVICE, Tier.HOST): copies,
                        (Tier.STORAGE, Tier.HOST): storage, (Tier.HOST, Tier.STORAGE): storage})
    assert be.num_layers == L
    pre, swap, back = Sink(), Sink(), Sink()
    hp = be.submit(op(OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [0], [2], [42]), pre, [])
    hs = be.submit(op(OpKind.SWAP_IN, Tier.HOST, Tier.DEVICE, [2], [1], [42]), swap, [hp])
    # same backend, layer by layer behind the swap-in: device 1 -> host 3
    be.submit(op(OpKind.BACKUP, Tier.DEVICE, Tier.HOST, [1], [3], [42]), back, [hs])
    await asyncio.sleep(0.03)
    assert hs.inner is None and not swap.layers  # waits for the store read, off the backend
    await asyncio.gather(pre.finished, swap.finished, back.finished)
    assert pre.error is swap.error is back.error is None
    assert swap.layers == back.layers == [0, 1, 2]
    want = block_bytes(42, L, LB)
    assert np.array_equal(copies.device[:, 1], want)
    assert np.array_equal(host.array[3], want)
    with pytest.raises(TransferError, match="no backend moves"):
        be.submit(op(OpKind.SWAP_IN, Tier.STORAGE, Tier.DEVICE, [0], [0], [1]), Sink(), [])


@pytest.mark.asyncio
async def test_routed_cancel_of_a_waiting_op_never_starts_it() -> None:
    host = HostArrays(4, L, LB)
    store = SlowStore(0.1)
    store.put(1, bytes(BPB))
    copies = HostCopyBackend(host, 4)
    storage = StoreBackend(store, host, L)
    be = RoutedBackend({(Tier.HOST, Tier.DEVICE): copies, (Tier.STORAGE, Tier.HOST): storage})
    pre, swap = Sink(), Sink()
    hp = be.submit(op(OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [0], [0], [1]), pre, [])
    hs = be.submit(op(OpKind.SWAP_IN, Tier.HOST, Tier.DEVICE, [0], [0], [1]), swap, [hp])
    be.cancel(hs)
    await swap.finished
    assert isinstance(swap.error, TransferError) and not pre.finished.done()
    await pre.finished
    assert pre.error is None and hs.inner is None and copies.inflight == 0
    storage.close()


@pytest.mark.asyncio
async def test_host_copy_backend_rejects_bad_ids_on_the_loop() -> None:
    host = HostArrays(2, L, LB)
    copies = HostCopyBackend(host, 2)
    s = Sink()
    copies.submit(op(OpKind.SWAP_IN, Tier.HOST, Tier.DEVICE, [0], [5], [1]), s, [])
    assert not s.finished.done()  # never inside submit
    await s.finished
    assert "out of range" in str(s.error)


@pytest.mark.asyncio
async def test_after_holds_only_the_backends_own_handles_and_finished_ones_are_skipped() -> None:
    host = HostArrays(4, L, LB)
    copies = HostCopyBackend(host, 4)
    storage = StoreBackend(MemoryStore(NS), host, L)
    fill(host, 0, 3)
    w, c = Sink(), Sink()
    hw = storage.submit(op(OpKind.WRITE, Tier.HOST, Tier.STORAGE, [0], [0], [3]), w, [])
    hc = copies.submit(op(OpKind.SWAP_IN, Tier.HOST, Tier.DEVICE, [0], [0], [3]), c, [])
    await asyncio.gather(w.finished, c.finished)
    backup = op(OpKind.BACKUP, Tier.DEVICE, Tier.HOST, [0], [1], [3])
    prefetch = op(OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [0], [2], [3])
    cases: list[tuple[Any, str, Any, Any, TransferOp]] = [
        (copies, "HostCopyBackend", hc, hw, backup),
        (storage, "StoreBackend", hw, hc, prefetch),
    ]
    for be, name, own, other, o in cases:
        with pytest.raises(TypeError) as info:
            be.submit(o, Sink(), [other])
        assert str(info.value) == (
            f"op {o.op_id}: 'after' holds {other!r}, not a {name} handle "
            "(route mixed backends through RoutedBackend)")
        # its own finished handle is no reason to wait
        s = Sink()
        be.submit(o, s, [own])
        await s.finished
        assert s.error is None and s.layers == [0, 1, 2]
    assert np.array_equal(host.array[1], host.array[0])
    assert np.array_equal(host.array[2], host.array[0])
    storage.close()


# -------------------------------------------------------------------------- the executor
class _Plan:
    def __init__(self, keys: list[int], device_ids: list[int], cached: int) -> None:
        self.keys = tuple(keys)
        self.device_ids = device_ids
        self.source_tiers = [0] * cached
        self.nodes: list[Any] = []
        self.computing: list[Any] = []

    @property
    def num_cached(self) -> int:
        return len(self.source_tiers)


class _Req:
    def __init__(self, rid: int, keys: list[int]) -> None:
        self.request_id, self.keys = rid, tuple(keys)


class _St:
    def __init__(self, rid: int, plan: _Plan) -> None:
        self.req, self.plan = _Req(rid, list(plan.keys)), plan


@pytest.mark.asyncio
async def test_executor_writes_new_blocks_and_catches_a_wrong_byte() -> None:
    from kvflow.engine import StepBatch

    host = HostArrays(2, L, LB)
    copies = HostCopyBackend(host, 8)
    ex = KeyedBlockExecutor(copies.device_layer, L, LB, block_tokens=4)
    # request 0 computes 3 blocks (12 tokens) into device blocks 5, 6, 7
    st = _St(0, _Plan([100, 101, 102], [5, 6, 7], cached=0))
    await ex.run_step(StepBatch(prefill=[(12, 0)], requests=[st]), [])
    assert ex.stats.blocks_written == 3 and ex.stats.corrupt_reads == 0
    # request 1 has the first two cached (blocks 5, 6) and computes the third into 2
    st1 = _St(1, _Plan([100, 101, 103], [5, 6, 2], cached=2))
    await ex.run_step(StepBatch(prefill=[(4, 8)], requests=[st1]), [])
    assert ex.stats.blocks_verified == 2 and ex.stats.corrupt_reads == 0
    copies.device[1, 6, 3] ^= 1  # one flipped byte in layer 1 of a cached block
    await ex.run_step(StepBatch(decode=[13], requests=[st1]), [])
    assert ex.stats.corrupt_reads == 1 and ex.stats.examples[0][1:] == (1, 101, 1)
    with pytest.raises(ConfigError, match=r"StepBatch\.requests"):
        await ex.run_step(StepBatch(prefill=[(4, 0)]), [])
