"""Where a GPU replay's TTFT goes, request by request, against the simulator's.

For the fidelity question "why is slice B's TTFT p50 20% above the simulator's
while its transfers agree within 4%": (1) isolated executor steps at the
prefill sizes slice B's turns make (1,024 new tokens at 2k context for a
first turn, 1,056..1,120 at 3k..5k for later ones) and small decode batches,
GPU time and the engine's wall time per step; (2) the GPU replay of a suite
slice with the executor's step log and the per-request CSV, written to
``--out`` as JSON (the simulator's CSV of the same slice is made on any
machine with ``kvflow replay --requests-csv``), so each request's TTFT can be
split into queueing, the host's share and its prefill step's GPU time.

Run (repository root, on a GPU):
    PYTHONPATH=. python benchmarks/ttft_breakdown.py --out $OUT/ttft.json [--slices B]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_suite  # the slices, pools and model the suite replays

#: (new tokens, context) of the isolated prefill steps; decode (batch, context).
PREFILLS = [(1024, 2048), (1056, 3072), (1088, 4096), (1120, 5120), (1024, 3072),
            (1024, 4096), (1152, 4096), (1280, 4096), (1536, 4096), (2048, 4096),
            (3072, 0), (960, 4096), (992, 4096)]
DECODES = [(1, 4096), (2, 4096), (4, 4096), (8, 4096)]


async def isolated(reps: int = 7) -> list[dict[str, Any]]:
    """GPU time, wall time and enqueue time of single steps on the fast executor."""
    from kernels.backend import CudaBackend
    from kernels.fast import make_executor
    from kernels.model import StepItem
    from kvflow.layout import preset

    spec = preset(gpu_suite.MODEL, block_tokens=512)
    bt = spec.block_tokens
    need = max(max(-(-(n + c) // bt) for n, c in PREFILLS),
               max(b * -(-(c + 1) // bt) for b, c in DECODES))
    backend = CudaBackend(spec, need + 4, 1)
    ex = make_executor("fast", backend, seed=0, max_tokens=8192 + 64)
    await ex.warm_up(block=need + 3)
    rng = np.random.default_rng(3)

    def prefill_item(n: int, ctx: int, first: int = 0) -> StepItem:
        table = np.arange(first, first + -(-(n + ctx) // bt), dtype=np.int32)
        return StepItem(("p", n, ctx), False, rng.integers(0, 1 << 30, n).astype(np.int32),
                        ctx, table, True)

    for start in range(0, need, 16):  # real KV everywhere
        await ex.run_items([prefill_item(min(16, need - start) * bt, 0, start)])

    def decode_items(b: int, ctx: int) -> list[StepItem]:
        per = -(-(ctx + 1) // bt)
        return [StepItem(("d", i), True, np.array([7], dtype=np.int32), ctx,
                         np.arange(i * per, (i + 1) * per, dtype=np.int32), True)
                for i in range(b)]

    async def timed(label: str, items_of: Any) -> dict[str, Any]:
        g, w, e = [], [], []
        for _ in range(reps + 2):
            await ex.run_items(items_of())
            g.append(ex.last_gpu_s)
            w.append(ex.last_wall_s)
            e.append(ex.last_enqueue_s)
        row = {"step": label, "gpu_ms": statistics.median(g[2:]) * 1e3,
               "wall_ms": statistics.median(w[2:]) * 1e3,
               "enqueue_ms": statistics.median(e[2:]) * 1e3, "first_gpu_ms": g[0] * 1e3}
        print(f"  {label:>16}: gpu {row['gpu_ms']:7.3f} ms  wall {row['wall_ms']:7.3f} ms  "
              f"enqueue {row['enqueue_ms']:6.3f} ms  (first run gpu {row['first_gpu_ms']:.3f})",
              flush=True)
        return row

    rows = []
    for n, c in PREFILLS:
        rows.append(await timed(f"prefill {n}@{c}", lambda n=n, c=c: [prefill_item(n, c)]))
    for b, c in DECODES:
        rows.append(await timed(f"decode {b}x{c}", lambda b=b, c=c: decode_items(b, c)))
    backend.synchronize()
    return rows


def replay(name: str, trace: Path, pools: tuple[int, int]) -> dict[str, Any]:
    """A GPU replay of one slice: the executor's step log and the per-request CSV."""
    from kernels.world import CudaWorld
    from kvflow.replay import ReplayConfig, run_replay

    log: list[Any] = []
    cfg = ReplayConfig(trace=str(trace), model=gpu_suite.MODEL, device_blocks=pools[0],
                       host_blocks=pools[1], storage_blocks=0, backend="cuda",
                       executor="fast", instances=1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "requests.csv"
        report = run_replay(cfg, world=CudaWorld(None, log, None, executor="fast"),
                            requests_csv=path)
        with path.open() as f:
            reqs = list(csv.DictReader(f))
    print(f"slice {name}: TTFT p50 {report['ttft_s']['p50'] * 1e3:.2f} ms, TPOT p50 "
          f"{report['tpot_s']['p50'] * 1e3:.3f} ms, {len(log)} steps", flush=True)
    return {"requests": reqs, "steps": [[p, d, g, w, s] for p, d, g, w, s in log],
            "ttft_s": report["ttft_s"], "tpot_s": report["tpot_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--slices", default="B")
    ap.add_argument("--no-isolated", action="store_true")
    args = ap.parse_args()
    out: dict[str, Any] = {}
    if not args.no_isolated:
        print("isolated steps (fast executor, llama-3-8b-l4, 512-token blocks):", flush=True)
        out["isolated"] = asyncio.run(isolated())
    slices = gpu_suite.make_slices()
    pools = {"A": gpu_suite.POOLS_A, "B": gpu_suite.POOLS_B}
    for name in filter(None, args.slices.split(",")):
        out[f"replay_{name}"] = replay(name, slices[name], pools[name])
    Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
