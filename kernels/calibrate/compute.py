"""Calibration of compute: the executor's GEMMs by rows, HBM, attention, and whole steps.

The weight GEMMs over ``GEMM_ROWS`` (their efficiency curve becomes the
profile's ``gemm_efficiency``), cuBLAS for reference, HBM copy bandwidth,
attention throughput, then ``GpuExecutor`` steps over a grid of prefill and
decode batches timed by events: the points ``fit_roofline`` fits.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from kernels._cuda import cupy_module
from kernels.calibrate.fit import Log, StepPoint, step_point
from kernels.calibrate.links import gpu_seconds
from kvflow.layout import ModelSpec

#: Rows at which the executor's weight GEMMs are timed: their efficiency curve
#: (``kvflow.cost.gemm_shape``) spans a decode of one sequence to a full chunk.
GEMM_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def measure_matmuls(log: Log, reps: int = 5) -> dict[str, Any]:
    """cuBLAS fp16 8192^3 (reference peak) and a 4 GiB device copy (HBM, read + write)."""
    cp = cupy_module()
    stream = cp.cuda.Stream(non_blocking=True)
    out: dict[str, Any] = {}
    with stream:
        ab = [cp.random.standard_normal((8192, 8192), dtype=cp.float32).astype(cp.float16)
              for _ in range(2)]
        t = gpu_seconds(cp, stream, lambda: cp.matmul(ab[0], ab[1]), reps)
        out["cublas_fp16_8192_flops"] = 2 * 8192**3 / t
        ab.clear()
        xy = [cp.empty(1 << 31, dtype=cp.uint8) for _ in range(2)]
        t = gpu_seconds(cp, stream, lambda: xy[1].__setitem__(Ellipsis, xy[0]), reps)
        out["hbm_copy_Bps"] = 2 * (1 << 31) / t
        xy.clear()
    log(f"cuBLAS fp16 8192^3: {out['cublas_fp16_8192_flops'] / 1e12:.0f} TFLOP/s; "
        f"device copy: {out['hbm_copy_Bps'] / 1e12:.2f} TB/s (read + write)")
    return out


async def measure_executor(spec: ModelSpec, log: Log, reps: int = 3,
                           stream_priority: int | None = None) -> dict[str, Any]:
    """GEMM and attention throughput of the executor, and its steps over a batch grid."""
    from kernels.backend import CudaBackend
    from kernels.fast import DEFAULT_EXECUTOR, make_executor
    from kernels.model import ModelShape, StepItem

    cp = cupy_module()
    shape = ModelShape.from_spec(spec)
    bt = spec.block_tokens
    # Long prompts arrive as full chunks at growing contexts: 8192@16384 and @32768 are
    # where a long-context replay spends its time.
    prefills = [(512, 0), (2048, 0), (8192, 0), (1024, 2048), (1024, 4096), (4096, 4096),
                (2048, 8192), (8192, 8192), (4096, 16384), (1024, 32768), (256, 4096),
                (8192, 16384), (8192, 32768), (2048, 32768),
                # just past a wave of prefill attention CTAs / a GEMM row tile, and short
                # of it: where tile quantisation shows (Tiles in kernels.calibrate.fit)
                (1024, 3072), (1056, 3072), (1088, 4096), (1152, 4096), (1280, 4096),
                (1536, 4096), (960, 4096)]
    decodes = [(1, 1024), (8, 4096), (32, 4096), (32, 8192), (64, 2048)]
    mixed = [((2048, 0), (16, 4096))]
    need = max(max(-(-(n + c) // bt) for n, c in prefills),
               max(b * -(-(c + 1) // bt) for b, c in decodes))
    backend = CudaBackend(spec, need + 4, 1, stream_priority=stream_priority)
    # The replays' executor (kernels.fast): the steps fitted later mix these with theirs.
    ex = make_executor(DEFAULT_EXECUTOR, backend, seed=0, max_tokens=8192 + 64)
    await ex.warm_up(block=need + 3)
    # every block gets real KV values: run prefills over the whole pool once
    rng = np.random.default_rng(2)

    def prefill_item(n: int, ctx: int, first: int = 0) -> StepItem:
        table = np.arange(first, first + -(-(n + ctx) // bt), dtype=np.int32)
        return StepItem(("p", n, ctx), False, rng.integers(0, 1 << 30, n).astype(np.int32), ctx,
                        table, True)

    for start in range(0, need, 16):  # fill KV (16 blocks per step)
        k = min(16, need - start)
        await ex.run_items([prefill_item(k * bt, 0, start)])

    def decode_items(b: int, ctx: int) -> list[StepItem]:
        per = -(-(ctx + 1) // bt)
        return [StepItem(("d", i), True, np.array([7], dtype=np.int32), ctx,
                         np.arange(i * per, (i + 1) * per, dtype=np.int32), True)
                for i in range(b)]

    async def gpu_time(items: list[StepItem]) -> float:
        ts = []
        for _ in range(reps + 1):
            await ex.run_items(items)
            ts.append(ex.last_gpu_s)
        return statistics.median(ts[1:])

    points: list[StepPoint] = []
    for n, c in prefills:
        t = await gpu_time([prefill_item(n, c)])
        points.append(step_point(f"prefill {n}@{c}", spec, [(n, c)], [], t))
    for b_, c in decodes:
        t = await gpu_time(decode_items(b_, c))
        points.append(step_point(f"decode {b_}x{c}", spec, [], [c + 1] * b_, t))
    for (n, c), (b_, dc) in mixed:
        items = [*decode_items(b_, dc), prefill_item(n, c, b_ * -(-(dc + 1) // bt))]
        t = await gpu_time(items)
        points.append(step_point(f"mixed {n}@{c}+{b_}x{dc}", spec, [(n, c)], [dc + 1] * b_, t))

    # GEMM throughput of the executor's kernel, per layer's four GEMMs
    gemm = {}
    for m in GEMM_ROWS:
        x = cp.zeros((m, max(shape.hidden, shape.intermediate, shape.q_dim)), cp.uint16)
        x[...] = 0x3F80  # 1.0 in bf16: real values, no zeros
        out16 = cp.empty((m, max(shape.qkv_dim, 2 * shape.intermediate)), cp.uint16)
        out32 = cp.zeros((m, shape.hidden), cp.float32)
        xp, o16, o32 = (np.uint64(a.data.ptr) for a in (x, out16, out32))
        cp.cuda.runtime.deviceSynchronize()

        def layer_gemms(m: int = m, xp: np.uint64 = xp, o16: np.uint64 = o16,
                        o32: np.uint64 = o32, w: dict[str, Any] = ex.weights[0]) -> None:
            ex._gemm(xp, w["wqkv"], o16, m, shape.qkv_dim, shape.hidden, 0)
            ex._gemm(xp, w["wo"], o32, m, shape.hidden, shape.q_dim, 1)
            ex._gemm(xp, w["wgu"], o16, m, 2 * shape.intermediate, shape.hidden, 0)
            ex._gemm(xp, w["wd"], o32, m, shape.hidden, shape.intermediate, 1)

        t = gpu_seconds(cp, ex.stream, layer_gemms, 5)
        gemm[m] = {"flops": 2 * m * shape.params_per_layer / t,
                   "weight_Bps": shape.params_per_layer * 2 / t}
    log("executor GEMM (one layer's four): " + ", ".join(
        f"M={m}: {v['flops'] / 1e12:.0f} TFLOP/s ({v['weight_Bps'] / 1e12:.2f} TB/s of weights)"
        for m, v in gemm.items()))
    # attention: the extra time of context (same new tokens)
    by = {p.label: p for p in points}
    att = {}
    for n, c in ((2048, 8192), (4096, 16384), (1024, 32768)):
        base = [p for p in points if p.label == f"prefill {n}@0"]
        if base:
            dt = by[f"prefill {n}@{c}"].seconds - base[0].seconds
        else:  # same tokens at context 0, measured now
            dt = by[f"prefill {n}@{c}"].seconds - await gpu_time([prefill_item(n, 0)])
        pairs_extra = n * c
        flops = spec.num_layers * 4 * shape.heads * shape.head_dim * pairs_extra
        att[f"{n}@{c}"] = flops / dt if dt > 0 else float("nan")
    log("executor attention (extra context): " + ", ".join(
        f"{k}: {v / 1e12:.0f} TFLOP/s" for k, v in att.items()))
    backend.synchronize()
    return {"points": points, "gemm": gemm, "attention_flops": att,
            "prefill_rows": int(getattr(ex, "prefill_rows", 0)),
            "sms": int(cp.cuda.runtime.getDeviceProperties(ex.device)["multiProcessorCount"])}


#: Prompt sizes (blocks) of the links replay: the engine's common small ops three times
#: each (one op of a size is often a stall, and their per-op cost is what small
#: swap-ins and backups pay), a few large ones for the bandwidth.
