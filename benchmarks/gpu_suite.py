"""Everything issue 6 measures on a GPU, in one run (one device call).

1. the GPU tests (bit-identical outputs across pools, GPU vs float64 reference,
   device-side wait);
2. the overlap benchmark (``bench_overlap.py``), copy streams at both priorities;
   the better one is what calibration and the GPU replays use;
3. ``kvflow calibrate`` -> ``$OUT/h100-calibrated.toml``;
4. two trace slices replayed in both worlds, the simulator with the calibrated
   profile, the same pools: (A) 40 consecutive requests of the bundled Mooncake
   conversation trace, verbatim; (B) a synthetic multi-turn trace whose small
   device pool makes turns load their history back from host (A has no reuse
   beyond its first block within seconds, so no swap-ins);
5. the fidelity table: per-transfer time, TTFT/TPOT percentiles, hit rates; each
   slice runs ``SUITE_GPU_RUNS`` times on the GPU (default 3), and the simulator is
   compared with the median of those runs, their range beside it (one run of the
   GPU world differs from the next by more than the ±5% asked of transfers).

Each step is a subprocess with a time limit, so one failing step (a CUDA
error poisons its process) does not stop the others. Everything goes to
stdout and ``$OUT/log``; ``$OUT/results.json`` holds every number and report.

Run (repository root): PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/gpu_suite.py
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = Path(os.environ.get("OUT", ROOT / "out"))
TMP = Path(os.environ.get("SUITE_TMP", "/tmp/kvflow_suite"))
MODEL = "llama-3-8b-l4"
PROFILE = OUT / "h100-calibrated.toml"
SLICE_A = (480, 520)     # lines of traces/samples/conversation_1k.jsonl (0-based, end excl.)
POOLS_A = (60, 1024)     # device, host blocks
POOLS_B = (48, 512)
TARGETS = {"transfer": 0.05, "ttft_p50": 0.10}
#: GPU replays per slice: the simulator is compared with their median, and their
#: spread is reported beside it (the GPU world moves by more than ±5% between runs).
GPU_RUNS = int(os.environ.get("SUITE_GPU_RUNS", "3"))
_log_file: Any = None


def say(msg: str = "") -> None:
    print(msg, flush=True)
    if _log_file is not None:
        _log_file.write(msg + "\n")
        _log_file.flush()


#: Wall-clock end of the whole suite (SUITE_BUDGET_S from start): steps shrink to fit.
T_END = time.time() + float(os.environ.get("SUITE_BUDGET_S", "1e9"))


def sh(cmd: str, timeout: float, env: dict[str, str] | None = None) -> int:
    """Run ``cmd`` in its own process group, streaming its output; kill it past ``timeout``."""
    timeout = min(timeout, T_END - time.time() - 15)
    say(f"\n$ {cmd}")
    if timeout < 20:
        say("[skipped: the suite's time budget is spent]")
        return 125
    t0 = time.time()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    e = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    e.update(env or {})
    proc = subprocess.Popen(cmd, shell=True, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout is not None
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group this call started

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        for line in proc.stdout:
            say(line.rstrip("\n"))
        rc = proc.wait()
    finally:
        timer.cancel()
    if killed.is_set():
        say(f"[timed out after {timeout:.0f} s]")
        rc = 124
    say(f"[rc={rc}, {time.time() - t0:.1f} s]")
    return rc


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def make_slices() -> dict[str, Path]:
    from traces.generate import multi_turn, write_generic

    TMP.mkdir(parents=True, exist_ok=True)
    lines = (ROOT / "traces/samples/conversation_1k.jsonl").read_text().splitlines()
    a = TMP / f"conversation_{SLICE_A[0]}_{SLICE_A[1]}.jsonl"
    a.write_text("\n".join(lines[SLICE_A[0]:SLICE_A[1]]) + "\n")
    b = TMP / "multi_turn.jsonl"
    reqs = multi_turn(sessions=16, turns=4, system_len=2048, user_len=1024, output_len=32,
                      think_time_s=3.0, rate=2.0, block_tokens=512, seed=1)
    write_generic(reqs, b, block_tokens=512, force=True)
    return {"A": a, "B": b}


def replay_cmd(trace: Path, pools: tuple[int, int], out: Path, cuda: bool) -> str:
    parts = [sys.executable, "cli.py", "replay", str(trace), "--model", MODEL,
             "--profile", str(PROFILE), "--device-blocks", str(pools[0]),
             "--host-blocks", str(pools[1]), "--storage-blocks", "0",
             "--instances", "1", "--out", str(out), "--force"]
    if cuda:
        parts += ["--backend", "cuda"]
    return shlex.join(parts)


def rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b - 1


def fidelity(sim: dict[str, Any], gpu: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows: metric, simulator, GPU, relative difference, target, met."""
    rows: list[dict[str, Any]] = []

    def row(name: str, s: float | None, g: float | None, unit: str, target: float | None,
            scale: float = 1.0) -> None:
        d = rel(s, g)
        rows.append({"metric": name, "sim": None if s is None else s * scale,
                     "gpu": None if g is None else g * scale, "unit": unit, "diff": d,
                     "target": target,
                     "met": None if target is None or d is None else abs(d) <= target})

    st, gt = sim.get("transfers") or {}, gpu.get("transfers") or {}
    for kind in sorted(set(st) | set(gt)):
        s, g = st.get(kind, {}), gt.get(kind, {})
        row(f"{kind}: service per block", s.get("service_per_block_s"),
            g.get("service_per_block_s"), "ms", TARGETS["transfer"], 1e3)
        row(f"{kind}: service per op (mean)", s.get("service_mean_s"), g.get("service_mean_s"),
            "ms", None, 1e3)
        row(f"{kind}: ops / blocks", s.get("ops"), g.get("ops"), "", None)
        rows[-1]["note"] = f"{s.get('blocks')} / {g.get('blocks')} blocks"
    for key in ("ttft_s", "tpot_s"):
        for p in ("p50", "p90", "p99"):
            s = (sim.get(key) or {}).get(p)
            g = (gpu.get(key) or {}).get(p)
            row(f"{key[:-2].upper()} {p}", s, g, "ms",
                TARGETS["ttft_p50"] if (key, p) == ("ttft_s", "p50") else None, 1e3)
    for tier in ("device", "host", "total"):
        s, g = sim["hit_rate"][tier], gpu["hit_rate"][tier]
        rows.append({"metric": f"hit rate {tier}", "sim": s, "gpu": g, "unit": "",
                     "diff": None if g == 0 else s / g - 1, "target": 0.0,
                     "met": abs(s - g) < 1e-12})
    row("elapsed (trace span + drain)", sim.get("sim_time_s"), gpu.get("sim_time_s"), "s", None)
    row("requests", sim.get("requests"), gpu.get("requests"), "", None)
    lag = ((gpu.get("device") or {}).get("arrival_lag_s") or {})
    for p in ("p50", "p90"):
        if lag.get(p) is not None:  # the simulator's arrivals are exact: none
            row(f"GPU arrival lag {p}", 0.0, lag[p], "ms", None, 1e3)
    return rows


def combine(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per metric from several GPU runs' rows: the GPU value is their median,
    ``spread`` their range; hit rates must be equal in every run."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for rows in runs:
        for r in rows:
            by_name.setdefault(r["metric"], []).append(r)
    out = []
    for name, rs in by_name.items():
        r = dict(rs[0])
        vals = sorted(x["gpu"] for x in rs if x["gpu"] is not None)
        if "hit" in name:
            r["met"] = all(x["met"] for x in rs)
        elif vals:
            r["gpu"] = statistics.median(vals)
            r["diff"] = rel(r["sim"], r["gpu"])
            r["met"] = (None if r["target"] is None or r["diff"] is None
                        else abs(r["diff"]) <= r["target"])
        if len(vals) > 1:
            r["spread"] = (vals[0], vals[-1])
        out.append(r)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| metric | simulator | GPU (median) | GPU runs, min..max | sim/GPU - 1 | target "
           "| met |", "|---|---|---|---|---|---|---|"]
    def f(v: Any, r: dict[str, Any]) -> str:
        if v is None:
            return "-"
        if "hit" in r["metric"]:
            return f"{v:.4f}"
        return f"{v:.4g} {r['unit']}".strip()

    for r in rows:
        d = "-" if r["diff"] is None else f"{r['diff']:+.1%}"
        tgt = "-" if r["target"] is None else ("equal" if r["target"] == 0 else
                                               f"±{r['target']:.0%}")
        met = {True: "yes", False: "**no**", None: "-"}[r["met"]]
        note = f" ({r['note']})" if r.get("note") else ""
        lo_hi = r.get("spread")
        spread = "-" if lo_hi is None else f"{f(lo_hi[0], r)}..{f(lo_hi[1], r)}"
        out.append(f"| {r['metric']}{note} | {f(r['sim'], r)} | {f(r['gpu'], r)} | {spread} | "
                   f"{d} | {tgt} | {met} |")
    return "\n".join(out)


def main() -> int:
    global _log_file
    OUT.mkdir(parents=True, exist_ok=True)
    TMP.mkdir(parents=True, exist_ok=True)
    _log_file = open(OUT / "log", "a")  # noqa: SIM115 - closed at exit
    t0 = time.time()
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "steps": {}}
    say(f"kvflow GPU suite, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    sh("nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,"
       "pcie.link.width.current,clocks.max.sm --format=csv", 30)
    sh(f"{sys.executable} -c 'import cupy, numpy, sys; print(sys.version); "
       "print(\"cupy\", cupy.__version__, \"numpy\", numpy.__version__)'", 60)

    # 1. tests; if the faster kernel variants fail them, the rest runs on the plain ones
    tests = f"{sys.executable} -m pytest -q -p no:cacheprovider -rs tests/test_gpu_engine.py"
    kernel_env: dict[str, str] = {}
    results["steps"]["tests"] = sh(tests, 420)
    if results["steps"]["tests"] != 0:
        kernel_env = {"KVFLOW_ATTN_KEYS": "16", "KVFLOW_GEMM_SKINNY": "0"}
        say(f"tests failed: again with {kernel_env}")
        results["steps"]["tests_plain_kernels"] = sh(tests, 420, kernel_env)
    results["kernel_env"] = kernel_env

    # 2. overlap (both priorities)
    ov = TMP / "overlap.json"
    results["steps"]["overlap"] = sh(f"{sys.executable} benchmarks/bench_overlap.py "
                                     f"--json {ov} {os.environ.get('SUITE_OVERLAP_ARGS', '')}",
                                     360, kernel_env)
    overlap = load(ov)
    results["overlap"] = overlap
    priority = "default"
    if overlap:
        def mean_eff(r: dict[str, Any]) -> float:
            return sum(row["efficiency"] for row in r["rows"]) / len(r["rows"])
        best = max([r for r in overlap if r.get("case", "batch") == "batch"] or overlap,
                   key=mean_eff)
        priority = "default" if best["stream_priority"] is None else "highest"
    say(f"\ncopy streams for calibration and replays: priority {priority}")
    env = {"KVFLOW_STREAM_PRIORITY": priority, **kernel_env}
    results["stream_priority"] = priority

    # 3. calibrate
    cal_json = TMP / "calibration.json"
    results["steps"]["calibrate"] = sh(
        f"{sys.executable} cli.py calibrate --model {MODEL} --out {PROFILE} "
        f"--json {cal_json} --force {os.environ.get('SUITE_CALIBRATE_ARGS', '')}", 360, env)
    results["calibration"] = load(cal_json)
    if not PROFILE.exists():
        say("no calibrated profile: the replays use the h100 preset instead")
        PROFILE.write_text('base = "h100"\nname = "h100-uncalibrated"\n')

    # 4. replays
    slices = make_slices()
    fid: dict[str, Any] = {}
    for name, pools in (("A", POOLS_A), ("B", POOLS_B)):
        trace = slices[name]
        sim_out = TMP / f"sim_{name}.json"
        results["steps"][f"sim_{name}"] = sh(replay_cmd(trace, pools, sim_out, False), 120)
        sim = load(sim_out)
        if sim is None:
            continue
        say(f"simulator predicts {sim['sim_time_s']:.1f} s for slice {name}")
        budget = 60 + 3 * sim["sim_time_s"]
        gpus, per_run = [], []
        for k in range(GPU_RUNS):
            out = TMP / f"gpu_{name}_{k}.json"
            results["steps"][f"gpu_{name}_{k}"] = sh(replay_cmd(trace, pools, out, True),
                                                     min(budget, 420), env)
            gpu = load(out)
            if gpu is not None:
                gpus.append(gpu)
                per_run.append(fidelity(sim, gpu))
        fid[name] = {"trace": str(trace), "pools": pools, "sim": sim, "gpu": gpus,
                     "rows_per_run": per_run}
        if per_run:
            rows = combine(per_run)
            fid[name]["rows"] = rows
            say(f"\nFidelity, slice {name} ({trace.name}, device {pools[0]} / host {pools[1]} "
                f"blocks, {MODEL}; {len(per_run)} GPU runs):\n" + table(rows))
    results["fidelity"] = fid
    results["seconds"] = time.time() - t0
    (OUT / "results.json").write_text(json.dumps(results, indent=1, default=str))

    # summary last (the reply shows the end of the output)
    say("\n==================== summary ====================")
    say(f"steps (rc): {results['steps']}; stream priority {priority}; "
        f"{results['seconds']:.0f} s")
    if overlap:
        for r in overlap:
            for row in r["rows"]:
                say(f"overlap {r.get('case')} prio={r['stream_priority']}: "
                    f"n={row['new_tokens']} transfer "
                    f"{row['transfer_s'] * 1e3:.2f} ms compute {row['compute_s'] * 1e3:.2f} ms "
                    f"together {row['together_s'] * 1e3:.2f} ms eff {row['efficiency']:.1%} "
                    f"enqueue {row['enqueue_s'] * 1e3:.2f} ms")
    cal = results.get("calibration")
    if cal:
        say(f"calibrated: {json.dumps(cal['profile'])}")
    for name, f in fid.items():
        if "rows" in f:
            say(f"\nslice {name}:\n" + table(f["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
