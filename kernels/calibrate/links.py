"""Calibration of the links: what a copy between host and device costs on this GPU.

Raw ceilings (one contiguous ``cudaMemcpyAsync`` each way and both at once,
4 KB copies for per-op latency), first ``CudaBackend`` ops of k scattered
blocks timed with CUDA events as a GPU replay times them (alone and beside
executor steps), the swap kernels by block size and CTA count, and the
transfers of a small GPU replay (``measure_replay_links``), which run slower
than isolated ops and are what the simulator's links are fitted to.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kernels._cuda import cupy_module
from kernels.calibrate.fit import Log, fit_link
from kernels.testing import spin
from kvflow.layout import ModelSpec
from kvflow.manager import OpKind, TransferOp
from kvflow.radix import Tier

_H2D, _D2H = 1, 2


def gpu_seconds(cp: Any, stream: Any, enqueue: Callable[[], None], reps: int,
                 stat: Callable[[list[float]], float] = statistics.median) -> float:
    times = []
    for _ in range(reps + 1):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        enqueue()
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return stat(times[1:])


def measure_raw_link(log: Log, nbytes: int = 256 << 20, reps: int = 5) -> dict[str, Any]:
    """Contiguous ceilings each way and both ways, and per-op time of 4 KB copies."""
    cp = cupy_module()
    rt = cp.cuda.runtime
    dev = cp.empty(2 * nbytes, dtype=cp.uint8)
    host = cp.cuda.alloc_pinned_memory(2 * nbytes)
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    d0, h0 = int(dev.data.ptr), int(host.ptr)
    out: dict[str, Any] = {}
    out["h2d_Bps"] = nbytes / gpu_seconds(
        cp, s1, lambda: rt.memcpyAsync(d0, h0, nbytes, _H2D, s1.ptr), reps, min)
    out["d2h_Bps"] = nbytes / gpu_seconds(
        cp, s1, lambda: rt.memcpyAsync(h0, d0, nbytes, _D2H, s1.ptr), reps, min)

    def both() -> None:
        ev = cp.cuda.Event()
        ev.record(s1)
        s2.wait_event(ev)
        rt.memcpyAsync(d0, h0, nbytes, _H2D, s1.ptr)
        rt.memcpyAsync(h0 + nbytes, d0 + nbytes, nbytes, _D2H, s2.ptr)
        ev2 = cp.cuda.Event()
        ev2.record(s2)
        s1.wait_event(ev2)

    out["both_Bps"] = 2 * nbytes / gpu_seconds(cp, s1, both, reps, min)
    n = 200
    for name, kind, (dst, src) in (("h2d", _H2D, (d0, h0)), ("d2h", _D2H, (h0, d0))):
        def small(kind: int = kind, dst: int = dst, src: int = src) -> None:
            spin(s1, 0.01)  # queued behind a spin: the GPU, not Python's call rate, is timed
            for i in range(n):
                rt.memcpyAsync(dst + i * 4096, src + i * 4096, 4096, kind, s1.ptr)

        t = gpu_seconds(cp, s1, small, reps) - 0.01
        out[f"{name}_op_4k_s"] = max(t, 0.0) / n
    log(f"raw link: h2d {out['h2d_Bps'] / 1e9:.1f} GB/s, d2h {out['d2h_Bps'] / 1e9:.1f}, both "
        f"{out['both_Bps'] / 1e9:.1f}; 4 KB copy {out['h2d_op_4k_s'] * 1e6:.2f} / "
        f"{out['d2h_op_4k_s'] * 1e6:.2f} us")
    del dev, host
    return out


async def _backend_ops(backend: Any, pairs: list[tuple[Tier, Tier, list[int], list[int]]],
                       ) -> list[float]:
    """Submit ops at once (each on its own stream), return each one's event-timed seconds.

    Timed as a GPU replay times them (``kernels.world.cuda_service_s``): from
    the task's start event, recorded right before its first copy (after the
    host has validated and prepared the op), to an event after its last.
    """
    from kernels.backend import FutureSink

    cp = cupy_module()
    backend.record_starts = True
    recs = []
    for i, (src, dst, s, d) in enumerate(pairs):
        sink = FutureSink(backend.num_layers)
        task = backend.submit(TransferOp(10_000 + i, OpKind.EVICT, src, dst, s, d, []), sink)
        recs.append((task, sink))
    for _, sink in recs:
        await sink.wait()
    return [cp.cuda.get_elapsed_time(t.start_event, t.end_event) / 1e3 for t, _ in recs]


async def scattered_op_seconds(backend: Any, src: Tier, dst: Tier, k: int, pool: int,
                               reps: int, rng: np.random.Generator, gap_s: float = 0.0
                               ) -> float:
    """Median event-timed seconds of ``reps`` ops of ``k`` random ids out of ``pool`` on
    each side, one at a time; ``gap_s``: up to that long (uniform) between them, so ops
    land anywhere in whatever else runs."""
    ts: list[float] = []
    for _ in range(reps):
        s = rng.permutation(pool)[:k].tolist()
        d = rng.permutation(pool)[:k].tolist()
        ts += await _backend_ops(backend, [(src, dst, s, d)])
        if gap_s:
            await asyncio.sleep(gap_s * rng.random())
    return statistics.median(ts)


async def measure_backend_links(spec: ModelSpec, log: Log, reps: int = 5,
                                sizes: Sequence[int] = (1, 2, 3, 4, 6, 8, 16),
                                stream_priority: int | None = None,
                                under_load: bool = False, dma: str = "auto",
                                ceilings: dict[str, float] | None = None) -> dict[str, Any]:
    """CudaBackend ops of k scattered blocks each way (and both at once); fitted link models.

    ``under_load``: while ``GpuExecutor`` steps run back to back on other blocks
    (8 decodes at context 4096 and a prefill of 1024 tokens at 2048), which is when
    the engine moves KV: loads are submitted as their request's step starts,
    backups as a request finishes amid other requests' steps. The swap kernel
    then shares the SMs with compute.
    """
    from kernels.backend import CudaBackend
    from kernels.fast import DEFAULT_EXECUTOR, make_executor
    from kernels.model import StepItem

    n = 2 * max(sizes) + 2
    bt = spec.block_tokens
    extra = 8 * -(-4097 // bt) + -(-3072 // bt) + 1 if under_load else 0
    backend = CudaBackend(spec, n + extra, n, stream_priority=stream_priority, dma=dma)
    for layer in range(spec.num_layers):  # real bytes, not zeros
        for role in ("k", "v"):
            kv = backend.device_kv(layer, role)
            kv[...] = cupy_module().random.randint(0, 255, kv.shape, dtype=np.uint8)
    cupy_module().cuda.runtime.deviceSynchronize()  # (default stream: not ordered with ours)
    churn: asyncio.Task[None] | None = None
    stop = asyncio.Event()
    if under_load:
        ex = make_executor(DEFAULT_EXECUTOR, backend, seed=0, max_tokens=2048)
        await ex.warm_up(block=n + extra - 1)
        per = -(-4097 // bt)
        dec = [StepItem(("d", i), True, np.array([5], dtype=np.int32), 4096,
                        np.arange(n + i * per, n + (i + 1) * per, dtype=np.int32), True)
               for i in range(8)]
        first = n + 8 * per
        pre = [StepItem("p", False, np.arange(1024, dtype=np.int32), 2048,
                        np.arange(first, first + -(-3072 // bt), dtype=np.int32), True)]

        async def run_compute() -> None:
            # one kind of step, back to back: every op sees the same load
            while not stop.is_set():
                await ex.run_items([*dec, *pre])

        churn = asyncio.ensure_future(run_compute())
        await asyncio.sleep(0.05)
    rng = np.random.default_rng(0)
    units = spec.num_layers
    per_block = spec.bytes_per_block
    out: dict[str, Any] = {"bytes_per_block": per_block, "units_per_op": units,
                           "copy_path": "copy engine (batched)" if backend.use_dma
                           else "swap kernel"}
    for name, src, dst in (("h2d", Tier.HOST, Tier.DEVICE), ("d2h", Tier.DEVICE, Tier.HOST)):
        # Warm up every size once: a first batch over fresh addresses can stall.
        for k in sizes:
            await _backend_ops(backend, [(src, dst, rng.permutation(n)[:k].tolist(),
                                          rng.permutation(n)[:k].tolist())])
        pts = [(k * per_block, await scattered_op_seconds(backend, src, dst, k, n, reps, rng))
               for k in sizes]
        lat, bw = fit_link(pts, units, max_bandwidth_Bps=(ceilings or {}).get(f"{name}_Bps"))
        out[name] = {"latency_s": lat, "bandwidth_Bps": bw,
                     "points": [(b, t) for b, t in pts]}
        log(f"backend {name}{' under load' if under_load else ''}: {bw / 1e9:.2f} GB/s, "
            f"{lat * 1e6:.2f} us per layer unit "
            f"(ops of {', '.join(map(str, sizes))} blocks of {per_block / 2**20:.1f} MiB)")
    k = max(sizes)
    both = []
    for _ in range(reps):
        perm = rng.permutation(n)
        a, b = perm[:k].tolist(), perm[k:2 * k].tolist()
        both.append(await _backend_ops(backend, [(Tier.HOST, Tier.DEVICE, a, a),
                                                 (Tier.DEVICE, Tier.HOST, b, b)]))
    t_in = statistics.median(t[0] for t in both)
    t_out = statistics.median(t[1] for t in both)
    out["both"] = {"h2d_Bps": k * per_block / t_in, "d2h_Bps": k * per_block / t_out}
    log(f"backend both ways at once ({k} blocks each): h2d {out['both']['h2d_Bps'] / 1e9:.2f}"
        f" GB/s, d2h {out['both']['d2h_Bps'] / 1e9:.2f} GB/s")
    if churn is not None:
        stop.set()
        await churn
    backend.synchronize()
    out["under_load"] = under_load
    return out


def measure_swap_kernels(log: Log, volume: int = 128 << 20, reps: int = 5,
                         blocks: Sequence[int] = (16 << 10, 128 << 10, 1 << 20),
                         ctas: Sequence[int] = (2, 4, 8, 16)) -> list[dict[str, Any]]:
    """BlockCopier bandwidth (GB/s) over scattered ids, by block size and CTAs, each way."""
    from kernels.swap import BlockCopier, SwapKernels

    cp = cupy_module()
    dev = cp.random.randint(0, 255, 2 * volume, dtype=np.uint8)
    host = cp.cuda.alloc_pinned_memory(2 * volume)
    cp.cuda.runtime.deviceSynchronize()
    kernels = SwapKernels()
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(1)
    rows = []
    for block in blocks:
        n = volume // block
        cap = 2 * n
        dbase = np.array([[int(dev.data.ptr)]], dtype=np.int64)
        hbase = np.array([[int(host.ptr)]], dtype=np.int64)
        for c in ctas:
            row: dict[str, Any] = {"block_bytes": block, "ctas": c}
            for name, src, dst in (("h2d", hbase, dbase), ("d2h", dbase, hbase)):
                cop = BlockCopier(src, dst, [block], cap, cap, ctas=c, min_run_bytes=0,
                                  kernels=kernels)
                s_ids = rng.permutation(cap)[:n].astype(np.int32)
                d_ids = rng.permutation(cap)[:n].astype(np.int32)
                prep = cop.prepare(s_ids, d_ids, stream)
                t = gpu_seconds(cp, stream, lambda cop=cop, prep=prep: cop.launch(prep, stream),
                                 reps)
                stream.synchronize()
                prep.release()
                row[f"{name}_GBps"] = n * block / t / 1e9
            rows.append(row)
        log("swap kernel " + f"{block >> 10} KB: " + ", ".join(
            f"{r['ctas']} CTAs {r['h2d_GBps']:.1f}/{r['d2h_GBps']:.1f}"
            for r in rows if r["block_bytes"] == block) + " GB/s (h2d/d2h)")
    del dev, host
    return rows




REPLAY_LINK_SIZES = (1, 2, 3, 4, 5, 6) * 3 + (8, 10, 12, 16)
#: Output tokens of each links-replay request: enough decode steps that copies land
#: while other requests decode, as in the engine's replays (small copies ran 2-9%
#: slower under any compute than on an idle GPU: benchmarks/copy_under_load.py); with 4
#: tokens the second wave's loads met an idle GPU and the fit fell short of replays' ops.
REPLAY_LINK_OUTPUT = 24


def measure_replay_links(spec: ModelSpec, log: Log, ceilings: dict[str, float] | None = None,
                         backend_options: dict[str, Any] | None = None,
                         sizes: Sequence[int] = REPLAY_LINK_SIZES,
                         host_layout: str = "layer_major",
                         first_wave_gap_s: float = 0.0) -> dict[str, Any]:
    """The link model fitted to the transfers of a small GPU replay, as replays see them.

    Isolated ops (``measure_backend_links``) miss what a replay adds around a
    transfer: the other direction busy, compute and host work in between,
    small ops. So a replay through ``kvflow replay --backend cuda``'s harness:
    a first wave of prompts of ``sizes`` blocks (finishing ones back up to
    host: device -> host ops of each size), then the same prompts, one block
    longer, arriving one every 40 ms into a device pool too small to have
    kept them: each loads its prefix back from host (host -> device ops of
    each size) while the others compute. ``fit_link`` on each direction's
    (bytes, service time) gives ``latency_s`` and ``bandwidth_Bps``.

    ``host_layout``: the replay's host pool layout (``kvflow.host_layout``); an op
    then moves a group of layers per unit, so the fit's units per op are the
    layout's groups (``latency_s`` is per group), as the simulator charges them.
    ``first_wave_gap_s``: the first wave's prompts arrive this far apart (0: all at
    once), so that their backups meet a few requests' decode steps, not one burst of
    prefills (whose kernels hold the SMs a grouped layout's gather needs).
    """
    import tempfile

    from kernels.world import run_gpu_replay
    from kvflow.host_layout import HostLayout
    from kvflow.replay import ReplayConfig
    from traces.schema import Request
    from traces.writer import write_generic

    bt = spec.block_tokens
    first = 1 << 41
    reqs, prefixes = [], []
    requests = len(sizes)
    for i, k in enumerate(sizes):
        ids = tuple(range(first, first + k + 1))
        first += k + 1
        prefixes.append(ids)
        reqs.append(Request(i, i * first_wave_gap_s, k * bt, REPLAY_LINK_OUTPUT, ids[:k]))
    wave2 = 3.0 + requests * first_wave_gap_s  # s: the first wave (~56k prompt tokens) is
    # done by then
    for i, ids in enumerate(prefixes):
        reqs.append(Request(requests + i, wave2 + 0.04 * i, len(ids) * bt, REPLAY_LINK_OUTPUT,
                            ids))
    blocks = sum(-(-(len(ids) * bt + REPLAY_LINK_OUTPUT) // bt) for ids in prefixes)
    ops: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="kvflow-calibrate-") as tmp:
        trace = Path(tmp) / "links.jsonl"
        write_generic(reqs, trace, block_tokens=bt, source="kvflow calibrate")
        # A device pool for about two of the largest requests: the first wave
        # leaves little on the device, so the second loads almost all from host.
        cfg = ReplayConfig(trace=str(trace), model=spec.name,
                           device_blocks=2 * (max(sizes) + 2) + 4, host_blocks=2 * blocks,
                           storage_blocks=0, backend="cuda", host_layout=host_layout)
        run_gpu_replay(cfg, backend_options=backend_options or {}, op_log=ops)
    units = len(HostLayout.parse(host_layout).groups(spec.num_layers))
    per_block = spec.bytes_per_block
    out: dict[str, Any] = {"ops": len(ops), "host_layout": host_layout, "units_per_op": units,
                           "block_tokens": bt, "bytes_per_block": per_block}
    for name in ("h2d", "d2h"):
        pts = [(n * per_block, t) for _, link, n, t in ops if link == name and n > 0]
        sizes = {b for b, _ in pts}
        if len(pts) < 8 or len(sizes) < 3:
            log(f"replay links: {len(pts)} {name} ops of {len(sizes)} sizes: too few to fit")
            continue
        # one point per size (the median), as for isolated ops
        by_size: dict[float, list[float]] = {}
        for b, t in pts:
            by_size.setdefault(b, []).append(t)
        med = sorted((b, statistics.median(ts)) for b, ts in by_size.items())
        lat, bw = fit_link(med, units, max_bandwidth_Bps=(ceilings or {}).get(f"{name}_Bps"))
        out[name] = {"latency_s": lat, "bandwidth_Bps": bw, "ops": len(pts), "points": med}
        log(f"replay links {name} ({host_layout}): {bw / 1e9:.2f} GB/s, {lat * 1e6:.2f} us "
            f"per unit of {spec.num_layers // units} layer(s) ({len(pts)} ops of {len(sizes)} "
            "sizes in a GPU replay)")
    return out


