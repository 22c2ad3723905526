"""Cluster replay (issue 18): routers x pools at 16 instances, its cost, and Mooncake's figures.

Four parts, each a flag (all by default):

``--table``   the full conversation trace (and a tool&agent-like and the synthetic
              trace) on 16 simulated H100s, every router with per-instance storage
              and with a global KV pool: mean and p90 TTFT, hit rate per tier, SLO
              attainment (TTFT <= 2 s and TPOT <= 0.1 s by default);
``--speed``   CPU time of the 16-instance replay (prefix router, global pool) against
              the single-instance replay of the same trace, interleaved in one
              process, best of ``--repeat``: the cluster layer's cost;
``--memory``  peak RSS (and RSS when the replay ends, before its report) and CPU per
              request of that 16-instance replay at 12k, 24k, 48k and ~96k requests
              (copies of the trace in a row, ``--sizes``), each in its own process;
``--mooncake`` the settings of the Mooncake FAST'25 paper's Fig. 5 (scheduling policies,
              16 nodes of 8 GPUs, conversation trace) and Fig. 10 (10 prefill nodes,
              1-token outputs, 3M tokens of cache per node, local vs global pool),
              as close as kvflow's model gets, beside the published numbers.

Run (repository root): ``python benchmarks/bench_cluster.py [--table] [--speed] [--memory]
[--mooncake] [--json out.json]``. Traces: ``../shared/traces`` (the conversation and
synthetic traces) and a tool&agent-like trace ``kvflow trace gen tool-agent`` writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvflow.replay import ReplayConfig, run_replay  # noqa: E402

SHARED = ROOT.parent / "shared" / "traces"
CONV = SHARED / "conversation_trace.jsonl"
SYNTH = SHARED / "synthetic_trace.jsonl"
ROUTERS = ("random", "round_robin", "least_loaded", "prefix", "ttft")

# Mooncake FAST'25 (FAST25-release/Mooncake-FAST25.pdf in kvcache-ai/Mooncake): Fig. 5
# mean TTFT printed on the figure; Fig. 10 hit rates read off the bars (+-0.1 point).
MOONCAKE_FIG10 = {"conversation": (0.169, 0.375), "tool_agent": (0.420, 0.581),
                  "synthetic": (0.264, 0.622)}


def _run(cfg: ReplayConfig) -> dict[str, Any]:
    t, w = time.process_time(), time.perf_counter()
    r = run_replay(cfg)
    r["cpu_s"], r["run_wall_s"] = time.process_time() - t, time.perf_counter() - w
    return r


def _row(name: str, r: dict[str, Any]) -> dict[str, Any]:
    slo = r.get("slo") or {}
    return {"setting": name, "requests": r["requests"], "ttft_mean_s": r["ttft_s"]["mean"],
            "ttft_p90_s": r["ttft_s"]["p90"], "tpot_p50_s": (r["tpot_s"] or {}).get("p50"),
            "hit_device": r["hit_rate"]["device"], "hit_host": r["hit_rate"]["host"],
            "hit_storage": r["hit_rate"]["storage"], "hit_total": r["hit_rate"]["total"],
            "slo_attainment": slo.get("attainment"), "cpu_s": r["cpu_s"],
            "wall_s": r.get("run_wall_s"), "overloaded": r["load"]["overloaded"],
            "utilisation": r["load"].get("utilization_predicted"),
            "busy_share": r["load"].get("compute_busy_share"), "pool": r.get("pool")}


def tool_agent_trace(out_dir: Path) -> Path:
    from traces.generate import tool_agent
    from traces.writer import write_generic

    path = out_dir / "tool_agent.jsonl"
    write_generic(tool_agent(seed=0), path, block_tokens=512, force=True)
    return path


def table(workers: int, slo: tuple[float, float], pool_gb: float,
          policies: tuple[str, ...] = ("best_effort",),
          limit: int | None = None) -> list[dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="kvflow_cluster_"))
    traces = {"conversation": CONV, "tool_agent": tool_agent_trace(tmp), "synthetic": SYNTH}
    jobs = []
    for policy in policies:
        for tname, path in traces.items():
            for router in ROUTERS:
                for pool in (None, pool_gb):
                    cfg = ReplayConfig(trace=str(path), instances=16, router=router,
                                       slo_ttft_s=slo[0], slo_tpot_s=slo[1], pool_gb=pool,
                                       prefetch_policy=policy, limit=limit)
                    jobs.append((f"{tname} {router} {'pool' if pool else 'local'} {policy}",
                                 cfg))
    with ProcessPoolExecutor(workers) as ex:
        results = list(ex.map(_run, [c for _, c in jobs]))
    return [_row(name, r) for (name, _), r in zip(jobs, results, strict=True)]


def speed(repeat: int, pool_gb: float) -> dict[str, Any]:
    one = ReplayConfig(trace=str(CONV))
    many = ReplayConfig(trace=str(CONV), instances=16, router="prefix", pool_gb=pool_gb)
    best: dict[str, float] = {}
    for _ in range(repeat):  # interleaved: a load on the machine hits both alike
        for name, cfg in (("single", one), ("cluster16", many)):
            t = time.process_time()
            run_replay(cfg)
            best[name] = min(best.get(name, float("inf")), time.process_time() - t)
    return {"single_cpu_s": best["single"], "cluster16_cpu_s": best["cluster16"],
            "ratio": best["cluster16"] / best["single"],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _one_token_trace(src: Path, dst: Path) -> Path:
    with open(src) as f, open(dst, "w") as g:
        for line in f:
            obj = json.loads(line)
            obj["output_length"] = 1
            g.write(json.dumps(obj) + "\n")
    return dst


A800 = str(ROOT / "sim" / "profiles" / "a800.toml")
#: Mooncake's node: 8 GPUs (one instance, tensor parallel), ~1 TB of DRAM for KV = 3M tokens
#: of LLaMA3-70B (320 KB/token), 4 x 200 Gb/s RDMA NICs (100 GB/s) to the other nodes.
NODE_TOKENS = 3_000_000
NODE_NIC_GB_PER_S = 100.0


def mooncake(workers: int, limit: int | None = None, pd: str | None = None
             ) -> dict[str, Any]:
    """Fig. 5 and Fig. 10's settings, approximated (results/cluster.md says what differs).

    Every instance is one node: llama-3-70b on 8 A800s (``--tp 8``), its device blocks
    plus host blocks making 3M tokens of cache, no storage of its own; "global" adds a
    pool of every node's 3M tokens over each node's 100 GB/s of NICs. Loads are waited
    for (``wait_complete``): Mooncake's prefill reads its cached prefix, local or
    remote, before it computes."""
    model = dict(model="llama-3-70b", profile=A800, tp=8, prefetch_policy="wait_complete",
                 storage_blocks=0, limit=limit)
    probe = ReplayConfig(trace=str(CONV), instances=1, **model)
    dev = _device_blocks(probe)
    bt = 512  # the traces' block
    node_blocks = NODE_TOKENS // bt
    host = max(0, node_blocks - dev)

    def cfg(trace: Path, n: int, router: str, pool: bool, pd: str | None = None
            ) -> ReplayConfig:
        kw = dict(model, host_blocks=host, pd=pd)
        if pool:
            kw.update(storage_blocks=None, pool_blocks=n * node_blocks,
                      nic_gb_per_s=NODE_NIC_GB_PER_S)
        return ReplayConfig(trace=str(trace), instances=n, router=router, **kw)

    fig5 = {"random": cfg(CONV, 16, "random", False),
            "least_loaded": cfg(CONV, 16, "least_loaded", False),
            "prefix": cfg(CONV, 16, "prefix", False),
            "ttft": cfg(CONV, 16, "ttft", False),
            "prefix+pool": cfg(CONV, 16, "prefix", True),
            "ttft+pool": cfg(CONV, 16, "ttft", True)}
    tmp = Path(tempfile.mkdtemp(prefix="kvflow_mooncake_"))
    traces = {"conversation": _one_token_trace(CONV, tmp / "conv1.jsonl"),
              "tool_agent": _one_token_trace(tool_agent_trace(tmp), tmp / "tool1.jsonl"),
              "synthetic": _one_token_trace(SYNTH, tmp / "synth1.jsonl")}
    fig10 = {}
    for name, path in traces.items():
        fig10[f"{name} local"] = cfg(path, 10, "prefix", False)
        fig10[f"{name} global"] = cfg(path, 10, "prefix", True)
    if pd is not None:  # Fig. 5 again with P prefill and D decode nodes (Mooncake's shape)
        fig5 = {f"{k} pd {pd}": dataclasses.replace(c, pd=pd) for k, c in fig5.items()}
        fig10 = {}
    jobs = list(fig5.items()) + list(fig10.items())
    with ProcessPoolExecutor(workers) as ex:
        results = list(ex.map(_run, [c for _, c in jobs]))
    out = {name: _row(name, r) for (name, _), r in zip(jobs, results, strict=True)}
    paper5 = {"random": 19.65, "least_loaded": 5.27, "prefix": 3.58, "ttft": 3.58,
              "prefix+pool": 3.07, "ttft+pool": 3.07}
    return {"setting": {"device_blocks": dev, "host_blocks": host, "node_blocks": node_blocks},
            "fig5": {k: dict(out[k], paper_ttft_mean_s=paper5[k.split(" pd ")[0]])
                     for k in fig5},
            "fig10": {k: {"local": out[f"{k} local"], "global": out[f"{k} global"],
                          "paper_hit_local": MOONCAKE_FIG10[k][0],
                          "paper_hit_global": MOONCAKE_FIG10[k][1]} for k in traces
                     if fig10}}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _memory_child(trace: str, pool_gb: float) -> dict[str, Any]:
    """One 16-instance replay (prefix router, global pool) in this (fresh) process: peak
    RSS, and RSS when the replay ends (the ``inspect`` hook, before the report is built)."""
    at_end: list[float] = []
    tables: dict[str, float] = {}

    def inspect(m: Any, _rt: Any) -> None:
        if not at_end:
            at_end.append(_rss_mb())
            # The pool directory's hash tables: a dict that evicts as it inserts grows its
            # table to 3x its entries at the first resize after it is full (CPython's
            # GROWTH_RATE), so they double once the pool turns over: capacity, not requests.
            d = m.pool.directory
            tables.update(pool_entries=len(d.entries), pool_held=len(d.held),
                          pool_tables_mb=(sys.getsizeof(d.entries) + sys.getsizeof(d.held))
                          / 2**20)

    before = _rss_mb()
    t, w = time.process_time(), time.perf_counter()
    r = run_replay(ReplayConfig(trace=trace, instances=16, router="prefix", pool_gb=pool_gb),
                   inspect=inspect)
    return {"requests": r["requests"], "cpu_s": time.process_time() - t,
            "wall_s": time.perf_counter() - w, "rss_before_mb": before,
            "rss_replay_end_mb": at_end[0], "pool_blocks": r["pool"]["blocks"], **tables,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def memory(pool_gb: float, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> list[dict[str, Any]]:
    """Peak RSS and CPU per request of the cluster replay at 12k x each of ``sizes`` requests
    (the conversation trace, and 2, 4, 8 copies of it one after another:
    ``traces.reshape.repeat``, with each copy's block ids its own (new users: the pool's
    index grows until the pool is full)), and at the largest size once more sharing them
    (the same prompts again); each in its own process so one peak cannot hide another's.
    The growth per request between the two largest sizes is what is left to flatten."""
    from traces import open_trace
    from traces.reshape import repeat
    from traces.writer import write_generic

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tr = open_trace(CONV)
        runs: list[tuple[str, Path]] = []
        for k in sizes:
            for shared in (False, True) if k == max(sizes) and k > 1 else (False,):
                if k == 1:
                    runs.append(("x1", CONV))
                    continue
                name = f"x{k}, {'shared' if shared else 'own'} block ids"
                path = Path(tmp) / f"conversation_x{k}_{'shared' if shared else 'own'}.jsonl"
                write_generic(repeat(tr, k, share_ids=shared), path,
                              block_tokens=tr.block_tokens, force=True)
                runs.append((name, path))
        for name, trace in runs:
            with ProcessPoolExecutor(1) as ex:
                row = ex.submit(_memory_child, str(trace), pool_gb).result()
            row["size"] = name
            row["cpu_ms_per_request"] = 1e3 * row["cpu_s"] / row["requests"]
            rows.append(row)
            print(row, flush=True)
    own = [r for r in rows if "shared" not in r["size"]]
    if len(own) >= 2:
        a, b = own[-2], own[-1]
        dn = b["requests"] - a["requests"]
        mib = 2**20 / dn
        peak = (b["peak_rss_mb"] - a["peak_rss_mb"]) * mib
        end = (b["rss_replay_end_mb"] - a["rss_replay_end_mb"]) * mib
        print(f"growth {a['size']} -> {b['size']}: peak {peak:.0f} B a request, "
              f"at the replay's end {end:.0f} B a request", flush=True)
    return rows


def _device_blocks(cfg: ReplayConfig) -> int:
    from kvflow.replay import resolve
    from kvflow.world import load_world

    return resolve(dataclasses.replace(cfg, limit=1), load_world("sim")).capacities.device


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--mooncake", action="store_true")
    ap.add_argument("--memory", action="store_true",
                    help="peak RSS and CPU per request at 12k to ~96k requests")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="--memory: copies of the conversation trace to replay, each size "
                         "in its own process")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)))
    ap.add_argument("--pool-gb", type=float, default=16 * 2048.0,
                    help="global pool size (default: the 16 instances' 2 TB each)")
    ap.add_argument("--slo", type=float, nargs=2, default=(2.0, 0.1), metavar=("TTFT", "TPOT"))
    ap.add_argument("--policies", nargs="+", default=["best_effort"],
                    help="prefetch policies of the table (each: every trace x router x pool)")
    ap.add_argument("--limit", type=int, help="only the first N requests of each trace")
    ap.add_argument("--mooncake-pd", metavar="P:D",
                    help="--mooncake: Fig. 5 only, with P prefill and D decode nodes")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    everything = not (a.table or a.speed or a.mooncake or a.memory)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:]}
    t0, c0 = time.perf_counter(), time.process_time()
    if a.speed or everything:
        out["speed"] = speed(a.repeat, a.pool_gb)
        print(json.dumps(out["speed"], indent=1), flush=True)
    if a.table or everything:
        out["table"] = table(a.workers, tuple(a.slo), a.pool_gb, tuple(a.policies), a.limit)
        print("| setting | TTFT mean | TTFT p90 | hit d/h/s/total | SLO | overloaded | "
              "CPU / wall |")
        print("|---|---:|---:|---|---:|---|---:|")
        for r in out["table"]:
            print(f"| {r['setting']} | {r['ttft_mean_s']:.3f} s | {r['ttft_p90_s']:.3f} s | "
                  f"{r['hit_device']:.1%} / {r['hit_host']:.1%} / {r['hit_storage']:.1%} / "
                  f"{r['hit_total']:.1%} | {r['slo_attainment']:.1%} | {r['overloaded']} | "
                  f"{r['cpu_s']:.1f} / {r['wall_s']:.1f} s |", flush=True)
    if a.memory or everything:
        out["memory"] = memory(a.pool_gb, tuple(a.sizes))
    if a.mooncake or everything:
        out["mooncake"] = mooncake(a.workers, a.limit, a.mooncake_pd)
        print(json.dumps(out["mooncake"], indent=1), flush=True)
    out["wall_s"], out["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
