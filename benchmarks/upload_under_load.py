"""Does a step's small host -> device upload wait behind a layer-wise load? (issue 22)

A step's first act on its stream is to get its packed metadata (tokens,
positions, slots, work lists: ~16 KB at 1,024 tokens, ~33 KB at 2,048) to the
device. With the fast executor the overlap benchmark saw steps of 2,048 tokens
start only once a whole 1 GiB load had landed. This isolates that: one swap-in
of 16 blocks (llama-3-8b, 512-token blocks, 32 layers: 1 GiB, each layer one
batched memcpy on the copy engine) is started, then an upload of SIZE bytes
goes to the device on another stream, and CUDA events say when the upload was
done, counted from the load's start, against when the load was done.

Load modes:
  queued  all 32 layers enqueued at submit
  paced   4 layers at submit, then one more every ``--pace-us`` of CPU time,
          after the upload (as a step's enqueue loop pumps them, ``eager_layers``)
  kernel  paced, but the load moved by the swap kernel (SMs), not the copy engine
Ways to upload:
  memcpy        cudaMemcpyAsync on a stream of default priority (the executor before)
  memcpy-hi     the same on a stream of the highest priority
  memcpy-8k     the same, in pieces of at most 8 KB
  memcpy-first  the same, enqueued before the load is submitted
  kernel        ``kvflow_upload16`` (compute.cu): SMs read the pinned buffer (the fix)

Run: PYTHONPATH=. python benchmarks/upload_under_load.py [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import numpy as np

from kernels._cuda import cupy_module, load_module
from kernels.backend import HIGHEST_PRIORITY, CudaBackend
from kernels.compute import BackendTask, upload_grid
from kvflow.layout import preset
from kvflow.manager import OpKind, TransferOp
from kvflow.radix import Tier

SIZES = (4 << 10, 8 << 10, 16 << 10, 24 << 10, 32 << 10, 48 << 10, 64 << 10, 256 << 10)
WAYS = ("memcpy", "memcpy-hi", "memcpy-8k", "memcpy-first", "kernel")
MODES = ("queued", "paced", "kernel")
_H2D = 1


async def measure(reps: int, pace_us: float, sizes: tuple[int, ...], blocks: int
                  ) -> list[dict[str, Any]]:
    cp = cupy_module()
    spec = preset("llama-3-8b", block_tokens=512)
    L = spec.num_layers
    backends = {"ce": CudaBackend(spec, blocks + 1, blocks, dma="always", eager_layers=4),
                "sm": CudaBackend(spec, blocks + 1, blocks, dma="never", min_run_bytes=0,
                                 eager_layers=4)}
    dev = backends["ce"].device
    up16 = load_module("compute.cu", dev).get_function("kvflow_upload16")
    src_mem = cp.cuda.alloc_pinned_memory(max(sizes))
    np.ndarray((max(sizes),), np.uint8, src_mem)[:] = np.arange(max(sizes)) % 251
    dst = cp.zeros(max(sizes), cp.uint8)
    streams = {"default": cp.cuda.Stream(non_blocking=True),
               "hi": cp.cuda.Stream(non_blocking=True, priority=HIGHEST_PRIORITY)}
    ids = list(range(blocks))
    op_id = [0]

    def upload(way: str, size: int) -> Any:
        s = streams["hi" if way == "memcpy-hi" else "default"]
        src, d = int(src_mem.ptr), int(dst.data.ptr)
        if way == "kernel":
            ctas, n16 = upload_grid(size)
            up16((ctas,), (256,), (np.uint64(src), np.uint64(d), np.int64(n16)), stream=s)
        elif way == "memcpy-8k":
            for off in range(0, size, 8 << 10):
                cp.cuda.runtime.memcpyAsync(d + off, src + off, min(8 << 10, size - off), _H2D,
                                            s.ptr)
        else:
            cp.cuda.runtime.memcpyAsync(d, src, size, _H2D, s.ptr)
        ev = cp.cuda.Event()
        ev.record(s)
        return ev

    async def trial(mode: str, way: str, size: int) -> tuple[float, float]:
        backend = backends["sm" if mode == "kernel" else "ce"]
        backend.eager_layers = L if mode == "queued" else 4
        op_id[0] += 1
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(backend.load_stream)
        u = upload(way, size) if way == "memcpy-first" else None
        t = BackendTask(backend, TransferOp(op_id[0], OpKind.SWAP_IN, Tier.HOST, Tier.DEVICE,
                                            ids, ids, []))
        if u is None:
            u = upload(way, size)
        if mode != "queued":
            for _ in range(4, L):  # one more layer every pace_us, as a step's enqueue loop
                until = time.perf_counter() + pace_us / 1e6
                while time.perf_counter() < until:
                    pass
                backend.pump()
        backend.flush()
        b.record(backend.load_stream)
        await t.wait()
        u.synchronize()
        el = cp.cuda.get_elapsed_time
        return el(a, u), el(a, b)

    def alone(way: str, size: int) -> float:
        s = streams["hi" if way == "memcpy-hi" else "default"]
        a = cp.cuda.Event()
        a.record(s)
        u = upload(way, size)
        u.synchronize()
        return cp.cuda.get_elapsed_time(a, u)

    for mode in MODES:  # warm-up: kernels loaded, copy paths touched
        await trial(mode, "kernel", sizes[0])
        await trial(mode, "memcpy", sizes[0])
    rows = []
    for mode in MODES:
        for size in sizes:
            for way in WAYS:
                vals = [await trial(mode, way, size) for _ in range(reps)]
                solo = statistics.median(alone(way, size) for _ in range(reps))
                rows.append({"mode": mode, "way": way, "bytes": size,
                             "upload_done_ms": statistics.median(v[0] for v in vals),
                             "upload_done_max_ms": max(v[0] for v in vals),
                             "load_done_ms": statistics.median(v[1] for v in vals),
                             "upload_alone_ms": solo})
    # the kernel's copy is a copy: the bytes arrived
    ref = np.ndarray((max(sizes),), np.uint8, src_mem)[:sizes[-1]]
    got = cp.asnumpy(dst[:sizes[-1]])
    if not np.array_equal(ref, got):
        raise AssertionError("the upload's bytes differ from the source")
    for b in backends.values():
        b.synchronize()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pace-us", type=float, default=250.0)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0, c0 = time.perf_counter(), time.process_time()
    rows = asyncio.run(measure(args.reps, args.pace_us, SIZES, args.blocks))
    print(f"upload under a {args.blocks}-block load (llama-3-8b, 512-token blocks); median of "
          f"{args.reps}; times from the load's start")
    print("| load | upload | bytes | upload done ms (max) | load done ms | upload alone ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['way']} | {r['bytes'] >> 10} KiB | {r['upload_done_ms']:.3f} "
              f"({r['upload_done_max_ms']:.3f}) | {r['load_done_ms']:.2f} | "
              f"{r['upload_alone_ms']:.4f} |")
    print(f"wall {time.perf_counter() - t0:.1f} s, CPU {time.process_time() - c0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
