"""Small copies' service time on an idle GPU and under each kind of compute.

For the fidelity question "why do a replay's small backups and swap-ins take
longer than the link fit says": ``CudaBackend`` ops of 1, 3 and 6 scattered
blocks (the fidelity model, 512-token blocks), event-timed as replays time
them, while ``GpuExecutor`` runs one kind of step back to back (decode
batches, prefills short and long, or nothing). Prints the median per size.

Run (repository root, on a GPU):
    PYTHONPATH=. python benchmarks/copy_under_load.py [--priority highest]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.backend import CudaBackend
from kernels.calibrate import _backend_ops, scattered_op_seconds
from kernels.compute import GpuExecutor
from kernels.model import StepItem
from kvflow.layout import preset
from kvflow.radix import Tier

MODEL = "llama-3-8b-l4"
SIZES = (1, 3, 6)
POOL = 40  # blocks each copy draws from, on each side


async def measure(priority: int | None, reps: int) -> None:
    spec = preset(MODEL, block_tokens=512)
    bt = spec.block_tokens
    backend = CudaBackend(spec, POOL + 200, POOL, stream_priority=priority)
    ex = GpuExecutor(backend, seed=0, max_tokens=8192 + 64)
    await ex.warm_up(block=POOL + 199)
    rng = np.random.default_rng(1)

    def decode(batch: int, ctx: int) -> list[StepItem]:
        per = -(-(ctx + 1) // bt)
        return [StepItem(("d", i), True, np.array([5], dtype=np.int32), ctx,
                         np.arange(POOL + i * per, POOL + (i + 1) * per, dtype=np.int32), True)
                for i in range(batch)]

    def prefill(new: int, ctx: int) -> list[StepItem]:
        return [StepItem("p", False, np.arange(new, dtype=np.int32), ctx,
                         np.arange(POOL, POOL + -(-(new + ctx) // bt), dtype=np.int32), True)]

    loads: dict[str, list[StepItem] | None] = {
        "idle": None, "decode 1x4k": decode(1, 4096), "decode 4x4k": decode(4, 4096),
        "decode 16x4k": decode(16, 4096), "prefill 1024": prefill(1024, 0),
        "prefill 1024@8k": prefill(1024, 8192), "prefill 8192": prefill(8192, 0)}
    ways = (("h2d", Tier.HOST, Tier.DEVICE), ("d2h", Tier.DEVICE, Tier.HOST))
    for _, src, dst in ways:  # warm up every size once: fresh addresses can stall
        for k in SIZES:
            await _backend_ops(backend, [(src, dst, list(range(k)), list(range(k)))])
    print(f"median service time, ms ({reps} ops each; scattered ids)")
    print(f"{'load':16} " + " ".join(f"{w}{k:<2}" for w, _, _ in ways for k in SIZES))
    for label, items in loads.items():
        stop = asyncio.Event()

        async def churn(items: list[StepItem], stop: asyncio.Event = stop) -> None:
            while not stop.is_set():
                await ex.run_items(items)

        task = asyncio.ensure_future(churn(items)) if items else None
        await asyncio.sleep(0.05)
        row = []
        for _, src, dst in ways:
            for k in SIZES:  # up to 3 ms apart: ops land anywhere in a step
                t = await scattered_op_seconds(backend, src, dst, k, POOL, reps, rng, 0.003)
                row.append(f"{t * 1e3:.3f}")
        stop.set()
        if task is not None:
            await task
        print(f"{label:16} " + " ".join(f"{v:>5}" for v in row), flush=True)
    backend.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--priority", choices=("default", "highest"), default="default",
                    help="copy streams' priority")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    asyncio.run(measure(-1000 if args.priority == "highest" else None, args.reps))


if __name__ == "__main__":
    main()
