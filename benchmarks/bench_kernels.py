"""Bandwidth of the swap kernel against the PCIe ceiling and the per-block memcpy baseline.

For each block size (bytes of one contiguous piece: one role of one layer of
one block), host->device, device->host and both at once:

  (a) ceiling    one cudaMemcpyAsync of the whole volume, contiguous
  (b) per-block  one cudaMemcpyAsync per scattered block (the common baseline)
  (c) kernel     the swap kernel over scattered ids, all layers in one launch,
                 at 2, 4, 8 and 16 CTAs (and per-layer launches, as the backend runs it);
                 both ways at once also for every (load CTAs, store CTAs) split
  (d) batch      the copy engine given every scattered piece in one batched driver
                 call per launch (kernels/dma.py), all layers at once and per layer
  ours           what ``BlockCopier`` picks by default for the size (the kernel below
                 ``DEFAULT_DMA_MIN_BYTES`` per piece, the batch from there), launched
                 per layer on one stream each way, as the backend runs it

plus the Python host time of one all-layer submission and of one backend
``submit`` (per-layer launches, events, host callbacks). GPU time is taken
with CUDA events, median of ``--reps``; per-block memcpys are queued behind a
spin kernel so the GPU, not Python's call rate, is timed. The last output is
a table of ratios to the ceiling.

Run: PYTHONPATH=. python benchmarks/bench_kernels.py [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from kernels._cuda import cupy_module
from kernels.dma import batch_memcpy_unavailable_reason
from kernels.swap import (
    DEFAULT_DMA_MIN_BYTES,
    DEFAULT_LOAD_CTAS,
    DEFAULT_STORE_CTAS,
    BlockCopier,
    SwapKernels,
)
from kernels.testing import spin
from kvflow.world import new_loop

CTAS = (2, 4, 8, 16)
MEMCPY_DEFAULT = 4


def gpu_time(enqueue: Callable[[], None], stream: object, reps: int,
             others: tuple[object, ...] = (), pre: Callable[[], None] | None = None,
             stat: Callable[[list[float]], float] = statistics.median) -> float:
    """Seconds between two events around ``enqueue`` (joined over ``others`` streams).

    ``stat`` of ``reps`` timings after one warm-up: the median by default; the
    ceilings take the minimum (the best the copy engine did).
    """
    cp = cupy_module()
    times = []
    for _ in range(reps + 1):  # first one warms up
        if pre is not None:
            pre()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for s in others:
            s.wait_event(start)
        enqueue()
        for s in others:
            ev = cp.cuda.Event()
            ev.record(s)
            stream.wait_event(ev)
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return stat(times[1:])


class Buffers:
    """Two device and two pinned host buffers of ``2 * total`` bytes, reused for every size."""

    def __init__(self, total: int) -> None:
        cp = cupy_module()
        self.total = total
        size = 2 * total
        self.dev_a = cp.empty(size, dtype=np.uint8)   # H2D destination
        self.dev_b = cp.random.randint(0, 256, size=size, dtype=np.uint8)  # D2H source
        self.host_a = cp.cuda.alloc_pinned_memory(size)  # H2D source
        self.host_b = cp.cuda.alloc_pinned_memory(size)  # D2H destination
        self.host_a_np = np.ndarray((size,), dtype=np.uint8, buffer=self.host_a)
        rt = cp.cuda.runtime
        rt.memcpy(self.host_a.ptr, self.dev_b.data.ptr, size, MEMCPY_DEFAULT)  # random bytes


def ceilings(buf: Buffers, reps: int) -> dict:
    """(a) one contiguous cudaMemcpyAsync of the volume each way, and both ways at once.

    The best of ``reps`` (both ways: over three fresh stream pairs too, since
    the copy engines' overlap varies between runs: 64 to 96 GB/s seen).
    """
    cp = cupy_module()
    rt = cp.cuda.runtime
    moved = buf.total
    out = {"h2d": 0.0, "d2h": 0.0, "both": 0.0}
    for _ in range(3):
        s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)

        def h2d(s: object = s1) -> None:
            rt.memcpyAsync(buf.dev_a.data.ptr, buf.host_a.ptr, moved, MEMCPY_DEFAULT, s.ptr)

        def d2h(s: object = s1) -> None:
            rt.memcpyAsync(buf.host_b.ptr, buf.dev_b.data.ptr, moved, MEMCPY_DEFAULT, s.ptr)

        got = {
            "h2d": moved / gpu_time(h2d, s1, reps, stat=min),
            "d2h": moved / gpu_time(d2h, s1, reps, stat=min),
            "both": 2 * moved / gpu_time(lambda a=s1, b=s2: (h2d(a), d2h(b)), s1, reps, (s2,),
                                         stat=min),
        }
        out = {k: max(v, got[k]) for k, v in out.items()}
    return out


def copiers(buf: Buffers, block: int, layers: int, kernels: SwapKernels,
            rng: np.random.Generator, dma: str = "never"
            ) -> tuple[BlockCopier, BlockCopier, np.ndarray, np.ndarray]:
    """Both directions over ``layers`` x ``2n`` blocks of ``block`` bytes; n scattered ids."""
    n = buf.total // (layers * block)
    cap = 2 * n
    stride = cap * block

    def bases(ptr: int) -> np.ndarray:
        return np.array([[ptr + layer * stride] for layer in range(layers)], dtype=np.int64)

    h2d = BlockCopier(bases(buf.host_a.ptr), bases(buf.dev_a.data.ptr), [block], cap, cap,
                      min_run_bytes=0, kernels=kernels, dma=dma, ctas=DEFAULT_LOAD_CTAS)
    d2h = BlockCopier(bases(buf.dev_b.data.ptr), bases(buf.host_b.ptr), [block], cap, cap,
                      min_run_bytes=0, kernels=kernels, dma=dma, ctas=DEFAULT_STORE_CTAS)
    src = rng.permutation(cap)[:n].astype(np.int32)
    dst = rng.permutation(cap)[:n].astype(np.int32)
    return h2d, d2h, src, dst


def bench_both_ctas(buf: Buffers, layers: int, reps: int, kernels: SwapKernels,
                    rng: np.random.Generator, kb: int = 16) -> dict:
    """Both ways at once for every (load CTAs, store CTAs) pair: how to split the SMs."""
    cp = cupy_module()
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    h2d, d2h, src, dst = copiers(buf, kb << 10, layers, kernels, rng)
    p_in, p_out = h2d.prepare(src, dst, s1), d2h.prepare(src, dst, s2)
    moved = p_in.num_scattered * layers * (kb << 10)
    out = {}
    for c_in in CTAS:
        for c_out in CTAS:
            out[c_in, c_out] = 2 * moved / gpu_time(
                lambda a=c_in, b=c_out: (h2d.launch(p_in, s1, ctas=a),
                                         d2h.launch(p_out, s2, ctas=b)), s1, reps, (s2,))
    return out


def ours_times(h2d: BlockCopier, d2h: BlockCopier, p_in: object, p_out: object,
               s1: object, s2: object, ctas: int, reps: int,
               ctas_out: int | None = None) -> dict[str, float]:
    """(c) seconds for one all-layer launch each way and both ways at once."""
    c_out = ctas if ctas_out is None else ctas_out
    return {
        "h2d": gpu_time(lambda: h2d.launch(p_in, s1, ctas=ctas), s1, reps),
        "d2h": gpu_time(lambda: d2h.launch(p_out, s1, ctas=ctas), s1, reps),
        "both": gpu_time(lambda: (h2d.launch(p_in, s1, ctas=ctas),
                                  d2h.launch(p_out, s2, ctas=c_out)), s1, reps, (s2,)),
    }


def per_layer_times(name: str, h2d: BlockCopier, d2h: BlockCopier, p_in: object,
                    p_out: object, s1: object, s2: object, layers: int, moved: int,
                    reps: int) -> dict[str, float]:
    """GB/s with one launch per layer (the backend's way), each way and both interleaved."""
    def one(copier: BlockCopier, prep: object, stream: object) -> Callable[[], None]:
        return lambda: [copier.launch(prep, stream, layer, 1) for layer in range(layers)]

    def both() -> None:
        for layer in range(layers):
            h2d.launch(p_in, s1, layer, 1)
            d2h.launch(p_out, s2, layer, 1)

    return {f"{name}_h2d_per_layer": moved / gpu_time(one(h2d, p_in, s1), s1, reps),
            f"{name}_d2h_per_layer": moved / gpu_time(one(d2h, p_out, s1), s1, reps),
            f"{name}_both_per_layer": 2 * moved / gpu_time(both, s1, reps, (s2,))}


def bench_size(buf: Buffers, block: int, layers: int, reps: int, kernels: SwapKernels,
               rng: np.random.Generator, max_memcpy_pieces: int, ceil: dict,
               both_split: tuple[int, int]) -> dict:
    cp = cupy_module()
    rt = cp.cuda.runtime
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    h2d, d2h, src, dst = copiers(buf, block, layers, kernels, rng)
    n, cap = src.size, h2d.num_src_blocks
    stride = cap * block
    moved = n * layers * block
    res: dict = {"block_kb": block // 1024, "blocks_per_layer": n, "layers": layers,
                 "bytes": moved}
    res.update({f"ceil_{d}": ceil[d] for d in ("h2d", "d2h", "both")})

    # (b) one memcpy per block, queued behind a spin so the GPU is what is timed
    pieces = min(n * layers, max_memcpy_pieces)
    p_layer = rng.integers(0, layers, size=pieces)
    p_src = rng.integers(0, cap, size=pieces)
    p_dst = rng.integers(0, cap, size=pieces)
    offs_src = (p_layer * stride + p_src * block).tolist()
    offs_dst = (p_layer * stride + p_dst * block).tolist()

    def per_block(dst_base: int, src_base: int) -> Callable[[], None]:
        def go() -> None:
            for a, b in zip(offs_dst, offs_src, strict=True):
                rt.memcpyAsync(dst_base + a, src_base + b, block, MEMCPY_DEFAULT, s1.ptr)
        return go

    def hold() -> None:
        spin(s1, 0.02 + pieces * 4e-6)

    res["memcpy_h2d"] = pieces * block / gpu_time(
        per_block(buf.dev_a.data.ptr, buf.host_a.ptr), s1, max(3, reps // 2), pre=hold)
    res["memcpy_d2h"] = pieces * block / gpu_time(
        per_block(buf.host_b.ptr, buf.dev_b.data.ptr), s1, max(3, reps // 2), pre=hold)

    # (c) ours: scattered ids, all layers in one launch
    p_in = h2d.prepare(src, dst, s1)
    p_out = d2h.prepare(src, dst, s2)
    for ctas in CTAS:
        t = ours_times(h2d, d2h, p_in, p_out, s1, s2, ctas, reps)
        res[f"ours_h2d_{ctas}"] = moved / t["h2d"]
        res[f"ours_d2h_{ctas}"] = moved / t["d2h"]
        res[f"ours_both_{ctas}"] = 2 * moved / t["both"]
    c_in, c_out = both_split
    res["ours_both_split"] = 2 * moved / ours_times(
        h2d, d2h, p_in, p_out, s1, s2, c_in, reps, c_out)["both"]

    def per_layer() -> None:
        for layer in range(layers):
            h2d.launch(p_in, s1, layer, 1)

    res["ours_h2d_per_layer"] = moved / gpu_time(per_layer, s1, reps)
    res["per_layer_ctas"] = h2d.ctas
    res.update(per_layer_times("kernel", h2d, d2h, p_in, p_out, s1, s2, layers, moved, reps))
    if batch_memcpy_unavailable_reason() is None:
        # (d) the copy engine, batched; then the bytes it moved are checked below
        h2d, d2h, src, dst = copiers(buf, block, layers, kernels, rng, dma="always")
        p_in, p_out = h2d.prepare(src, dst, s1), d2h.prepare(src, dst, s2)
        t = ours_times(h2d, d2h, p_in, p_out, s1, s2, 0, reps)
        res.update({f"batch_{d}": (2 if d == "both" else 1) * moved / v for d, v in t.items()})
        res.update(per_layer_times("batch", h2d, d2h, p_in, p_out, s1, s2, layers, moved, reps))
    path = "batch" if block >= DEFAULT_DMA_MIN_BYTES and "batch_h2d" in res else "kernel"
    res["path"] = path
    for d in ("h2d", "d2h", "both"):
        res[f"auto_{d}"] = res[f"{path}_{d}_per_layer"]
    s1.synchronize()
    s2.synchronize()
    # spot check: the scattered copy is bit-exact
    dev = cp.asnumpy(buf.dev_a[: layers * stride]).reshape(layers, cap, block)
    host = buf.host_a_np[: layers * stride].reshape(layers, cap, block)
    for layer in (0, layers - 1):
        for j in rng.integers(0, n, size=16).tolist():
            if not np.array_equal(dev[layer, dst[j]], host[layer, src[j]]):
                raise SystemExit(f"MISMATCH at block {block} layer {layer} pair {j}")
    return res


SPLIT_FRACTIONS = (0.0, 0.2, 0.3, 0.4, 0.5, 1.0)


def bench_split(buf: Buffers, kb: int, layers: int, reps: int, kernels: SwapKernels,
                rng: np.random.Generator, ceil: dict, ctas: int = 8) -> dict:
    """An experiment, not a path ``BlockCopier`` takes: a fraction f of an op's scattered
    blocks to the copy-engine batch on a second stream while the kernel copies the rest,
    launched per layer; ratio to the ceiling for each f, each way and both at once
    (four streams)."""
    cp = cupy_module()
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    hk, dk, src, dst = copiers(buf, kb << 10, layers, kernels, rng, dma="never")
    hc, dc, _, _ = copiers(buf, kb << 10, layers, kernels, rng, dma="always")
    n = src.size
    moved = n * layers * (kb << 10)
    out: dict = {}
    for f in SPLIT_FRACTIONS:
        k = n - round(f * n)
        preps = (hk.prepare(src[:k], dst[:k], streams[0]), hc.prepare(src[k:], dst[k:], streams[1]),
                 dk.prepare(src[:k], dst[:k], streams[2]), dc.prepare(src[k:], dst[k:], streams[3]))

        def go(ways: str, p: tuple = preps) -> None:
            for layer in range(layers):
                if "h" in ways:
                    hk.launch(p[0], streams[0], layer, 1, ctas=ctas)
                    hc.launch(p[1], streams[1], layer, 1)
                if "d" in ways:
                    dk.launch(p[2], streams[2], layer, 1, ctas=ctas)
                    dc.launch(p[3], streams[3], layer, 1)

        out[f] = {d: (2 if d == "both" else 1) * moved / gpu_time(
            lambda w=w: go(w), streams[0], reps, tuple(streams[1:])) / ceil[d]
            for d, w in (("h2d", "h"), ("d2h", "d"), ("both", "hd"))}
    for s in streams:
        s.synchronize()
    return out


BATCH_STREAMS = (1, 2, 3, 4, 6, 8)


def bench_batch_streams(buf: Buffers, kb: int, layers: int, reps: int,
                        rng: np.random.Generator, ceil: dict) -> dict:
    """An experiment, not a path ``BlockCopier`` takes: each layer's batched-memcpy
    descriptors split evenly over k streams (the driver may hand streams to different
    copy engines), for k in ``BATCH_STREAMS``; ratio to the ceiling each way, and both
    ways with k/2 streams a direction."""
    from kernels.dma import BatchMemcpy, block_descriptors

    cp = cupy_module()
    block = kb << 10
    n = buf.total // (layers * block)
    stride = 2 * n * block

    def bases(ptr: int) -> np.ndarray:
        return np.array([[ptr + layer * stride] for layer in range(layers)], dtype=np.int64)

    src, dst = rng.permutation(2 * n)[:n], rng.permutation(2 * n)[:n]
    descs = {"h2d": block_descriptors(bases(buf.host_a.ptr), bases(buf.dev_a.data.ptr),
                                      [block], src, dst),
             "d2h": block_descriptors(bases(buf.dev_b.data.ptr), bases(buf.host_b.ptr),
                                      [block], src, dst)}
    batch = BatchMemcpy()
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2 * max(BATCH_STREAMS))]

    def enqueue(desc: tuple[np.ndarray, ...], ss: list) -> None:
        k = len(ss)
        for layer in range(layers):
            for j, st in enumerate(ss):
                part = slice(layer * n + j * n // k, layer * n + (j + 1) * n // k)
                batch.enqueue(*(np.ascontiguousarray(a[part]) for a in desc), st.ptr)

    moved = n * layers * block
    out: dict = {}
    for k in BATCH_STREAMS:
        one, two = streams[:k], streams[k:2 * k]
        half = max(k // 2, 1)
        out[k] = {
            d: moved / gpu_time(lambda d=d, one=one: enqueue(descs[d], one), one[0], reps,
                                tuple(one[1:])) / ceil[d] for d in ("h2d", "d2h")}
        out[k]["both"] = 2 * moved / gpu_time(
            lambda one=one, two=two, h=half: (enqueue(descs["h2d"], one[:h]),
                                              enqueue(descs["d2h"], two[:h])),
            one[0], reps, (*one[1:half], *two[:half])) / ceil["both"]
    for st in streams:
        st.synchronize()
    return out


def host_times(reps: int) -> dict:
    """Python host time (us, median) of the submission path and of its pieces (llama-3-8b)."""
    cp = cupy_module()
    from kernels.backend import CudaBackend, FutureSink
    from kernels.plan import split_runs, validate_ids
    from kvflow.layout import preset
    from kvflow.manager import OpKind, TransferOp
    from kvflow.radix import Tier

    spec = preset("llama-3-8b")
    # every layer enqueued at submit, so "backend submit" times the whole op (eager_layers)
    backend = CudaBackend(spec, 256, 512, eager_layers=None)
    rng = np.random.default_rng(0)
    src = rng.permutation(512)[:128].astype(np.int32)
    dst = rng.permutation(256)[:128].astype(np.int32)
    s = backend.load_stream
    side = cp.cuda.Stream(non_blocking=True)
    copier = backend.h2d
    prep = copier.prepare(src, dst, s)
    ev = cp.cuda.Event(disable_timing=True)
    kern = copier.kernels
    args = (copier._table_ptr, copier._roles_ptr, 2, copier.chunks_per_block, 0, 1,
            prep.ids_ptr, prep.num_scattered)

    def noop(_: object) -> None:
        pass

    def median_us(fn: Callable[[], object], n: int = reps) -> float:
        keep, samples = [], []
        for i in range(n + 20):
            t0 = time.perf_counter()
            keep.append(fn())
            samples.append(time.perf_counter() - t0)
            if i % 32 == 31:
                cp.cuda.Device().synchronize()
                keep.clear()
        cp.cuda.Device().synchronize()
        return statistics.median(samples[20:]) * 1e6

    out: dict = {"model": spec.name, "layers": spec.num_layers, "blocks": 128}
    out["validate_ids (slow path)"] = median_us(lambda: validate_ids(src, dst, 512, 256))
    out["split_runs (slow path)"] = median_us(lambda: split_runs(src, dst, 32))
    out["prepare"] = median_us(lambda: copier.prepare(src, dst, s))
    out["prepare (list ids)"] = median_us(lambda: copier.prepare(src.tolist(), dst.tolist(), s))
    out["kernel launch (raw)"] = median_us(lambda: kern.launch(s.ptr, 8, args))
    out["kernel launch (cupy call)"] = median_us(
        lambda: kern._fn((8,), (1024,), args, stream=s))
    out["BlockCopier.launch 1 layer"] = median_us(lambda: copier.launch(prep, s, 0, 1))
    out["event record"] = median_us(lambda: ev.record(s))
    out["stream wait_event"] = median_us(lambda: side.wait_event(ev))
    out["launch_host_func"] = median_us(lambda: side.launch_host_func(noop, None))
    out["all_layer_submit_us"] = median_us(lambda: copier.copy(src, dst, s))
    if batch_memcpy_unavailable_reason() is None:
        # the copy-engine path costs host time per piece: 512-token blocks (1 MiB pieces)
        big = CudaBackend(preset("llama-3-8b", block_tokens=512), 20, 20, dma="always")
        b_src, b_dst = rng.permutation(20)[:16], rng.permutation(20)[:16]
        pieces = 16 * big.num_layers * len(big.roles)
        out[f"batch: prepare, 16 blocks x {big.num_layers} layers x 2 ({pieces} pieces)"] = \
            median_us(lambda: big.h2d.prepare(b_src, b_dst, s), 50)
        out["batch: one all-layer submission (same)"] = median_us(
            lambda: big.h2d.copy(b_src, b_dst, big.load_stream), 50)
        b_prep = big.h2d.prepare(b_src, b_dst, s)
        out["batch: launch of one layer (32 pieces)"] = median_us(
            lambda: big.h2d.launch(b_prep, big.load_stream, 0, 1), 50)
        del big
    # Does a fresh cudaHostAlloc wait for a busy GPU? (why staging is a ring allocated once)
    spin(s, 0.05)
    t0 = time.perf_counter()
    cp.cuda.PinnedMemory(1 << 16)
    out["fresh cudaHostAlloc, GPU busy 50 ms"] = (time.perf_counter() - t0) * 1e6
    cp.cuda.Device().synchronize()
    src_l, dst_l = src.tolist(), dst.tolist()

    async def submits(b: CudaBackend) -> float:
        times = []
        for i in range(reps // 4 + 5):
            sink = FutureSink(spec.num_layers)
            op = TransferOp(i, OpKind.SWAP_IN, Tier.HOST, Tier.DEVICE, src_l, dst_l, keys=[])
            t0 = time.perf_counter()
            b.submit(op, sink, ())
            times.append(time.perf_counter() - t0)
            await sink.wait()
        return statistics.median(times[5:])

    grouped = CudaBackend(spec, 256, 512, layers_per_launch=4, eager_layers=None)
    with asyncio.Runner(loop_factory=new_loop) as runner:
        out["backend_submit_us"] = runner.run(submits(backend)) * 1e6
        out["backend submit, 4 layers/launch"] = runner.run(submits(grouped)) * 1e6
    cp.cuda.Device().synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4,16,32,128,512", help="block sizes in KB")
    ap.add_argument("--total-mb", type=int, default=256, help="volume moved per measurement")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--max-memcpy-pieces", type=int, default=2048)
    ap.add_argument("--skip-host", action="store_true", help="skip the host-time section")
    ap.add_argument("--json", help="write all numbers here")
    ap.add_argument("--split", default="", help="also the kernel + copy-engine split "
                    "experiment at these block sizes in KB (e.g. 16,32,64)")
    ap.add_argument("--batch-streams", default="", help="also the copy-engine batch split "
                    "over 1-8 streams at these block sizes in KB (e.g. 16,32,64)")
    args = ap.parse_args()
    cp = cupy_module()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"device: {name}, {props['multiProcessorCount']} SMs; cupy {cp.__version__}")
    buf = Buffers(args.total_mb << 20)
    rng = np.random.default_rng(1)
    ceil = ceilings(buf, 3 * args.reps)
    print("ceiling (one contiguous cudaMemcpyAsync, GB/s): "
          + "  ".join(f"{d} {v / 1e9:.1f}" for d, v in ceil.items()))
    kernels = SwapKernels()
    split = bench_both_ctas(buf, args.layers, args.reps, kernels, rng)
    print("\nboth ways at once, 16 KB, GB/s by (load CTAs, store CTAs):")
    for c_in in CTAS:
        print(f"  load {c_in:2d}: " + "  ".join(f"store {c}: {split[c_in, c] / 1e9:5.1f}"
                                              for c in CTAS))
    best_split = max(split, key=split.get)
    print(f"  -> best split {best_split}")
    rows = []
    for kb in (int(x) for x in args.sizes.split(",")):
        r = bench_size(buf, kb << 10, args.layers, args.reps, kernels, rng,
                       args.max_memcpy_pieces, ceil, best_split)
        rows.append(r)
        gb = {k: v / 1e9 for k, v in r.items() if k.startswith(("ceil", "memcpy", "ours"))}
        print(f"\n{kb} KB blocks ({r['blocks_per_layer']} per layer x {r['layers']} layers), GB/s:")
        for d in ("h2d", "d2h", "both"):
            ours = "  ".join(f"@{c}:{gb[f'ours_{d}_{c}']:6.1f}" for c in CTAS)
            memcpy = f"{gb[f'memcpy_{d}']:6.1f}" if f"memcpy_{d}" in gb else "     -"
            print(f"  {d:4s} ceiling {gb[f'ceil_{d}']:6.1f}  per-block {memcpy}  ours {ours}")
        print(f"  both at split {best_split}: {gb['ours_both_split']:6.1f};"
              f"  h2d per-layer launches @{r['per_layer_ctas']}: {gb['ours_h2d_per_layer']:6.1f}")
        for path in ("kernel", "batch"):
            if f"{path}_h2d_per_layer" in r:
                print(f"  {path} per layer: " + "  ".join(
                    f"{d} {r[f'{path}_{d}_per_layer'] / 1e9:6.1f}" for d in ("h2d", "d2h", "both"))
                    + (f";  all layers: h2d {r['batch_h2d'] / 1e9:6.1f} d2h "
                       f"{r['batch_d2h'] / 1e9:6.1f} both {r['batch_both'] / 1e9:6.1f}"
                       if path == "batch" else ""))
        print(f"  ours ({r['path']}): " + "  ".join(
            f"{d} {r[f'auto_{d}'] / 1e9:6.1f}" for d in ("h2d", "d2h", "both")))
    split_rows = {}
    for kb in (int(x) for x in args.split.split(",") if x):
        split_rows[kb] = bench_split(buf, kb, args.layers, args.reps, kernels, rng, ceil)
        print(f"\nsplit {kb} KB, ratio to the ceiling (h2d / d2h / both) by copy-engine "
              "share f, per-layer launches, kernel at 8 CTAs:")
        print("  " + "  ".join(f"f={f:.1f}: {r['h2d']:.3f}/{r['d2h']:.3f}/{r['both']:.3f}"
                               for f, r in split_rows[kb].items()))
    stream_rows = {}
    for kb in (int(x) for x in args.batch_streams.split(",") if x):
        if batch_memcpy_unavailable_reason() is not None:
            print(f"\nbatch streams: skipped ({batch_memcpy_unavailable_reason()})")
            break
        stream_rows[kb] = bench_batch_streams(buf, kb, args.layers, args.reps, rng, ceil)
        print(f"\nbatch over k streams, {kb} KB, ratio to the ceiling (h2d / d2h / both, "
              "k/2 streams a direction), per-layer calls:")
        print("  " + "  ".join(f"k={k}: {r['h2d']:.3f}/{r['d2h']:.3f}/{r['both']:.3f}"
                               for k, r in stream_rows[kb].items()))
    ht = {"all_layer_submit_us": float("nan"), "backend_submit_us": float("nan")}
    if not args.skip_host:
        ht = host_times(400)
        print_host_times(ht)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "ceiling": ceil,
                       "both_split": {f"{a},{b}": v for (a, b), v in split.items()},
                       "sizes": rows, "host": ht,
                       "split": {kb: {str(f): r for f, r in v.items()}
                                 for kb, v in split_rows.items()},
                       "batch_streams": stream_rows}, f, indent=1)
    print_ratios(rows, best_split, ht)


def print_host_times(ht: dict) -> None:
    print(f"\nhost time, us ({ht['model']}, {ht['layers']} layers x 2 roles, "
          f"{ht['blocks']} scattered blocks):")
    for k, v in ht.items():
        if isinstance(v, float):
            print(f"  {k:40s} {v:9.1f}")


def print_ratios(rows: list[dict], best_split: tuple[int, int], ht: dict) -> None:
    """The last output: each path as a fraction of the ceiling, and the targets' column."""
    print(f"\nratio to the ceiling of this run. kernel: best of 2-16 CTAs, all layers in one "
          f"launch (both: split {best_split[0]}+{best_split[1]}); batch: copy engine, best of "
          "all-layer and per-layer calls; memcpy: one per block; ours: the default path for "
          "the size, per-layer launches as the backend runs them. 'vs 93': ours both ways "
          "against the issue's 93 GB/s.")
    print(f"host time per all-layer submission (kernel path): {ht['all_layer_submit_us']:.1f} us;"
          f" per backend submit {ht['backend_submit_us']:.1f} us")
    print(" block path  | h2d kernel batch memcpy  OURS | d2h kernel batch memcpy  OURS "
          "| both kernel batch  OURS  vs 93")
    for r in rows:
        cells = []
        for d in ("h2d", "d2h", "both"):
            c = r[f"ceil_{d}"]
            kern = max([r[f"ours_{d}_{k}"] for k in CTAS]
                       + ([r["ours_both_split"]] if d == "both" else [])) / c
            batch = (max(r[f"batch_{d}"], r[f"batch_{d}_per_layer"]) / c
                     if f"batch_{d}" in r else float("nan"))
            memcpy = f" {r[f'memcpy_{d}'] / c:6.2f}" if d != "both" else ""
            tail = f"  {r['auto_both'] / 93e9:5.2f}" if d == "both" else ""
            cells.append(f"    {kern:5.2f} {batch:5.2f}{memcpy} {r[f'auto_{d}'] / c:5.2f}{tail}")
        print(f"{r['block_kb']:4d}KB {r['path']:6s} |" + " |".join(cells))


if __name__ == "__main__":
    main()
