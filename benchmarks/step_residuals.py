"""Where the simulator's step time departs from the GPU's, step by step.

For the fidelity question "why is slice A's TTFT/TPOT off when the calibration's
own steps fit within a few percent": replays the suite's slices on the GPU with
the executor's step log, and sets each step's measured period (its start to the
next step's start: GPU time plus the host's share) beside what ``CostModel``
charges for the same batch under a profile. Steps are grouped by kind, decode
batch size and mean context; each group prints its medians and the model's
ratio, so the part of the batch space the calibration grid misses stands out.
A period longer than GPU time + 20 ms is idle time (no request ready), not
step time, and is left out.

Run (repository root, on a GPU):
    PYTHONPATH=. python benchmarks/step_residuals.py [PROFILE] [--slices A,B]
(default profile: the shipped ``sim/profiles/h100-calibrated.toml``; the suite
writes this machine's to ``$OUT/h100-calibrated.toml``).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_suite  # the slices, pools and model the suite replays

from kvflow.cost import CostModel
from kvflow.layout import preset
from kvflow.profile import load_profile

SHIPPED = Path(__file__).resolve().parent.parent / "sim/profiles/h100-calibrated.toml"
IDLE_S = 0.020


def gpu_steps(trace: Path, pools: tuple[int, int]) -> list[tuple[Any, ...]]:
    """The executor's step log of one GPU replay: (prefills, decode contexts, gpu s,
    wall s, start s) per step."""
    from kernels.world import run_gpu_replay
    from kvflow.replay import ReplayConfig

    log: list[tuple[Any, ...]] = []
    cfg = ReplayConfig(trace=str(trace), model=gpu_suite.MODEL, device_blocks=pools[0],
                       host_blocks=pools[1], storage_blocks=0, backend="cuda")
    run_gpu_replay(cfg, step_log=log)
    return log


def group_of(prefills: list[tuple[int, int]], decodes: list[int]) -> str:
    if prefills:
        kind = "mixed" if decodes else "prefill"
        return f"{kind} {'<=2k' if sum(n for n, _ in prefills) <= 2048 else '>2k'} new"
    b = len(decodes)
    bb = "1" if b == 1 else "2-8" if b <= 8 else "9-24" if b <= 24 else "25+"
    ctx = sum(decodes) / b
    cb = "<4k" if ctx < 4096 else "4-12k" if ctx < 12288 else "12k+"
    return f"decode b={bb} ctx {cb}"


def residuals(log: list[tuple[Any, ...]], model: CostModel) -> dict[str, dict[str, float]]:
    """Per group: steps, median measured period / GPU time / model time, and sums."""
    rows: dict[str, list[tuple[float, float, float]]] = {}
    for (pre, dec, gpu, _, start), nxt in itertools.pairwise(log):
        period = nxt[4] - start
        if period > gpu + IDLE_S:
            continue
        rows.setdefault(group_of(pre, dec), []).append((period, gpu, model.step_time(pre, dec)))
    out = {}
    for g, r in sorted(rows.items()):
        period = sum(p for p, _, _ in r)
        out[g] = {"steps": len(r),
                  "period_ms": statistics.median(p for p, _, _ in r) * 1e3,
                  "gpu_ms": statistics.median(x for _, x, _ in r) * 1e3,
                  "model_ms": statistics.median(m for _, _, m in r) * 1e3,
                  "period_sum_s": period, "model_sum_s": sum(m for _, _, m in r)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", nargs="?", default=str(SHIPPED))
    ap.add_argument("--slices", default="A,B")
    args = ap.parse_args()
    model = CostModel(preset(gpu_suite.MODEL, block_tokens=512), load_profile(args.profile))
    slices = gpu_suite.make_slices()
    pools = {"A": gpu_suite.POOLS_A, "B": gpu_suite.POOLS_B}
    for name in args.slices.split(","):
        log = gpu_steps(slices[name], pools[name])
        res = residuals(log, model)
        total_p = sum(v["period_sum_s"] for v in res.values())
        total_m = sum(v["model_sum_s"] for v in res.values())
        print(f"\nslice {name}: {len(log)} steps; busy periods {total_p:.3f} s measured, "
              f"{total_m:.3f} s model ({total_m / total_p - 1:+.1%})")
        print(f"  {'group':28} {'steps':>6} {'period':>9} {'gpu':>9} {'model':>9} "
              f"{'model/period-1 (sums)':>22}")
        for g, v in res.items():
            print(f"  {g:28} {v['steps']:6d} {v['period_ms']:8.3f}m {v['gpu_ms']:8.3f}m "
                  f"{v['model_ms']:8.3f}m {v['model_sum_s'] / v['period_sum_s'] - 1:+21.1%}")


if __name__ == "__main__":
    main()
