"""Calibration of the host's share of a step: the time between GPU steps.

A small GPU replay (``kvflow replay --backend cuda``'s harness) logs every
step; the time to the next step's start not covered by the step's GPU time is
the host's (scheduling, planning, launches), fitted as fixed + per sequence +
per prefill item (``host_share_fit``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kernels.calibrate.fit import Log, step_point
from kvflow.layout import ModelSpec


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

    from kernels.world import run_gpu_replay
    from kvflow.replay import ReplayConfig
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


def admission_delays(arrivals: Sequence[float], first_tokens: Sequence[float],
                     steps: Sequence[tuple[Any, ...]]) -> list[float]:
    """Per request, arrival to the start of the step that gave its first token.

    ``arrivals`` and ``first_tokens`` are on the replay's clock (its report), ``steps``
    the executor's log (``start`` and ``wall`` on ``time.perf_counter``): a first token
    is recorded as its step's wall time ends, so the clocks' offset is the median of
    first token - (start + wall) over the steps that gave one (its spread was a few us
    on an H100). Requests must not share a prefill step (one arrives after the last
    finished): the k-th step with a prefill is the k-th request's.
    """
    pre_steps = [s for s in steps if s[0]]
    if len(pre_steps) != len(arrivals) or len(first_tokens) != len(arrivals):
        raise ValueError(f"{len(arrivals)} requests but {len(pre_steps)} prefill steps")
    if not arrivals:
        return []
    off = float(np.median([ft - (s[4] + s[3]) for ft, s in zip(first_tokens, pre_steps,
                                                                  strict=True)]))
    return [s[4] + off - a for a, s in zip(arrivals, pre_steps, strict=True)]


def measure_admission(spec: ModelSpec, log: Log, requests: int = 16, repeats: int = 8,
                      gap_s: float = 0.03,
                      backend_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Host time from a request's arrival to its first step, the engine idle before it,
    and what a load from host adds to it.

    A GPU replay of ``requests`` two-block prompts (4 output tokens), ``gap_s``
    apart, so each finds the engine idle: the wake-up, admission (prefix lookup,
    allocation, write-through backup submission), scheduling and step build that the
    gaps between a busy engine's steps never show (in a replay whose requests all
    arrive at once they overlap the GPU). On an H100 the fast executor's slice-B
    turns waited 0.5-0.75 ms for it before their prefill step started, their TTFT's
    largest part the cost model did not charge (benchmarks/results/gpu_suite_fast.md).
    Then ``repeats`` requests reuse the first prompts plus one new block; the device
    pool (8 blocks) has evicted those prompts by then, so each loads its two blocks
    back from host in one op: the median extra delay over the fresh requests' is the
    host's submission of a load (``load_submit_s``; slice B's turns with host hits
    waited 1.0-1.45 ms).
    """
    import csv

    from kernels.world import CudaWorld
    from kvflow.replay import ReplayConfig, run_replay
    from traces.schema import Request
    from traces.writer import write_generic

    bt, base = spec.block_tokens, 1 << 41
    reqs = [Request(i, i * gap_s, 2 * bt, 4, (base + 2 * i, base + 2 * i + 1))
            for i in range(requests)]
    reqs += [Request(requests + j, (requests + j) * gap_s, 3 * bt, 4,
                     (base + 2 * j, base + 2 * j + 1, base + 2 * requests + j))
             for j in range(min(repeats, requests))]
    step_log: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="kvflow-calibrate-") as tmp:
        trace, out = Path(tmp) / "admission.jsonl", Path(tmp) / "requests.csv"
        write_generic(reqs, trace, block_tokens=bt, source="kvflow calibrate")
        cfg = ReplayConfig(trace=str(trace), model=spec.name, device_blocks=8,
                           host_blocks=4 * len(reqs) + 8, storage_blocks=0, backend="cuda",
                           executor="fast", instances=1)
        run_replay(cfg, world=CudaWorld(backend_options or {}, step_log, None,
                                        executor="fast"), requests_csv=out)
        with out.open() as f:
            rows = sorted(csv.DictReader(f), key=lambda r: int(r["request_id"]))
    delays = admission_delays([float(r["arrival_s"]) for r in rows],
                              [float(r["first_token_s"]) for r in rows], step_log)
    fresh = [d for r, d in zip(rows, delays, strict=True)
             if 0 < int(r["request_id"]) < requests and int(r["hits_host"]) == 0]
    hit = [d for r, d in zip(rows, delays, strict=True) if int(r["hits_host"]) > 0]
    admission = float(np.median(fresh or delays))
    submit = max(float(np.median(hit)) - admission, 0.0) if hit else 0.0
    log(f"admission: {admission * 1e3:.3f} ms from arrival to the first step, median of "
        f"{len(fresh)} requests arriving at an idle engine "
        f"(min {min(fresh or delays) * 1e3:.3f}, max {max(fresh or delays) * 1e3:.3f} ms); "
        f"a load from host adds {submit * 1e3:.3f} ms ({len(hit)} requests with host hits)")
    return {"admission_s": admission, "load_submit_s": submit,
            "delays_s": [round(d, 7) for d in delays]}
