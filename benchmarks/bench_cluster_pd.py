"""Prefill/decode disaggregation against colocated instances, same trace, same GPUs.

Replays one trace (default: the full Mooncake conversation trace) on N
simulated H100s, first colocated (every instance prefills and decodes), then
disaggregated at each ``--pd P:D`` split, all with the same router, and prints
a markdown table: TTFT and TPOT (mean, p90), PD transfer bytes, transfer time
and the wait from first token to decode start, and each run's CPU and wall
time, with TTFT/TPOT as ratios to the colocated run of the same process.

    python benchmarks/bench_cluster_pd.py --trace /work/shared/traces/conversation_trace.jsonl
    python benchmarks/bench_cluster_pd.py --limit 2000 --pd 8:8 --pd 12:4 --rate-scale 4
    python benchmarks/bench_cluster_pd.py --whole --device-only --rate-scale 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvflow.replay import ReplayConfig, run_replay


def run(cfg: ReplayConfig) -> tuple[dict[str, Any], float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    rep = run_replay(cfg)
    return rep, time.process_time() - c0, time.perf_counter() - w0


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:,.1f}"


def row(name: str, rep: dict[str, Any], cpu: float, wall: float,
        base: dict[str, Any] | None) -> str:
    ttft, tpot = rep["ttft_s"], rep["tpot_s"]
    pd = rep.get("pd")
    ratio = (f"{ttft['mean'] / base['ttft_s']['mean']:.2f} / "
             f"{tpot['mean'] / base['tpot_s']['mean']:.2f}") if base else "1 / 1"
    if pd:
        util = pd["utilization_predicted"]
        moved = (f"{pd['bytes'] / 1e12:.2f} TB | {ms(pd['transfer_s']['mean'])} / "
                 f"{ms(pd['transfer_s']['p90'])} | {ms(pd['decode_wait_s']['mean'])} / "
                 f"{ms(pd['decode_wait_s']['p90'])} | {util['prefill']:.2f} / "
                 f"{util['decode']:.2f}")
    else:
        moved = f"- | - | - | {rep['load']['utilization_predicted']:.2f}"
    return (f"| {name} | {rep['requests']:,} | {ms(ttft['mean'])} / {ms(ttft['p90'])} | "
            f"{ms(tpot['mean'])} / {ms(tpot['p90'])} | {ratio} | {rep['hit_rate']['total']:.1%}"
            f" | {moved} | {cpu:.0f} / {wall:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="/work/shared/traces/conversation_trace.jsonl")
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--pd", action="append", default=None, help="P:D splits (repeatable)")
    ap.add_argument("--router", default="prefix")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--rate-scale", type=float, default=1.0,
                    help="replay the trace this many times faster")
    ap.add_argument("--whole", action="store_true", help="also each split with --pd-whole")
    ap.add_argument("--device-only", action="store_true",
                    help="also each split with --pd-decode-device-only")
    ap.add_argument("--json", type=Path, default=None, help="write the reports here")
    args = ap.parse_args()
    splits = args.pd or ["8:8", "12:4"]
    base_cfg = ReplayConfig(trace=args.trace, instances=args.instances, router=args.router,
                            limit=args.limit, rate_scale=args.rate_scale)
    print("| run | requests | TTFT mean / p90 (ms) | TPOT mean / p90 (ms) | "
          "TTFT / TPOT vs colocated | hit rate | PD bytes | transfer mean / p90 (ms) | "
          "first token -> decode mean / p90 (ms) | predicted util. prefill / decode | "
          "CPU / wall (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    reports: dict[str, Any] = {}
    base, cpu, wall = run(base_cfg)
    reports["colocated"] = base
    print(row(f"{args.instances} colocated", base, cpu, wall, None), flush=True)
    variants = [(True, True)]
    if args.whole:
        variants.append((False, True))
    if args.device_only:
        variants.append((True, False))
    for split in splits:
        for layerwise, offload in variants:
            cfg = ReplayConfig(trace=args.trace, pd=split, router=args.router,
                               limit=args.limit, pd_layerwise=layerwise,
                               pd_decode_offload=offload, rate_scale=args.rate_scale)
            rep, cpu, wall = run(cfg)
            name = (f"pd {split}" + ("" if layerwise else " whole")
                    + ("" if offload else " decode device-only"))
            reports[name] = rep
            print(row(name, rep, cpu, wall, base), flush=True)
    if args.json is not None:
        for rep in reports.values():
            rep.pop("timeseries", None)
            rep.pop("samples", None)
        args.json.write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
