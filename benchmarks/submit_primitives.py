"""Host CPU time of each CUDA call an op's submission is made of (choose the design by it).

Per call, median over ``--reps`` rounds of ``--calls`` calls (the stream synchronized
between rounds, so queues never fill): a kernel launch through CuPy's ``RawKernel``
and through the driver binding the swap kernel uses, an event record, a stream's
wait on an event, a host function, the stream memory operations of
``kernels.progress`` (wait on / write a word in pinned memory), a CUDA graph launch
(1 and 32 kernel nodes), a ``cudaMemcpyAsync`` and one batched copy-engine call of
1 to 1,024 descriptors (32 KiB pieces, host -> device). Wall time with ``perf_counter``;
the calls never block, so it is CPU time of the submitting thread.

Run (repository root, on a GPU): PYTHONPATH=. python benchmarks/submit_primitives.py
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels._cuda import cupy_module
from kernels.dma import BatchMemcpy, batch_memcpy_unavailable_reason
from kernels.progress import ProgressWords, progress_unavailable_reason

_NOOP = r"""
extern "C" __global__ void noop(unsigned long long a, unsigned long long b,
    unsigned long long c, unsigned long long d, unsigned long long e, unsigned long long f,
    unsigned long long g, unsigned long long h) {}
"""


def per_call(fn: Callable[[], None], calls: int, reps: int, sync: Callable[[], None]) -> float:
    """Median over rounds of (time of ``calls`` calls) / calls, in microseconds."""
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
    sync()
    return statistics.median(out) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    cp = cupy_module()
    s = cp.cuda.Stream(non_blocking=True)
    side = cp.cuda.Stream(non_blocking=True)
    sync = s.synchronize

    def both() -> None:
        s.synchronize()
        side.synchronize()

    rows: list[tuple[str, float]] = []

    def add(name: str, fn: Callable[[], None], calls: int = args.calls,
            sy: Callable[[], None] = sync) -> None:
        us = per_call(fn, calls, args.reps, sy)
        rows.append((name, us))
        print(f"  {name:58s} {us:8.2f} us", flush=True)

    fn = cp.RawKernel(_NOOP, "noop")
    a8 = tuple(np.uint64(i) for i in range(8))
    add("RawKernel call (CuPy, 8 u64 args)", lambda: fn((1,), (32,), a8, stream=s))
    params = ctypes.create_string_buffer(64)
    argv = (ctypes.c_void_p * 8)(*(ctypes.addressof(params) + 8 * i for i in range(8)))
    argv_ptr = ctypes.addressof(argv)
    launch = cp.cuda.driver.launchKernel
    fptr = int(fn.kernel.ptr)
    pack = struct.Struct("<8q").pack_into
    sp = s.ptr

    def raw() -> None:
        pack(params, 0, 1, 2, 3, 4, 5, 6, 7, 8)
        launch(fptr, 1, 1, 1, 32, 1, 1, 0, sp, argv_ptr, 0)

    add("driver.launchKernel + pack (SwapKernels.launch's path)", raw)
    ev = cp.cuda.Event(disable_timing=True)
    add("Event.record", lambda: ev.record(s))
    ev.record(s)
    add("Stream.wait_event", lambda: side.wait_event(ev), sy=both)
    add("Stream.launch_host_func (no-op)", lambda: side.launch_host_func(lambda _: None, None),
        calls=50, sy=both)
    from kernels.testing import spin

    def held() -> None:  # the callbacks run only after the timing: the enqueue alone
        both()
        spin(side, 0.05)

    add("Stream.launch_host_func (no-op), stream held by a spin",
        lambda: side.launch_host_func(lambda _: None, None), calls=50, sy=held)
    both()
    why = progress_unavailable_reason()
    if why is None:
        words = ProgressWords(4)
        seq = words.take()
        words.write(s.ptr, 0, seq)
        s.synchronize()
        add("cuStreamWriteValue32 (ProgressWords.write)", lambda: words.write(sp, 1, seq))
        add("cuStreamWaitValue32 (ProgressWords.wait, satisfied)",
            lambda: words.wait(side.ptr, 0, seq), sy=both)
        add("ProgressWords.landed (host read)", lambda: words.landed(0, seq))
    else:
        print(f"  stream memory operations unavailable: {why}")
    for nodes in (1, 32):
        s.begin_capture()
        for _ in range(nodes):
            fn((1,), (32,), a8, stream=s)
        g = s.end_capture()
        g.upload(s) if hasattr(g, "upload") else None
        add(f"CUDA graph launch ({nodes} kernel nodes)", lambda g=g: g.launch(s), calls=50)
    if batch_memcpy_unavailable_reason() is None:
        bm = BatchMemcpy()
        piece = 32 << 10
        n_max = 1024
        host = cp.cuda.alloc_pinned_memory(piece * n_max)
        dev = cp.empty(piece * n_max, dtype=np.uint8)
        perm = np.random.default_rng(0).permutation(n_max).astype(np.uint64)
        srcs = np.uint64(host.ptr) + perm * np.uint64(piece)
        dsts = np.uint64(dev.data.ptr) + np.arange(n_max, dtype=np.uint64) * np.uint64(piece)
        sizes = np.full(n_max, piece, dtype=np.uint64)
        rt = cp.cuda.runtime
        d0, s0 = int(dsts[0]), int(srcs[0])
        add("cudaMemcpyAsync (CuPy runtime), 32 KiB h2d",
            lambda: rt.memcpyAsync(d0, s0, piece, 4, sp), calls=32)
        for n in (1, 16, 64, 256, 1024):
            add(f"cuMemcpyBatchAsync, {n} descriptors of 32 KiB",
                lambda n=n: bm.enqueue_at(dsts.ctypes.data, srcs.ctypes.data,
                                          sizes.ctypes.data, n, sp),
                calls=max(2, 64 // n))
    print("\n| call | host us per call |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
