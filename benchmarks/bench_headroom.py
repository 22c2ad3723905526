"""The report's headroom section (``kvflow.headroom``): its memory and its cost.

``rss``: one replay in this process (full or cache mode, a rate scale, headroom on or
off); prints its CPU and wall seconds, peak RSS (``ru_maxrss``) and the optimum it
reports. Run each case in a fresh process (peak RSS is the process's).

``cost``: the section alone on a trace's default full-mode setup, best of 3,
interleaved in one process: streaming the trace once (what any section pays to see
every request's keys), the section as built now (``AccessLog``), and the list
implementation it replaced (``traces.optimum.tier_optimum_hits``); asserts both give
the same figures.

    python benchmarks/bench_headroom.py rss TRACE [--mode full] [--rate-scale 0.35] \\
        [--no-headroom]
    python benchmarks/bench_headroom.py cost TRACE
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvflow.headroom import headroom_section
from kvflow.replay import ReplayConfig, run_replay
from kvflow.replay.config import resolve
from traces.optimum import tier_optimum_hits


def old_rates(requests, caps) -> list[float]:
    """``kvflow.headroom`` before the access log: every request's keys in a list,
    ``traces.optimum`` once per tier."""
    reqs = [r.keys for r in requests]
    blocks = sum(len(r) for r in reqs)
    return [h / blocks for h in tier_optimum_hits(reqs, caps)]


def rss(args: argparse.Namespace) -> None:
    c, w = time.process_time(), time.perf_counter()
    r = run_replay(ReplayConfig(trace=args.trace, mode=args.mode, rate_scale=args.rate_scale,
                                headroom=not args.no_headroom))
    print(f"{Path(args.trace).name} {args.mode} rate_scale={args.rate_scale} "
          f"headroom={not args.no_headroom}: CPU {time.process_time() - c:.2f} s, wall "
          f"{time.perf_counter() - w:.2f} s, peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB, optimum "
          f"{(r.get('headroom') or {}).get('optimum')}")


def cost(args: argparse.Namespace) -> None:
    setup = resolve(ReplayConfig(trace=args.trace, mode="full"))
    caps = [setup.capacities[t] for t in (0, 1, 2)]
    cases = {
        "stream only": lambda: sum(1 for r in setup.requests if r.keys is not None),
        "headroom (AccessLog)": lambda: headroom_section((r.keys for r in setup.requests),
                                                         caps, "lru"),
        "headroom (list, before)": lambda: old_rates(setup.requests, caps),
    }
    best: dict[str, float] = {}
    for _ in range(3):
        for name, f in cases.items():
            t = time.process_time()
            f()
            best[name] = min(best.get(name, float("inf")), time.process_time() - t)
    new = headroom_section((r.keys for r in setup.requests), caps, "lru")["optimum"]
    assert [new["device"], new["host"], new["storage"]] == old_rates(setup.requests, caps)
    print(f"{Path(args.trace).name}: " + ", ".join(f"{k} {v:.3f} s CPU" for k, v in best.items())
          + " (same figures)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("rss")
    a.add_argument("trace")
    a.add_argument("--mode", default="full")
    a.add_argument("--rate-scale", type=float, default=0.35)
    a.add_argument("--no-headroom", action="store_true")
    b = sub.add_parser("cost")
    b.add_argument("trace")
    args = ap.parse_args()
    rss(args) if args.cmd == "rss" else cost(args)


if __name__ == "__main__":
    main()
