"""Every transfer of a GPU replay of the suite's slices, timed one by one.

For the fidelity question "why do slice B's ops take longer than the link fit
says": each op's service time by its size (median per size), and the share of
its time during which an op in the other PCIe direction was in flight (duplex).
Start and end come from the task's own CUDA events (``record_starts``), read
against one reference event recorded before the replay.

Run (repository root, on a GPU): PYTHONPATH=. python benchmarks/op_timeline.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_suite  # the slices, pools and model the suite replays

import kernels.world as gpu_world
from kernels._cuda import cupy_module
from kvflow.replay import ReplayConfig


def timed_replay(trace: Path, pools: tuple[int, int]) -> list[tuple[str, int, float, float]]:
    """(link, blocks, start s, end s) of every op that landed."""
    cp = cupy_module()
    ops: list[tuple[str, int, float, float]] = []
    plain = gpu_world.cuda_service_s
    ref = cp.cuda.Event()
    ref.record()  # before the replay's first op: the timeline's origin

    def timed(handle: Any) -> float | None:
        s = plain(handle)
        if s is not None:
            el = cp.cuda.get_elapsed_time
            link = "h2d" if int(handle.op.dst_tier) == 0 else "d2h"
            ops.append((link, handle.op.num_blocks, el(ref, handle.start_event) / 1e3,
                        el(ref, handle.end_event) / 1e3))
        return s

    gpu_world.cuda_service_s = timed
    try:
        cfg = ReplayConfig(trace=str(trace), model=gpu_suite.MODEL, device_blocks=pools[0],
                           host_blocks=pools[1], storage_blocks=0, backend="cuda")
        gpu_world.run_gpu_replay(cfg)
    finally:
        gpu_world.cuda_service_s = plain
    return ops


def duplex_share(op: tuple[str, int, float, float],
                 ops: list[tuple[str, int, float, float]]) -> float:
    link, _, a, b = op
    busy = sum(max(0.0, min(b, e) - max(a, s)) for other, _, s, e in ops if other != link)
    return min(busy / max(b - a, 1e-12), 1.0)


def main() -> None:
    slices = gpu_suite.make_slices()
    for name, pools in (("A", gpu_suite.POOLS_A), ("B", gpu_suite.POOLS_B)):
        ops = timed_replay(slices[name], pools)
        print(f"slice {name}: {len(ops)} ops")
        for link in ("h2d", "d2h"):
            mine = [o for o in ops if o[0] == link]
            if not mine:
                continue
            shared = sum(1 for o in mine if duplex_share(o, ops) > 0.01)
            by_size: dict[int, list[float]] = {}
            for _, n, s, e in mine:
                by_size.setdefault(n, []).append(e - s)
            per_block = sum(e - s for _, _, s, e in mine) / sum(n for _, n, _, _ in mine)
            print(f"  {link}: {len(mine)} ops, {shared} overlapping the other direction; "
                  f"service per block {per_block * 1e3:.4f} ms")
            print("    by size, median ms (ops): " + " ".join(
                f"{n}:{statistics.median(v) * 1e3:.3f}({len(v)})"
                for n, v in sorted(by_size.items())))


if __name__ == "__main__":
    main()
