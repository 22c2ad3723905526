"""The fast executor (``kernels.fast``) against the exact one, kernel by kernel (issue 22).

On one GPU, in one process, llama-3-8b shapes (32 query heads, 8 KV heads, head
dim 128, hidden 4096, MLP 14336; 4 layers, ``llama-3-8b-l4``), timed with CUDA
events on the executor's stream (median of ``--reps`` after a warm-up):

  gemm     one layer's four weight GEMMs (qkv, o, gate/up, down) at 512..8192
           rows: fast (cuBLAS ``gemmEx``, bf16 in, fp32 accumulate), exact
           (compute.cu), and CuPy's own ``a @ b`` for reference (bf16 where this
           CuPy has ``cupy.bfloat16``, else fp16); fraction of the dense bf16 peak
  prefill  causal attention of one prompt of 1k..8k tokens (all 32 heads, KV
           read through 16- or 32-token blocks), FLOPs = 4 * heads * head_dim *
           n^2 / 2; fraction of the peak; every fast prefill kernel variant, each
           checked against the exact kernel's output (relative L2 error)
  decode   32 sequences x 4k context, one token each: split-K attention plus the
           combine; bytes = the K and V read; fraction of HBM bandwidth; the fast
           kernel at fixed splits and at its automatic one
  steps    whole engine steps of the 4-layer model (GPU time), both executors
  agree    the fast executor's emitted rows and greedy tokens against the exact
           one's on the same (teacher-forced) steps

Ratios are fast / exact, measured in the same process; CPU time beside wall time
per section. Peaks: ``--peak-tflops`` (H100 SXM dense bf16: 989.4) and
``--hbm-tbps`` (H100 SXM: 3.35).

Run (repository root, a CUDA GPU and CuPy):
  PYTHONPATH=. python benchmarks/bench_executor.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from kernels._cuda import cupy_module
from kernels.backend import CudaBackend
from kernels.compute import GpuExecutor, to_bf16
from kernels.fast import PREFILL_VARIANTS, FastExecutor
from kernels.model import ModelShape, StepItem, prompt_tokens
from kvflow.layout import preset

GEMM_ROWS = (512, 1024, 2048, 4096, 8192)
PREFILL_N = (1024, 2048, 4096, 8192)
DECODE = (32, 4096)  # sequences, context
DECODE_SPLITS = (256, 512, 1024, 2048)


def gpu_seconds(cp: Any, stream: Any, enqueue: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps + 1):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        enqueue()
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return statistics.median(times[1:])


class Section:
    """Wall and CPU time of one part of the benchmark; an error in it is printed and
    recorded, and the benchmark goes on with the next part."""

    def __init__(self, name: str, out: dict[str, Any]) -> None:
        self.name, self.out = name, out

    def __enter__(self) -> Section:
        self.t, self.c = time.perf_counter(), time.process_time()
        print(f"[{self.name}] ...", flush=True)
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> bool:
        w, c = time.perf_counter() - self.t, time.process_time() - self.c
        self.out.setdefault("sections", {})[self.name] = {"wall_s": w, "cpu_s": c}
        print(f"[{self.name}] {w:.1f} s wall, {c:.1f} s CPU", flush=True)
        if exc is not None and isinstance(exc, Exception):
            traceback.print_exception(exc)
            self.out.setdefault("errors", {})[self.name] = repr(exc)
            return True
        return False


def fill_kv(cp: Any, backend: CudaBackend) -> None:
    """Random bf16 N(0, 1) in every block of every layer and role."""
    rs = cp.random.RandomState(3)
    for layer in range(backend.num_layers):
        for role in ("k", "v"):
            kv = backend.device_kv(layer, role).view(cp.uint16)
            kv[...] = to_bf16(rs.standard_normal(kv.shape, dtype=cp.float32))
    cp.cuda.runtime.deviceSynchronize()


def fill_qkv(cp: Any, ex: GpuExecutor, rows: int) -> None:
    rs = cp.random.RandomState(4)
    ex._qkv[:rows] = to_bf16(rs.standard_normal((rows, ex.shape.qkv_dim), dtype=cp.float32))
    cp.cuda.runtime.deviceSynchronize()


def gemm_row(cp: Any, exs: dict[str, GpuExecutor], shape: ModelShape, m: int, reps: int,
             peak: float) -> dict[str, Any]:
    """One layer's four GEMMs at ``m`` rows, each executor's way and CuPy's ``a @ b``."""
    w0 = exs["exact"].weights[0]
    width = max(shape.hidden, shape.intermediate, shape.q_dim)
    x = to_bf16(cp.random.standard_normal((m, width), dtype=cp.float32))
    o16 = cp.empty((m, max(shape.qkv_dim, 2 * shape.intermediate)), cp.uint16)
    o32 = cp.zeros((m, shape.hidden), cp.float32)
    xp, p16, p32 = (np.uint64(a.data.ptr) for a in (x, o16, o32))
    cp.cuda.runtime.deviceSynchronize()
    flops = 2.0 * m * shape.params_per_layer
    row: dict[str, Any] = {"rows": m}

    def figures(t: float) -> dict[str, float]:
        return {"s": t, "tflops": flops / t / 1e12, "of_peak": flops / t / peak}

    for kind, ex in exs.items():
        def layer(ex: GpuExecutor = ex) -> None:
            ex._gemm(xp, w0["wqkv"], p16, m, shape.qkv_dim, shape.hidden, 0)
            ex._gemm(xp, w0["wo"], p32, m, shape.hidden, shape.q_dim, 1)
            ex._gemm(xp, w0["wgu"], p16, m, 2 * shape.intermediate, shape.hidden, 0)
            ex._gemm(xp, w0["wd"], p32, m, shape.hidden, shape.intermediate, 1)

        row[kind] = figures(gpu_seconds(cp, ex.stream, layer, reps))
    # CuPy's own a @ b for reference: bf16 where this CuPy has it (ml_dtypes), else fp16
    # (the same cuBLAS tensor-core path and bytes), on fresh arrays of each shape.
    dt = getattr(cp, "bfloat16", None) or cp.float16
    pairs = [(cp.random.standard_normal((m, w0[k].shape[1]), dtype=cp.float32).astype(dt),
              cp.random.standard_normal(w0[k].shape, dtype=cp.float32).astype(dt).T)
             for k in ("wqkv", "wo", "wgu", "wd")]
    stream = exs["fast"].stream

    def matmuls() -> None:
        with stream:
            for a, w in pairs:
                _ = a @ w

    row["cupy_matmul"] = {**figures(gpu_seconds(cp, stream, matmuls, reps)),
                          "dtype": cp.dtype(dt).name}
    row["ratio"] = row["exact"]["s"] / row["fast"]["s"]
    return row


def bench_gemm(cp: Any, exs: dict[str, GpuExecutor], shape: ModelShape, reps: int,
               peak: float, rows: tuple[int, ...]) -> list[dict[str, Any]]:
    out = []
    for m in rows:
        row = gemm_row(cp, exs, shape, m, reps, peak)
        out.append(row)
        mm = row["cupy_matmul"]
        print(f"  gemm M={m}: fast {row['fast']['of_peak']:.3f}, exact "
              f"{row['exact']['of_peak']:.3f}, cupy a@b ({mm['dtype']}) {mm['of_peak']:.3f} "
              "of peak", flush=True)
        cp.get_default_memory_pool().free_all_blocks()
    return out


def bench_prefill(cp: Any, exs: dict[str, GpuExecutor], shape: ModelShape, reps: int,
                  peak: float, sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    out = []
    bt = shape.block_tokens
    for n in sizes:
        table = np.arange(-(-n // bt), dtype=np.int32)
        items = [StepItem("p", False, np.arange(n, dtype=np.int32), 0, table, True)]
        flops = 4.0 * shape.heads * shape.head_dim * n * n / 2
        row: dict[str, Any] = {"tokens": n}
        fast = exs["fast"]
        assert isinstance(fast, FastExecutor)
        chosen = fast.prefill
        runs = [("exact", exs["exact"], None), *[(f"fast {v}", fast, v) for v in PREFILL_VARIANTS]]
        ref = None
        for label, ex, variant in runs:
            try:
                if variant is not None:
                    fast.use_prefill(variant)
                plan = ex._build(items)
                meta = ex._upload(plan)
                fill_qkv(cp, ex, n)
                ex._o[:n] = 0
                t = gpu_seconds(cp, ex.stream, lambda ex=ex, plan=plan, meta=meta:
                                ex._attend(plan, meta, 0), reps)
            except Exception as exc:  # one kernel failing leaves the others measured
                row[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                print(f"  prefill n={n} {label}: {row[label]['error']}", flush=True)
                continue
            # attention check: this kernel's output against the exact kernel's (the same
            # Q, K, V), relative L2 error over all rows and heads
            got = (ex._o[:n].astype(cp.uint32) << 16).view(cp.float32)
            if ref is None:
                ref = got.copy()
            err = float(cp.linalg.norm(got - ref) / cp.linalg.norm(ref))
            if not np.isfinite(err):
                err = float("inf")
            row[label] = {"s": t, "tflops": flops / t / 1e12, "of_peak": flops / t / peak,
                          "rel_err": err}
        fast.use_prefill(chosen)
        row["fast"] = row[f"fast {chosen}"]
        row["ratio"] = row["exact"]["s"] / row["fast"]["s"]
        out.append(row)
        print(f"  prefill n={n} (block {bt}): " + ", ".join(
            f"{k} {row[k]['of_peak']:.3f} (err {row[k]['rel_err']:.1e})"
            for k, _, _ in runs if "s" in row[k]) + " of peak", flush=True)
    return out


def bench_decode(cp: Any, exs: dict[str, GpuExecutor], shape: ModelShape, reps: int,
                 hbm: float, first_block: int) -> dict[str, Any]:
    b, ctx = DECODE
    bt = shape.block_tokens
    per = -(-(ctx + 1) // bt)
    items = [StepItem(("d", i), True, np.array([7], dtype=np.int32), ctx,
                      np.arange(first_block + i * per, first_block + (i + 1) * per,
                                dtype=np.int32), True) for i in range(b)]
    nbytes = b * (ctx + 1) * shape.kv_dim * 2 * 2
    row: dict[str, Any] = {"sequences": b, "context": ctx, "block_tokens": bt, "bytes": nbytes}

    def timed(ex: GpuExecutor) -> dict[str, Any]:
        plan = ex._build(items)
        meta = ex._upload(plan)
        fill_qkv(cp, ex, b)
        t = gpu_seconds(cp, ex.stream, lambda: ex._attend(plan, meta, 0), reps)
        return {"s": t, "Bps": nbytes / t, "of_hbm": nbytes / t / hbm,
                "splits_per_seq": len(plan.decode_work) // b}

    for kind, ex in exs.items():
        row[kind] = timed(ex)
    fast = exs["fast"]
    assert isinstance(fast, FastExecutor)
    fixed = fast.fixed_split
    row["fast_by_split"] = {}
    for split in DECODE_SPLITS:
        fast.fixed_split = split
        row["fast_by_split"][split] = timed(fast)
    fast.fixed_split = fixed
    row["ratio"] = row["exact"]["s"] / row["fast"]["s"]
    print(f"  decode {b}x{ctx} (block {bt}): fast {row['fast']['of_hbm']:.3f}, exact "
          f"{row['exact']['of_hbm']:.3f} of HBM; by split: " + ", ".join(
              f"{s}: {v['of_hbm']:.3f}" for s, v in row["fast_by_split"].items()), flush=True)
    return row


async def bench_steps(exs: dict[str, GpuExecutor], shape: ModelShape, reps: int,
                      first_block: int) -> list[dict[str, Any]]:
    bt = shape.block_tokens
    b, ctx = DECODE
    per = -(-(ctx + 1) // bt)
    dec = [StepItem(("d", i), True, np.array([7], dtype=np.int32), ctx,
                    np.arange(first_block + i * per, first_block + (i + 1) * per,
                              dtype=np.int32), True) for i in range(b)]
    cases = {
        "prefill 8192@0": [StepItem("p", False, np.arange(8192, dtype=np.int32), 0,
                                    np.arange(8192 // bt, dtype=np.int32), True)],
        "prefill 2048@6144": [StepItem("p", False, np.arange(2048, dtype=np.int32), 6144,
                                       np.arange(8192 // bt, dtype=np.int32), True)],
        f"decode {b}x{ctx}": dec,
        f"mixed 2048@0+{b}x{ctx}": [*dec, StepItem("p", False, np.arange(2048, dtype=np.int32),
                                                   0, np.arange(2048 // bt, dtype=np.int32),
                                                   True)],
    }
    out = []
    for label, items in cases.items():
        row: dict[str, Any] = {"step": label}
        for kind, ex in exs.items():
            ts = []
            for _ in range(reps + 1):
                await ex.run_items(items)
                ts.append(ex.last_gpu_s)
            row[kind] = {"gpu_s": statistics.median(ts[1:]), "enqueue_s": ex.last_enqueue_s}
        row["ratio"] = row["exact"]["gpu_s"] / row["fast"]["gpu_s"]
        out.append(row)
        print(f"  step {label}: fast {row['fast']['gpu_s'] * 1e3:.2f} ms, exact "
              f"{row['exact']['gpu_s'] * 1e3:.2f} ms ({row['ratio']:.2f}x)", flush=True)
    return out


async def bench_agreement(exs: dict[str, GpuExecutor], shape: ModelShape,
                          first_block: int) -> dict[str, Any]:
    """8 prompts of 1,000 tokens (two chunks, one 600-token step beside decodes), then 16
    decode steps with fixed tokens: the same steps through each executor."""
    bt = shape.block_tokens
    per = -(-1100 // bt)
    reqs = [(f"r{i}", np.arange(first_block + i * per, first_block + (i + 1) * per,
                                dtype=np.int32),
             prompt_tokens([1000 * i + j for j in range(per)], f"r{i}", bt, 0, 1000))
            for i in range(8)]
    steps = [[StepItem(r, False, toks[:400], 0, tab, False) for r, tab, toks in reqs],
             [StepItem(r, False, toks[400:], 400, tab, True) for r, tab, toks in reqs]]
    for k in range(16):
        steps.append([StepItem(r, True, np.array([(31 * k + i) % 1000], dtype=np.int32),
                               1000 + k, tab, True) for i, (r, tab, _) in enumerate(reqs)])
    rows: dict[str, list[np.ndarray]] = {}
    for kind, ex in exs.items():
        got = []
        for items in steps:
            await ex.run_items(items)
            got.append(np.array([ex.rows[it.request_id][-1] for it in items if it.emit]))
        rows[kind] = got
    pairs = [(f, e) for f, e in zip(rows["fast"], rows["exact"], strict=True) if len(e)]
    errs = [float(np.linalg.norm(f - e) / np.linalg.norm(e)) for f, e in pairs]
    f, e = np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])
    agree = float(np.mean(f.argmax(axis=1) == e.argmax(axis=1)))
    print(f"  agreement: max step rel error {max(errs):.2e}, median {statistics.median(errs):.2e};"
          f" greedy tokens equal on {agree:.1%} of {len(f)} positions", flush=True)
    return {"max_rel_err": max(errs), "median_rel_err": statistics.median(errs),
            "token_agreement": agree, "positions": len(f)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    cp = cupy_module()
    peak, hbm = args.peak_tflops * 1e12, args.hbm_tbps * 1e12
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    result: dict[str, Any] = {"device": name, "model": args.model, "peak_flops": peak,
                              "hbm_Bps": hbm, "cupy": cp.__version__,
                              "has_cupy_bfloat16": hasattr(cp, "bfloat16"),
                              "prefill": args.prefill}
    reps = args.reps
    b, ctx = DECODE
    for bt in args.block_tokens:
        spec = preset(args.model, block_tokens=bt)
        shape = ModelShape.from_spec(spec)
        dec_first = -(-max(PREFILL_N) // bt)
        blocks = dec_first + b * -(-(ctx + 1) // bt) + 1
        backend = CudaBackend(spec, blocks, 1)
        fill_kv(cp, backend)
        exact = GpuExecutor(backend, seed=0, max_tokens=8192 + 64, record_rows=True)
        fast = FastExecutor(backend, seed=0, max_tokens=8192 + 64, record_rows=True,
                            weights=exact.weights, prefill=args.prefill)
        chosen = result["prefill"] = fast.prefill
        asyncio.run(exact.warm_up(block=blocks - 1))
        asyncio.run(fast.warm_up(block=blocks - 1))
        exs: dict[str, GpuExecutor] = {"fast": fast, "exact": exact}
        res: dict[str, Any] = {"kernels": {}}
        for v in PREFILL_VARIANTS:
            fast.use_prefill(v)
            res["kernels"][v] = fast.kernel_info()["fast_prefill"]
        fast.use_prefill(chosen)
        res["kernels"]["decode"] = fast.kernel_info()["fast_decode"]
        print(f"  kernels (block {bt}): {res['kernels']}", flush=True)
        want = set(args.sections.split(","))
        if bt == args.block_tokens[0] and "gemm" in want:
            with Section(f"gemm (block {bt})", result):
                res["gemm"] = bench_gemm(cp, exs, shape, reps, peak,
                                         GEMM_ROWS[::2] if args.quick else GEMM_ROWS)
        if "prefill" in want:
            with Section(f"prefill (block {bt})", result):
                res["prefill"] = bench_prefill(cp, exs, shape, reps, peak,
                                               PREFILL_N[1::2] if args.quick else PREFILL_N)
        if "decode" in want:
            with Section(f"decode (block {bt})", result):
                res["decode"] = bench_decode(cp, exs, shape, reps, hbm, dec_first)
        if bt == args.block_tokens[0] and "steps" in want:
            with Section(f"steps (block {bt})", result):
                res["steps"] = asyncio.run(bench_steps(exs, shape, max(2, reps // 2),
                                                       dec_first))
        if bt == args.block_tokens[0] and "agree" in want:
            fill_kv(cp, backend)
            with Section(f"agreement (block {bt})", result):
                res["agreement"] = asyncio.run(bench_agreement(exs, shape, 0))
        result[f"block_{bt}"] = res
        backend.synchronize()
        del exact, fast, backend, exs
        cp.get_default_memory_pool().free_all_blocks()
    return result


def report(r: dict[str, Any], bts: list[int]) -> str:
    lines = [f"device: {r['device']}; model {r['model']}; peak {r['peak_flops'] / 1e12:.1f} "
             f"TFLOP/s dense bf16, HBM {r['hbm_Bps'] / 1e12:.2f} TB/s; cupy {r['cupy']}", ""]
    first = r[f"block_{bts[0]}"]
    lines += ["Weight GEMMs (one layer's four), fraction of peak (TFLOP/s):", "",
              "| rows | fast (cuBLAS gemmEx, bf16) | exact (compute.cu) | cupy a @ b "
              "(reference) | fast / exact speed |", "|---|---|---|---|---|"]
    for g in first.get("gemm", []):
        mm = g["cupy_matmul"]
        lines.append(f"| {g['rows']} | {g['fast']['of_peak']:.3f} ({g['fast']['tflops']:.0f}) | "
                     f"{g['exact']['of_peak']:.3f} ({g['exact']['tflops']:.0f}) | "
                     f"{mm['of_peak']:.3f} ({mm['tflops']:.0f}, {mm['dtype']}) | "
                     f"{g['ratio']:.2f}x |")
    for bt in bts:
        res = r[f"block_{bt}"]
        cols = [f"fast {v}" for v in PREFILL_VARIANTS] + ["exact"]
        if "prefill" in res:
            lines += ["", f"Prefill attention, causal, one prompt, {bt}-token blocks, fraction "
                      "of peak (TFLOP/s); fast kernels named warps/m-tiles a warp/keys a tile:",
                      "", "| tokens | " + " | ".join(cols) + " | default fast / exact speed |",
                      "|---" * (len(cols) + 2) + "|"]
            for p in res["prefill"]:
                lines.append(f"| {p['tokens']} | " + " | ".join(
                    f"{p[c]['of_peak']:.3f} ({p[c]['tflops']:.0f})" if "s" in p[c] else "error"
                    for c in cols) + f" | {p['ratio']:.2f}x |")
            lines += ["", "Attention check: relative L2 error of each kernel's output against "
                      "the exact kernel's (same Q, K, V), worst over the sizes: " + ", ".join(
                          f"{c} {max(p[c].get('rel_err', np.inf) for p in res['prefill']):.1e}"
                          for c in cols[:-1])]
        d = res.get("decode")
        if d is not None:
            lines += ["", f"Decode attention, {d['sequences']} x {d['context']} context, {bt}-"
                      f"token blocks ({d['bytes'] / 2**20:.0f} MiB of K+V), fraction of HBM "
                      "bandwidth:", "",
                      "| executor | split (keys) | splits/seq | time us | TB/s | of HBM |",
                      "|---|---|---|---|---|---|"]
            rows = [("fast", "auto", d["fast"]), ("exact", "1024", d["exact"])]
            rows += [("fast", str(sp), v) for sp, v in d["fast_by_split"].items()]
            for kind, split, v in rows:
                lines.append(f"| {kind} | {split} | {v['splits_per_seq']} | {v['s'] * 1e6:.0f} | "
                             f"{v['Bps'] / 1e12:.2f} | {v['of_hbm']:.3f} |")
        if "steps" in res:
            lines += ["", "Whole steps of the model (GPU time):", "",
                      "| step | fast ms | exact ms | speed-up |", "|---|---|---|---|"]
            for st in res["steps"]:
                lines.append(f"| {st['step']} | {st['fast']['gpu_s'] * 1e3:.2f} | "
                             f"{st['exact']['gpu_s'] * 1e3:.2f} | {st['ratio']:.2f}x |")
        if "agreement" in res:
            a = res["agreement"]
            lines += ["", f"Fast vs exact, same steps: emitted rows' relative error max "
                      f"{a['max_rel_err']:.2e} (median {a['median_rel_err']:.2e}) per step; "
                      f"greedy tokens equal on {a['token_agreement']:.1%} of "
                      f"{a['positions']} positions."]
    lines += ["", f"fast executor's prefill kernel in the steps and agreement: {r['prefill']}",
              "", "CPU time beside wall time, per section:", ""]
    for name, v in r["sections"].items():
        lines.append(f"- {name}: {v['wall_s']:.1f} s wall, {v['cpu_s']:.1f} s CPU")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3-8b-l4")
    ap.add_argument("--block-tokens", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--peak-tflops", type=float, default=989.4)
    ap.add_argument("--hbm-tbps", type=float, default=3.35)
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    ap.add_argument("--prefill", default=None, choices=list(PREFILL_VARIANTS),
                    help="the fast executor's prefill kernel in the steps and agreement "
                         "(default: the executor's own choice for this GPU)")
    ap.add_argument("--sections", default="gemm,prefill,decode,steps,agree",
                    help="comma-separated parts to run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="also write the tables here")
    args = ap.parse_args()
    t0, c0 = time.perf_counter(), time.process_time()
    r = run(args)
    r["wall_s"], r["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1, default=str)
    try:
        text = report(r, args.block_tokens)
    except Exception:  # a section failed: the JSON has what was measured
        traceback.print_exc()
        text = json.dumps(r, indent=1, default=str)
    print("\n" + text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
