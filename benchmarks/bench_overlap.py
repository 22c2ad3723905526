"""Layer-wise swap-in behind compute: transfer alone, compute alone, both together.

Requests' cached prefixes (blocks of the model, all layers) sit in pinned host
memory; one swap-in brings them back while the step computing each request's
next n tokens runs, attending to them. Two cases: a batch (8 requests x 2
blocks: attention is short, the step is GEMM work) and one long context (1 x 16
blocks: the step is attention over 8k keys for few queries, latency-bound).
Measured with CUDA events (median of ``--reps`` after a warm-up):

  transfer  the swap-in alone (``CudaBackend``: one launch + event per layer)
  compute   the step alone, the prefix already on the device (``--executor``: fast or exact)
  together  the swap-in submitted, then at once the step with the swap-in as
            its wait: layer i of the step waits on the GPU for layer i of the
            load only (``wait_layer``); from the load's first event to the
            step's last

overlap efficiency = (transfer + compute - together) / min(transfer, compute):
1.0 when the shorter one is fully hidden. With L layers a perfect pipeline
still pays one layer of the shorter side, so the ceiling is about (L-1)/L.
Also reported: the CPU time to enqueue the step (it never waits on a layer)
against the time the GPU takes; where "together" loses time: how long after
the load's start the step starts on the GPU, the CPU time ``submit`` took for
the load, and how long the step's stream stalled on the load's layers (events
around each ``wait_layer``, in a separate probe pass). n is picked so that compute is close to the
transfer, then n/2 and 2n are shown too; the batch case runs with the copy
streams at the default priority and at the highest.

``--upload memcpy,kernel`` measures each size with both ways of getting the
step's metadata to the device (``GpuExecutor.upload``): a copy-engine memcpy
queues behind the load, the upload kernel does not. ``--case
LABEL:REQUESTS:BLOCKS[:N,N..]`` replaces the two default cases (repeatable;
copy streams at the highest priority): e.g. the crossover between load and
compute over context and new tokens, or a trace's worst load/compute ratio.
One new token is a decode step (a request whose prompt was cached whole).

Run: PYTHONPATH=. python benchmarks/bench_overlap.py [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import numpy as np

from kernels._cuda import cupy_module
from kernels.backend import HIGHEST_PRIORITY, CudaBackend
from kernels.compute import UPLOAD_MODES, BackendTask
from kernels.fast import DEFAULT_EXECUTOR, EXECUTORS, make_executor
from kernels.model import StepItem, prompt_tokens
from kvflow.layout import preset
from kvflow.manager import OpKind, TransferOp
from kvflow.radix import Tier


async def run(model: str, block_tokens: int, requests: int, blocks: int, reps: int,
              priority: int | None, sizes: list[int] | None,
              dma: str = "auto", eager_layers: int | None = 4,
              executor: str = DEFAULT_EXECUTOR,
              uploads: tuple[str, ...] = ("kernel",),
              host_layout: str = "layer_major", one_launch: bool = True) -> dict[str, Any]:
    """``requests`` requests with ``blocks`` cached blocks each, loaded by one swap-in;
    each size measured once per metadata upload of ``uploads``."""
    cp = cupy_module()
    spec = preset(model, block_tokens=block_tokens)
    bt = block_tokens
    # blocks per request for its new tokens (at least 2: up to 2 * bt)
    extra = max(2, -(-max(sizes) // bt)) if sizes else 2
    k = requests * blocks
    backend = CudaBackend(spec, k + requests * extra + 1, k, stream_priority=priority,
                          dma=dma, eager_layers=eager_layers, host_layout=host_layout,
                          one_launch=one_launch)
    ex = make_executor(executor, backend, seed=0, max_tokens=requests * extra * bt)
    await ex.warm_up(block=k + requests * extra)
    keys = [[(r, b) for b in range(blocks + extra)] for r in range(requests)]
    tables = [np.array([*range(r * blocks, (r + 1) * blocks),
                        *range(k + r * extra, k + (r + 1) * extra)], dtype=np.int32)
              for r in range(requests)]
    # each request's prefix: computed on the device, then copied to host blocks 0..k-1
    for r in range(requests):
        toks = prompt_tokens(keys[r], r, bt, 0, blocks * bt)
        await ex.run_items([StepItem(r, False, toks, 0, tables[r], False)])
    out = BackendTask(backend, TransferOp(1, OpKind.EVICT, Tier.DEVICE, Tier.HOST,
                                          list(range(k)), list(range(k)), []))
    await out.wait()
    ids = list(range(k))
    op_id = [100]

    def load() -> BackendTask:
        op_id[0] += 1
        return BackendTask(backend, TransferOp(op_id[0], OpKind.SWAP_IN, Tier.HOST,
                                               Tier.DEVICE, ids, ids, []))

    def items(n: int) -> list[StepItem]:
        """n new tokens per request; n = 1 is a decode (a prompt cached whole)."""
        pos = blocks * bt
        return [StepItem(r, n == 1, prompt_tokens(keys[r], r, bt, pos, pos + n), pos,
                         tables[r], True) for r in range(requests)]

    async def transfer_alone() -> float:
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(backend.load_stream)
        t = load()
        backend.flush()  # every layer enqueued before the end event (``eager_layers``)
        b.record(getattr(backend.h2d, "tail", backend.load_stream))  # (host layouts' scatter)
        await t.wait()
        return cp.cuda.get_elapsed_time(a, b) / 1e3

    async def compute_alone(n: int) -> float:
        await ex.run_items(items(n))
        return ex.last_gpu_s

    async def together(n: int) -> tuple[float, float, float, float]:
        """(together, CPU enqueue of the step, step start after the load's, CPU submit
        of the load), in seconds."""
        a = cp.cuda.Event()
        a.record(backend.load_stream)
        t0 = time.perf_counter()
        t = load()
        submit_s = time.perf_counter() - t0
        await ex.run_items(items(n), [t])
        assert t.ok
        el = cp.cuda.get_elapsed_time
        return (el(a, ex._ev_end) / 1e3, ex.last_enqueue_s, el(a, ex._ev_start) / 1e3,
                submit_s)

    async def stalls(n: int) -> float:
        """Seconds the step's compute stream waited on the load, summed over layers:
        events recorded on it just before and after each ``wait_layer`` (a probe,
        run apart from the timed passes)."""
        marks: list[tuple[Any, Any]] = []
        plain = backend.wait_layer

        def probed(stream: Any, handle: Any, layer: int) -> None:
            before, after = cp.cuda.Event(), cp.cuda.Event()
            before.record(stream)
            plain(stream, handle, layer)
            after.record(stream)
            marks.append((before, after))

        backend.wait_layer = probed  # type: ignore[method-assign]
        try:
            await ex.run_items(items(n), [load()])
        finally:
            del backend.wait_layer  # the class's method again
        return sum(cp.cuda.get_elapsed_time(b, e) for b, e in marks) / 1e3

    async def beside(n: int) -> float:
        """Compute's GPU time while the same load runs, not waited on: the slowdown
        the concurrent copy causes by itself (memory, PCIe, SMs), apart from waits."""
        t = load()
        await ex.run_items(items(n))
        await t.wait()
        return ex.last_gpu_s

    async def median(f: Any, *args: Any) -> Any:
        vals = [await f(*args) for _ in range(reps + 1)][1:]
        if isinstance(vals[0], tuple):
            return tuple(statistics.median(v[i] for v in vals) for i in range(len(vals[0])))
        return statistics.median(vals)

    t_x = await median(transfer_alone)
    if sizes is None:  # compute ~ transfer: scan n, keep the closest
        cands = [n for n in (8, 16, 32, 64, 128, 256, 512, 1024) if n <= extra * bt]
        comp: dict[int, float] = {}
        for n in cands:
            comp[n] = await median(compute_alone, n)
            if comp[n] > 4 * t_x:
                break
        cands = list(comp)
        best = min(cands, key=lambda n: abs(comp[n] - t_x))
        sizes = sorted({max(cands[0], best // 2), best, min(cands[-1], best * 2)})
    rows = []
    for n in sizes:
        for up in uploads:
            ex.upload = up
            t_c = await median(compute_alone, n)
            t_t, enq, lag, submit = await median(together, n)
            t_b = await median(beside, n)
            stalled = await median(stalls, n)
            eff = (t_x + t_c - t_t) / min(t_x, t_c)
            rows.append({"new_tokens": n, "upload": up, "transfer_s": t_x, "compute_s": t_c,
                         "together_s": t_t, "efficiency": eff, "enqueue_s": enq,
                         "compute_beside_load_s": t_b, "step_start_lag_s": lag,
                         "load_submit_s": submit, "stalled_on_load_s": stalled})
    backend.synchronize()
    return {"model": spec.name, "layers": spec.num_layers, "block_tokens": bt,
            "executor": executor,
            "requests": requests, "blocks_per_request": blocks, "cached_blocks": k,
            "bytes": k * spec.bytes_per_block, "stream_priority": priority, "rows": rows,
            "copy_path": "batched memcpy" if backend.use_dma else "swap kernel"}


def parse_case(text: str) -> tuple[str, int, int, list[int] | None]:
    """``LABEL:REQUESTS:BLOCKS[:N,N..]`` -> (label, requests, cached blocks each, sizes)."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or not parts[0].strip():
        raise argparse.ArgumentTypeError(
            f"--case {text!r}: expected LABEL:REQUESTS:BLOCKS[:N,N..]")
    try:
        requests, blocks = int(parts[1]), int(parts[2])
        sizes = [int(n) for n in parts[3].split(",")] if len(parts) == 4 else None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--case {text!r}: {exc}") from None
    if requests <= 0 or blocks <= 0 or (sizes is not None and min(sizes, default=0) <= 0):
        raise argparse.ArgumentTypeError(
            f"--case {text!r}: requests, blocks and new tokens must be positive")
    return parts[0].strip(), requests, blocks, sizes


def parse_uploads(text: str) -> tuple[str, ...]:
    """``memcpy,kernel`` -> ('memcpy', 'kernel'), each one of ``UPLOAD_MODES``."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in UPLOAD_MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(
            f"--upload {text!r}: a comma-separated list of {', '.join(UPLOAD_MODES)}")
    return modes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--block-tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="the batch case only")
    ap.add_argument("--copy-engine", default="auto", choices=("auto", "never", "always"),
                    help="how loads move: by piece size (auto), swap kernel, batched memcpy")
    ap.add_argument("--executor", default=DEFAULT_EXECUTOR, choices=EXECUTORS,
                    help="the step's compute: fast (cuBLAS + fast.cu) or exact (compute.cu)")
    ap.add_argument("--eager-layers", type=int, default=4,
                    help="layers of a load CudaBackend enqueues at submit (0: all)")
    ap.add_argument("--upload", type=parse_uploads, default=("kernel",),
                    help="step metadata upload(s) to measure: kernel, memcpy or both "
                         "(memcpy,kernel)")
    ap.add_argument("--sizes", default=None,
                    help="new tokens per request, comma-separated (default: scanned)")
    ap.add_argument("--host-layout", default="layer_major",
                    help="host layout(s) to measure, comma-separated (kvflow.host_layout: "
                         "layer_major, block_major, grouped:G)")
    ap.add_argument("--launch", default="layer", choices=("op", "layer"),
                    help="kernel-path loads: one signalling launch per op (CudaBackend "
                         "one_launch) or a launch and an event per layer")
    ap.add_argument("--case", type=parse_case, action="append", default=None,
                    help="LABEL:REQUESTS:BLOCKS[:N,N..], instead of the default cases")
    args = ap.parse_args()
    t0, c0 = time.perf_counter(), time.process_time()
    eager = args.eager_layers or None
    forced = [int(n) for n in args.sizes.split(",")] if args.sizes else None
    # (label, requests, cached blocks each, stream priorities, sizes)
    cases = [("batch", 8, 2, (None, HIGHEST_PRIORITY), forced),
             ("long context", 1, 16, (HIGHEST_PRIORITY,), forced)]
    if args.quick:
        cases = cases[:1]
    if args.case:
        cases = [(label, reqs, blocks, (HIGHEST_PRIORITY,), sizes or forced)
                 for label, reqs, blocks, sizes in args.case]
    results = []
    for label, reqs, blocks, prios, sizes in cases:
        for layout in args.host_layout.split(","):
            for prio in prios:
                r = asyncio.run(run(args.model, args.block_tokens, reqs, blocks, args.reps,
                                    prio, sizes, args.copy_engine, eager, args.executor,
                                    args.upload, layout, args.launch == "op"))
                # the same sizes for each priority and layout
                sizes = sorted({row["new_tokens"] for row in r["rows"]})
                r["case"] = label
                r["host_layout"] = layout
                results.append(r)
    print(f"\n{results[0]['model']} ({results[0]['layers']} layers, {args.block_tokens}-token "
          "blocks): one swap-in of the cached blocks, then at once the step computing each "
          "request's next tokens")
    print(f"copy path: {results[0].get('copy_path')}; executor: {args.executor}; 'compute "
          "beside load': compute's GPU time while the same load runs, not waited on")
    print("| case | copy streams | new tokens per request | upload | transfer ms | compute ms | "
          "together ms | overlap efficiency | CPU enqueue ms | compute beside load ms | "
          "step starts after load ms | CPU submit of load ms | stalled on load ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        case = (f"{r['case']}: {r['requests']} x {r['blocks_per_request']} blocks "
                f"({r['bytes'] / 2**30:.2f} GiB)")
        if len(args.host_layout.split(",")) > 1 or r["host_layout"] != "layer_major":
            case += f", host {r['host_layout']}"
        for row in r["rows"]:
            print(f"| {case} | {'default' if r['stream_priority'] is None else 'highest'} "
                  f"priority | {row['new_tokens']} | {row['upload']} | "
                  f"{row['transfer_s'] * 1e3:.2f} | "
                  f"{row['compute_s'] * 1e3:.2f} | {row['together_s'] * 1e3:.2f} | "
                  f"{row['efficiency']:.1%} | {row['enqueue_s'] * 1e3:.2f} | "
                  f"{row['compute_beside_load_s'] * 1e3:.2f} | "
                  f"{row['step_start_lag_s'] * 1e3:.2f} | {row['load_submit_s'] * 1e3:.2f} | "
                  f"{row['stalled_on_load_s'] * 1e3:.3f} |")
    print(f"wall {time.perf_counter() - t0:.1f} s, CPU {time.process_time() - c0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
