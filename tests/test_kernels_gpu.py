"""GPU tests of the swap kernels and ``CudaBackend`` (skipped without CuPy or a GPU).

Random bytes everywhere (never zeros: they hide unwritten blocks), destinations
poisoned first, every cache role and dtype, ids mixing runs and singletons.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from kernels import gpu_unavailable_reason
from kernels.dma import batch_memcpy_unavailable_reason
from kvflow.errors import InvalidBlockId, TransferError
from kvflow.layout import ModelSpec
from kvflow.manager import OpKind, TransferOp
from kvflow.radix import Tier
from kvflow.world import new_loop

_REASON = gpu_unavailable_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_REASON is not None, reason=f"needs a CUDA GPU and CuPy: {_REASON}"),
]

if _REASON is None:
    import cupy as cp

    from kernels.backend import CudaBackend, FutureSink
    from kernels.testing import spin

SPECS = {
    "mha-bf16": ModelSpec("mha-bf16", num_layers=3, num_kv_heads=2, head_dim=64),
    "mha-fp16-128k": ModelSpec("mha-fp16-128k", num_layers=2, num_kv_heads=8, head_dim=128,
                               dtype="fp16", block_tokens=64),
    "mha-fp32": ModelSpec("mha-fp32", num_layers=2, num_kv_heads=1, head_dim=40, dtype="fp32"),
    "mha-fp8": ModelSpec("mha-fp8", num_layers=3, num_kv_heads=2, head_dim=64, dtype="fp8"),
    "mla-bf16": ModelSpec("mla-bf16", num_layers=2, num_kv_heads=1, head_dim=80, attention="mla",
                          kv_lora_rank=64, qk_rope_head_dim=16),
    "mla-fp8-dsa": ModelSpec("mla-fp8-dsa", num_layers=2, num_kv_heads=1, head_dim=80,
                             attention="mla", kv_lora_rank=64, qk_rope_head_dim=16,
                             indexer_head_dim=32, dtype="fp8"),
}
_op_ids = iter(range(1 << 30))


def run(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run under uvloop where installed (the real world's loop), else asyncio's."""
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(coro_fn())


def op(kind: OpKind, src: list[int], dst: list[int]) -> TransferOp:
    tiers = (Tier.HOST, Tier.DEVICE) if kind == OpKind.SWAP_IN else (Tier.DEVICE, Tier.HOST)
    return TransferOp(next(_op_ids), kind, tiers[0], tiers[1], list(src), list(dst), keys=[])


def mixed_ids(rng: np.random.Generator, n: int, src_cap: int, dst_cap: int):
    """``n`` pairs made of runs (consecutive on both sides) and singletons, shuffled."""
    lengths: list[int] = []
    while sum(lengths) < n:
        lengths.append(int(min(n - sum(lengths), rng.choice([1, 1, 1, 2, 5, 12, 40]))))

    def place(cap: int) -> list[np.ndarray]:
        # segments of the given lengths at random, non-overlapping, shuffled places
        slack = cap - n
        cuts = np.sort(rng.integers(0, slack + 1, size=len(lengths)))
        order = rng.permutation(len(lengths))
        starts, pos = {}, 0
        for k, i in enumerate(order):
            starts[i] = pos + cuts[k]
            pos += lengths[i]
        return [np.arange(starts[i], starts[i] + lengths[i]) for i in range(len(lengths))]

    src, dst = place(src_cap), place(dst_cap)
    perm = rng.permutation(len(lengths))
    return (np.concatenate([src[i] for i in perm]).tolist(),
            np.concatenate([dst[i] for i in perm]).tolist())


def fill_random(backend: CudaBackend, rng: np.random.Generator) -> None:
    for layer in range(backend.num_layers):
        for role in backend.roles:
            h = backend.host_kv(layer, role)
            h[...] = rng.integers(0, 256, size=h.shape, dtype=np.uint8)
            d = backend.device_kv(layer, role)
            d[...] = cp.random.randint(0, 256, size=d.shape, dtype=np.uint8)
    cp.cuda.Device().synchronize()


def snapshot_device(backend: CudaBackend) -> list[np.ndarray]:
    return [cp.asnumpy(backend.device_kv(layer, role))
            for layer in range(backend.num_layers) for role in backend.roles]


# ---------------------------------------------------------------- round trips
#: How an op moves: (min_run_bytes, dma) -- every id to the kernel; runs to one memcpy each,
#: the rest to the kernel; everything as batched copy-engine memcpys (runs as one piece).
PATHS = {"kernel-only": (0, "never"), "runs-to-copy-engine": (1, "never"),
         "batched-copy-engine": (0, "always")}
needs_dma = pytest.mark.skipif(
    _REASON is None and batch_memcpy_unavailable_reason() is not None,
    reason=f"batched memcpy unavailable: {batch_memcpy_unavailable_reason()}")


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(SPECS))
def test_round_trip_bit_exact(name: str, path: str) -> None:
    if PATHS[path][1] == "always" and batch_memcpy_unavailable_reason() is not None:
        pytest.skip(f"batched memcpy unavailable: {batch_memcpy_unavailable_reason()}")
    spec = SPECS[name]
    min_run_bytes, dma = PATHS[path]
    rng = np.random.default_rng(zlib.crc32(name.encode()) + min_run_bytes)
    nd, nh, n = 96, 200, 80
    backend = CudaBackend(spec, nd, nh, load_ctas=4, store_ctas=4, min_run_bytes=min_run_bytes,
                          dma=dma)
    assert backend.use_dma == (dma == "always")
    fill_random(backend, rng)
    host_src, dev = mixed_ids(rng, n, nh, nd)
    free_host = sorted(set(range(nh)) - set(host_src))
    host_dst = rng.permutation(free_host)[:n].tolist()
    for layer in range(spec.num_layers):  # poison what must be overwritten
        for role in backend.roles:
            backend.device_kv(layer, role)[dev] = 0xCD
            backend.host_kv(layer, role)[host_dst] = 0xAB

    async def main() -> tuple[FutureSink, FutureSink]:
        s_in, s_out = FutureSink(spec.num_layers), FutureSink(spec.num_layers)
        t_in = backend.submit(op(OpKind.SWAP_IN, host_src, dev), s_in, ())
        backend.submit(op(OpKind.EVICT, dev, host_dst), s_out, (t_in,))
        await asyncio.gather(s_in.wait(), s_out.wait())
        return s_in, s_out

    s_in, s_out = run(main)
    assert s_in.reported == list(range(spec.num_layers)) == s_out.reported
    for layer in range(spec.num_layers):
        for role in backend.roles:
            h = backend.host_kv(layer, role)
            d = cp.asnumpy(backend.device_kv(layer, role))
            np.testing.assert_array_equal(d[dev], h[host_src], err_msg=f"{layer}/{role} h2d")
            np.testing.assert_array_equal(h[host_dst], h[host_src], err_msg=f"{layer}/{role} d2h")


@pytest.mark.parametrize("per_launch", [2, 5])
def test_layer_groups_report_every_layer_in_order(per_launch: int) -> None:
    """``layers_per_launch`` > 1: fewer launches, still one report and one event per layer."""
    spec = SPECS["mha-fp8"].replace(num_layers=5)
    rng = np.random.default_rng(per_launch)
    backend = CudaBackend(spec, 64, 64, layers_per_launch=per_launch, min_run_bytes=1)
    fill_random(backend, rng)
    host_src, dev = mixed_ids(rng, 40, 64, 64)

    async def main() -> FutureSink:
        sink = FutureSink(spec.num_layers)
        backend.submit(op(OpKind.SWAP_IN, host_src, dev), sink, ())
        await sink.wait()
        return sink

    assert run(main).reported == list(range(spec.num_layers))
    for layer in range(spec.num_layers):
        for role in backend.roles:
            d = cp.asnumpy(backend.device_kv(layer, role))
            np.testing.assert_array_equal(d[dev], backend.host_kv(layer, role)[host_src])


def test_staging_overflow_falls_back_and_stays_exact() -> None:
    spec = SPECS["mha-bf16"]
    rng = np.random.default_rng(9)
    backend = CudaBackend(spec, 64, 64, staging_bytes=256)  # room for 32 pairs at a time
    fill_random(backend, rng)
    keeps, pairs = [], []
    with pytest.warns(RuntimeWarning, match="staging buffer is full"):
        for _ in range(3):
            host_src, dev = mixed_ids(rng, 30, 64, 64)
            keeps.append(backend.h2d.copy(host_src, dev, backend.load_stream))
            pairs.append((host_src, dev))
            backend.synchronize()
            for layer in range(spec.num_layers):
                d = cp.asnumpy(backend.device_kv(layer, "v"))
                np.testing.assert_array_equal(d[dev], backend.host_kv(layer, "v")[host_src])


@pytest.mark.parametrize("ctas", [1, 2, 16])
def test_all_layer_launch_bit_exact(ctas: int) -> None:
    """The one-launch path over all layers (used by benchmarks and bulk moves)."""
    spec = SPECS["mha-fp8"]
    rng = np.random.default_rng(ctas)
    backend = CudaBackend(spec, 64, 128, min_run_bytes=1)
    fill_random(backend, rng)
    host_src, dev = mixed_ids(rng, 60, 128, 64)
    before = snapshot_device(backend)
    keep = backend.h2d.copy(host_src, dev, backend.load_stream, ctas=ctas)
    backend.synchronize()
    del keep
    untouched = sorted(set(range(64)) - set(dev))
    k = 0
    for layer in range(spec.num_layers):
        for role in backend.roles:
            d = cp.asnumpy(backend.device_kv(layer, role))
            np.testing.assert_array_equal(d[dev], backend.host_kv(layer, role)[host_src])
            np.testing.assert_array_equal(d[untouched], before[k][untouched])
            k += 1


@pytest.mark.asyncio
async def test_runs_on_default_asyncio_loop() -> None:
    spec = SPECS["mla-bf16"]
    backend = CudaBackend(spec, 16, 16)
    fill_random(backend, np.random.default_rng(3))
    sink = FutureSink(spec.num_layers)
    backend.submit(op(OpKind.SWAP_IN, [5, 1, 9], [0, 15, 7]), sink, ())
    assert await sink.layers[0] == 0
    await sink.wait()
    d = cp.asnumpy(backend.device_kv(1, "latent"))
    np.testing.assert_array_equal(d[[0, 15, 7]], backend.host_kv(1, "latent")[[5, 1, 9]])


# ---------------------------------------------------------------- ordering
@pytest.mark.parametrize("dma", ["never", pytest.param("always", marks=needs_dma)])
def test_compute_stream_waits_for_each_layer_on_the_gpu(dma: str) -> None:
    """A kernel on the compute stream after ``wait_layer`` reads loaded bytes, never poison."""
    spec = SPECS["mha-bf16"]
    rng = np.random.default_rng(7)
    backend = CudaBackend(spec, 64, 64, dma=dma)
    fill_random(backend, rng)
    host_src, dev = mixed_ids(rng, 48, 64, 64)
    for layer in range(spec.num_layers):
        backend.device_kv(layer, "k")[dev] = 0xCD
    dev_idx = cp.asarray(dev)  # on the GPU already: indexing must not copy (and block) later
    cp.cuda.Device().synchronize()
    compute = cp.cuda.Stream(non_blocking=True)
    control = cp.cuda.Stream(non_blocking=True)

    async def warm_up() -> None:  # steady state: kernels compiled, pinned pool primed
        sink = FutureSink(spec.num_layers)
        backend.submit(op(OpKind.SWAP_IN, host_src, dev), sink, ())
        await sink.wait()
        with compute:
            backend.device_kv(0, "k")[dev_idx]
        spin(backend.load_stream, 1e-6)
        backend.synchronize()
        compute.synchronize()
        for layer in range(spec.num_layers):
            backend.device_kv(layer, "k")[dev] = 0xCD
        cp.cuda.Device().synchronize()

    run(warm_up)

    async def main() -> tuple[list, list, bool]:
        sink = FutureSink(spec.num_layers)
        spin(backend.load_stream, 1.0)  # the load cannot start for a second
        held = cp.cuda.Event()
        held.record(backend.load_stream)  # done once the hold is over
        task = backend.submit(op(OpKind.SWAP_IN, host_src, dev), sink, ())
        seen, stale = [], []
        with control:  # no wait: must see the poison (proves the test can fail)
            stale.append(backend.device_kv(0, "k")[dev_idx])
        for layer in range(spec.num_layers):
            backend.wait_layer(compute, task, layer)
            with compute:
                seen.append(backend.device_kv(layer, "k")[dev_idx])
        # The behaviour, not a stopwatch: the CPU got through submit and every
        # wait_layer while the load was still held back on the GPU.
        ahead = not held.done
        await sink.wait()
        return seen, stale, ahead

    seen, stale, ahead = run(main)
    compute.synchronize()
    control.synchronize()
    assert ahead, "submit + wait_layer returned only after the held-back load: the CPU blocked"
    assert (cp.asnumpy(stale[0]) == 0xCD).all()
    for layer, got in enumerate(seen):
        np.testing.assert_array_equal(cp.asnumpy(got), backend.host_kv(layer, "k")[host_src])


@pytest.mark.parametrize("dma", ["never", pytest.param("always", marks=needs_dma)])
def test_many_concurrent_tasks_both_directions(dma: str) -> None:
    """Evict-then-reuse chains across the two streams, plus independent loads and stores."""
    spec = SPECS["mha-fp8"]
    rng = np.random.default_rng(11)
    nd, nh, k, per = 384, 512, 16, 8
    backend = CudaBackend(spec, nd, nh, load_ctas=2, store_ctas=2, dma=dma)
    fill_random(backend, rng)
    dev_perm = rng.permutation(nd).tolist()
    host_perm = rng.permutation(nh).tolist()
    reused = [dev_perm[i * per:(i + 1) * per] for i in range(k)]           # evicted, then loaded
    independent = [dev_perm[(k + i) * per:(k + i + 1) * per] for i in range(k)]
    h_out = [host_perm[i * per:(i + 1) * per] for i in range(k)]
    h_in = [host_perm[(k + i) * per:(k + i + 1) * per] for i in range(k)]
    h_out2 = [host_perm[(2 * k + i) * per:(2 * k + i + 1) * per] for i in range(k)]
    h_in2 = [host_perm[(3 * k + i) * per:(3 * k + i + 1) * per] for i in range(k)]
    dev0 = snapshot_device(backend)
    host0 = {(layer, r): backend.host_kv(layer, r).copy()
             for layer in range(spec.num_layers) for r in backend.roles}

    async def main() -> list[FutureSink]:
        sinks = []
        spin(backend.store_stream, 0.03)  # evictions lag: a missing wait would lose their data
        for i in range(k):
            s_evict, s_load = FutureSink(spec.num_layers), FutureSink(spec.num_layers)
            ev = backend.submit(op(OpKind.EVICT, reused[i], h_out[i]), s_evict, ())
            backend.submit(op(OpKind.SWAP_IN, h_in[i], reused[i]), s_load, (ev,))
            s_a, s_b = FutureSink(spec.num_layers), FutureSink(spec.num_layers)
            backend.submit(op(OpKind.BACKUP, independent[i], h_out2[i]), s_a, ())
            free_dev = dev_perm[2 * k * per:][i * per // 2:(i + 1) * per // 2]
            backend.submit(op(OpKind.SWAP_IN, h_in2[i][: len(free_dev)], free_dev), s_b, ())
            sinks += [s_evict, s_load, s_a, s_b]
        await asyncio.gather(*(s.wait() for s in sinks))
        return sinks

    sinks = run(main)
    assert all(s.reported == list(range(spec.num_layers)) for s in sinks)
    k_ = 0
    for layer in range(spec.num_layers):
        for role in backend.roles:
            h = backend.host_kv(layer, role)
            d = cp.asnumpy(backend.device_kv(layer, role))
            for i in range(k):
                np.testing.assert_array_equal(h[h_out[i]], dev0[k_][reused[i]])
                np.testing.assert_array_equal(d[reused[i]], host0[layer, role][h_in[i]])
                np.testing.assert_array_equal(h[h_out2[i]], dev0[k_][independent[i]])
                free_dev = dev_perm[2 * k * per:][i * per // 2:(i + 1) * per // 2]
                np.testing.assert_array_equal(
                    d[free_dev], host0[layer, role][h_in2[i][: len(free_dev)]])
            k_ += 1


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        ([0, 1, 2], [3, 64, 5], "device block id 64 at position 1"),
        ([0, 1, 99], [3, 4, 5], "host block id 99 at position 2"),
        ([0, 1, 2], [7, 8, 7], "duplicate device block id 7"),
        ([0, -1], [1, 2], "host block id -1"),
    ],
)
@pytest.mark.parametrize("dma", ["never", pytest.param("always", marks=needs_dma)])
def test_invalid_ids_rejected_destination_untouched(src: list, dst: list, match: str,
                                                    dma: str) -> None:
    spec = SPECS["mha-fp8"]
    backend = CudaBackend(spec, 64, 64, min_run_bytes=1, dma=dma)
    fill_random(backend, np.random.default_rng(5))
    before = snapshot_device(backend)
    with pytest.raises(InvalidBlockId, match=match):
        backend.h2d.copy(src, dst, backend.load_stream)

    async def main() -> tuple[FutureSink, object]:
        sink = FutureSink(spec.num_layers)
        task = backend.submit(op(OpKind.SWAP_IN, src, dst), sink, ())
        with pytest.raises(TransferError, match="failed before it started"):
            backend.wait_layer(cp.cuda.Stream(non_blocking=True), task, 0)
        with pytest.raises(InvalidBlockId, match=match):
            await sink.wait()
        return sink, task

    sink, _ = run(main)
    assert sink.reported == []
    backend.synchronize()
    for got, want in zip(snapshot_device(backend), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_storage_ops_are_refused() -> None:
    backend = CudaBackend(SPECS["mha-bf16"], 8, 8)
    bad = TransferOp(0, OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [0], [0], keys=[])

    async def main() -> None:
        with pytest.raises(TransferError, match="storage transfers need a storage backend"):
            backend.submit(bad, FutureSink(backend.num_layers), ())

    run(main)


def test_cancel_reports_error_after_the_gpu_is_done() -> None:
    spec = SPECS["mha-bf16"]
    backend = CudaBackend(spec, 16, 16)

    async def main() -> FutureSink:
        sink = FutureSink(spec.num_layers)
        spin(backend.load_stream, 0.03)
        task = backend.submit(op(OpKind.SWAP_IN, [1, 2], [3, 4]), sink, ())
        backend.cancel(task)
        with pytest.raises(TransferError, match="cancelled"):
            await sink.wait()
        assert backend.layer_event(task, 0) is None  # finished: the GPU is past it
        return sink

    assert run(main).reported == []


def test_copy_path_chosen_by_piece_size() -> None:
    """``auto``: the copy engine for large pieces only; a tiny role keeps the op on the kernel."""
    if batch_memcpy_unavailable_reason() is not None:
        pytest.skip(f"batched memcpy unavailable: {batch_memcpy_unavailable_reason()}")
    big = ModelSpec("big", num_layers=2, num_kv_heads=8, head_dim=128, block_tokens=64)
    assert CudaBackend(big, 4, 4, dma_min_bytes=big.layout.roles[0].bytes_per_block).use_dma
    assert not CudaBackend(big, 4, 4, dma_min_bytes=1 << 30).use_dma
    assert not CudaBackend(big, 4, 4, dma="never", dma_min_bytes=1).use_dma
    assert not CudaBackend(SPECS["mla-fp8-dsa"], 4, 4, dma_min_bytes=1024).use_dma
    with pytest.raises(ValueError, match="dma must be one of"):
        CudaBackend(big, 4, 4, dma="sometimes")


def test_no_cuda_object_dies_on_the_driver_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host callbacks name tasks by key: a task (and its timing event) whose last
    reference went with a callback's argument was destroyed on CUDA's driver thread,
    where ``cudaEventDestroy`` fails (``cudaErrorNotPermitted``, printed, leaked)."""
    import gc
    import sys

    seen: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    # Reference counting is what is tested: a cyclic collection that happens to start
    # in a driver thread (``LoopThreadGC``'s concern) would fail it at random.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    spec = SPECS["mha-bf16"]
    backend = CudaBackend(spec, 16, 16)
    backend.record_starts = True

    async def main() -> None:
        sinks = []
        for i in range(32):
            sink = FutureSink(spec.num_layers)
            backend.submit(op(OpKind.SWAP_IN, [i % 16], [(i * 7) % 16]), sink, ())
            sinks.append(sink)  # the task itself is dropped at once
        await asyncio.gather(*(s.wait() for s in sinks))
        await asyncio.sleep(0.05)

    try:
        run(main)
        backend.synchronize()
    finally:
        if was_enabled:
            gc.enable()
    gc.collect()
    assert not seen, seen
    assert not backend._live


# ---------------------------------------------------------------- deferred layers
def test_deferred_layers_enqueue_on_demand_in_stream_order() -> None:
    """``eager_layers``: those at submit, later ones when waited on, pumped, or the stream's
    next op arrives (which must still run after them), the rest on the next turn."""
    spec = SPECS["mha-bf16"]
    L = spec.num_layers
    rng = np.random.default_rng(5)
    # (per-layer launches: with one_launch, a kernel-path op is whole at submit)
    backend = CudaBackend(spec, 64, 64, eager_layers=1, one_launch=False)
    fill_random(backend, rng)
    compute = cp.cuda.Stream(non_blocking=True)
    dev = rng.permutation(64)[:12].tolist()
    a, b, c = (rng.permutation(64)[:12].tolist() for _ in range(3))

    async def main() -> list[FutureSink]:
        sinks = [FutureSink(L) for _ in range(4)]
        spin(backend.load_stream, 0.02)
        t0 = backend.submit(op(OpKind.SWAP_IN, a, dev), sinks[0], ())
        assert t0.next_layer == 1
        backend.wait_layer(compute, t0, 1)
        assert t0.next_layer == 2
        backend.pump()
        assert t0.next_layer == L
        t1 = backend.submit(op(OpKind.SWAP_IN, b, dev), sinks[1], ())
        assert t1.next_layer == 1
        t2 = backend.submit(op(OpKind.SWAP_IN, c, dev), sinks[2], ())  # overwrites t1's blocks
        assert (t1.next_layer, t2.next_layer) == (L, 1)
        t3 = backend.submit(op(OpKind.EVICT, dev, b), sinks[3], (t2,))  # after t2, other stream
        assert t2.next_layer >= 1 and t3.next_layer == 1
        await asyncio.sleep(0)
        assert (t2.next_layer, t3.next_layer) == (L, L)
        await asyncio.gather(*(s.wait() for s in sinks))
        return sinks

    host0 = [backend.host_kv(layer, "k").copy() for layer in range(L)]
    sinks = run(main)
    assert all(s.reported == list(range(L)) for s in sinks)
    for layer in range(L):
        np.testing.assert_array_equal(cp.asnumpy(backend.device_kv(layer, "k"))[dev],
                                      host0[layer][c])
        np.testing.assert_array_equal(backend.host_kv(layer, "k")[b], host0[layer][c])

    for eager in (CudaBackend(spec, 64, 64, eager_layers=None),
                  CudaBackend(spec, 64, 64, eager_layers=L)):  # the default for L <= 4 layers

        async def eager_submit(backend: CudaBackend = eager) -> None:
            sink = FutureSink(L)
            task = backend.submit(op(OpKind.SWAP_IN, a, dev), sink, ())
            assert task.next_layer == L
            await sink.wait()

        run(eager_submit)
