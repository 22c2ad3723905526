"""Simulated PD (``--pd 1:1``) against ``kvflow serve-pd`` on the same slice and settings.

``kvflow serve-pd`` runs a prefill and a decode engine as two processes with KV
crossing TCP on loopback, in the real-time CPU world (compute paced at
``step_s + token_s * tokens`` a step) or on one GPU (real compute). This replays
the same requests in the simulator's PD mode, one prefill and one decode
instance with the same tiers, batching and policies, and prints TTFT, TPOT, the
KV landing after the first token and the bytes moved side by side, with the
simulator's error (sim / real - 1).

The simulator is given the real run's two rates and nothing fitted to its outcome:

* **compute** — a profile whose step time is exactly ``step_s + token_s *
  tokens`` for the model (attention and memory terms made negligible), with
  ``(step_s, token_s)`` the least-squares fit of the executors' own step logs
  (tokens -> wall seconds per step, both instances), as ``kvflow calibrate``
  fits steps; in the CPU world also (``nominal``) the pacing the executor
  sleeps, which leaves out the CPU work every step does besides (writing and
  checking key-derived bytes);
* **the link** — ``--pd-gb-per-s`` (default: the TCP transport's loopback
  figure of ``benchmarks/results/pd.md``) and ``--pd-latency-s`` per layer.

    python benchmarks/pd_fidelity.py --start 480 --limit 40 --time-scale 2
    python benchmarks/pd_fidelity.py --report pd_cuda.json --pd-gb-per-s 2.0  # a GPU run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvflow.cost import CostModel
from kvflow.layout import PRESETS, ModelSpec, preset
from kvflow.profile import load_profile
from kvflow.realtime.pd_instance import InstanceConfig, tiny_spec
from kvflow.realtime.pd_serve import ServeConfig, serve_pd
from kvflow.replay import ReplayConfig, run_replay
from traces import open_trace, sample_path
from traces.writer import write_generic

#: Share of the pacing's time the simulator's attention and memory terms may add.
NEGLIGIBLE = 1e-6


def slice_trace(cfg: dict[str, Any], path: Path) -> int:
    """Requests ``[start, start + limit)`` of the run's trace, arrivals from 0 and scaled
    as serve-pd scaled them, written as a generic trace; returns its block size."""
    tr = open_trace(cfg["trace"] or sample_path())
    reqs = [r for r in tr if cfg["start"] <= r.index < cfg["start"] + cfg["limit"]]
    t0 = reqs[0].arrival_s
    reqs = [dataclasses.replace(r, arrival_s=(r.arrival_s - t0) * cfg["time_scale"])
            for r in reqs]
    write_generic(reqs, path, block_tokens=tr.block_tokens, force=True)
    return tr.block_tokens


def pacing_profile(spec: ModelSpec, step_s: float, token_s: float, path: Path) -> None:
    """A profile under which the simulator's step of ``spec`` takes ``step_s + token_s *
    tokens``: weight FLOPs at a rate giving ``token_s`` a token over all layers, attention
    at a peak so much higher and HBM so fast that neither adds more than ``NEGLIGIBLE``."""
    flops = 2.0 * spec.active_params  # all layers, per token
    rate = flops / max(token_s, 1e-12)  # = peak * mfu
    mfu = NEGLIGIBLE
    text = f"""base = "h100"
name = "pd-pacing"
peak_bf16_flops = {rate / mfu:.6e}
mfu = {mfu}
attention_mfu = 1.0
hbm_bytes_per_s = 1e18
memory_bytes = 80e9
step_overhead_s = {step_s:.6e}

[h2d]
bandwidth_Bps = 20e9
latency_s = 5e-6

[d2h]
bandwidth_Bps = 20e9
latency_s = 5e-6
"""
    path.write_text(text)
    cm = CostModel(spec, load_profile(str(path)))
    for tokens in (1, 512, 2048):
        got = cm.step_time([(tokens, 4096)], [])
        want = step_s + token_s * tokens
        assert abs(got / want - 1) < 1e-3, (tokens, got, want)


def fit_steps(steps: list[list[float]]) -> tuple[float, float]:
    """``wall = step_s + token_s * tokens`` by least squares over a GPU run's steps."""
    a = np.array(steps, dtype=float)
    x, y = a[:, 0], a[:, 2]
    token_s, step_s = np.polyfit(x, y, 1)
    return max(float(step_s), 0.0), max(float(token_s), 0.0)


def sim_run(real: dict[str, Any], spec: ModelSpec, step_s: float, token_s: float,
            gb_per_s: float, latency_s: float, tmp: Path) -> tuple[dict[str, Any], float]:
    cfg = real["config"]
    inst = real["instances"]["prefill"]["config"]
    trace = tmp / "slice.jsonl"
    slice_trace(cfg, trace)
    prof = tmp / "pd-pacing.toml"
    pacing_profile(spec, step_s, token_s, prof)
    rc = ReplayConfig(trace=str(trace), model=cfg["model"], profile=str(prof),
                      device_blocks=inst["device_blocks"], host_blocks=inst["host_blocks"],
                      storage_blocks=0, eviction=inst["eviction"],
                      write_policy=inst["write_policy"],
                      max_batch_tokens=inst["max_batch_tokens"],
                      max_running=inst["max_running"], pd="1:1", pd_gb_per_s=gb_per_s,
                      pd_latency_s=latency_s, backend="sim", mode="full")
    c0 = time.process_time()
    rep = run_replay(rc)
    return rep, time.process_time() - c0


def cpu_tiny_registered(real: dict[str, Any]) -> ModelSpec:
    """The run's model; serve-pd's CPU ``tiny`` is no preset, so it is registered under its
    name first (in this process: the simulator runs here)."""
    PRESETS.setdefault(tiny_spec().name, tiny_spec())
    cfg = real["config"]
    return preset(cfg["model"], block_tokens=cfg["block_tokens"])


def _row(name: str, real: dict[str, Any] | None, sim: dict[str, Any] | None,
         keys: tuple[str, ...] = ("mean", "p50", "p90")) -> str:
    cells = []
    for k in keys:
        r = None if real is None else real.get(k)
        s = None if sim is None else sim.get(k)
        if r is None or s is None:
            cells.append("-")
            continue
        err = f"{s / r - 1:+.1%}" if r else "-"
        cells.append(f"{r * 1e3:,.1f} / {s * 1e3:,.1f} ({err})")
    return f"| {name} | " + " | ".join(cells) + " |"


def table(real: dict[str, Any], sim: dict[str, Any]) -> str:
    x, pd = real["transfer"], sim["pd"]
    lines = [
        "| ms: real / simulated (sim error) | mean | p50 | p90 |",
        "|---|---|---|---|",
        _row("TTFT", real["ttft_s"], sim["ttft_s"]),
        _row("TPOT", real["tpot_s"], sim["tpot_s"]),
        _row("E2E", real["e2e_s"], sim["e2e_s"]),
        _row("KV landed after the first token", x["after_prefill_s"], pd["after_prefill_s"]),
    ]
    # serve-pd's decode instance admits a request at its arrival (blocks allocated then) and
    # waits there for its KV: TTFT plus the exposed part. The simulator's allocates at the
    # prefill's last chunk, so it has no such figure; the real one is printed alone.
    for name, key in (("KV wait at decode admission", "wait_at_admission_s"),
                      ("  first token -> last frame sent", "sent_after_prefill_s"),
                      ("  last frame sent -> KV landed", "landed_after_sent_s")):
        w = x.get(key)
        if w:
            lines.append(f"| {name} (real only) | {w['mean'] * 1e3:,.1f} | "
                         f"{w['p50'] * 1e3:,.1f} | {w['p90'] * 1e3:,.1f} |")
    err = pd["bytes"] / x["bytes"] - 1 if x["bytes"] else float("nan")
    lines.append(f"| transfer bytes | {x['bytes'] / 1e6:,.1f} MB / {pd['bytes'] / 1e6:,.1f} MB "
                 f"({err:+.1%}) | {x['ok']} / {pd['transfers']} transfers | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", type=Path, help="a serve-pd report (JSON) to compare; "
                    "default: run serve-pd in the CPU world now")
    ap.add_argument("--trace")
    ap.add_argument("--start", type=int, default=480)
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--step-s", type=float, default=0.002)
    ap.add_argument("--token-s", type=float, default=2e-6)
    ap.add_argument("--pd-gb-per-s", type=float, default=0.6)
    ap.add_argument("--pd-latency-s", type=float, default=1e-4)
    ap.add_argument("--out", type=Path, help="write both reports (JSON) here")
    args = ap.parse_args()
    if args.report is not None:
        real = json.loads(args.report.read_text())
        wall = real.get("wall_s")
    else:
        inst = InstanceConfig(step_s=args.step_s, token_s=args.token_s, verify_decode=False)
        cfg = ServeConfig(trace=args.trace, start=args.start, limit=args.limit,
                          time_scale=args.time_scale, model=args.model, prefill=inst,
                          decode=dataclasses.replace(inst))
        real = serve_pd(cfg)
        wall = real["wall_s"]
    cfg = real["config"]
    spec = cpu_tiny_registered(real)
    steps = (real["instances"]["prefill"]["counters"]["steps"]
             + real["instances"]["decode"]["counters"]["steps"])
    models = [(*fit_steps(steps), f"measured: fitted to the run's {len(steps)} steps")]
    if real["world"] == "cpu-realtime":
        p = real["instances"]["prefill"]["config"]
        models.append((p["step_s"], p["token_s"], "nominal: the CPU world's pacing alone"))
    print(f"serve-pd ({real['world']}, {wall:.1f} s wall): requests {cfg['start']}.."
          f"{cfg['start'] + cfg['limit'] - 1}, {cfg['model']}, time scale "
          f"{cfg['time_scale']}; simulated PD 1:1, link {args.pd_gb_per_s} GB/s, "
          f"{args.pd_latency_s * 1e6:.0f} us a layer")
    out: dict[str, Any] = {"real": real, "sims": [],
                           "link": {"gb_per_s": args.pd_gb_per_s, "latency_s": args.pd_latency_s}}
    for step_s, token_s, how in models:
        with tempfile.TemporaryDirectory() as tmp:
            sim, cpu = sim_run(real, spec, step_s, token_s, args.pd_gb_per_s,
                               args.pd_latency_s, Path(tmp))
        print(f"\ncompute {step_s * 1e3:.3f} ms + {token_s * 1e6:.3f} us/token a step ({how}); "
              f"sim {cpu:.1f} cpu-s")
        print(table(real, sim))
        print(f"requests: real {real['requests']} (failed {len(real['failed'])}), "
              f"sim {sim['requests']}; sim wire time a transfer p50 "
              f"{sim['pd']['transfer_s']['p50'] * 1e3:.1f} ms")
        out["sims"].append({"step_s": step_s, "token_s": token_s, "how": how, "report": sim})
    if args.out is not None:
        args.out.write_text(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
