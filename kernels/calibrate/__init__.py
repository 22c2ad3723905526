"""``kvflow calibrate``: measure this GPU and write a profile the simulator reads.

What the simulator needs to predict the GPU world is what the GPU world runs,
so each number is measured on the code a GPU replay uses:

* **links** — first ``CudaBackend`` ops of k scattered blocks of the model,
  each way, alone and beside executor steps, timed with CUDA events as a GPU
  replay times them (from right before the first copy to after the last);
  then the transfers of a small GPU replay (``measure_replay_links``), which
  run slower than isolated ops (the other direction busy, compute and host
  work around them). The simulator's per-layer unit (``latency_s + bytes /
  bandwidth_Bps``, ``kvflow.profile.Link``) is fitted robustly to the replay's
  ops where there are enough, else to the isolated ones. Both ways at once
  gives ``pcie_duplex``. The raw ceilings (one contiguous
  ``cudaMemcpyAsync``) and per-op latency (4 KB copies) are recorded alongside;
* **swap kernels** — ``BlockCopier`` bandwidth by block size and CTA count;
* **compute** — the executor's GEMM by size, cuBLAS fp16 for reference, HBM
  copy bandwidth, attention throughput; then ``GpuExecutor`` steps over a grid
  of prefill and decode batches (GPU time by events);
* **host share** — a small GPU replay (``kvflow replay --backend cuda``'s
  harness): per step, the time to the next step's start not covered by its
  GPU time, fitted as fixed + per sequence + per prefill item;
* **the fit** — the simulator's step time (``kvflow.cost.CostModel``: ``layers *
  max(weight FLOPs / (peak * mfu) + attention FLOPs / (peak * attention_mfu),
  bytes / (hbm * mbu)) + step_overhead_s + step_overhead_per_seq_s * seqs +
  step_overhead_per_prefill_s * prefills``) fitted to GPU time + host share
  of each grid and replay step: ``mfu``, ``attention_mfu``, ``mbu`` and
  ``step_overhead_s`` are what make it match.

``write_profile`` renders the TOML (``kvflow.profile.load_profile`` keys, measured
values in comments) and checks that it loads. The fitting and rendering are
pure functions, tested without a GPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import gc
import time
from collections.abc import Sequence
from typing import Any

from kernels._cuda import cupy_module, gpu_unavailable_reason
from kernels.calibrate.compute import GEMM_ROWS, measure_executor, measure_matmuls
from kernels.calibrate.fit import (
    CEILING_SLACK,
    Log,
    RooflineFit,
    StepPoint,
    Tiles,
    choose_tiles,
    fit_link,
    fit_roofline,
    pcie_duplex,
    render_profile,
    retile,
    robust_fit_roofline,
    roofline,
    step_point,
    step_terms,
    tile_candidates,
    write_profile,
)
from kernels.calibrate.host_share import (
    HostShare,
    admission_delays,
    host_share_fit,
    measure_admission,
    measure_step_overhead,
)
from kernels.calibrate.layouts import (
    host_layout_tables,
    layout_link_comments,
    measure_layout_links,
)
from kernels.calibrate.links import (
    REPLAY_LINK_OUTPUT,
    REPLAY_LINK_SIZES,
    measure_backend_links,
    measure_raw_link,
    measure_replay_links,
    measure_swap_kernels,
    scattered_op_seconds,
)
from kernels.calibrate.links import _backend_ops as _backend_ops
from kvflow.errors import ConfigError
from kvflow.layout import preset

__all__ = [
    "CEILING_SLACK",
    "GEMM_ROWS",
    "REPLAY_LINK_OUTPUT",
    "REPLAY_LINK_SIZES",
    "Calibration",
    "HostShare",
    "Log",
    "RooflineFit",
    "StepPoint",
    "Tiles",
    "admission_delays",
    "calibrate",
    "choose_tiles",
    "fit_link",
    "fit_roofline",
    "host_share_fit",
    "measure_admission",
    "measure_backend_links",
    "measure_executor",
    "measure_layout_links",
    "measure_matmuls",
    "measure_raw_link",
    "measure_replay_links",
    "measure_step_overhead",
    "measure_swap_kernels",
    "pcie_duplex",
    "profile_comments",
    "render_profile",
    "retile",
    "robust_fit_roofline",
    "roofline",
    "scattered_op_seconds",
    "step_point",
    "step_terms",
    "tile_candidates",
    "write_profile",
]


@dataclasses.dataclass
class Calibration:
    """Everything measured, and the profile values derived from it."""

    device: dict[str, Any]
    model: str
    raw_link: dict[str, Any]
    links: dict[str, Any]
    links_idle: dict[str, Any]
    swap_kernels: list[dict[str, Any]]
    matmuls: dict[str, Any]
    executor: dict[str, Any]
    fit: dict[str, Any]
    overhead: dict[str, Any]
    profile: dict[str, Any]
    seconds: float
    replay_links: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: ``measure_layout_links`` per host layout asked for (``--host-layouts``).
    layout_links: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in ("points", "engine_points"):
            d["executor"][key] = [dataclasses.asdict(p) if isinstance(p, StepPoint) else p
                                  for p in self.executor.get(key, [])]
        return d


def calibrate(model: str = "llama-3-8b-l4", block_tokens: int = 512, base: str = "h100",
              name: str | None = None, quick: bool = False, stream_priority: int | None = None,
              dma: str | None = None, log: Log = print,
              host_layouts: Sequence[str] = ()) -> Calibration:
    """Measure links, swap kernels and compute on this GPU (see the module docstring);
    ``host_layouts``: also the links of each of these host layouts
    (``kernels.calibrate.layouts``), written as the profile's ``host_layouts``."""
    reason = gpu_unavailable_reason()
    if reason is not None:
        raise ConfigError(f"kvflow calibrate needs a CUDA GPU and CuPy: {reason}")
    from kvflow.cost import gemm_shape
    from kvflow.profile import PROFILES

    if base not in PROFILES:
        raise ConfigError(f"unknown base profile {base!r}; presets: {', '.join(PROFILES)}")
    cp = cupy_module()
    t0 = time.perf_counter()
    if stream_priority is None or dma is None:  # as the GPU replay will run the copy streams
        from kernels.world import env_backend_options

        env = env_backend_options()
        if stream_priority is None:
            stream_priority = env.get("stream_priority")
        if dma is None:
            dma = env.get("dma", "auto")
    spec = preset(model, block_tokens=block_tokens)
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    dname = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    _, total = cp.cuda.runtime.memGetInfo()
    device = {"name": dname, "sms": int(props["multiProcessorCount"]), "memory_bytes": total,
              "cupy": cp.__version__, "driver": cp.cuda.runtime.driverGetVersion(),
              "runtime": cp.cuda.runtime.runtimeGetVersion()}
    log(f"device: {dname}, {device['sms']} SMs, {total / 2**30:.1f} GiB")
    reps = 3 if quick else 5
    # Each phase leaves CUDA objects in reference cycles; collect them here, on this
    # thread: the collector may otherwise run on a CUDA driver thread (inside a host
    # callback), where destroying them fails with cudaErrorNotPermitted.
    raw = measure_raw_link(log, reps=reps)
    gc.collect()
    idle = asyncio.run(measure_backend_links(spec, log, reps=reps,
                                             stream_priority=stream_priority, dma=dma,
                                             ceilings=raw))
    gc.collect()
    links = asyncio.run(measure_backend_links(spec, log, reps=reps + 2,
                                              stream_priority=stream_priority, under_load=True,
                                              dma=dma, ceilings=raw))
    gc.collect()
    kernels = measure_swap_kernels(log, reps=reps,
                                   ctas=(2, 4, 16) if quick else (2, 4, 8, 16))
    mm = measure_matmuls(log, reps=reps)
    gc.collect()
    exe = asyncio.run(measure_executor(spec, log, reps=2 if quick else 3,
                                       stream_priority=stream_priority))
    gc.collect()
    b = PROFILES[base]
    from kernels.world import env_backend_options

    opts = {**env_backend_options(),  # (KVFLOW_EAGER_LAYERS too: replays read it)
            **{k: v for k, v in (("stream_priority", stream_priority), ("dma", dma))
               if v is not None}}
    over = measure_step_overhead(spec, log, backend_options=opts)
    gc.collect()
    try:
        over.update(measure_admission(spec, log, backend_options=opts))
    except (ValueError, ConfigError) as exc:  # steps and requests did not pair up
        log(f"admission not measured ({exc}): the profile charges none")
    gc.collect()
    replay_links = measure_replay_links(spec, log, raw, backend_options=opts)
    gc.collect()
    layout_links = measure_layout_links(spec, log, host_layouts, raw, opts) if host_layouts \
        else {}
    # The profile's links: as a replay sees them where that replay gave enough ops,
    # else the isolated ops under load.
    profile_links = {d: replay_links.get(d) or links[d] for d in ("h2d", "d2h")}
    # The engine sees a step take its GPU time plus the host's share (measured above,
    # fixed + per sequence); the simulator charges roofline + step_overhead_s +
    # step_overhead_per_seq_s per sequence: fit the rest to that.
    host, per_seq = over["host_fixed_s"], over["host_per_seq_s"]
    per_prefill = over["host_per_prefill_s"]
    engine_pts = over.pop("points")
    exe["engine_points"] = engine_pts  # (in the JSON: a refit needs their batches)
    steps = [dataclasses.replace(p, seconds=p.seconds + host + per_seq * p.seqs
                                 + per_prefill * p.prefills)
             for p in [*exe["points"], *engine_pts]]
    # The executor's GEMM efficiency by rows, measured above: the weight time's shape.
    curve = [(float(m), round(min(v["flops"] / b.peak_bf16_flops, 1.0), 5))
             for m, v in sorted(exe["gemm"].items())]
    shape = gemm_shape(curve)
    # Tile quantisation (GEMM row tiles, waves of prefill attention CTAs): whichever fits
    # the isolated grid steps best, off unless one does.
    grid = steps[:len(exe["points"])]
    tiles, grid_rms = choose_tiles(grid, spec, b.peak_bf16_flops, b.hbm_bytes_per_s,
                                   tile_candidates(exe.get("prefill_rows", 0), exe.get("sms", 0)),
                                   per_seq=per_seq, per_prefill=per_prefill, gemm_shape=shape)
    log(f"tile quantisation: gemm_row_tile {tiles.gemm_row_tile}, attention_tile_rows "
        f"{tiles.attention_tile_rows}, attention_ctas {tiles.attention_ctas} (grid steps' "
        f"rms log error {grid_rms:.3f})")
    steps = retile(steps, spec, tiles)
    (mfu, mbu, fixed, rms, attn_mfu), kept = robust_fit_roofline(
        steps, spec.num_layers, b.peak_bf16_flops, b.hbm_bytes_per_s, per_seq=per_seq,
        per_prefill=per_prefill, gemm_shape=shape)
    log(f"step-time fit: {kept.count(False)} of {len(kept)} steps left out as disturbed "
        "(off the first fit by more than 3x the median error)")
    rows = [{"step": p.label, "measured_s": p.seconds,
             "predicted_s": roofline(p, spec.num_layers, b.peak_bf16_flops, b.hbm_bytes_per_s,
                                     mfu, mbu, fixed, attn_mfu, per_seq, per_prefill, shape),
             "kept": k}
            for p, k in zip(steps, kept, strict=True)]
    log(f"step-time fit on {len(rows)} steps (GPU time + {host * 1e3:.3f} ms + "
        f"{per_seq * 1e6:.1f} us/seq host): mfu {mfu:.4f}, attention_mfu {attn_mfu:.4f}, "
        f"mbu {mbu:.4f}, fixed {fixed * 1e3:.3f} ms per step (rms log error {rms:.3f})")
    for r in rows[:len(exe["points"])]:
        log(f"  {r['step']:>24}: measured {r['measured_s'] * 1e3:8.3f} ms, model "
            f"{r['predicted_s'] * 1e3:8.3f} ms ({r['predicted_s'] / r['measured_s'] - 1:+.1%})")
    eng = rows[len(exe["points"]):]
    for kind in ("prefill", "mixed", "decode"):
        sel = [r for r in eng if f"engine {kind} " in r["step"]]
        if sel:
            m = sum(r["measured_s"] for r in sel)
            pr = sum(r["predicted_s"] for r in sel)
            log(f"  {len(sel):>4} engine {kind} steps: measured {m * 1e3:9.2f} ms in all, "
                f"model {pr * 1e3:9.2f} ms ({pr / m - 1:+.1%})")
    profile = {
        "base": base, "name": name or f"{base}-calibrated",
        "peak_bf16_flops": b.peak_bf16_flops, "mfu": round(mfu, 5),
        "attention_mfu": round(attn_mfu, 5),
        "hbm_bytes_per_s": b.hbm_bytes_per_s, "mbu": round(mbu, 5),
        "memory_bytes": float(total), "step_overhead_s": fixed,
        "step_overhead_per_seq_s": per_seq,
        # a prefill item also pays its request's admission (arrival to first step, engine
        # idle): host time the gaps between a busy engine's steps do not show
        "step_overhead_per_prefill_s": per_prefill + over.get("admission_s", 0.0),
        "h2d": {"bandwidth_Bps": profile_links["h2d"]["bandwidth_Bps"],
                "latency_s": profile_links["h2d"]["latency_s"]},
        "d2h": {"bandwidth_Bps": profile_links["d2h"]["bandwidth_Bps"],
                "latency_s": profile_links["d2h"]["latency_s"]},
        "pcie_duplex": pcie_duplex(links),
        "gemm_efficiency": [[int(t), e] for t, e in curve],
    }
    for key, value in dataclasses.asdict(tiles).items():
        if value:
            profile[key] = value
    if over.get("load_submit_s"):
        profile["load_submit_s"] = over["load_submit_s"]
    if layout_links:
        profile["host_layouts"] = host_layout_tables(layout_links)
    return Calibration(device, spec.name, raw, links, idle, kernels, mm, exe,
                       {"mfu": mfu, "attention_mfu": attn_mfu, "mbu": mbu,
                        "tiles": dataclasses.asdict(tiles), "tiles_grid_rms": grid_rms,
                        "step_overhead_s": fixed, "host_s": host, "host_per_seq_s": per_seq,
                        "host_per_prefill_s": per_prefill,
                        "rms_log_error": rms, "steps": rows},
                       over, profile, time.perf_counter() - t0, replay_links, layout_links)


def _replay_link_comments(cal: Calibration) -> list[str]:
    rl = cal.replay_links or {}
    used = [d for d in ("h2d", "d2h") if d in rl]
    if not used:
        return ["Links: the isolated ops below (a GPU replay gave too few ops to fit)."]
    parts = [f"{d} {rl[d]['bandwidth_Bps'] / 1e9:.1f} GB/s + {rl[d]['latency_s'] * 1e6:.1f} us "
             f"({rl[d]['ops']} ops)" for d in used]
    return [f"Links ({', '.join(used)}): fitted to the transfers of a small GPU replay "
            "(a wave of prompts of 1..16",
            "blocks backed up to host, then the same prompts loading their prefix back while",
            f"others compute): {'; '.join(parts)} per layer unit.", ""]


def profile_comments(cal: Calibration, command: str) -> list[str]:
    """The TOML's header: where, when, how, and the raw numbers behind each value."""
    r, lk, ex = cal.raw_link, cal.links, cal.executor
    best = max(cal.swap_kernels, key=lambda x: x["h2d_GBps"], default=None)
    lines = [
        f"GPU profile measured by `kvflow calibrate` on {cal.device['name']} "
        f"({cal.device['sms']} SMs), {datetime.date.today().isoformat()}.",
        f"Command: {command}",
        "Keys override the base preset (kvflow.profile.load_profile); storage links are the",
        "base's (not measured: this machine's GPU world has no storage tier).",
        "",
        f"Compute: fast executor steps of {cal.model} (kernels/fast.py: cuBLAS GEMMs, "
        "fast.cu attention),",
        f"step time fitted over {len(cal.fit['steps'])} steps: a grid of prefill/decode/mixed "
        "batches and every step",
        f"of a GPU replay (24 requests, 1k..8k prompts) (rms log error "
        f"{cal.fit['rms_log_error']:.3f});",
        "peak_bf16_flops and hbm_bytes_per_s stay datasheet values, mfu (weight GEMMs),",
        "attention_mfu and mbu carry the fit.",
        "Executor GEMM (a layer's four): " + ", ".join(
            f"M={m} {v['flops'] / 1e12:.0f} TFLOP/s" for m, v in ex["gemm"].items()) + ";",
        "attention (extra context): " + ", ".join(
            f"{k} {v / 1e12:.0f}" for k, v in ex["attention_flops"].items()) + " TFLOP/s;",
        f"cuBLAS fp16 8192^3 {cal.matmuls['cublas_fp16_8192_flops'] / 1e12:.0f} TFLOP/s; "
        f"device copy {cal.matmuls['hbm_copy_Bps'] / 1e12:.2f} TB/s (read + write).",
        f"Fitted to GPU step time + the host's share per step ({cal.fit['host_s'] * 1e3:.3f} ms"
        f" + {cal.fit.get('host_per_seq_s', 0.0) * 1e6:.1f} us per sequence + "
        f"{cal.fit.get('host_per_prefill_s', 0.0) * 1e6:.1f} us per prefill item, fitted to "
        f"the gaps between the {cal.overhead['steps']} steps of a GPU replay: wall "
        f"{cal.overhead['wall_s']:.3f} s, GPU {cal.overhead['gpu_s']:.3f} s),",
        "so step_overhead_s is the fixed host share plus the per-step GPU floor the roofline",
        "misses (small-M GEMMs stream weights far below HBM speed), and",
        "step_overhead_per_seq_s / _per_prefill_s the host's growth per sequence and per",
        "prefill item.",
        f"Tile quantisation chosen on the grid steps: {cal.fit.get('tiles')} (grid rms log "
        f"error {cal.fit.get('tiles_grid_rms', float('nan')):.3f}).",
        f"step_overhead_per_prefill_s adds each request's admission, "
        f"{cal.overhead.get('admission_s', 0.0) * 1e3:.3f} ms (arrival to its first step on "
        "an idle engine, median of a spaced GPU replay); load_submit_s what a load from host",
        f"adds to it ({cal.overhead.get('load_submit_s', 0.0) * 1e3:.3f} ms, same replay).",
        "",
        *_replay_link_comments(cal),
        f"Isolated links: CudaBackend ops ({lk.get('copy_path', 'swap kernel')}) of 1..16 "
        "scattered blocks "
        f"({lk['bytes_per_block'] / 2**20:.1f} MiB each, {lk['units_per_op']} layer units per "
        "op), event-timed,",
        "fitted to latency_s + bytes / bandwidth_Bps per unit, measured while GpuExecutor",
        "steps run (the engine moves KV while it computes: a swap kernel shares the SMs,",
        "the copy engine shares HBM and the host).",
        f"Idle: h2d {cal.links_idle['h2d']['bandwidth_Bps'] / 1e9:.1f} GB/s + "
        f"{cal.links_idle['h2d']['latency_s'] * 1e6:.1f} us, d2h "
        f"{cal.links_idle['d2h']['bandwidth_Bps'] / 1e9:.1f} GB/s + "
        f"{cal.links_idle['d2h']['latency_s'] * 1e6:.1f} us per unit. Both ways at once "
        f"(idle): h2d {cal.links_idle['both']['h2d_Bps'] / 1e9:.1f}, d2h "
        f"{cal.links_idle['both']['d2h_Bps'] / 1e9:.1f} GB/s.",
        f"Raw contiguous cudaMemcpyAsync: h2d {r['h2d_Bps'] / 1e9:.1f}, d2h "
        f"{r['d2h_Bps'] / 1e9:.1f}, both {r['both_Bps'] / 1e9:.1f} GB/s; 4 KB copy "
        f"{r['h2d_op_4k_s'] * 1e6:.2f} / {r['d2h_op_4k_s'] * 1e6:.2f} us.",
    ]
    if best is not None:
        lines.append(f"Swap kernel best h2d: {best['h2d_GBps']:.1f} GB/s "
                     f"({best['block_bytes'] >> 10} KB blocks, {best['ctas']} CTAs).")
    if cal.layout_links:
        lines += ["", *layout_link_comments(cal.layout_links, cal.model, command,
                                            cal.device["name"])]
    return lines

