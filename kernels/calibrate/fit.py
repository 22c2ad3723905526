"""Calibration's pure half: fitting measurements to the simulator's models, and the profile file.

``fit_link`` fits a link's per-layer unit (``latency_s + bytes / bandwidth_Bps``,
``kvflow.profile.Link``) to timed ops; ``fit_roofline`` fits the cost model's
step time (``kvflow.cost.CostModel``) to measured steps; ``pcie_duplex`` reads
both-ways-at-once from the link measurements; ``render_profile`` and
``write_profile`` turn the values into the TOML ``kvflow.profile.load_profile``
reads. No GPU is needed here: the tests run these on made-up points.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvflow.layout import ModelSpec

Log = Callable[[str], None]


# ----------------------------------------------------------------------- pure fitting
#: How far a fitted link bandwidth may exceed the raw contiguous copy's before it is
#: held (``fit_link``): batched copies were seen up to ~6% above one contiguous memcpy.
CEILING_SLACK = 1.10


def fit_link(points: Sequence[tuple[float, float]], units: int,
             max_bandwidth_Bps: float | None = None) -> tuple[float, float]:
    """(latency_s, bandwidth_Bps) of the link model from (bytes per op, seconds per op).

    An op is ``units`` per-layer units on the link, each ``latency + bytes / bw``:
    ``t = units * latency + bytes / bw``. Fitted in relative terms (each row
    divided by its time), so the engine's common small ops count as much as
    the few large ones, and robustly: a size disturbed by a stall of a
    millisecond or two (a shared machine; a first batch over fresh addresses)
    must not tilt the line. The line through the pair of points with the
    smallest median relative residual picks the inliers (within 3x that
    median, or 25%: a stall doubles an op's time, while small ops sitting a
    little above the line of the large ones are the engine's common case and
    must count); least squares over those gives the fit. A negative latency
    is clamped to 0 and the bandwidth refitted; a bandwidth more than
    ``CEILING_SLACK`` above ``max_bandwidth_Bps`` (the raw ceiling) is held
    there and the latency refitted. Not at the ceiling itself: the raw copy
    is one contiguous memcpy, and batched copies beat it on some machines
    (one read 50.7 GB/s raw while its replay's ops sloped at 53.8; held at
    50.7, the fit's latency fell to 0 and small backups came out 16% short).
    """
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    if len(x) < 2 or np.ptp(x) == 0:
        raise ValueError("fit_link needs ops of at least two sizes")

    def solve(xs: np.ndarray, ys: np.ndarray) -> tuple[float, float]:
        a = np.vstack([np.full_like(xs, units), xs]).T / ys[:, None]
        (lat, inv_bw), *_ = np.linalg.lstsq(a, np.ones_like(ys), rcond=None)
        if lat < 0 or inv_bw <= 0:
            return 0.0, float(np.mean(ys / xs))
        if max_bandwidth_Bps and 1.0 / inv_bw > CEILING_SLACK * max_bandwidth_Bps:
            inv_bw = 1.0 / (CEILING_SLACK * max_bandwidth_Bps)
            lat = max(float(np.mean(1.0 - xs * inv_bw / ys) / np.mean(units / ys)), 0.0)
        return float(lat), float(inv_bw)

    def residuals(lat: float, inv_bw: float) -> np.ndarray:
        return np.abs((units * lat + x * inv_bw) / y - 1.0)

    best: tuple[float, np.ndarray] | None = None
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            if x[i] == x[j]:
                continue
            r = residuals(*solve(x[[i, j]], y[[i, j]]))
            med = float(np.median(r))
            if best is None or med < best[0]:
                best = (med, r)
    if best is None:  # pragma: no cover - ptp > 0 guarantees a pair
        return solve(x, y)[0], 1.0 / solve(x, y)[1]
    med, r = best
    keep = r <= max(3 * med, 0.25)
    if keep.sum() < 2:
        keep[:] = True
    lat, inv_bw = solve(x[keep], y[keep])
    return lat, 1.0 / inv_bw


@dataclasses.dataclass(frozen=True)
class StepPoint:
    """One measured step: its per-layer cost-model terms and its time.

    ``flops`` counts weights and attention together; ``attn_flops`` is the
    attention part (it runs at its own rate); ``seqs`` the sequences in the
    step and ``prefills`` how many of them are prefill items (the host's share
    grows with both).
    """

    label: str
    flops: float       # per layer
    nbytes: float      # per layer
    seconds: float     # whole step
    attn_flops: float = 0.0
    seqs: int = 0
    prefills: int = 0
    tokens: int = 0
    #: The batch itself, (prefill (new, context) pairs, decode contexts): what a refit
    #: under other tile settings (``retile``) recomputes the terms from.
    batch: tuple[tuple[tuple[int, int], ...], tuple[int, ...]] = ((), ())


def step_terms(spec: ModelSpec, prefill: Sequence[tuple[int, int]],
               decode: Sequence[int]) -> tuple[float, float]:
    """Per-layer FLOPs and bytes of a batch, exactly as ``kvflow.cost.CostModel.layer_time``."""
    p = step_point("", spec, prefill, decode, 0.0)
    return p.flops, p.nbytes


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The cost model's tile quantisation (``GpuProfile.gemm_row_tile``,
    ``attention_tile_rows``, ``attention_ctas``; 0 = off)."""

    gemm_row_tile: int = 0
    attention_tile_rows: int = 0
    attention_ctas: int = 0


def step_point(label: str, spec: ModelSpec, prefill: Sequence[tuple[int, int]],
               decode: Sequence[int], seconds: float, tiles: Tiles = Tiles()) -> StepPoint:
    """A measured step in ``kvflow.cost.CostModel``'s terms (tokens, attention pairs, KV
    bytes), with ``tiles``' quantisation as the cost model applies it."""
    from kvflow.cost import CostModel, padded_rows, prefill_wave_pairs
    from kvflow.profile import PROFILES

    cm = CostModel(spec, PROFILES["h100"])
    tokens = len(decode)
    pairs = float(sum(decode))
    kv = pairs
    for new, ctx in prefill:
        tokens += new
        pairs += new * (ctx + new * 0.5)
        kv += ctx + new
    if tiles.attention_tile_rows and tiles.attention_ctas and prefill:
        heads = spec.num_attention_heads or spec.num_kv_heads
        pairs = float(sum(decode)) + prefill_wave_pairs(
            prefill, heads, tiles.attention_tile_rows, tiles.attention_ctas)
    rows = padded_rows(tokens, tiles.gemm_row_tile)
    attn = cm.attention_flops_per_pair * pairs
    batch = (tuple((int(n), int(c)) for n, c in prefill), tuple(int(d) for d in decode))
    return StepPoint(label, cm.weight_flops_per_token * rows + attn,
                     cm.weight_bytes + cm.kv_bytes_per_token * kv, seconds, attn,
                     len(prefill) + len(decode), len(prefill), rows, batch)


def retile(points: Sequence[StepPoint], spec: ModelSpec, tiles: Tiles) -> list[StepPoint]:
    """``points`` with their terms recomputed under ``tiles`` (same batches, same times)."""
    return [step_point(p.label, spec, p.batch[0], p.batch[1], p.seconds, tiles)
            for p in points]


def roofline(point: StepPoint, layers: int, peak: float, hbm: float, mfu: float,
             mbu: float, overhead: float = 0.0, attention_mfu: float = 0.0,
             per_seq: float = 0.0, per_prefill: float = 0.0,
             gemm_shape: Callable[[float], float] | None = None) -> float:
    """The simulator's step time (``kvflow.cost.CostModel.step_time``) for ``point``."""
    attn = attention_mfu or mfu
    shape = gemm_shape(point.tokens) if gemm_shape is not None and point.tokens else 1.0
    compute = ((point.flops - point.attn_flops) / (peak * mfu) / shape
               + point.attn_flops / (peak * attn))
    return (layers * max(compute, point.nbytes / (hbm * mbu)) + overhead
            + per_seq * point.seqs + per_prefill * point.prefills)


class RooflineFit(NamedTuple):
    mfu: float
    mbu: float
    overhead: float
    rms: float
    attention_mfu: float


def fit_roofline(points: Sequence[StepPoint], layers: int, peak: float, hbm: float,
                 overheads: Sequence[float] | None = None, per_seq: float = 0.0,
                 per_prefill: float = 0.0,
                 split_attention: bool = True,
                 gemm_shape: Callable[[float], float] | None = None) -> RooflineFit:
    """Efficiencies and fixed step cost minimising the squared log error of the step time.

    ``points`` carry measured step times as the engine sees them (GPU time plus
    the host's share); the model is ``roofline`` with ``per_seq`` and
    ``per_prefill`` held (measured apart, from a replay's gaps between steps),
    the weight time divided by ``gemm_shape`` at each step's rows where given
    (measured GEMM efficiency), and a fixed per-step term fitted.
    ``overheads``: candidate values for that term (default: 0 .. 90% of the
    fastest step); pass ``[x]`` to hold it.
    ``split_attention``: fit attention's own rate (else it shares ``mfu``).
    A grid (log scale for the efficiencies), then a finer one around the best:
    the objective is piecewise (which roofline term wins), so a grid is robust
    where a gradient is not.
    """
    if not points:
        raise ValueError("fit_roofline needs measured steps")
    meas = np.log(np.array([p.seconds for p in points]))
    attn = np.array([p.attn_flops for p in points]) * layers / peak
    weights = np.array([p.flops for p in points]) * layers / peak - attn
    if gemm_shape is not None:  # weight GEMMs at the measured efficiency for their rows
        weights = weights / np.array([gemm_shape(p.tokens) if p.tokens else 1.0
                                      for p in points])
    nbytes = np.array([p.nbytes for p in points]) * layers / hbm
    host = np.array([per_seq * p.seqs + per_prefill * p.prefills for p in points])
    split = split_attention and bool(attn.any())
    if overheads is None:
        overheads = np.linspace(0.0, 0.9 * min(p.seconds for p in points), 46)
    cs = np.asarray(overheads, dtype=float)

    def search(a: np.ndarray, a2: np.ndarray, b: np.ndarray,
               c: np.ndarray) -> tuple[float, float, float, float, float]:
        if not split:
            a2 = np.array([0.0])
        attn_rate = a2[None, :, None] if split else a[:, None, None]
        compute = weights / a[:, None, None] + attn / attn_rate                # [A, A2, P]
        memory = nbytes / b[:, None]                                           # [B, P]
        roof = np.maximum(compute[:, :, None, :], memory[None, None, :, :])   # [A, A2, B, P]
        best = (np.inf, 0.0, 0.0, 0.0, 0.0)
        for cv in c:
            err = np.mean((np.log(roof + cv + host) - meas) ** 2, axis=-1)
            k = np.unravel_index(int(np.argmin(err)), err.shape)
            if err[k] < best[0]:
                best = (float(err[k]), float(a[k[0]]), float(a2[k[1]]), float(b[k[2]]),
                        float(cv))
        return best

    grid = np.geomspace(0.005, 1.0, 40 if split else 90)
    e, a, a2, b, c = search(grid, grid, grid, cs)
    step = cs[1] - cs[0] if len(cs) > 1 else 0.0
    width = float(grid[1] / grid[0])
    for _ in range(5):  # zoom in around the best point, two grid steps either side
        def around(x: float, w: float = width * width) -> np.ndarray:
            return np.clip(np.geomspace(x / w, x * w, 11 if split else 21), 1e-4, 1.0)

        fine_c = np.clip(np.linspace(c - 2 * step, c + 2 * step, 11), 0.0, None) if step else cs
        e, a, a2, b, c = search(around(a), around(a2) if split else np.array([0.0]),
                                around(b), fine_c)
        width, step = width ** 0.5, step / 2
    return RooflineFit(a, b, c, math.sqrt(e), a2 if split else a)


def choose_tiles(points: Sequence[StepPoint], spec: ModelSpec, peak: float, hbm: float,
                 candidates: Sequence[Tiles], **fit_kwargs: Any) -> tuple[Tiles, float]:
    """The tile quantisation among ``candidates`` under which ``fit_roofline`` fits
    ``points`` best (least rms log error), and that error. Ties go to the earlier
    candidate, so list "off" (``Tiles()``) first: it is kept unless a tiling fits better.
    """
    best: tuple[Tiles, float] | None = None
    for tiles in candidates:
        rms = fit_roofline(retile(points, spec, tiles), spec.num_layers, peak, hbm,
                           **fit_kwargs).rms
        if best is None or rms < best[1]:
            best = (tiles, rms)
    if best is None:
        raise ValueError("choose_tiles needs candidates")
    return best


def tile_candidates(prefill_rows: int, sms: int) -> list[Tiles]:
    """Tilings ``kvflow calibrate`` tries: off first, GEMM row tiles of 128 and 256, prefill
    attention waves of one or two CTAs per SM (``prefill_rows`` rows an item)."""
    gemm = (0, 128, 256)
    ctas = (0, sms, 2 * sms) if prefill_rows > 0 and sms > 0 else (0,)
    return [Tiles(g, prefill_rows if c else 0, c) for c in ctas for g in gemm]


#: ``robust_fit_roofline``: a step whose log error under the first fit exceeds this many
#: times the median one (and ``TRIM_FLOOR``) is left out of the second.
TRIM_FACTOR = 3.0
TRIM_FLOOR = 0.05


def robust_fit_roofline(points: Sequence[StepPoint], layers: int, peak: float, hbm: float,
                        **kwargs: Any) -> tuple[RooflineFit, list[bool]]:
    """``fit_roofline``, then again without the steps it fits worst; the fit and which
    points were kept.

    A GPU replay's steps include a few disturbed by one-time costs: the first step at
    a new row count likely loads its cuBLAS kernel (lazy module loading), a host stall.
    Squared log error lets those few tilt the fit: on an H100 (2026-11-25) 16 of 170
    steps (decode steps of 3.6-17 ms where others of their size took 2-3) took the rms
    log error to 0.27 and the fitted HBM efficiency from ~0.71 to 0.56, and every decode
    step came out 9-25% slow. Steps off by more than ``TRIM_FACTOR`` x the median log error (and
    ``TRIM_FLOOR``) are dropped and the rest refitted; the rms returned is the kept
    steps'.
    """
    first = fit_roofline(points, layers, peak, hbm, **kwargs)
    shape = kwargs.get("gemm_shape")
    err = np.array([abs(math.log(roofline(
        p, layers, peak, hbm, first.mfu, first.mbu, first.overhead, first.attention_mfu,
        kwargs.get("per_seq", 0.0), kwargs.get("per_prefill", 0.0), shape) / p.seconds))
        for p in points])
    keep = err <= max(TRIM_FACTOR * float(np.median(err)), TRIM_FLOOR)
    if keep.all() or keep.sum() < 3:
        return first, [True] * len(points)
    kept = [p for p, k in zip(points, keep, strict=True) if k]
    return fit_roofline(kept, layers, peak, hbm, **kwargs), [bool(k) for k in keep]


def pcie_duplex(links: dict[str, Any]) -> float:
    """Each direction's share of its one-way bandwidth with both ways busy (``Hierarchy.duplex``).

    From ``measure_backend_links``: the both-ways rates over the one-way fits,
    averaged over the two directions, within [0.5, 1].
    """
    both = links.get("both") or {}
    shares = [both[f"{d}_Bps"] / links[d]["bandwidth_Bps"] for d in ("h2d", "d2h")
              if both.get(f"{d}_Bps") and links.get(d, {}).get("bandwidth_Bps")]
    if not shares:
        return 1.0
    return round(min(max(sum(shares) / len(shares), 0.5), 1.0), 4)




def render_profile(values: dict[str, Any], comments: Sequence[str]) -> str:
    """TOML text for ``kvflow.profile.load_profile``: top-level numbers, then link tables."""
    lines = [f"# {c}" if c else "#" for c in comments]
    lines.append("")
    links = ("h2d", "d2h", "storage_read", "storage_write")
    for k, v in values.items():
        if k in links or k == "host_layouts":
            continue
        lines.append(f"{k} = {_toml_value(v)}")
    for k in links:
        if k in values:
            lines.append("")
            lines.append(f"[{k}]")
            for kk, vv in values[k].items():
                lines.append(f"{kk} = {_toml_value(vv)}")
    return "\n".join(lines) + "\n" + render_host_layouts(values.get("host_layouts") or {})


def render_host_layouts(tables: dict[str, dict[str, dict[str, float]]]) -> str:
    """TOML tables ``[host_layouts."<layout>".<h2d|d2h>]`` for ``kvflow.profile``."""
    lines: list[str] = []
    for name, links in tables.items():
        for d in ("h2d", "d2h"):
            if d not in links:
                continue
            lines += ["", f'[host_layouts."{name}".{d}]']
            lines += [f"{k} = {_toml_value(v)}" for k, v in links[d].items()]
    return "\n".join(lines) + "\n" if lines else ""


def _toml_value(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, int):
        return str(v)
    return f"{float(v):.6g}" if abs(v) >= 1e-3 or v == 0 else f"{float(v):.6e}"


def write_profile(path: str | Path, values: dict[str, Any], comments: Sequence[str]) -> Any:
    """Write the profile and load it back (``ConfigError`` names a bad key); returns it."""
    from kvflow.profile import load_profile

    path = Path(path)
    path.write_text(render_profile(values, comments))
    return load_profile(str(path))


