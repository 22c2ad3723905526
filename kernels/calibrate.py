"""``kvflow calibrate``: measure this GPU and write a profile the simulator reads.

What the simulator needs to predict the GPU world is what the GPU world runs,
so each number is measured on the code a GPU replay uses:

* **links** — first ``CudaBackend`` ops of k scattered blocks of the model,
  each way, alone and beside executor steps, timed with CUDA events as a GPU
  replay times them (from right before the first copy to after the last);
  then the transfers of a small GPU replay (``measure_replay_links``), which
  run slower than isolated ops (the other direction busy, compute and host
  work around them). The simulator's per-layer unit (``latency_s + bytes /
  bandwidth_Bps``, ``sim.hierarchy.Link``) is fitted robustly to the replay's
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
* **the fit** — the simulator's step time (``sim.cost.CostModel``: ``layers *
  max(weight FLOPs / (peak * mfu) + attention FLOPs / (peak * attention_mfu),
  bytes / (hbm * mbu)) + step_overhead_s + step_overhead_per_seq_s * seqs +
  step_overhead_per_prefill_s * prefills``) fitted to GPU time + host share
  of each grid and replay step: ``mfu``, ``attention_mfu``, ``mbu`` and
  ``step_overhead_s`` are what make it match.

``write_profile`` renders the TOML (``sim.cost.load_profile`` keys, measured
values in comments) and checks that it loads. The fitting and rendering are
pure functions, tested without a GPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kernels._cuda import cupy_module, gpu_unavailable_reason
from kernels.testing import spin
from kvflow.errors import ConfigError
from kvflow.layout import ModelSpec, preset
from kvflow.manager import OpKind, TransferOp
from kvflow.radix import Tier

Log = Callable[[str], None]
_H2D, _D2H = 1, 2
#: Rows at which the executor's weight GEMMs are timed: their efficiency curve
#: (``sim.cost.gemm_shape``) spans a decode of one sequence to a full chunk.
GEMM_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


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


def step_terms(spec: ModelSpec, prefill: Sequence[tuple[int, int]],
               decode: Sequence[int]) -> tuple[float, float]:
    """Per-layer FLOPs and bytes of a batch, exactly as ``sim.cost.CostModel.layer_time``."""
    p = step_point("", spec, prefill, decode, 0.0)
    return p.flops, p.nbytes


def step_point(label: str, spec: ModelSpec, prefill: Sequence[tuple[int, int]],
               decode: Sequence[int], seconds: float) -> StepPoint:
    """A measured step in ``sim.cost.CostModel``'s terms (tokens, attention pairs, KV bytes)."""
    from sim.cost import PROFILES, CostModel

    cm = CostModel(spec, PROFILES["h100"])
    tokens = len(decode)
    pairs = float(sum(decode))
    kv = pairs
    for new, ctx in prefill:
        tokens += new
        pairs += new * (ctx + new * 0.5)
        kv += ctx + new
    attn = cm.attention_flops_per_pair * pairs
    return StepPoint(label, cm.weight_flops_per_token * tokens + attn,
                     cm.weight_bytes + cm.kv_bytes_per_token * kv, seconds, attn,
                     len(prefill) + len(decode), len(prefill), tokens)


def roofline(point: StepPoint, layers: int, peak: float, hbm: float, mfu: float,
             mbu: float, overhead: float = 0.0, attention_mfu: float = 0.0,
             per_seq: float = 0.0, per_prefill: float = 0.0,
             gemm_shape: Callable[[float], float] | None = None) -> float:
    """The simulator's step time (``sim.cost.CostModel.step_time``) for ``point``."""
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


class HostShare(NamedTuple):
    """Host time per engine step not covered by GPU time: fixed + per sequence + per prefill."""

    fixed: float
    per_seq: float
    per_prefill: float

    def of(self, seqs: int, prefills: int) -> float:
        return self.fixed + self.per_seq * seqs + self.per_prefill * prefills


def host_share_fit(starts: Sequence[float], gpu: Sequence[float], seqs: Sequence[int],
                   prefills: Sequence[int] | None = None) -> HostShare:
    """The host's share per engine step, by least squares on (1, sequences, prefill items).

    A step's host share is the time from its start to the next step's start
    not covered by its GPU time. A prefill item costs more host work than a
    decode (admission, its plan and loads, token and table uploads), hence
    its own term. Steps off the first fit by more than its 95th percentile
    residual (GC pauses, first-touch allocations) are left out of the second;
    a negative term is dropped and the rest refitted.
    """
    host = np.diff(np.asarray(starts, dtype=float)) - np.asarray(gpu[:-1], dtype=float)
    if host.size < 3:
        return HostShare(float(max(host.mean(), 0.0)) if host.size else 0.0, 0.0, 0.0)
    cols = [np.ones_like(host), np.asarray(seqs[:-1], dtype=float),
            np.asarray((prefills or [0] * len(seqs))[:-1], dtype=float)]
    active = [0] + [k for k in (1, 2) if np.ptp(cols[k]) > 0]

    def solve(mask: np.ndarray) -> np.ndarray:
        use = list(active)
        while True:
            a = np.stack([cols[k][mask] for k in use], axis=1)
            coef, *_ = np.linalg.lstsq(a, host[mask], rcond=None)
            bad = [k for k, c in zip(use, coef, strict=True) if k and c < 0]
            if not bad:
                out = np.zeros(3)
                out[use] = coef
                return out
            use.remove(bad[0])

    coef = solve(np.ones_like(host, dtype=bool))
    resid = host - sum(coef[k] * cols[k] for k in range(3))
    coef = solve(resid <= np.quantile(resid, 0.95))
    return HostShare(float(max(coef[0], 0.0)), float(coef[1]), float(coef[2]))


def render_profile(values: dict[str, Any], comments: Sequence[str]) -> str:
    """TOML text for ``sim.cost.load_profile``: top-level numbers, then link tables."""
    lines = [f"# {c}" if c else "#" for c in comments]
    lines.append("")
    links = ("h2d", "d2h", "storage_read", "storage_write")
    for k, v in values.items():
        if k in links:
            continue
        lines.append(f"{k} = {_toml_value(v)}")
    for k in links:
        if k in values:
            lines.append("")
            lines.append(f"[{k}]")
            for kk, vv in values[k].items():
                lines.append(f"{kk} = {_toml_value(vv)}")
    return "\n".join(lines) + "\n"


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
    from sim.cost import load_profile

    path = Path(path)
    path.write_text(render_profile(values, comments))
    return load_profile(str(path))


# ---------------------------------------------------------------------- measurements
def _gpu_seconds(cp: Any, stream: Any, enqueue: Callable[[], None], reps: int,
                 stat: Callable[[list[float]], float] = statistics.median) -> float:
    times = []
    for _ in range(reps + 1):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        enqueue()
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return stat(times[1:])


def measure_raw_link(log: Log, nbytes: int = 256 << 20, reps: int = 5) -> dict[str, Any]:
    """Contiguous ceilings each way and both ways, and per-op time of 4 KB copies."""
    cp = cupy_module()
    rt = cp.cuda.runtime
    dev = cp.empty(2 * nbytes, dtype=cp.uint8)
    host = cp.cuda.alloc_pinned_memory(2 * nbytes)
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    d0, h0 = int(dev.data.ptr), int(host.ptr)
    out: dict[str, Any] = {}
    out["h2d_Bps"] = nbytes / _gpu_seconds(
        cp, s1, lambda: rt.memcpyAsync(d0, h0, nbytes, _H2D, s1.ptr), reps, min)
    out["d2h_Bps"] = nbytes / _gpu_seconds(
        cp, s1, lambda: rt.memcpyAsync(h0, d0, nbytes, _D2H, s1.ptr), reps, min)

    def both() -> None:
        ev = cp.cuda.Event()
        ev.record(s1)
        s2.wait_event(ev)
        rt.memcpyAsync(d0, h0, nbytes, _H2D, s1.ptr)
        rt.memcpyAsync(h0 + nbytes, d0 + nbytes, nbytes, _D2H, s2.ptr)
        ev2 = cp.cuda.Event()
        ev2.record(s2)
        s1.wait_event(ev2)

    out["both_Bps"] = 2 * nbytes / _gpu_seconds(cp, s1, both, reps, min)
    n = 200
    for name, kind, (dst, src) in (("h2d", _H2D, (d0, h0)), ("d2h", _D2H, (h0, d0))):
        def small(kind: int = kind, dst: int = dst, src: int = src) -> None:
            spin(s1, 0.01)  # queued behind a spin: the GPU, not Python's call rate, is timed
            for i in range(n):
                rt.memcpyAsync(dst + i * 4096, src + i * 4096, 4096, kind, s1.ptr)

        t = _gpu_seconds(cp, s1, small, reps) - 0.01
        out[f"{name}_op_4k_s"] = max(t, 0.0) / n
    log(f"raw link: h2d {out['h2d_Bps'] / 1e9:.1f} GB/s, d2h {out['d2h_Bps'] / 1e9:.1f}, both "
        f"{out['both_Bps'] / 1e9:.1f}; 4 KB copy {out['h2d_op_4k_s'] * 1e6:.2f} / "
        f"{out['d2h_op_4k_s'] * 1e6:.2f} us")
    del dev, host
    return out


async def _backend_ops(backend: Any, pairs: list[tuple[Tier, Tier, list[int], list[int]]],
                       ) -> list[float]:
    """Submit ops at once (each on its own stream), return each one's event-timed seconds.

    Timed as a GPU replay times them (``kernels.replay.cuda_transfer_log``): from
    the task's start event, recorded right before its first copy (after the
    host has validated and prepared the op), to an event after its last.
    """
    from kernels.backend import FutureSink

    cp = cupy_module()
    backend.record_starts = True
    recs = []
    for i, (src, dst, s, d) in enumerate(pairs):
        sink = FutureSink(backend.num_layers)
        task = backend.submit(TransferOp(10_000 + i, OpKind.EVICT, src, dst, s, d, []), sink)
        recs.append((task, sink))
    for _, sink in recs:
        await sink.wait()
    return [cp.cuda.get_elapsed_time(t.start_event, t.end_event) / 1e3 for t, _ in recs]


async def scattered_op_seconds(backend: Any, src: Tier, dst: Tier, k: int, pool: int,
                               reps: int, rng: np.random.Generator, gap_s: float = 0.0
                               ) -> float:
    """Median event-timed seconds of ``reps`` ops of ``k`` random ids out of ``pool`` on
    each side, one at a time; ``gap_s``: up to that long (uniform) between them, so ops
    land anywhere in whatever else runs."""
    ts: list[float] = []
    for _ in range(reps):
        s = rng.permutation(pool)[:k].tolist()
        d = rng.permutation(pool)[:k].tolist()
        ts += await _backend_ops(backend, [(src, dst, s, d)])
        if gap_s:
            await asyncio.sleep(gap_s * rng.random())
    return statistics.median(ts)


async def measure_backend_links(spec: ModelSpec, log: Log, reps: int = 5,
                                sizes: Sequence[int] = (1, 2, 3, 4, 6, 8, 16),
                                stream_priority: int | None = None,
                                under_load: bool = False, dma: str = "auto",
                                ceilings: dict[str, float] | None = None) -> dict[str, Any]:
    """CudaBackend ops of k scattered blocks each way (and both at once); fitted link models.

    ``under_load``: while ``GpuExecutor`` steps run back to back on other blocks
    (8 decodes at context 4096 and a prefill of 1024 tokens at 2048), which is when
    the engine moves KV: loads are submitted as their request's step starts,
    backups as a request finishes amid other requests' steps. The swap kernel
    then shares the SMs with compute.
    """
    from kernels.backend import CudaBackend
    from kernels.compute import GpuExecutor
    from kernels.model import StepItem

    n = 2 * max(sizes) + 2
    bt = spec.block_tokens
    extra = 8 * -(-4097 // bt) + -(-3072 // bt) + 1 if under_load else 0
    backend = CudaBackend(spec, n + extra, n, stream_priority=stream_priority, dma=dma)
    for layer in range(spec.num_layers):  # real bytes, not zeros
        for role in ("k", "v"):
            kv = backend.device_kv(layer, role)
            kv[...] = cupy_module().random.randint(0, 255, kv.shape, dtype=np.uint8)
    cupy_module().cuda.runtime.deviceSynchronize()  # (default stream: not ordered with ours)
    churn: asyncio.Task[None] | None = None
    stop = asyncio.Event()
    if under_load:
        ex = GpuExecutor(backend, seed=0, max_tokens=2048)
        await ex.warm_up(block=n + extra - 1)
        per = -(-4097 // bt)
        dec = [StepItem(("d", i), True, np.array([5], dtype=np.int32), 4096,
                        np.arange(n + i * per, n + (i + 1) * per, dtype=np.int32), True)
               for i in range(8)]
        first = n + 8 * per
        pre = [StepItem("p", False, np.arange(1024, dtype=np.int32), 2048,
                        np.arange(first, first + -(-3072 // bt), dtype=np.int32), True)]

        async def run_compute() -> None:
            # one kind of step, back to back: every op sees the same load
            while not stop.is_set():
                await ex.run_items([*dec, *pre])

        churn = asyncio.ensure_future(run_compute())
        await asyncio.sleep(0.05)
    rng = np.random.default_rng(0)
    units = spec.num_layers
    per_block = spec.bytes_per_block
    out: dict[str, Any] = {"bytes_per_block": per_block, "units_per_op": units,
                           "copy_path": "copy engine (batched)" if backend.use_dma
                           else "swap kernel"}
    for name, src, dst in (("h2d", Tier.HOST, Tier.DEVICE), ("d2h", Tier.DEVICE, Tier.HOST)):
        # Warm up every size once: a first batch over fresh addresses can stall.
        for k in sizes:
            await _backend_ops(backend, [(src, dst, rng.permutation(n)[:k].tolist(),
                                          rng.permutation(n)[:k].tolist())])
        pts = [(k * per_block, await scattered_op_seconds(backend, src, dst, k, n, reps, rng))
               for k in sizes]
        lat, bw = fit_link(pts, units, max_bandwidth_Bps=(ceilings or {}).get(f"{name}_Bps"))
        out[name] = {"latency_s": lat, "bandwidth_Bps": bw,
                     "points": [(b, t) for b, t in pts]}
        log(f"backend {name}{' under load' if under_load else ''}: {bw / 1e9:.2f} GB/s, "
            f"{lat * 1e6:.2f} us per layer unit "
            f"(ops of {', '.join(map(str, sizes))} blocks of {per_block / 2**20:.1f} MiB)")
    k = max(sizes)
    both = []
    for _ in range(reps):
        perm = rng.permutation(n)
        a, b = perm[:k].tolist(), perm[k:2 * k].tolist()
        both.append(await _backend_ops(backend, [(Tier.HOST, Tier.DEVICE, a, a),
                                                 (Tier.DEVICE, Tier.HOST, b, b)]))
    t_in = statistics.median(t[0] for t in both)
    t_out = statistics.median(t[1] for t in both)
    out["both"] = {"h2d_Bps": k * per_block / t_in, "d2h_Bps": k * per_block / t_out}
    log(f"backend both ways at once ({k} blocks each): h2d {out['both']['h2d_Bps'] / 1e9:.2f}"
        f" GB/s, d2h {out['both']['d2h_Bps'] / 1e9:.2f} GB/s")
    if churn is not None:
        stop.set()
        await churn
    backend.synchronize()
    out["under_load"] = under_load
    return out


def measure_swap_kernels(log: Log, volume: int = 128 << 20, reps: int = 5,
                         blocks: Sequence[int] = (16 << 10, 128 << 10, 1 << 20),
                         ctas: Sequence[int] = (2, 4, 8, 16)) -> list[dict[str, Any]]:
    """BlockCopier bandwidth (GB/s) over scattered ids, by block size and CTAs, each way."""
    from kernels.swap import BlockCopier, SwapKernels

    cp = cupy_module()
    dev = cp.random.randint(0, 255, 2 * volume, dtype=np.uint8)
    host = cp.cuda.alloc_pinned_memory(2 * volume)
    cp.cuda.runtime.deviceSynchronize()
    kernels = SwapKernels()
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(1)
    rows = []
    for block in blocks:
        n = volume // block
        cap = 2 * n
        dbase = np.array([[int(dev.data.ptr)]], dtype=np.int64)
        hbase = np.array([[int(host.ptr)]], dtype=np.int64)
        for c in ctas:
            row: dict[str, Any] = {"block_bytes": block, "ctas": c}
            for name, src, dst in (("h2d", hbase, dbase), ("d2h", dbase, hbase)):
                cop = BlockCopier(src, dst, [block], cap, cap, ctas=c, min_run_bytes=0,
                                  kernels=kernels)
                s_ids = rng.permutation(cap)[:n].astype(np.int32)
                d_ids = rng.permutation(cap)[:n].astype(np.int32)
                prep = cop.prepare(s_ids, d_ids, stream)
                t = _gpu_seconds(cp, stream, lambda cop=cop, prep=prep: cop.launch(prep, stream),
                                 reps)
                stream.synchronize()
                prep.release()
                row[f"{name}_GBps"] = n * block / t / 1e9
            rows.append(row)
        log("swap kernel " + f"{block >> 10} KB: " + ", ".join(
            f"{r['ctas']} CTAs {r['h2d_GBps']:.1f}/{r['d2h_GBps']:.1f}"
            for r in rows if r["block_bytes"] == block) + " GB/s (h2d/d2h)")
    del dev, host
    return rows


def measure_matmuls(log: Log, reps: int = 5) -> dict[str, Any]:
    """cuBLAS fp16 8192^3 (reference peak) and a 4 GiB device copy (HBM, read + write)."""
    cp = cupy_module()
    stream = cp.cuda.Stream(non_blocking=True)
    out: dict[str, Any] = {}
    with stream:
        ab = [cp.random.standard_normal((8192, 8192), dtype=cp.float32).astype(cp.float16)
              for _ in range(2)]
        t = _gpu_seconds(cp, stream, lambda: cp.matmul(ab[0], ab[1]), reps)
        out["cublas_fp16_8192_flops"] = 2 * 8192**3 / t
        ab.clear()
        xy = [cp.empty(1 << 31, dtype=cp.uint8) for _ in range(2)]
        t = _gpu_seconds(cp, stream, lambda: xy[1].__setitem__(Ellipsis, xy[0]), reps)
        out["hbm_copy_Bps"] = 2 * (1 << 31) / t
        xy.clear()
    log(f"cuBLAS fp16 8192^3: {out['cublas_fp16_8192_flops'] / 1e12:.0f} TFLOP/s; "
        f"device copy: {out['hbm_copy_Bps'] / 1e12:.2f} TB/s (read + write)")
    return out


async def measure_executor(spec: ModelSpec, log: Log, reps: int = 3,
                           stream_priority: int | None = None) -> dict[str, Any]:
    """GEMM and attention throughput of the executor, and its steps over a batch grid."""
    from kernels.backend import CudaBackend
    from kernels.compute import GpuExecutor
    from kernels.model import ModelShape, StepItem

    cp = cupy_module()
    shape = ModelShape.from_spec(spec)
    bt = spec.block_tokens
    # Long prompts arrive as full chunks at growing contexts: 8192@16384 and @32768 are
    # where a long-context replay spends its time.
    prefills = [(512, 0), (2048, 0), (8192, 0), (1024, 2048), (1024, 4096), (4096, 4096),
                (2048, 8192), (8192, 8192), (4096, 16384), (1024, 32768), (256, 4096),
                (8192, 16384), (8192, 32768), (2048, 32768)]
    decodes = [(1, 1024), (8, 4096), (32, 4096), (32, 8192), (64, 2048)]
    mixed = [((2048, 0), (16, 4096))]
    need = max(max(-(-(n + c) // bt) for n, c in prefills),
               max(b * -(-(c + 1) // bt) for b, c in decodes))
    backend = CudaBackend(spec, need + 4, 1, stream_priority=stream_priority)
    ex = GpuExecutor(backend, seed=0, max_tokens=8192 + 64)
    await ex.warm_up(block=need + 3)
    # every block gets real KV values: run prefills over the whole pool once
    rng = np.random.default_rng(2)

    def prefill_item(n: int, ctx: int, first: int = 0) -> StepItem:
        table = np.arange(first, first + -(-(n + ctx) // bt), dtype=np.int32)
        return StepItem(("p", n, ctx), False, rng.integers(0, 1 << 30, n).astype(np.int32), ctx,
                        table, True)

    for start in range(0, need, 16):  # fill KV (16 blocks per step)
        k = min(16, need - start)
        await ex.run_items([prefill_item(k * bt, 0, start)])

    def decode_items(b: int, ctx: int) -> list[StepItem]:
        per = -(-(ctx + 1) // bt)
        return [StepItem(("d", i), True, np.array([7], dtype=np.int32), ctx,
                         np.arange(i * per, (i + 1) * per, dtype=np.int32), True)
                for i in range(b)]

    async def gpu_time(items: list[StepItem]) -> float:
        ts = []
        for _ in range(reps + 1):
            await ex.run_items(items)
            ts.append(ex.last_gpu_s)
        return statistics.median(ts[1:])

    points: list[StepPoint] = []
    for n, c in prefills:
        t = await gpu_time([prefill_item(n, c)])
        points.append(step_point(f"prefill {n}@{c}", spec, [(n, c)], [], t))
    for b_, c in decodes:
        t = await gpu_time(decode_items(b_, c))
        points.append(step_point(f"decode {b_}x{c}", spec, [], [c + 1] * b_, t))
    for (n, c), (b_, dc) in mixed:
        items = [*decode_items(b_, dc), prefill_item(n, c, b_ * -(-(dc + 1) // bt))]
        t = await gpu_time(items)
        points.append(step_point(f"mixed {n}@{c}+{b_}x{dc}", spec, [(n, c)], [dc + 1] * b_, t))

    # GEMM throughput of the executor's kernel, per layer's four GEMMs
    gemm = {}
    for m in GEMM_ROWS:
        x = cp.zeros((m, max(shape.hidden, shape.intermediate, shape.q_dim)), cp.uint16)
        x[...] = 0x3F80  # 1.0 in bf16: real values, no zeros
        out16 = cp.empty((m, max(shape.qkv_dim, 2 * shape.intermediate)), cp.uint16)
        out32 = cp.zeros((m, shape.hidden), cp.float32)
        xp, o16, o32 = (np.uint64(a.data.ptr) for a in (x, out16, out32))
        cp.cuda.runtime.deviceSynchronize()

        def layer_gemms(m: int = m, xp: np.uint64 = xp, o16: np.uint64 = o16,
                        o32: np.uint64 = o32, w: dict[str, Any] = ex.weights[0]) -> None:
            ex._gemm(xp, w["wqkv"], o16, m, shape.qkv_dim, shape.hidden, 0)
            ex._gemm(xp, w["wo"], o32, m, shape.hidden, shape.q_dim, 1)
            ex._gemm(xp, w["wgu"], o16, m, 2 * shape.intermediate, shape.hidden, 0)
            ex._gemm(xp, w["wd"], o32, m, shape.hidden, shape.intermediate, 1)

        t = _gpu_seconds(cp, ex.stream, layer_gemms, 5)
        gemm[m] = {"flops": 2 * m * shape.params_per_layer / t,
                   "weight_Bps": shape.params_per_layer * 2 / t}
    log("executor GEMM (one layer's four): " + ", ".join(
        f"M={m}: {v['flops'] / 1e12:.0f} TFLOP/s ({v['weight_Bps'] / 1e12:.2f} TB/s of weights)"
        for m, v in gemm.items()))
    # attention: the extra time of context (same new tokens)
    by = {p.label: p for p in points}
    att = {}
    for n, c in ((2048, 8192), (4096, 16384), (1024, 32768)):
        base = [p for p in points if p.label == f"prefill {n}@0"]
        if base:
            dt = by[f"prefill {n}@{c}"].seconds - base[0].seconds
        else:  # same tokens at context 0, measured now
            dt = by[f"prefill {n}@{c}"].seconds - await gpu_time([prefill_item(n, 0)])
        pairs_extra = n * c
        flops = spec.num_layers * 4 * shape.heads * shape.head_dim * pairs_extra
        att[f"{n}@{c}"] = flops / dt if dt > 0 else float("nan")
    log("executor attention (extra context): " + ", ".join(
        f"{k}: {v / 1e12:.0f} TFLOP/s" for k, v in att.items()))
    backend.synchronize()
    return {"points": points, "gemm": gemm, "attention_flops": att}


#: Prompt sizes (blocks) of the links replay: the engine's common small ops three times
#: each (one op of a size is often a stall, and their per-op cost is what small
#: swap-ins and backups pay), a few large ones for the bandwidth.
REPLAY_LINK_SIZES = (1, 2, 3, 4, 5, 6) * 3 + (8, 10, 12, 16)
#: Output tokens of each links-replay request: enough decode steps that copies land
#: while other requests decode, as in the engine's replays (small copies ran 2-9%
#: slower under any compute than on an idle GPU: benchmarks/copy_under_load.py); with 4
#: tokens the second wave's loads met an idle GPU and the fit fell short of replays' ops.
REPLAY_LINK_OUTPUT = 24


def measure_replay_links(spec: ModelSpec, log: Log, ceilings: dict[str, float] | None = None,
                         backend_options: dict[str, Any] | None = None,
                         sizes: Sequence[int] = REPLAY_LINK_SIZES) -> dict[str, Any]:
    """The link model fitted to the transfers of a small GPU replay, as replays see them.

    Isolated ops (``measure_backend_links``) miss what a replay adds around a
    transfer: the other direction busy, compute and host work in between,
    small ops. So a replay through ``kvflow replay --backend cuda``'s harness:
    a first wave of prompts of ``sizes`` blocks (finishing ones back up to
    host: device -> host ops of each size), then the same prompts, one block
    longer, arriving one every 40 ms into a device pool too small to have
    kept them: each loads its prefix back from host (host -> device ops of
    each size) while the others compute. ``fit_link`` on each direction's
    (bytes, service time) gives ``latency_s`` and ``bandwidth_Bps``.
    """
    import tempfile

    from kernels.replay import run_gpu_replay
    from sim.replay import ReplayConfig
    from traces.schema import Request
    from traces.writer import write_generic

    bt = spec.block_tokens
    first = 1 << 41
    reqs, prefixes = [], []
    requests = len(sizes)
    for i, k in enumerate(sizes):
        ids = tuple(range(first, first + k + 1))
        first += k + 1
        prefixes.append(ids)
        reqs.append(Request(i, 0.0, k * bt, REPLAY_LINK_OUTPUT, ids[:k]))
    wave2 = 3.0  # s: the first wave (~56k prompt tokens) is done by then
    for i, ids in enumerate(prefixes):
        reqs.append(Request(requests + i, wave2 + 0.04 * i, len(ids) * bt, REPLAY_LINK_OUTPUT,
                            ids))
    blocks = sum(-(-(len(ids) * bt + REPLAY_LINK_OUTPUT) // bt) for ids in prefixes)
    ops: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="kvflow-calibrate-") as tmp:
        trace = Path(tmp) / "links.jsonl"
        write_generic(reqs, trace, block_tokens=bt, source="kvflow calibrate")
        # A device pool for about two of the largest requests: the first wave
        # leaves little on the device, so the second loads almost all from host.
        cfg = ReplayConfig(trace=str(trace), model=spec.name,
                           device_blocks=2 * (max(sizes) + 2) + 4, host_blocks=2 * blocks,
                           storage_blocks=0, backend="cuda")
        run_gpu_replay(cfg, backend_options=backend_options or {}, op_log=ops)
    out: dict[str, Any] = {"ops": len(ops)}
    per_block = spec.bytes_per_block
    for name in ("h2d", "d2h"):
        pts = [(n * per_block, t) for _, link, n, t in ops if link == name and n > 0]
        sizes = {b for b, _ in pts}
        if len(pts) < 8 or len(sizes) < 3:
            log(f"replay links: {len(pts)} {name} ops of {len(sizes)} sizes: too few to fit")
            continue
        # one point per size (the median), as for isolated ops
        by_size: dict[float, list[float]] = {}
        for b, t in pts:
            by_size.setdefault(b, []).append(t)
        med = sorted((b, statistics.median(ts)) for b, ts in by_size.items())
        lat, bw = fit_link(med, spec.num_layers,
                           max_bandwidth_Bps=(ceilings or {}).get(f"{name}_Bps"))
        out[name] = {"latency_s": lat, "bandwidth_Bps": bw, "ops": len(pts), "points": med}
        log(f"replay links {name}: {bw / 1e9:.2f} GB/s, {lat * 1e6:.2f} us per layer unit "
            f"({len(pts)} ops of {len(sizes)} sizes in a GPU replay)")
    return out


def measure_step_overhead(spec: ModelSpec, log: Log, requests: int = 24,
                          output_len: int = 64,
                          backend_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A GPU replay: wall time minus GPU time per step, and every step as a fit point.

    Requests of 1k..8k prompt tokens (all at once) then decode together: chunked
    prefills, mixed steps, and decode batches shrinking from 24 as they finish
    (outputs of 8 .. 2 x ``output_len`` tokens, so every batch size from 24 to 1
    occurs and the host share's growth per sequence can be fitted). It runs
    through ``kvflow replay --backend cuda``'s own harness (transfer log, a host
    tier taking write-through backups, sampler, fine clock), because the host
    share the simulator must charge is that of the runs it is compared with.
    Steps taken by the engine join the synthetic grid in the fit.
    """
    import tempfile

    from kernels.replay import run_gpu_replay
    from sim.replay import ReplayConfig
    from traces.schema import Request
    from traces.writer import write_generic

    bt = spec.block_tokens
    lens = [1024 * (1 + i % 8) for i in range(requests)]
    outs = [8 + (2 * output_len * i) // requests for i in range(requests)]
    reqs, first = [], 1 << 40  # ids of their own: nothing shared, nothing cached
    for i, (n, o) in enumerate(zip(lens, outs, strict=True)):
        k = -(-n // bt)
        reqs.append(Request(i, 0.0, n, o, tuple(range(first, first + k))))
        first += k
    blocks = sum(-(-(n + o) // bt) for n, o in zip(lens, outs, strict=True)) + 8
    step_log: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="kvflow-calibrate-") as tmp:
        trace = Path(tmp) / "calibration.jsonl"
        write_generic(reqs, trace, block_tokens=bt, source="kvflow calibrate")
        cfg = ReplayConfig(trace=str(trace), model=spec.name, device_blocks=blocks,
                           host_blocks=blocks, storage_blocks=0, backend="cuda")
        run_gpu_replay(cfg, backend_options=backend_options or {}, step_log=step_log)
    gpus = [r[2] for r in step_log]
    starts = [r[4] for r in step_log]
    steps = len(step_log)
    wall = starts[-1] + step_log[-1][3] - starts[0]
    busy = sum(gpus)
    overhead = max(wall - busy, 0.0) / steps
    log(f"replay run: {steps} steps in {wall:.3f} s, GPU busy {busy:.3f} s: "
        f"{overhead * 1e3:.3f} ms per step not overlapped")
    points = []
    for pre, dec, gpu, _, _ in step_log:
        kind = "mixed" if pre and dec else "prefill" if pre else "decode"
        points.append(step_point(f"engine {kind} {sum(n for n, _ in pre)}+{len(dec)}", spec,
                                 pre, dec, gpu))
    seqs = [len(r[0]) + len(r[1]) for r in step_log]
    prefills = [len(r[0]) for r in step_log]
    share = host_share_fit(starts, gpus, seqs, prefills)
    fixed, per_seq = share.fixed, share.per_seq
    log(f"host share per step: {fixed * 1e3:.3f} ms + {per_seq * 1e6:.1f} us per sequence + "
        f"{share.per_prefill * 1e6:.1f} us per prefill item (gaps between step starts, "
        "less GPU time)")
    return {"steps": steps, "wall_s": wall, "gpu_s": busy, "step_overhead_s": overhead,
            "host_fixed_s": fixed, "host_per_seq_s": per_seq,
            "host_per_prefill_s": share.per_prefill, "points": points,
            "host_steps": [(n, p, round(b - a - g, 7)) for n, p, a, b, g
                           in zip(seqs, prefills, starts, starts[1:], gpus, strict=False)]}


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

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["executor"]["points"] = [dataclasses.asdict(p) if isinstance(p, StepPoint) else p
                                   for p in self.executor["points"]]
        return d


def calibrate(model: str = "llama-3-8b-l4", block_tokens: int = 512, base: str = "h100",
              name: str | None = None, quick: bool = False, stream_priority: int | None = None,
              dma: str | None = None, log: Log = print) -> Calibration:
    """Measure links, swap kernels and compute on this GPU (see the module docstring)."""
    reason = gpu_unavailable_reason()
    if reason is not None:
        raise ConfigError(f"kvflow calibrate needs a CUDA GPU and CuPy: {reason}")
    from sim.cost import PROFILES, gemm_shape

    if base not in PROFILES:
        raise ConfigError(f"unknown base profile {base!r}; presets: {', '.join(PROFILES)}")
    cp = cupy_module()
    t0 = time.perf_counter()
    if stream_priority is None or dma is None:  # as the GPU replay will run the copy streams
        from kernels.replay import env_backend_options

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
    opts = {k: v for k, v in (("stream_priority", stream_priority), ("dma", dma))
            if v is not None}
    over = measure_step_overhead(spec, log, backend_options=opts)
    gc.collect()
    replay_links = measure_replay_links(spec, log, raw, backend_options=opts)
    gc.collect()
    # The profile's links: as a replay sees them where that replay gave enough ops,
    # else the isolated ops under load.
    profile_links = {d: replay_links.get(d) or links[d] for d in ("h2d", "d2h")}
    # The engine sees a step take its GPU time plus the host's share (measured above,
    # fixed + per sequence); the simulator charges roofline + step_overhead_s +
    # step_overhead_per_seq_s per sequence: fit the rest to that.
    host, per_seq = over["host_fixed_s"], over["host_per_seq_s"]
    per_prefill = over["host_per_prefill_s"]
    engine_pts = over.pop("points")
    steps = [dataclasses.replace(p, seconds=p.seconds + host + per_seq * p.seqs
                                 + per_prefill * p.prefills)
             for p in [*exe["points"], *engine_pts]]
    # The executor's GEMM efficiency by rows, measured above: the weight time's shape.
    curve = [(float(m), round(min(v["flops"] / b.peak_bf16_flops, 1.0), 5))
             for m, v in sorted(exe["gemm"].items())]
    shape = gemm_shape(curve)
    mfu, mbu, fixed, rms, attn_mfu = fit_roofline(steps, spec.num_layers, b.peak_bf16_flops,
                                                  b.hbm_bytes_per_s, per_seq=per_seq,
                                                  per_prefill=per_prefill, gemm_shape=shape)
    rows = [{"step": p.label, "measured_s": p.seconds,
             "predicted_s": roofline(p, spec.num_layers, b.peak_bf16_flops, b.hbm_bytes_per_s,
                                     mfu, mbu, fixed, attn_mfu, per_seq, per_prefill, shape)}
            for p in steps]
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
        "step_overhead_per_prefill_s": per_prefill,
        "h2d": {"bandwidth_Bps": profile_links["h2d"]["bandwidth_Bps"],
                "latency_s": profile_links["h2d"]["latency_s"]},
        "d2h": {"bandwidth_Bps": profile_links["d2h"]["bandwidth_Bps"],
                "latency_s": profile_links["d2h"]["latency_s"]},
        "pcie_duplex": pcie_duplex(links),
        "gemm_efficiency": [[int(t), e] for t, e in curve],
    }
    return Calibration(device, spec.name, raw, links, idle, kernels, mm, exe,
                       {"mfu": mfu, "attention_mfu": attn_mfu, "mbu": mbu,
                        "step_overhead_s": fixed, "host_s": host, "host_per_seq_s": per_seq,
                        "host_per_prefill_s": per_prefill,
                        "rms_log_error": rms, "steps": rows},
                       over, profile, time.perf_counter() - t0, replay_links)


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
        "Keys override the base preset (sim.cost.load_profile); storage links are the",
        "base's (not measured: this machine's GPU world has no storage tier).",
        "",
        f"Compute: GpuExecutor steps of {cal.model} (bf16 mma.sync kernels, compute.cu),",
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
    return lines
