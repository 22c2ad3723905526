"""A replay's report: the JSON-ready dict every view reads (``kvflow.reports``).

Built from the same objects in every world (engine, runtime, transfer log,
sampler), so a simulated and a real replay's reports have the same keys and
measure the same things; a world adds its own section (``Site.report``).
Same inputs and seed give the same report, ``wall_s`` aside.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvflow.engine import Engine, RequestState
from kvflow.profile import LINKS
from kvflow.replay.transfer_log import TransferLog
from kvflow.runtime import Runtime

if TYPE_CHECKING:
    from kvflow.manager import CacheManager
    from kvflow.replay.config import ReplayConfig, Setup

REPORT_VERSION = 1


def assemble_report(cfg: ReplayConfig, setup: Setup, manager: CacheManager,
                    body: dict[str, Any], t0: float) -> dict[str, Any]:
    """The report around a replay's body (shared by both worlds)."""
    report: dict[str, Any] = {
        "kvflow_report": REPORT_VERSION,
        "config": config_dict(cfg, setup),
    }
    report.update(body)
    report["evictions"] = dict(zip(("device", "host", "storage"),
                                   manager.stats.evictions, strict=True))
    report["wall_s"] = round(time.perf_counter() - t0, 3)
    return report


def config_dict(cfg: ReplayConfig, setup: Setup) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d.update(trace=setup.trace_path, device_blocks=setup.capacities.device,
             host_blocks=setup.capacities.host, storage_blocks=setup.capacities.storage,
             block_tokens=setup.spec.block_tokens, bytes_per_block=setup.spec.bytes_per_block,
             num_layers=setup.spec.num_layers, skipped_lines=setup.skipped)
    return d



class Sampler:
    """Per-interval samples for the report's time series."""

    LINKS = LINKS

    def __init__(self, engine: Engine, backend: Any, executor: Any,
                 interval: float) -> None:
        self.engine, self.backend, self.executor = engine, backend, executor
        self.interval = interval
        self.t: list[float] = []
        self.queue_len: list[int] = []
        self.running: list[int] = []
        self.util: dict[str, list[float]] = {k: [] for k in self.LINKS}
        self._last_busy = dict.fromkeys(self.LINKS, 0.0)
        self._last_t = engine.loop.time()
        self.next_sample = self._last_t + interval

    async def run(self) -> None:
        """Sample every interval while the engine makes progress.

        An interval in which the engine had work but took no step, with no
        transfer in flight, is a stall and ends the sampling: a sampler that
        kept ticking would keep the virtual clock running forever over it,
        hiding the loop's deadlock report. (An engine idle between arrivals
        is not stalled: the arrivals keep the clock going.)
        """
        engine = self.engine
        last_steps = -1
        while True:
            await asyncio.sleep(self.next_sample - engine.loop.time())
            self.sample()
            self.next_sample += self.interval
            steps = engine.stats.steps
            if (steps == last_steps and not engine.runtime.tasks
                    and (engine.waiting or engine.running)):
                return
            last_steps = steps

    def sample(self) -> None:
        now = self.engine.loop.time()
        span = now - self._last_t
        if span <= 0:
            return
        links = self.backend.metrics()
        for k in self.LINKS:
            busy = links[k]["busy_s"]
            self.util[k].append(round(min(1.0, (busy - self._last_busy[k]) / span), 6))
            self._last_busy[k] = busy
        self.t.append(round(now, 6))
        self.queue_len.append(self.engine.queue_len)
        self.running.append(len(self.engine.running))
        self._last_t = now



def summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def full_report(setup: Setup, engine: Engine, runtime: Runtime, backend: Any,
                 sampler: Sampler, sim_time: float) -> dict[str, Any]:
    """The full-mode body; ``backend`` has ``metrics()`` (per-link ``busy_s``) and, for a
    ``TransferLog``, ``summary()`` (per-transfer times)."""
    finished = [st for st in engine.done if st.finish_s is not None]
    ttft = [st.first_token_s - st.req.arrival_s for st in finished]  # type: ignore[operator]
    e2e = [st.finish_s - st.req.arrival_s for st in finished]  # type: ignore[operator]
    tpot = [(st.finish_s - st.first_token_s) / (st.generated - 1)  # type: ignore[operator]
            for st in finished if st.generated > 1]
    hits = [sum(st.hits[t] for st in finished) for t in (0, 1, 2)]
    blocks = sum(len(st.req.keys) for st in finished)
    links = backend.metrics()
    span = sim_time if sim_time > 0 else 1.0
    out_tokens = sum(st.generated for st in finished)
    in_tokens = sum(st.req.input_len for st in finished)
    m = runtime.metrics
    series: dict[str, Any] = {"interval_s": sampler.interval, "t": sampler.t}
    series.update(hit_series(finished, sampler))
    series.update({f"link_util_{k}": v for k, v in sampler.util.items()})
    series.update(queue_len=sampler.queue_len, running=sampler.running)
    return {
        "requests": len(finished),
        "rejected": engine.stats.rejected,
        "hit_rate": hit_rates(hits, blocks),
        "ttft_s": summary(ttft), "tpot_s": summary(tpot), "e2e_s": summary(e2e),
        "throughput": {"requests_per_s": len(finished) / span,
                       "output_tokens_per_s": out_tokens / span,
                       "prompt_tokens_per_s": in_tokens / span},
        "bytes": dict(m.bytes),
        "link_utilization": {k: min(1.0, links[k]["busy_s"] / span) for k in LINKS},
        "prefetch": dict(m.prefetch),
        "errors": {"failed_transfers": m.failed + m.cancelled,
                   "recomputed_blocks": runtime.manager.stats.recomputed_blocks,
                   "recomputed_tokens": engine.stats.recomputed_tokens,
                   "replans": engine.stats.replans},
        "engine": {"steps": engine.stats.steps,
                   "compute_busy_s": getattr(engine.executor, "busy_s", None)},
        "transfers": backend.summary() if isinstance(backend, TransferLog) else None,
        "sim_time_s": sim_time,
        "timeseries": series,
        "samples": {"ttft_s": [round(x, 6) for x in ttft],
                    "tpot_s": [round(x, 6) for x in tpot]},
    }


def hit_series(finished: list[RequestState],
                sampler: Sampler) -> dict[str, list[float | None]]:
    """Hit rate per tier of the requests arriving in each sampling interval."""
    n = len(sampler.t)
    if n == 0:
        return {"hit_rate_device": [], "hit_rate_host": [], "hit_rate_storage": []}
    hits = np.zeros((3, n))
    blocks = np.zeros(n)
    for st in finished:
        b = min(n - 1, math.floor(st.req.arrival_s / sampler.interval))
        blocks[b] += len(st.req.keys)
        for t in (0, 1, 2):
            hits[t, b] += st.hits[t]
    rates = hits / np.maximum(blocks, 1)
    # An interval with no arrivals has no hit rate (null), not a rate of zero.
    return {f"hit_rate_{name}": [round(float(x), 6) if b else None
                                 for x, b in zip(rates[t], blocks, strict=True)]
            for t, name in enumerate(("device", "host", "storage"))}




def hit_rates(hits: list[int], blocks: int) -> dict[str, float]:
    d = {name: (h / blocks if blocks else 0.0)
         for name, h in zip(("device", "host", "storage"), hits, strict=True)}
    d["total"] = sum(hits) / blocks if blocks else 0.0
    return d
