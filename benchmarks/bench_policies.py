"""Every eviction policy against the offline optimum: hit rates and time, cache mode.

For each trace and device capacity, replays the trace in arrival order through
``CacheManager`` (device tier only, every copy at once: the replay's cache
mode) with each policy, and reports the device hit rate, its share of the
offline optimum's, and the best wall and CPU time of ``--repeat`` runs
(interleaved, same process), with each policy's time as a ratio to LRU's
(kvflow's default: its order linked through the native index's nodes).

Rows: the online policies; ``lru-py``, the same LRU order kept in Python
(``kvflow.policy.LRU``: what any policy written in Python starts from);
``belady`` (offline: reads the future; the manager running Belady's MIN);
``optimum``, the same optimum computed apart (``traces.optimum``, what
``kvflow.headroom`` and ``kvflow trace stats`` use). Belady's hit rate must
equal the optimum's, and no online policy may exceed it (checked here too).

    python benchmarks/bench_policies.py [TRACE ...] [--capacity N ...] [--repeat R]
                                        [--policies a,b,...] [--core native|python]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import date
from functools import partial
from pathlib import Path

from kvflow.belady import FutureUses
from kvflow.manager import CacheManager, Capacities
from kvflow.policy import EVICTION_POLICIES, LRU, OFFLINE_POLICIES
from traces import open_trace
from traces.optimum import optimum_hits

SHARED = Path(__file__).resolve().parents[1].parent / "shared/traces"
DEFAULT_TRACES = [SHARED / "conversation_trace.jsonl", SHARED / "synthetic_trace.jsonl"]
DEFAULT_CAPACITIES = [1000, 4000, 16000, 64000]
ONLINE = [p for p in EVICTION_POLICIES if p not in OFFLINE_POLICIES]
# The LRU order kept in Python under the same index core (the index links "lru" through
# the native nodes): a name the index does not recognise, for this process only.
EVICTION_POLICIES["lru-py"] = LRU


def load(path: Path) -> list[list[int]]:
    return [list(r.block_hashes or ()) for r in open_trace(path)]


def replay(requests: list[list[int]], capacity: int, policy: str, core: str | None) -> int:
    """Device hits of a cache-mode replay (device tier only: no copies to land)."""
    future = None
    eviction = policy
    if policy == "belady":
        future = FutureUses([r[:capacity] for r in requests])
    m = CacheManager(Capacities(capacity), eviction=eviction, index_core=core, future=future)
    plan, commit, finish = m.plan, m.commit, m.finish
    for i, keys in enumerate(requests):
        p = plan(i, keys[:capacity])
        commit(p)
        finish(p)
    return m.stats.hits[0]


def timed(fn: Callable[[], int]) -> tuple[int, float, float]:
    gc.collect()
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--capacity", type=int, nargs="+", default=DEFAULT_CAPACITIES)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--policies", default=",".join([*ONLINE, "lru-py", "belady", "optimum"]))
    ap.add_argument("--core", default=None, help="index core: native (default) or python")
    args = ap.parse_args()
    policies = args.policies.split(",")
    if "lru" not in policies:
        policies.insert(0, "lru")
    print(f"# bench_policies, {date.today()}, {platform.node()}: {platform.processor() or ''} "
          f"{os.cpu_count()} cores, Python {platform.python_version()}, "
          f"index core {args.core or 'auto'}")
    print(f"# {' '.join(sys.argv)}")
    worst: dict[str, float] = {}
    for path in args.traces:
        reqs = load(path)
        blocks = sum(map(len, reqs))
        print(f"\n## {path.name}: {len(reqs):,} requests, {blocks:,} block accesses\n")
        print("| capacity | policy | hit rate | of optimum | wall s | CPU s | wall / LRU | "
              "CPU / LRU |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        for cap in args.capacity:
            best: dict[str, tuple[int, float, float]] = {}
            for _ in range(args.repeat):
                for pol in policies:
                    if pol == "optimum":
                        run = timed(partial(optimum_hits, reqs, cap))
                    else:
                        run = timed(partial(replay, reqs, cap, pol, args.core))
                    old = best.get(pol)
                    if old is not None and old[0] != run[0]:
                        raise AssertionError(f"{pol} at {cap}: {run[0]} hits, then {old[0]}")
                    best[pol] = run if old is None else (
                        run[0], min(old[1], run[1]), min(old[2], run[2]))
            opt = best["optimum"][0] if "optimum" in best else None
            _, lw, lc = best["lru"]
            for pol in policies:
                hits, w, c = best[pol]
                label = f"{pol} (offline)" if pol in ("belady", "optimum") else pol
                of = f"{hits / opt:.2f}" if opt else "-"
                print(f"| {cap:,} | {label} | {hits / blocks:.4f} | {of} | {w:.3f} | {c:.3f} | "
                      f"{w / lw:.2f} | {c / lc:.2f} |")
                if opt is not None and pol in ONLINE and hits > opt:
                    raise AssertionError(f"{pol} beat the offline optimum at {cap}")
                if pol == "belady" and opt is not None and hits != opt:
                    raise AssertionError(f"belady {hits} != optimum {opt} at {cap}")
                if pol in ONLINE:
                    worst[pol] = max(worst.get(pol, 0.0), c / lc)
    print("\nworst CPU time / LRU's over traces and capacities: "
          + ", ".join(f"{p} {r:.2f}x" for p, r in worst.items()))


if __name__ == "__main__":
    main()
