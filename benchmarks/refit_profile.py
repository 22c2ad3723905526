"""Redo ``kvflow calibrate``'s step-time fit from a calibration's JSON, without a GPU.

A calibration's JSON (``kvflow calibrate --json``, or the ``calibration`` key of the
GPU suite's ``results.json``) keeps every measured step with its batch; this fits
them again with the current fitting code (tile quantisation chosen on the grid
steps, the robust fit that leaves disturbed steps out) and writes the profile: the
device's TOML with ``mfu``, ``attention_mfu``, ``mbu``, ``step_overhead_s`` and
the tile keys replaced and a header saying so. Engine steps are used where the JSON
has their batches (calibrations after 2026-11-25 13:20 UTC); older ones give the
grid steps alone.

Run (repository root):
    PYTHONPATH=. python benchmarks/refit_profile.py RESULTS_OR_CALIBRATION.json \
        DEVICE_PROFILE.toml OUT.toml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from kernels.calibrate.fit import (
    StepPoint,
    choose_tiles,
    retile,
    robust_fit_roofline,
    tile_candidates,
)
from kvflow.cost import gemm_shape
from kvflow.layout import preset
from kvflow.profile import load_profile


def points_of(rows: list[dict[str, Any]]) -> list[StepPoint]:
    out = []
    for p in rows:
        p = dict(p)
        pre, dec = p.pop("batch")
        out.append(StepPoint(**p, batch=(tuple(tuple(x) for x in pre), tuple(dec))))
    return out


def refit(cal: dict[str, Any], device_toml: str) -> tuple[str, dict[str, Any]]:
    """The refitted profile's TOML text, and the fit's figures."""
    spec = preset(cal["model"], block_tokens=512)
    prof = load_profile(device_toml)
    fit, ex = cal["fit"], cal["executor"]
    host, per_seq, per_prefill = fit["host_s"], fit["host_per_seq_s"], fit["host_per_prefill_s"]
    grid = points_of(ex["points"])
    engine = points_of(ex.get("engine_points", []))
    steps = [dataclasses.replace(p, seconds=p.seconds + host + per_seq * p.seqs
                                 + per_prefill * p.prefills) for p in [*grid, *engine]]
    shape = gemm_shape(prof.gemm_efficiency)
    kw: dict[str, Any] = {"per_seq": per_seq, "per_prefill": per_prefill, "gemm_shape": shape}
    tiles, grid_rms = choose_tiles(steps[:len(grid)], spec, prof.peak_bf16_flops,
                                   prof.hbm_bytes_per_s,
                                   tile_candidates(ex.get("prefill_rows", 0), ex.get("sms", 0)),
                                   **kw)
    f, kept = robust_fit_roofline(retile(steps, spec, tiles), spec.num_layers,
                                  prof.peak_bf16_flops, prof.hbm_bytes_per_s, **kw)
    values = {"mfu": round(f.mfu, 5), "attention_mfu": round(f.attention_mfu, 5),
              "mbu": round(f.mbu, 5), "step_overhead_s": f.overhead,
              **{k: v for k, v in dataclasses.asdict(tiles).items()}}
    text = Path(device_toml).read_text()
    for key in ("gemm_row_tile", "attention_tile_rows", "attention_ctas"):
        text = re.sub(rf"(?m)^{key} = .*\n", "", text)
    for key in ("mfu", "attention_mfu", "mbu", "step_overhead_s"):
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {values[key]:.6g}", text)
    text = re.sub(r"(?m)^(\[h2d\])", "gemm_row_tile = {}\nattention_tile_rows = {}\n"
                  "attention_ctas = {}\n\n\\1".format(*dataclasses.astuple(tiles)), text, count=1)
    head = (f"# Refit by benchmarks/refit_profile.py from the calibration's stored steps: "
            f"{len(grid)} grid steps, {len(engine)} engine steps, {kept.count(False)} left out "
            f"as disturbed;\n# rms log error {f.rms:.3f} over the kept steps; tiles chosen on "
            f"the grid steps (rms {grid_rms:.3f}). Below, the calibration's own header.\n")
    return head + text, {**values, "rms": f.rms, "left_out": kept.count(False),
                         "grid": len(grid), "engine": len(engine)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("calibration")
    ap.add_argument("device_toml")
    ap.add_argument("out")
    args = ap.parse_args()
    data = json.loads(Path(args.calibration).read_text())
    cal = data.get("calibration", data)
    text, figures = refit(cal, args.device_toml)
    Path(args.out).write_text(text)
    load_profile(args.out)  # it must load
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
