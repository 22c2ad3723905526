"""A cluster with and without a shared KV pool, against one instance, in one process.

On the full Mooncake conversation trace (12,031 requests): 16 instances behind
the ``prefix`` router, each with its own host (256 GiB) and storage (2 TiB)
tiers, against the same with the storage replaced by one pool of the same total
size (16 x 2 TiB) read and written over each instance's NIC (50 GB/s), with no
aggregate limit and with one (``--pool-gb-per-s``). Each cluster's CPU time is
given as a ratio to the single-instance replay of the same trace with the same
prefetch policy, measured in the same process just before (issue 18 asks the
cluster layer, routing and the pool's index to cost little beside the engine).

Two prefetch policies, because they decide what storage is worth here:
``best_effort`` (the default) recomputes whatever has not reached host memory
when a request is admitted, and at 16 instances a request is admitted at once,
so a storage or pool read started at its arrival has almost never landed;
``wait_complete`` waits for it (a Mooncake-style prefill reads its cached
prefix from the pool, layer by layer).

    python benchmarks/bench_cluster_pool.py [TRACE] [--limit N] [--instances 16]
        [--pool-gb-per-s 10] [--policies best_effort,wait_complete] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from kvflow.replay import ReplayConfig, run_replay

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared/traces/conversation_trace.jsonl"
)
STORAGE_GB = 2048.0  # each instance's own storage, the world's default


def run(label: str, cfg: ReplayConfig) -> dict[str, Any]:
    cpu0 = time.process_time()
    r = run_replay(cfg)
    cpu = time.process_time() - cpu0
    row = {
        "label": label, "instances": cfg.instances, "prefetch": cfg.prefetch_policy,
        "cpu_s": cpu, "wall_s": r["wall_s"], "requests": r["requests"],
        "ttft_mean_s": r["ttft_s"]["mean"], "ttft_p90_s": r["ttft_s"]["p90"],
        "hit_rate": r["hit_rate"], "utilization": r["load"]["utilization_predicted"],
        "bytes_storage_read": r["bytes"]["storage_read"],
        "bytes_storage_write": r["bytes"]["storage_write"],
    }
    if r.get("cluster"):
        row["prefix_routed_share"] = r["cluster"]["prefix_routed_share"]
        row["imbalance_requests"] = r["cluster"]["imbalance_requests"]
    if r.get("pool"):
        p = r["pool"]
        row["pool"] = {k: p[k] for k in ("blocks", "published", "evicted", "imported_copies")}
        if p["gate"]:
            row["pool"]["held_read_s"] = p["gate"]["read"]["held_s"]
            row["pool"]["held_write_s"] = p["gate"]["write"]["held_s"]
    h = row["hit_rate"]
    print(f"{label:<44} cpu {cpu:7.1f} s  wall {r['wall_s']:7.1f} s  TTFT mean "
          f"{row['ttft_mean_s']:8.3f} p90 {row['ttft_p90_s']:8.3f} s  hits dev "
          f"{h['device']:.3f} host {h['host']:.3f} sto {h['storage']:.3f} "
          f"total {h['total']:.3f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--pool-gb-per-s", type=float, default=10.0,
                    help="aggregate bandwidth of the limited pool, GB/s each way")
    ap.add_argument("--policies", default="best_effort,wait_complete")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    n = args.instances
    rows = []
    for policy in args.policies.split(","):
        base = dict(trace=str(args.trace), limit=args.limit, prefetch_policy=policy)
        one = run(f"1 instance ({policy})", ReplayConfig(instances=1, **base))
        cluster = dict(base, instances=n, router="prefix")
        local = run(f"{n} x prefix, local storage ({policy})", ReplayConfig(**cluster))
        pool = run(f"{n} x prefix, global pool ({policy})",
                   ReplayConfig(pool_gb=STORAGE_GB * n, **cluster))
        limited = run(f"{n} x prefix, pool at {args.pool_gb_per_s:g} GB/s ({policy})",
                      ReplayConfig(pool_gb=STORAGE_GB * n, pool_gb_per_s=args.pool_gb_per_s,
                                   **cluster))
        for row in (one, local, pool, limited):
            row["cpu_vs_one"] = row["cpu_s"] / one["cpu_s"]
        rows += [one, local, pool, limited]
    print()
    print("| setting | TTFT mean | TTFT p90 | hit device / host / storage-or-pool / total | "
          "CPU s | CPU vs 1 instance |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        h = r["hit_rate"]
        print(f"| {r['label']} | {r['ttft_mean_s']:.3f} s | {r['ttft_p90_s']:.3f} s | "
              f"{h['device']:.3f} / {h['host']:.3f} / {h['storage']:.3f} / {h['total']:.3f} | "
              f"{r['cpu_s']:.1f} | {r['cpu_vs_one']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.node(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
