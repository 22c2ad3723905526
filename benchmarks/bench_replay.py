"""Wall time of a full-mode replay with device, host and storage tiers.

The target (issue 4) is the whole Mooncake conversation trace — 12,031
requests — in <= 30 s on the 2-core dev machine, aiming for <= 10 s.

    python benchmarks/bench_replay.py [TRACE] [--limit N] [--host-gb G] [--storage-gb G]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from pathlib import Path

from kvflow.replay import ReplayConfig, run_replay

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared/traces/conversation_trace.jsonl"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--host-gb", type=float, default=256.0)
    ap.add_argument("--storage-gb", type=float, default=2048.0)
    ap.add_argument("--write-policy", default="write_through")
    ap.add_argument("--profile", action="store_true", help="print the top of a cProfile")
    args = ap.parse_args()
    cfg = ReplayConfig(trace=str(args.trace), model=args.model, host_gb=args.host_gb,
                       storage_gb=args.storage_gb, write_policy=args.write_policy,
                       limit=args.limit)
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    r = run_replay(cfg)
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    c = r["config"]
    print(f"trace={args.trace.name} model={c['model']} blocks: device={c['device_blocks']} "
          f"host={c['host_blocks']} storage={c['storage_blocks']}")
    print(f"hit rate: {r['hit_rate']}")
    print(f"ttft p50={r['ttft_s']['p50']:.3f}s p99={r['ttft_s']['p99']:.3f}s "
          f"steps={r['engine']['steps']}")
    print(f"RESULT requests={r['requests']} sim_time_s={r['sim_time_s']:.1f} "
          f"wall_s={r['wall_s']:.2f}")


if __name__ == "__main__":
    main()
