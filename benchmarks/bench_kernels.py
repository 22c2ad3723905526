"""Bandwidth of the swap kernel against the PCIe ceiling and the per-block memcpy baseline.

For each block size (bytes of one contiguous piece: one role of one layer of
one block), host->device, device->host and both at once:

  (a) ceiling    one cudaMemcpyAsync of the whole volume, contiguous
  (b) per-block  one cudaMemcpyAsync per scattered block (the common baseline)
  (c) ours       the swap kernel over scattered ids, all layers in one launch,
                 at 2, 4, 8 and 16 CTAs (and per-layer launches, as the backend runs it)

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
from kernels.swap import BlockCopier, SwapKernels
from kernels.testing import spin

CTAS = (2, 4, 8, 16)
MEMCPY_DEFAULT = 4


def gpu_time(enqueue: Callable[[], None], stream: object, reps: int,
             others: tuple[object, ...] = (), pre: Callable[[], None] | None = None) -> float:
    """Median seconds between two events around ``enqueue`` (joined over ``others`` streams)."""
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
    return statistics.median(times[1:])


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


def bench_size(buf: Buffers, block: int, layers: int, reps: int, kernels: SwapKernels,
               rng: np.random.Generator, max_memcpy_pieces: int) -> dict:
    cp = cupy_module()
    rt = cp.cuda.runtime
    total = buf.total
    n = total // (layers * block)          # blocks per layer moved
    cap = 2 * n                            # blocks per layer in each pool
    stride = cap * block
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)

    def bases(ptr: int) -> np.ndarray:
        return np.array([[ptr + layer * stride] for layer in range(layers)], dtype=np.int64)

    h2d = BlockCopier(bases(buf.host_a.ptr), bases(buf.dev_a.data.ptr), [block], cap, cap,
                      min_run_bytes=0, kernels=kernels)
    d2h = BlockCopier(bases(buf.dev_b.data.ptr), bases(buf.host_b.ptr), [block], cap, cap,
                      min_run_bytes=0, kernels=kernels)
    src = rng.permutation(cap)[:n].astype(np.int32)
    dst = rng.permutation(cap)[:n].astype(np.int32)
    res: dict = {"block_kb": block // 1024, "blocks_per_layer": n, "layers": layers,
                 "bytes": n * layers * block}
    moved = n * layers * block

    # (a) ceiling: one contiguous copy of the same volume
    def ceil_h2d() -> None:
        rt.memcpyAsync(buf.dev_a.data.ptr, buf.host_a.ptr, moved, MEMCPY_DEFAULT, s1.ptr)

    def ceil_d2h(stream: object = s1) -> None:
        rt.memcpyAsync(buf.host_b.ptr, buf.dev_b.data.ptr, moved, MEMCPY_DEFAULT, stream.ptr)

    res["ceil_h2d"] = moved / gpu_time(ceil_h2d, s1, reps)
    res["ceil_d2h"] = moved / gpu_time(ceil_d2h, s1, reps)
    res["ceil_both"] = 2 * moved / gpu_time(lambda: (ceil_h2d(), ceil_d2h(s2)), s1, reps, (s2,))

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
        res[f"ours_h2d_{ctas}"] = moved / gpu_time(lambda c=ctas: h2d.launch(p_in, s1, ctas=c),
                                                   s1, reps)
        res[f"ours_d2h_{ctas}"] = moved / gpu_time(lambda c=ctas: d2h.launch(p_out, s1, ctas=c),
                                                   s1, reps)
        res[f"ours_both_{ctas}"] = 2 * moved / gpu_time(
            lambda c=ctas: (h2d.launch(p_in, s1, ctas=c), d2h.launch(p_out, s2, ctas=c)),
            s1, reps, (s2,))

    def per_layer() -> None:
        for layer in range(layers):
            h2d.launch(p_in, s1, layer, 1)

    res["ours_h2d_per_layer"] = moved / gpu_time(per_layer, s1, reps)
    s1.synchronize()
    s2.synchronize()
    # spot check: the scattered copy is bit-exact
    dev = cp.asnumpy(buf.dev_a).reshape(layers, cap, block)
    host = buf.host_a_np.reshape(layers, cap, block)
    for layer in (0, layers - 1):
        for j in rng.integers(0, n, size=16).tolist():
            if not np.array_equal(dev[layer, dst[j]], host[layer, src[j]]):
                raise SystemExit(f"MISMATCH at block {block} layer {layer} pair {j}")
    return res


def host_times(reps: int) -> dict:
    """Python host time of one all-layer submission and of one backend submit (llama-3-8b)."""
    cp = cupy_module()
    from kernels.backend import CudaBackend, FutureSink
    from kvflow.layout import preset
    from kvflow.manager import OpKind, TransferOp
    from kvflow.radix import Tier

    spec = preset("llama-3-8b")
    backend = CudaBackend(spec, 256, 512)
    rng = np.random.default_rng(0)
    src = rng.permutation(512)[:128].astype(np.int32)
    dst = rng.permutation(256)[:128].astype(np.int32)
    s = backend.load_stream
    out: dict = {"model": spec.name, "layers": spec.num_layers, "blocks": 128}
    keep = []
    samples = []
    for i in range(reps + 20):
        t0 = time.perf_counter()
        keep.append(backend.h2d.copy(src, dst, s))
        samples.append(time.perf_counter() - t0)
        if i % 16 == 15:
            s.synchronize()
            keep.clear()
    s.synchronize()
    out["all_layer_submit_us"] = statistics.median(samples[20:]) * 1e6
    src_l, dst_l = src.tolist(), dst.tolist()

    async def submits() -> float:
        times = []
        for i in range(reps // 4 + 5):
            sink = FutureSink(spec.num_layers)
            op = TransferOp(i, OpKind.SWAP_IN, Tier.HOST, Tier.DEVICE, src_l, dst_l, keys=[])
            t0 = time.perf_counter()
            backend.submit(op, sink, ())
            times.append(time.perf_counter() - t0)
            await sink.wait()
        return statistics.median(times[5:])

    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        out["backend_submit_us"] = runner.run(submits()) * 1e6
    cp.cuda.Device().synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4,16,32,128,512", help="block sizes in KB")
    ap.add_argument("--total-mb", type=int, default=256, help="volume moved per measurement")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--max-memcpy-pieces", type=int, default=2048)
    ap.add_argument("--json", help="write all numbers here")
    args = ap.parse_args()
    cp = cupy_module()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"device: {name}, {props['multiProcessorCount']} SMs; cupy {cp.__version__}")
    buf = Buffers(args.total_mb << 20)
    kernels = SwapKernels()
    rng = np.random.default_rng(1)
    rows = []
    for kb in (int(x) for x in args.sizes.split(",")):
        r = bench_size(buf, kb << 10, args.layers, args.reps, kernels, rng, args.max_memcpy_pieces)
        rows.append(r)
        gb = {k: v / 1e9 for k, v in r.items() if k.startswith(("ceil", "memcpy", "ours"))}
        print(f"\n{kb} KB blocks ({r['blocks_per_layer']} per layer x {r['layers']} layers), GB/s:")
        for d in ("h2d", "d2h", "both"):
            ours = "  ".join(f"@{c}:{gb[f'ours_{d}_{c}']:6.1f}" for c in CTAS)
            memcpy = f"{gb[f'memcpy_{d}']:6.1f}" if f"memcpy_{d}" in gb else "     -"
            print(f"  {d:4s} ceiling {gb[f'ceil_{d}']:6.1f}  per-block {memcpy}  ours {ours}")
        print(f"  h2d  ours per-layer launches @8: {gb['ours_h2d_per_layer']:6.1f}")
    ht = host_times(200)
    print(f"\nhost time ({ht['model']}, {ht['layers']} layers, {ht['blocks']} scattered blocks): "
          f"all-layer submission {ht['all_layer_submit_us']:.1f} us; "
          f"backend submit (per-layer launches + events + host funcs) "
          f"{ht['backend_submit_us']:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "sizes": rows, "host": ht}, f, indent=1)
    print("\nratio to ceiling (ours: best of <=16 CTAs, and at 8 CTAs; per-block memcpy):")
    print(" block | h2d best  h2d@8  memcpy | d2h best  d2h@8  memcpy | both best  both@8")
    for r in rows:
        cells = []
        for d in ("h2d", "d2h", "both"):
            best = max(r[f"ours_{d}_{c}"] for c in CTAS) / r[f"ceil_{d}"]
            at8 = r[f"ours_{d}_8"] / r[f"ceil_{d}"]
            mc = f"  {r[f'memcpy_{d}'] / r[f'ceil_{d}']:5.2f}" if d != "both" else ""
            cells.append(f"   {best:5.2f}  {at8:5.2f}{mc}")
        print(f"{r['block_kb']:4d}KB |" + " |".join(cells))


if __name__ == "__main__":
    main()
