"""Simulator against the GPU world, per host layout (issue 23), in one device call.

1. ``kvflow calibrate --onto PROFILE --host-layouts ...``: the PCIe links of each
   host layout, measured as the profile's own links are (a small GPU replay in
   that layout) and written onto a copy of the compute-calibrated profile
   (``$OUT/profile.toml``; ``--no-calibrate`` uses ``--profile`` as it is);
2. one trace slice (gpu_suite's slice B: a multi-turn trace whose small device
   pool makes later turns load their history back from host) replayed in both
   worlds for each layout, the simulator with that profile, the same pools and
   layout; the model has 16 layers by default (``llama-3-8b-l16``), so that
   ``grouped:4``, ``grouped:8`` and ``block_major`` are three different groupings
   (on the 4-layer slice the suite replays, all three are one group);
3. the fidelity rows per layout (``gpu_suite.fidelity``: service time per block
   of backups and swap-ins, TTFT/TPOT percentiles, hit rates), the simulator
   against the median of ``--gpu-runs`` GPU replays, and one summary table:
   per layout, transfers per block and TTFT p50, sim against GPU, and each
   layout's TTFT p50 relative to ``layer_major`` in either world (what a reader
   choosing a layout reads off the simulator).

Without a GPU (or with ``--sim-only``) only the simulator runs; ``--gpu-dir DIR``
then reads the GPU reports (in ``DIR/layout_fidelity.json``) and ``DIR/profile.toml``
that an earlier device run wrote, so the tables can be rebuilt off the device. Under
``--out`` go at most five files (the device tool brings back eight): the profile, the
calibration's JSON, the results JSON (every report of both worlds), the log and the
summary table.

Run (repository root): PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/layout_fidelity.py
[--out DIR] [--gpu-runs N] [--layouts layer_major,grouped:4,grouped:8,block_major]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402
from gpu_suite import TARGETS, combine, fidelity, say, sh, table  # noqa: E402

LAYOUTS = "layer_major,grouped:4,grouped:8,block_major"
MODEL = "llama-3-8b-l16"
PROFILE = ROOT / "sim/profiles/h100-fast-calibrated.toml"
POOLS = (48, 256)  # device, host blocks (512-token blocks: 32 MiB each at 16 layers)


def tag(layout: str) -> str:
    return layout.replace(":", "")


def make_slice(tmp: Path, block_tokens: int, rate: float, think_s: float) -> Path:
    """gpu_suite's slice B (multi-turn, turns loading their history back from host), by
    default at twice its rate and half its think time: the same 64 requests, 20 of them
    loading from host, in 15 s of trace instead of 30 (one device call holds 4 layouts)."""
    from traces.generate import multi_turn, write_generic

    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / f"multi_turn_{block_tokens}_{rate:g}_{think_s:g}.jsonl"
    reqs = multi_turn(sessions=16, turns=4, system_len=2048, user_len=1024, output_len=32,
                      think_time_s=think_s, rate=rate, block_tokens=block_tokens, seed=1)
    write_generic(reqs, path, block_tokens=block_tokens, force=True)
    return path


def sim_report(trace: Path, model: str, profile: Path, pools: tuple[int, int],
               layout: str) -> dict[str, Any]:
    from kvflow.replay import ReplayConfig, run_replay

    cfg = ReplayConfig(trace=str(trace), model=model, profile=str(profile),
                       device_blocks=pools[0], host_blocks=pools[1], storage_blocks=0,
                       instances=1, host_layout=layout)
    return run_replay(cfg)


def gpu_cmd(trace: Path, model: str, profile: Path, pools: tuple[int, int], layout: str,
            out: Path) -> str:
    return shlex.join([sys.executable, "cli.py", "replay", str(trace), "--model", model,
                       "--profile", str(profile), "--device-blocks", str(pools[0]),
                       "--host-blocks", str(pools[1]), "--storage-blocks", "0",
                       "--instances", "1", "--host-layout", layout, "--backend", "cuda",
                       "--out", str(out), "--force"])


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _metric(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next((r for r in rows if r["metric"] == name), {})


def summary(per_layout: dict[str, dict[str, Any]]) -> str:
    """One row per layout: transfers per block and TTFT p50, sim / GPU, and TTFT p50
    relative to layer_major's in each world."""
    base = per_layout.get("layer_major", {})
    bs, bg = base.get("sim_ttft"), base.get("gpu_ttft")
    out = ["| layout | backup per block, ms: sim / GPU | sim/GPU - 1 | swap-in per block, ms: "
           "sim / GPU | sim/GPU - 1 | TTFT p50, ms: sim / GPU | sim/GPU - 1 | TTFT p50 / "
           "layer_major's: sim / GPU |", "|---|---|---|---|---|---|---|---|"]

    def cell(r: dict[str, Any], scale: float = 1.0) -> tuple[str, str]:
        s, g = r.get("sim"), r.get("gpu")
        if s is None and g is None:
            return "-", "-"
        pair = " / ".join("-" if v is None else f"{v * scale:.3f}" for v in (s, g))
        d = r.get("diff")
        if d is None:
            return pair, "-"
        flag = "" if r.get("met") in (True, None) else " **(no)**"
        return pair, f"{d:+.1%}{flag}"

    for lay, f in per_layout.items():
        rows = f.get("rows") or []
        b = cell(_metric(rows, "backup: service per block"))
        s = cell(_metric(rows, "swap_in: service per block"))
        t = cell(_metric(rows, "TTFT p50"))
        rs = None if bs is None or f.get("sim_ttft") is None else f["sim_ttft"] / bs
        rg = None if bg is None or f.get("gpu_ttft") is None else f["gpu_ttft"] / bg
        ratio = " / ".join("-" if v is None else f"{v:.3f}" for v in (rs, rg))
        out.append(f"| {lay} | {b[0]} | {b[1]} | {s[0]} | {s[1]} | {t[0]} | {t[1]} | {ratio} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--layouts", default=LAYOUTS)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--profile", type=Path, default=PROFILE,
                    help="compute-calibrated profile the per-layout links are written onto")
    ap.add_argument("--pools", default=f"{POOLS[0]},{POOLS[1]}", help="device,host blocks")
    ap.add_argument("--block-tokens", type=int, default=512)
    ap.add_argument("--rate", type=float, default=4.0, help="sessions per second")
    ap.add_argument("--think", type=float, default=1.5, help="seconds between turns")
    ap.add_argument("--gpu-runs", type=int, default=1)
    ap.add_argument("--no-calibrate", action="store_true",
                    help="replay with --profile as it is (no per-layout links measured)")
    ap.add_argument("--sim-only", action="store_true")
    ap.add_argument("--lean", action="store_true",
                    help="only profile.toml and the two JSON files under --out (the log and "
                         "the summary go to the trace's folder)")
    ap.add_argument("--gpu-dir", type=Path, default=None,
                    help="read GPU reports and profile.toml of an earlier run from here")
    args = ap.parse_args()
    from kernels._cuda import gpu_unavailable_reason
    from kernels.calibrate.layouts import parse_layouts

    layouts = parse_layouts(args.layouts)
    pools = tuple(int(x) for x in args.pools.split(","))
    assert len(pools) == 2, "--pools takes device,host"
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(os.environ.get("SUITE_TMP", "/tmp/kvflow_layouts"))
    tmp.mkdir(parents=True, exist_ok=True)
    side = tmp if args.lean else out
    gpu_suite._log_file = open(side / "layout_fidelity.log", "a")  # noqa: SIM115
    t0 = time.time()
    reason = None if not args.sim_only else "--sim-only"
    reason = reason or gpu_unavailable_reason()
    gpu = reason is None and args.gpu_dir is None
    say(f"layout fidelity, {time.strftime('%Y-%m-%d %H:%M:%S')}: {args.model}, "
        f"{args.block_tokens}-token blocks, pools {pools}, layouts {layouts}; GPU world: "
        + ("yes" if gpu else f"no ({reason or 'reports from ' + str(args.gpu_dir)})"))
    results: dict[str, Any] = {"model": args.model, "pools": pools, "layouts": layouts,
                               "block_tokens": args.block_tokens, "rate": args.rate,
                               "think_s": args.think, "steps": {},
                               "env": {k: v for k, v in os.environ.items()
                                       if k.startswith("KVFLOW_")}}
    trace = make_slice(tmp, args.block_tokens, args.rate, args.think)
    profile = args.profile
    earlier: dict[str, Any] = {}
    if args.gpu_dir is not None:
        earlier = (load(args.gpu_dir / "layout_fidelity.json") or {}).get("fidelity", {})
        if (args.gpu_dir / "profile.toml").exists():
            profile = args.gpu_dir / "profile.toml"
            results["calibration"] = load(args.gpu_dir / "layouts_calibration.json")
    elif gpu and not args.no_calibrate:
        cal = out / "profile.toml"
        results["steps"]["calibrate"] = sh(
            f"{sys.executable} cli.py calibrate --onto {shlex.quote(str(args.profile))} "
            f"--host-layouts {','.join(layouts)} --model {args.model} "
            f"--block-tokens {args.block_tokens} --out {cal} "
            f"--json {out / 'layouts_calibration.json'} --force", 300)
        if cal.exists():
            profile = cal
        results["calibration"] = load(out / "layouts_calibration.json")
    say(f"profile: {profile}")
    results["profile"] = str(profile)
    per_layout: dict[str, dict[str, Any]] = {}
    for lay in layouts:
        t = time.time()
        sim = sim_report(trace, args.model, profile, pools, lay)
        say(f"simulator, {lay}: {sim['sim_time_s']:.1f} s of trace in {time.time() - t:.1f} s")
        gpus = list((earlier.get(lay) or {}).get("gpu") or [])
        for k in range(args.gpu_runs if gpu else 0):
            path = trace.parent / f"gpu_{tag(lay)}_{k}.json"
            path.unlink(missing_ok=True)
            results["steps"][f"gpu_{tag(lay)}_{k}"] = sh(
                gpu_cmd(trace, args.model, profile, pools, lay, path),
                60 + 3 * sim["sim_time_s"])
            rep = load(path)
            if rep is not None:
                gpus.append(rep)
        per_run = [fidelity(sim, g) for g in gpus]
        f: dict[str, Any] = {"sim": sim, "gpu": gpus, "rows_per_run": per_run,
                             "sim_ttft": sim["ttft_s"]["p50"]}
        if per_run:
            f["rows"] = combine(per_run)
            f["gpu_ttft"] = _metric(f["rows"], "TTFT p50").get("gpu")
            if f["gpu_ttft"] is not None:
                f["gpu_ttft"] /= 1e3  # (rows hold ms)
        else:
            f["rows"] = fidelity(sim, sim)  # the simulator's own values, GPU columns absent
            for r in f["rows"]:
                r["gpu"] = r["diff"] = r["met"] = None
        per_layout[lay] = f
        results["fidelity"] = per_layout  # (written after each layout: a cut run keeps them)
        (out / "layout_fidelity.json").write_text(json.dumps(results, indent=1, default=str))
        if per_run:
            say(f"\nFidelity, {lay} ({len(per_run)} GPU runs):\n" + table(f["rows"]))
    results["fidelity"] = per_layout
    results["seconds"] = time.time() - t0
    (out / "layout_fidelity.json").write_text(json.dumps(results, indent=1, default=str))
    say("\n==================== per layout ====================")
    say(f"targets: transfers ±{TARGETS['transfer']:.0%}, TTFT p50 ±{TARGETS['ttft_p50']:.0%}; "
        f"{results['seconds']:.0f} s; steps (rc): {results['steps']}")
    text = summary(per_layout)
    (side / "layout_fidelity.md").write_text(text + "\n")
    say(text)
    cal = results.get("calibration")
    if cal:
        say(f"links per layout: {json.dumps(cal.get('tables'))}")
    return 0


__all__ = ["main", "summary"]

if __name__ == "__main__":
    sys.exit(main())
