"""PD's GPU path: KV moved between two caches by ``kernels.pd_peer``, against a
contiguous copy of the same bytes in the same run.

A llama-3-8b-shaped cache (K and V, 32 layers, 16-token blocks: 64 KiB per block and
layer), ``--blocks`` scattered blocks per request, one frame per layer, as a
prefill chunk of that many blocks sends. Both caches on GPU 0 (two engines' pools
on one GPU: device to device), and, where two GPUs are visible, GPU 0 -> GPU 1
(peer copies). The same bytes, every way in one run:

* ``transport`` — through the in-process link and ports, as PD runs it: each frame
  is one PD copy kernel (``kernels/pd_copy.cu``), awaited (landed) before the next
  is sent;
* ``enqueued``  — the same per-layer kernels enqueued back to back, one wait at the
  end (what the copies cost without the per-frame round trip to the host);
* ``enqueued_ops`` — the CuPy ops the kernel replaced (per role an index upload, a
  gather into a temporary and a scatter; still the path where two GPUs cannot
  reach each other), enqueued back to back: the before;
* ``kernel_only`` — the same kernels launched from a tight loop with their arguments
  packed beforehand, timed with CUDA events: what the GPU side of a frame costs;
* ``contiguous`` — one ``cudaMemcpyAsync`` (``cudaMemcpyPeerAsync``) per frame of
  the same size between contiguous buffers: the ceiling;
* ``staged`` / ``staged_ops`` / ``staged_contiguous`` (one GPU only) — the TCP
  transport's GPU ends without the socket: per frame the prefill side's ``read``
  (gather into pinned host rows) and the decode side's ``write`` (the frame into
  pinned staging, scattered into the blocks), by the kernel / by the CuPy ops;
  against one contiguous device -> pinned copy, the host copy into staging and one
  contiguous pinned -> device copy per frame, each waited for as ``read``/``write`` do.

Run (repository root, on a GPU machine): python benchmarks/bench_pd_gpu.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.pd_peer import CudaBlockMemory, enable_peer_access, gpu_count
from kvflow.layout import preset
from kvflow.pd.ports import prompt_digest
from kvflow.pd.transports import inproc_ports


def cpu_s() -> float:
    """This process's CPU seconds, user + system (ns resolution: ``os.times`` counts
    10 ms ticks, too coarse for a few ms of work)."""
    return time.process_time()


def caches(spec: Any, pool: int, src_dev: int, dst_dev: int) -> tuple[Any, Any]:
    import cupy as cp

    sizes = [r.bytes_per_block for r in spec.layout.roles]
    out = []
    for dev in (src_dev, dst_dev):
        with cp.cuda.Device(dev):
            out.append(CudaBlockMemory(dev, [cp.random.randint(
                0, 256, (spec.num_layers, pool, b), dtype=np.uint8) for b in sizes]))
            cp.cuda.Device().synchronize()
    return out[0], out[1]


async def transport(spec: Any, src: Any, dst: Any, s_ids: np.ndarray, d_ids: np.ndarray,
                    requests: int) -> float:
    send, recv = inproc_ports((spec, src), (spec, dst))
    keys = list(range(len(s_ids)))
    t0 = time.perf_counter()
    for i in range(requests):
        done = asyncio.get_running_loop().create_future()
        await recv.expect(f"r{i}", 0, d_ids, prompt_digest(keys, 0, len(keys)),
                          lambda layer: None, done.set_result)
        pull = await send.pull(f"r{i}")
        for layer in range(spec.num_layers):
            await send.put(pull, layer, 0, s_ids)
        assert await done is None
    return time.perf_counter() - t0


async def enqueued(spec: Any, src: Any, dst: Any, s_ids: np.ndarray, d_ids: np.ndarray,
                   requests: int) -> float:
    t0 = time.perf_counter()
    pending = []
    for _ in range(requests):
        for layer in range(spec.num_layers):
            pending.append(dst.copy_from(src, layer, s_ids, d_ids))
    await asyncio.gather(*pending)
    return time.perf_counter() - t0


async def enqueued_ops(spec: Any, src: Any, dst: Any, s_ids: np.ndarray,
                       d_ids: np.ndarray, requests: int) -> float:
    t0 = time.perf_counter()
    pending = []
    for _ in range(requests):
        for layer in range(spec.num_layers):
            pending.append(dst._copy_by_gather(src, layer, s_ids, d_ids))
    await asyncio.gather(*pending)
    return time.perf_counter() - t0


def kernel_only(spec: Any, src: Any, dst: Any, s_ids: np.ndarray, d_ids: np.ndarray,
                requests: int) -> float:
    import cupy as cp

    # the arguments ``enqueued`` packed for this chunk (it runs first)
    packed = next(c.packed[src._key] for c in dst._ids.values() if src._key in c.packed)
    n = len(s_ids)
    with cp.cuda.Device(dst.device):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(dst.stream)
        for _ in range(requests):
            for layer in range(spec.num_layers):
                dst._launch(packed, layer, n, dst._device_ctas())
        end.record(dst.stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / 1e3


def staged(spec: Any, src: Any, dst: Any, s_ids: np.ndarray, d_ids: np.ndarray,
           requests: int, ops: bool) -> float:
    t0 = time.perf_counter()
    for _ in range(requests):
        for layer in range(spec.num_layers):
            if ops:
                rows = src._read_by_gather(layer, s_ids, pinned_rows(len(s_ids),
                                                                     src.layer_bytes))
                dst._write_by_scatter(layer, d_ids, pinned_copy(dst, rows))
            else:
                dst.write(layer, d_ids, src.read(layer, s_ids))
    return time.perf_counter() - t0


def pinned_rows(n: int, row: int) -> np.ndarray:
    """What ``read`` returns a frame in: fresh pinned memory (from CuPy's pool)."""
    import cupy as cp

    return np.frombuffer(cp.cuda.alloc_pinned_memory(n * row), np.uint8, n * row).reshape(n, row)


def pinned_copy(mem: Any, rows: np.ndarray) -> np.ndarray:
    """What ``write`` does before its scatter: the frame into (reused) pinned staging."""
    import cupy as cp

    if mem._staging is None or mem._staging.nbytes < rows.nbytes:
        mem._staging = np.frombuffer(cp.cuda.alloc_pinned_memory(rows.nbytes), np.uint8)
    host = mem._staging[:rows.nbytes].reshape(rows.shape)
    np.copyto(host, rows)
    return host


def staged_contiguous(nbytes: int, frames: int) -> float:
    import cupy as cp

    rt = cp.cuda.runtime
    a = cp.random.randint(0, 256, nbytes, dtype=np.uint8)
    b = cp.empty(nbytes, dtype=np.uint8)
    out = np.frombuffer(cp.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
    stage = np.frombuffer(cp.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(frames):
        rt.memcpyAsync(out.ctypes.data, a.data.ptr, nbytes, rt.memcpyDeviceToHost, s.ptr)
        s.synchronize()
        np.copyto(stage, out)
        rt.memcpyAsync(b.data.ptr, stage.ctypes.data, nbytes, rt.memcpyHostToDevice, s.ptr)
        s.synchronize()
    return time.perf_counter() - t0


def contiguous(nbytes: int, frames: int, src_dev: int, dst_dev: int) -> float:
    import cupy as cp

    with cp.cuda.Device(src_dev):
        a = cp.random.randint(0, 256, nbytes, dtype=np.uint8)
    with cp.cuda.Device(dst_dev):
        b = cp.empty(nbytes, dtype=np.uint8)
        s = cp.cuda.Stream(non_blocking=True)
        cp.cuda.Device(src_dev).synchronize()
        t0 = time.perf_counter()
        for _ in range(frames):
            if src_dev == dst_dev:
                cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes,
                                            cp.cuda.runtime.memcpyDeviceToDevice, s.ptr)
            else:
                cp.cuda.runtime.memcpyPeerAsync(b.data.ptr, dst_dev, a.data.ptr, src_dev,
                                                nbytes, s.ptr)
        s.synchronize()
        return time.perf_counter() - t0


def measure(args: argparse.Namespace, src_dev: int, dst_dev: int) -> dict[str, Any]:
    spec = preset(args.model)
    src, dst = caches(spec, args.pool, src_dev, dst_dev)
    rng = np.random.default_rng(0)
    s_ids = rng.permutation(args.pool)[:args.blocks]
    d_ids = rng.permutation(args.pool)[:args.blocks]
    frame = args.blocks * spec.layout.bytes_per_layer_block
    frames = args.requests * spec.num_layers
    total = frame * frames
    best: dict[str, tuple[float, float]] = {}

    def keep(name: str, c0: float, wall: float) -> None:
        if name not in best or wall < best[name][0]:
            best[name] = (wall, cpu_s() - c0)

    for _ in range(args.repeat):
        for name, fn in (("transport", transport), ("enqueued", enqueued),
                         ("enqueued_ops", enqueued_ops)):
            c0 = cpu_s()
            keep(name, c0, asyncio.run(fn(spec, src, dst, s_ids, d_ids, args.requests)))
        c0 = cpu_s()
        keep("contiguous", c0, contiguous(frame, frames, src_dev, dst_dev))
        if src_dev == dst_dev and dst._kernel is not None:
            c0 = cpu_s()
            keep("kernel_only", c0, kernel_only(spec, src, dst, s_ids, d_ids, args.requests))
        if src_dev == dst_dev:
            for name, ops in (("staged", False), ("staged_ops", True)):
                c0 = cpu_s()
                keep(name, c0, staged(spec, src, dst, s_ids, d_ids, args.requests, ops))
            c0 = cpu_s()
            keep("staged_contiguous", c0, staged_contiguous(frame, frames))
    # the bytes landed where they should (one layer of the last request, every role)
    import cupy as cp

    for a, b in zip(src.arrays, dst.arrays, strict=True):
        assert np.array_equal(cp.asnumpy(a[5][cp.asarray(s_ids)]),
                              cp.asnumpy(b[5][cp.asarray(d_ids)]))
    out = {k: {"wall_s": w, "cpu_s": c, "GB_per_s": total / w / 1e9} for k, (w, c) in best.items()}
    for k in ("transport", "enqueued", "enqueued_ops", "kernel_only", "staged", "staged_ops"):
        ceiling = out.get("staged_contiguous" if k.startswith("staged") else "contiguous")
        if k in out and ceiling is not None:
            out[k]["share_of_contiguous"] = out[k]["GB_per_s"] / ceiling["GB_per_s"]
    return {"src": src_dev, "dst": dst_dev, "frame_bytes": frame, "frames": frames,
            "bytes": total, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--pool", type=int, default=256)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import cupy as cp

    pairs = [(0, 0)] + ([(0, 1)] if gpu_count() >= 2 else [])
    res = {"date": time.strftime("%Y-%m-%d"),
           "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "gpus": gpu_count(), "host": platform.node(),
           "command": "python benchmarks/bench_pd_gpu.py " + " ".join(sys.argv[1:]),
           "runs": []}
    for a, b in pairs:
        peer = enable_peer_access(a, b)
        r = measure(args, a, b)
        r["peer_access"] = peer
        res["runs"].append(r)
        kib = r["frame_bytes"] // args.blocks // 1024
        print(f"GPU {a} -> GPU {b}: {args.blocks} blocks x {kib} KiB per frame, "
              f"{r['frames']} frames ({r['bytes'] / 1e9:.2f} GB), best of "
              f"{args.repeat}")
        for k in ("contiguous", "kernel_only", "enqueued", "transport", "enqueued_ops",
                  "staged_contiguous", "staged", "staged_ops"):
            if k not in r:
                continue
            x = r[k]
            share = (f"  {x['share_of_contiguous']:.1%} of contiguous"
                     if "share_of_contiguous" in x else "")
            print(f"  {k:17s} {x['GB_per_s']:8.1f} GB/s  wall {x['wall_s'] * 1e3:8.2f} ms  "
                  f"cpu {x['cpu_s'] * 1e3:8.2f} ms{share}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
