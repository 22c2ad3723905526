"""Prefix index + manager vs a plain OrderedDict LRU, on a real trace.

Replays a Mooncake trace in arrival order through ``CacheManager`` in
device-only LRU mode (plan -> commit -> finish per request, no timing) and
through a bare ``OrderedDict`` block LRU, in the same process, several times
each, interleaved; reports the best time per request of each and their ratio,
and whether both give the same block hit rate (they must).

    python benchmarks/bench_index.py [TRACE] [--capacity N] [--repeat R] [--core C] [--profile]

``--core python`` times the plain-Python index core (the fallback where the
native one, ``kvflow._index_core``, was not built); the default is the native
core where it was built.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections import OrderedDict
from functools import partial
from pathlib import Path

from kvflow.manager import CacheManager, Capacities
from kvflow.radix import CORES, PrefixIndex

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared/traces/conversation_trace.jsonl"
)


def load_hash_ids(path: Path) -> list[list[int]]:
    with open(path) as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


def plain_lru(requests: list[list[int]], capacity: int) -> tuple[int, int]:
    """The oracle: hit = leading run resident at arrival; then touch tail-first."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for ids in requests:
        for h in ids:
            if h not in cache:
                break
            hits += 1
        total += len(ids)
        for h in reversed(ids):
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits, total


def manager_lru(requests: list[list[int]], capacity: int,
                core: str | None = None) -> tuple[int, int]:
    m = CacheManager(Capacities(capacity), eviction="lru", index_core=core)
    for i, ids in enumerate(requests):
        plan = m.plan(i, ids[:capacity])
        m.commit(plan)
        m.finish(plan)
    return m.stats.hits[0], m.stats.prompt_blocks + sum(
        max(0, len(ids) - capacity) for ids in requests
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--capacity", type=int, default=5000, help="device blocks")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--core", choices=CORES, default="auto", help="index core (default: auto)")
    ap.add_argument("--profile", action="store_true",
                    help="first print the top of a cProfile of one manager replay")
    args = ap.parse_args()
    native = PrefixIndex([1, 0, 0], core=args.core).native
    reqs = load_hash_ids(args.trace)
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(manager_lru, reqs, args.capacity, args.core)
        pstats.Stats(prof).sort_stats("tottime").print_stats(8)
    best = {"manager": float("inf"), "plain": float("inf")}
    results = {}
    for _ in range(args.repeat):
        for name, fn in (("plain", plain_lru),
                         ("manager", partial(manager_lru, core=args.core))):
            t0 = time.perf_counter()
            results[name] = fn(reqs, args.capacity)
            best[name] = min(best[name], time.perf_counter() - t0)
    n = len(reqs)
    m_us, p_us = best["manager"] / n * 1e6, best["plain"] / n * 1e6
    (mh, mt), (ph, pt) = results["manager"], results["plain"]
    print(f"trace={args.trace.name} requests={n} capacity={args.capacity} blocks "
          f"index_core={'native' if native else 'python'}")
    print(f"hit rate: manager={mh / mt:.6f} plain={ph / pt:.6f}")
    print(f"RESULT manager_us_per_req={m_us:.2f} plain_us_per_req={p_us:.2f} "
          f"ratio={m_us / p_us:.2f} hit_equal={(mh, mt) == (ph, pt)}")


if __name__ == "__main__":
    main()
