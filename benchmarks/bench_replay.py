"""Replay speed at trace scale: requests/s by CPU time and wall, peak RSS, where the time goes.

For each trace size and mode (full: the timed simulation; cache: hit rates only) a
fresh process replays the trace with device, host and storage tiers, then runs a
bare three-tier ``OrderedDict`` LRU over the same block hash ids and tier sizes;
the ratio of their CPU times per request is what a loaded machine cannot move
much (the two share the process, the machine and the minute). Sizes: the first
1,000 requests of the Mooncake conversation trace, the whole trace (12,031), and
the trace concatenated with itself 8 times, each copy shifted to start after the
last and given block ids of its own (96,248 requests, ``traces.reshape.repeat``).

    python benchmarks/bench_replay.py [--sizes 1k,12k,100k] [--modes full,cache]
        [--repeat 3] [--rate-scale 1.0] [--profile 12k] [--top 15] [--json out.json]

Peak RSS is the process's high-water mark (``ru_maxrss``) after the replay, before
the LRU's lists exist. At the trace's own rate one H100 instance is ~2.5x
overloaded, so its waiting queue (real model state: requests that arrived and
wait) grows with the trace; ``--rate-scale 0.35`` offers it at a load one
instance keeps up with, where memory is flat in the trace's length. ``--profile``
reruns the named sizes under cProfile (in their own processes, untimed) and
prints the functions with the most own time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONVERSATION = ROOT.parent / "shared/traces/conversation_trace.jsonl"
SIZES = {"1k": (1_000, 1), "12k": (None, 1), "100k": (None, 8)}


def trace_for(size: str, tmp: Path) -> tuple[str, int | None]:
    """The trace file and request limit of a size (100k: written once into ``tmp``)."""
    limit, copies = SIZES[size]
    if copies == 1:
        return str(CONVERSATION), limit
    path = tmp / f"conversation_x{copies}.jsonl"
    if not path.exists():
        from traces import open_trace
        from traces.reshape import repeat
        from traces.writer import write_generic

        tr = open_trace(CONVERSATION)
        write_generic(repeat(tr, copies), path, block_tokens=tr.block_tokens, force=True)
    return str(path), limit


def lru3(requests: Sequence[Sequence[Any]], caps: tuple[int, int, int]) -> list[int]:
    """A bare three-tier LRU: a request's leading blocks found on any tier are hits; then
    all its blocks go to the device (most recent), and each tier's overflow goes one down."""
    dev: OrderedDict[Any, None] = OrderedDict()
    host: OrderedDict[Any, None] = OrderedDict()
    sto: OrderedDict[Any, None] = OrderedDict()
    cd, ch, cs = caps
    hits = [0, 0, 0, 0]
    for ids in requests:
        for b in ids:
            if b in dev:
                hits[0] += 1
            elif b in host:
                hits[1] += 1
            elif b in sto:
                hits[2] += 1
            else:
                break
        hits[3] += len(ids)
        for b in reversed(ids):
            if b in dev:
                dev.move_to_end(b)
            else:
                host.pop(b, None)
                sto.pop(b, None)
                dev[b] = None
        while len(dev) > cd:
            host[dev.popitem(last=False)[0]] = None
        while len(host) > ch:
            sto[host.popitem(last=False)[0]] = None
        while len(sto) > cs:
            sto.popitem(last=False)
    return hits


def one(size: str, mode: str, tmp: Path, repeat: int, rate_scale: float = 1.0
        ) -> dict[str, Any]:
    """Measure one size and mode in this process (run by ``main`` in a fresh one)."""
    from kvflow.replay import ReplayConfig, resolve, run_replay

    trace, limit = trace_for(size, tmp)
    cfg = ReplayConfig(trace=trace, limit=limit, mode=mode, rate_scale=rate_scale)
    c0, w0 = time.process_time(), time.perf_counter()
    report = run_replay(cfg)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    n = report["requests"] + report.get("rejected", 0)
    c0 = time.process_time()
    setup = resolve(cfg)
    read_cpu = time.process_time() - c0
    ids = [r.keys for r in setup.requests]
    caps = (setup.capacities.device, setup.capacities.host, setup.capacities.storage)
    lru_cpu = float("inf")
    for _ in range(repeat):
        c0 = time.process_time()
        lru3(ids, caps)
        lru_cpu = min(lru_cpu, time.process_time() - c0)
    return {
        "size": size, "mode": mode, "requests": n, "cpu_s": cpu, "wall_s": wall,
        "read_cpu_s": read_cpu, "peak_rss_mb": rss_mb, "lru_cpu_s": lru_cpu,
        "req_per_cpu_s": n / cpu, "req_per_wall_s": n / wall,
        "us_per_req": cpu / n * 1e6, "lru_us_per_req": lru_cpu / n * 1e6,
        "ratio": cpu / lru_cpu, "ratio_without_read": (cpu - read_cpu) / lru_cpu,
        "hit_rate": report["hit_rate"]["total"], "rate_scale": rate_scale,
        "max_queue": max(report["timeseries"].get("queue_len") or [0]),
    }


def profile(size: str, mode: str, tmp: Path, top: int) -> None:
    import cProfile
    import pstats

    from kvflow.replay import ReplayConfig, run_replay

    trace, limit = trace_for(size, tmp)
    prof = cProfile.Profile()
    prof.runcall(run_replay, ReplayConfig(trace=trace, limit=limit, mode=mode))
    print(f"--- {size} {mode}: top {top} functions by own time (cProfile)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def _child(args: list[str]) -> str:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True,
                         text=True, cwd=ROOT)
    return out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1k,12k,100k")
    ap.add_argument("--modes", default="full,cache")
    ap.add_argument("--repeat", type=int, default=3, help="LRU runs (best of)")
    ap.add_argument("--rate-scale", type=float, default=1.0,
                    help="offer the traces this many times faster (0.35: a load one "
                         "instance keeps up with, so its queue stays short)")
    ap.add_argument("--profile", default="", help="sizes to profile, e.g. 12k")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()) / "kvflow_bench")
    ap.add_argument("--one", nargs=2, metavar=("SIZE", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--profile-one", nargs=2, metavar=("SIZE", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.tmp.mkdir(parents=True, exist_ok=True)
    if args.one:
        print(json.dumps(one(*args.one, args.tmp, args.repeat, args.rate_scale)))
        return
    if args.profile_one:
        profile(*args.profile_one, args.tmp, args.top)
        return
    sizes, modes = args.sizes.split(","), args.modes.split(",")
    for s in sizes:
        trace_for(s, args.tmp)  # write the long trace before timing anything
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} / {load[1]:.2f} / "
          f"{load[2]:.2f} (1/5/15 min) at start; rate scale {args.rate_scale}")
    rows = []
    head = (f"{'size':>5} {'mode':>5} {'requests':>8} {'req/s cpu':>9} {'req/s wall':>10} "
            f"{'us/req':>7} {'LRU us/req':>10} {'x LRU':>6} {'x LRU*':>6} {'RSS MB':>7} "
            f"{'max queue':>9}")
    print(head)
    for s in sizes:
        for m in modes:
            row = json.loads(_child(["--one", s, m, "--repeat", str(args.repeat),
                                     "--rate-scale", str(args.rate_scale),
                                     "--tmp", str(args.tmp)]))
            rows.append(row)
            print(f"{s:>5} {m:>5} {row['requests']:>8} {row['req_per_cpu_s']:>9,.0f} "
                  f"{row['req_per_wall_s']:>10,.0f} {row['us_per_req']:>7.1f} "
                  f"{row['lru_us_per_req']:>10.1f} {row['ratio']:>6.2f} "
                  f"{row['ratio_without_read']:>6.2f} {row['peak_rss_mb']:>7.0f} "
                  f"{row['max_queue']:>9}", flush=True)
    load = os.getloadavg()
    print(f"load average at end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    print("x LRU: replay CPU / bare LRU CPU, same process; x LRU*: the replay less its "
          "trace read (the LRU gets parsed ids)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    for s in filter(None, args.profile.split(",")):
        for m in modes:
            print(_child(["--profile-one", s, m, "--top", str(args.top),
                          "--tmp", str(args.tmp)]))


if __name__ == "__main__":
    main()
