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
from array import array
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvflow.engine import Engine
from kvflow.headroom import AccessLog, headroom_section
from kvflow.profile import LINKS
from kvflow.replay.aggregate import Finished, merged
from kvflow.replay.load import load_section, pd_utilization, slo_section
from kvflow.replay.transfer_log import TransferLog, summarize_logs
from kvflow.runtime import Runtime

if TYPE_CHECKING:
    from kvflow.manager import CacheManager
    from kvflow.replay.config import ReplayConfig, Setup

REPORT_VERSION = 1


def assemble_report(cfg: ReplayConfig, setup: Setup, manager: CacheManager,
                    body: dict[str, Any], t0: float,
                    accesses: AccessLog | None = None) -> dict[str, Any]:
    """The report around a replay's body (shared by both worlds). ``accesses``: the
    trace's accesses, where the replay logged them as it read the trace (else the
    headroom section reads it again)."""
    report: dict[str, Any] = {
        "kvflow_report": REPORT_VERSION,
        "config": config_dict(cfg, setup),
    }
    # A full replay's body carries the queue's first/last-quarter waits in a partial
    # load section; the whole section is built here (and placed where it always was).
    body = dict(body)
    waits = (body.pop("load", None) or {}).get("queue_wait_first_last_s")
    report.update(body)
    report["evictions"] = dict(zip(("device", "host", "storage"),
                                   manager.stats.evictions, strict=True))
    engine = body.get("engine") or {}
    report["load"] = load_section(setup.requests, setup.spec, setup.profile, setup.capacities,
                                  cfg.max_batch_tokens, cfg.max_running, cfg.instances,
                                  engine.get("compute_busy_s"), body.get("sim_time_s"),
                                  None if waits is None else (waits[0], waits[1]),
                                  **setup.load_kwargs())
    if report.get("pd"):
        pd = report["pd"]
        pd["utilization_predicted"] = pd_utilization(report["load"], pd["prefill_instances"],
                                                     pd["decode_instances"])
        report["load"]["overloaded"] |= bool(pd["utilization_predicted"]["overloaded"])
    if cfg.headroom:
        caps = [setup.capacities[t] for t in (0, 1, 2)]
        report["headroom"] = headroom_section(
            (r.keys for r in setup.requests) if accesses is None else accesses, caps,
            cfg.eviction, cfg.instances)
    report["wall_s"] = round(time.perf_counter() - t0, 3)
    return report


def config_dict(cfg: ReplayConfig, setup: Setup) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    if d.get("host_layout") == "layer_major":
        del d["host_layout"]  # the default: reports stay as they were before layouts existed
    if cfg.store is None:  # (a report without a store reads as it did before there was one)
        d.pop("store")
    else:  # a Redis URL's password never reaches a report
        from kvflow.stores.spec import describe_store

        d["store"] = describe_store(cfg.store)
    d.update(trace=setup.trace_path, device_blocks=setup.capacities.device,
             host_blocks=setup.capacities.host, storage_blocks=setup.capacities.storage,
             block_tokens=setup.spec.block_tokens, bytes_per_block=setup.spec.bytes_per_block,
             num_layers=setup.spec.num_layers, skipped_lines=setup.skipped)
    return d



class IdleSkip:
    """Lets a replay's samplers step over an idle stretch together, as one sample.

    Ticking every interval through an empty gap made a replay's cost follow virtual
    time: one arrival 10^7 s after the one before cost a million samples. When nothing
    is queued, running, held or in flight on any engine and the next arrival is known,
    the samplers sleep until one interval before it; the stretch becomes one sample
    (zeros; its span is in ``t``). The decision is taken once per tick for every
    sampler, so a cluster's instances keep the same grid (their series are summed
    index by index). A stretch of less than two empty intervals is sampled as before.
    """

    def __init__(self, engines: Sequence[Engine],
                 next_arrival: Callable[[], float | None]) -> None:
        self.engines = engines
        self.next_arrival = next_arrival
        self._tick = -1
        self._skip = 0

    def intervals(self, tick: int, next_sample: float, interval: float) -> int:
        """Intervals to step over after the sample of ``tick`` (next due at ``next_sample``)."""
        if tick != self._tick:
            self._tick, self._skip = tick, self._decide(next_sample, interval)
        return self._skip

    def _decide(self, next_sample: float, interval: float) -> int:
        for e in self.engines:
            if e.waiting or e.running or e.holding or e.runtime.tasks:
                return 0
        arrival = self.next_arrival()
        if arrival is None:
            return 0
        # One interval of margin: the sample after the jump ends before the arrival's
        # interval, whatever the rounding of the grid's accumulated times.
        return max(0, math.floor((arrival - next_sample) / interval) - 1)


class Sampler:
    """Per-interval samples for the report's time series.

    ``t`` is the end of each sample's span; a span is ``interval`` long except an idle
    stretch stepped over (``IdleSkip``), and the last, partial one. ``ticks`` numbers
    each sample's end on the interval grid (1 for the first interval's), which places
    the per-interval hit rates (``hit_series``). Each series is an array of C numbers,
    8 bytes a sample (a list held an object a float: 16 instances sampling a long
    trace every 10 s held megabytes); the report lists them.
    """

    LINKS = LINKS

    def __init__(self, engine: Engine, backend: Any, executor: Any,
                 interval: float, skip: IdleSkip | None = None) -> None:
        self.engine, self.backend, self.executor = engine, backend, executor
        self.interval = interval
        self.skip = skip
        self.t: array[float] = array("d")
        self.ticks: array[int] = array("q")
        self.queue_len: array[int] = array("q")
        self.running: array[int] = array("q")
        self.util: dict[str, array[float]] = {k: array("d") for k in self.LINKS}
        self._last_busy = dict.fromkeys(self.LINKS, 0.0)
        self._last_t = engine.loop.time()
        self.next_sample = self._last_t + interval
        self._tick = 1  # grid number of next_sample

    async def run(self) -> None:
        """Sample every interval while the engine makes progress.

        An interval in which the engine had work but took no step, with no
        transfer in flight, is a stall and ends the sampling: a sampler that
        kept ticking would keep the virtual clock running forever over it,
        hiding the loop's deadlock report. (An engine idle between arrivals
        is not stalled: the arrivals keep the clock going, and the sampler
        steps over the stretch, ``IdleSkip``.)
        """
        engine = self.engine
        last_steps = -1
        while True:
            await asyncio.sleep(self.next_sample - engine.loop.time())
            self.sample()
            self.next_sample += self.interval
            self._tick += 1
            if self.skip is not None:
                skip = self.skip.intervals(self._tick, self.next_sample, self.interval)
                if skip:
                    self.next_sample += skip * self.interval
                    self._tick += skip
            steps = engine.stats.steps
            if (steps == last_steps and not engine.runtime.tasks and not engine.computing
                    and (engine.waiting or engine.running) and not engine.waits_on_peer):
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
        self.ticks.append(self._tick)
        self.queue_len.append(self.engine.queue_len)
        self.running.append(len(self.engine.running))
        self._last_t = now


def summary(values: Sequence[float]) -> dict[str, float] | None:
    if not len(values):
        return None
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


@dataclass
class Part:
    """One engine instance's objects, as the report reads them: ``finished`` holds what
    its finished requests contributed (``kvflow.replay.aggregate``)."""

    engine: Engine
    runtime: Runtime
    log: TransferLog
    sampler: Sampler
    finished: Finished


def _sum_dicts(dicts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Key-wise sums, keys in first-seen order (one dict: an equal copy)."""
    out: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out[k] + v if k in out else v
    return out


def full_report(setup: Setup, parts: Sequence[Part], sim_time: float,
                slo: tuple[float | None, float | None] = (None, None)) -> dict[str, Any]:
    """The full-mode body over every instance (one, or a cluster's): totals, rates over all
    requests, link use averaged over instances. With one instance it is that instance's."""
    fin = merged([p.finished for p in parts])
    ttft, tpot = fin.ttft, fin.tpot
    span = sim_time if sim_time > 0 else 1.0
    metrics = [p.runtime.metrics for p in parts]
    links = [p.log.metrics() for p in parts]
    n = len(parts)
    busy = [getattr(p.engine.executor, "busy_s", None) for p in parts]
    rejected = sum(p.engine.stats.rejected for p in parts)
    count = len(fin)
    body = {
        "requests": count,
        "rejected": rejected,
        "hit_rate": hit_rates(fin.hits, fin.blocks),
        "ttft_s": summary(ttft), "tpot_s": summary(tpot), "e2e_s": summary(fin.e2e),
        "throughput": {"requests_per_s": count / span,
                       "output_tokens_per_s": fin.out_tokens / span,
                       "prompt_tokens_per_s": fin.in_tokens / span},
        "bytes": _sum_dicts([m.bytes for m in metrics]),
        "link_utilization": {k: sum(min(1.0, ln[k]["busy_s"] / span) for ln in links) / n
                             for k in LINKS},
        "prefetch": _sum_dicts([m.prefetch for m in metrics]),
        "errors": {"failed_transfers": sum(m.failed + m.cancelled for m in metrics),
                   "recomputed_blocks": sum(p.runtime.manager.stats.recomputed_blocks
                                            for p in parts),
                   "recomputed_tokens": sum(p.engine.stats.recomputed_tokens for p in parts),
                   "replans": sum(p.engine.stats.replans for p in parts)},
        "engine": {"steps": sum(p.engine.stats.steps for p in parts),
                   "compute_busy_s": None if None in busy else sum(busy)},  # type: ignore[arg-type]
        "transfers": summarize_logs([p.log for p in parts]),
        "sim_time_s": sim_time,
        "timeseries": _series(parts, fin),
        "samples": {"ttft_s": [round(x, 6) for x in ttft],
                    "tpot_s": [round(x, 6) for x in tpot]},
    }
    body["slo"] = slo_section(ttft, fin.tpot_or_none(), rejected, span, *slo)
    body["queue_s"] = summary(fin.wait)
    waits = fin.queue_growth()
    body["load"] = {"queue_wait_first_last_s": None if waits is None else list(waits)}
    return body


def _series(parts: Sequence[Part], fin: Finished) -> dict[str, Any]:
    """The time series over all instances: counts summed, link use averaged."""
    first = parts[0].sampler
    if len(parts) == 1:
        series: dict[str, Any] = {"interval_s": first.interval, "t": first.t.tolist()}
        series.update(hit_series(fin, first))
        series.update({f"link_util_{k}": v.tolist() for k, v in first.util.items()})
        series.update(queue_len=first.queue_len.tolist(), running=first.running.tolist())
        return series
    n = min(len(p.sampler.t) for p in parts)  # a stalled instance stops sampling early
    t = first.t[:n].tolist()
    k = len(parts)
    series = {"interval_s": first.interval, "t": t}
    series.update(hit_series(fin, first, n))
    for link in LINKS:
        series[f"link_util_{link}"] = [round(sum(p.sampler.util[link][i] for p in parts) / k, 6)
                                       for i in range(n)]
    series["queue_len"] = [sum(p.sampler.queue_len[i] for p in parts) for i in range(n)]
    series["running"] = [sum(p.sampler.running[i] for p in parts) for i in range(n)]
    return series


def instance_rows(parts: Sequence[Part], sim_time: float) -> list[dict[str, Any]]:
    """One row per instance: what it served, how well, how busy it was."""
    span = sim_time if sim_time > 0 else 1.0
    rows = []
    for i, p in enumerate(parts):
        fin = p.finished
        busy = getattr(p.engine.executor, "busy_s", None)
        links = p.log.metrics()
        rows.append({
            "instance": i,
            "requests": len(fin),
            "rejected": p.engine.stats.rejected,
            "hit_rate": hit_rates(fin.hits, fin.blocks),
            "ttft_s": summary(fin.ttft),
            "queue_s": summary(fin.wait),
            "compute_utilization": None if busy is None else min(1.0, busy / span),
            "link_utilization": {k: min(1.0, links[k]["busy_s"] / span) for k in LINKS},
            "bytes": dict(p.runtime.metrics.bytes),
        })
    return rows


def hit_series(fin: Finished, sampler: Sampler,
               intervals: int | None = None) -> dict[str, list[float | None]]:
    """Hit rate per tier of the requests arriving in each sampling interval (arrivals
    past the last interval count in it)."""
    n = len(sampler.t) if intervals is None else intervals
    if n == 0:
        return {"hit_rate_device": [], "hit_rate_host": [], "hit_rate_storage": []}
    hits = np.zeros((3, n))
    blocks = np.zeros(n)
    ticks = sampler.ticks  # [1, 2, ..., n] but where an idle stretch was stepped over
    for b, row in fin.by_interval():  # integer sums: exact in any order
        i = min(n - 1, bisect_left(ticks, b + 1))  # the sample ending interval b
        blocks[i] += row[0]
        for t in (0, 1, 2):
            hits[t, i] += row[t + 1]
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
