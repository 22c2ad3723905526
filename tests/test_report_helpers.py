"""A realistic synthetic replay report, for testing the views without running a replay.

The numbers hang together the way a replay's do: percentiles are computed from
the samples, the total hit rate is the sum of the tiers', bytes follow the hits,
time series cover the simulated time. Shared by the report, compare and sweep
tests (``from test_report_helpers import make_report``); it holds no tests itself.
It also holds what the tests of the views on synthetic and on real replays
expect alike (:data:`FULL_PLOTS`) and read alike (:func:`rendered`,
:func:`embedded_pngs`), so that both check the same thing.
"""

from __future__ import annotations

import base64
import math
import os
import random
import re
from dataclasses import dataclass
from io import StringIO
from typing import Any

from rich.console import Console

from kvflow.errors import ConfigError
from kvflow.reports import render as R

#: The plots of a full-mode report, in the order the views show them (written out
#: here, not taken from ``kvflow.reports.render``, so that a plot lost or reordered there fails).
FULL_PLOTS = ("hit_rate_tiers", "ttft_cdf", "tpot_cdf", "hit_rate", "link_util", "queue")


def rendered(report: dict[str, Any], source: str | None = None) -> str:
    """The report's tables as ``kvflow report`` prints them, 160 columns, no colour."""
    buf = StringIO()
    R.print_report(report, Console(file=buf, width=160, color_system=None), source)
    return buf.getvalue()


def embedded_pngs(page: str) -> list[bytes]:
    """The PNGs an HTML report embeds as ``data:`` images, decoded, in page order."""
    imgs = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    return [base64.b64decode(i) for i in imgs]


def _pcts(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    n = len(s)

    def q(p: float) -> float:
        return s[min(n - 1, max(0, math.ceil(p * n) - 1))]

    return {"mean": sum(s) / n, "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def make_report(
    *,
    mode: str = "full",
    n: int = 200,
    seed: int = 0,
    hit: tuple[float, float, float] = (0.2, 0.05, 0.01),
    ttft_scale: float = 0.4,
    **config: Any,
) -> dict[str, Any]:
    """A report of ``n`` requests; ``config`` overrides the config section's fields."""
    rng = random.Random(seed)
    cfg: dict[str, Any] = {
        "trace": "traces/samples/conversation_1k.jsonl",
        "model": "llama-3-8b",
        "profile": "h100",
        "mode": mode,
        "device_blocks": 800,
        "host_blocks": 4000,
        "storage_blocks": 20000,
        "block_tokens": 512,
        "eviction": "lru",
        "write_policy": "write_through",
        "prefetch_policy": "best_effort",
        "seed": seed,
        "limit": None,
    }
    cfg.update(config)
    dev, host, sto = hit
    sim_time = 300.0
    rep: dict[str, Any] = {
        "kvflow_report": 1,
        "config": cfg,
        "requests": n,
        "rejected": 3,
        "hit_rate": {"device": dev, "host": host, "storage": sto, "total": dev + host + sto},
        "throughput": {
            "requests_per_s": n / sim_time,
            "output_tokens_per_s": 912.5,
            "prompt_tokens_per_s": 30123.0,
        },
        "bytes": {
            "h2d": 1.25e12 * host / 0.05,
            "d2h": 5.1e11,
            "storage_read": 1.0e11,
            "storage_write": 2.0e11,
        },
        "link_utilization": {
            "h2d": 0.31,
            "d2h": 0.104,
            "storage_read": 0.02,
            "storage_write": 0.055,
        },
        "evictions": {"device": 1234, "host": 20, "storage": 0},
        "prefetch": {"issued": 10, "completed": 8, "cancelled": 2, "failed": 0},
        "errors": {"failed_transfers": 0, "recomputed_blocks": 7},
        "sim_time_s": sim_time,
        "wall_s": 2.5,
    }
    if mode == "cache":  # as kvflow.replay writes it: no timing sections at all
        rep.update(
            {k: None for k in ("ttft_s", "tpot_s", "e2e_s", "throughput", "bytes")},
            link_utilization=None,
            prefetch=None,
            sim_time_s=None,
            timeseries={},
            samples={},
            truncated=2,
        )
        return rep

    ttft = [ttft_scale * rng.lognormvariate(0, 0.6) for _ in range(n)]
    tpot = [0.02 * rng.lognormvariate(0, 0.3) for _ in range(n)]
    e2e = [a + 250 * b for a, b in zip(ttft, tpot, strict=True)]
    rep["ttft_s"], rep["tpot_s"], rep["e2e_s"] = _pcts(ttft), _pcts(tpot), _pcts(e2e)
    k = 30
    t = [10.0 * (i + 1) for i in range(k)]

    def wobble(base: float) -> list[float]:
        return [
            max(0.0, base * (1 + 0.3 * math.sin(i / 3) + 0.1 * rng.uniform(-1, 1)))
            for i in range(k)
        ]

    rep["timeseries"] = {
        "interval_s": 10.0,
        "t": t,
        "hit_rate_device": [min(1.0, x * (i + 1) / k * 1.6) for i, x in enumerate(wobble(dev))],
        "hit_rate_host": wobble(host),
        "hit_rate_storage": wobble(sto),
        "link_util_h2d": wobble(0.31),
        "link_util_d2h": wobble(0.1),
        "link_util_storage_read": wobble(0.02),
        "link_util_storage_write": wobble(0.05),
        "queue_len": [int(x) for x in wobble(6)],
        "running": [int(x) for x in wobble(24)],
    }
    rep["timeseries"]["hit_rate_storage"][4] = None  # an interval with no arrivals
    rep["samples"] = {"ttft_s": ttft, "tpot_s": tpot}
    return rep


@dataclass
class FakeConfig:
    """Mirrors ``kvflow.replay.ReplayConfig``'s sweepable fields (sweep tests need no replay)."""

    trace: str | None = None
    model: str = "llama-3-8b"
    profile: str = "h100"
    device_blocks: int | None = None
    host_blocks: int | None = None
    storage_blocks: int | None = None
    eviction: str = "lru"
    write_policy: str = "write_through"
    prefetch_policy: str = "best_effort"
    mode: str = "full"
    seed: int = 0
    limit: int | None = None
    sample_interval_s: float = 10.0
    skip_bad: bool = False

    def __post_init__(self) -> None:
        if self.limit == 13:  # stands in for a combination the real config rejects
            raise ConfigError("limit 13 is unlucky")


def fake_run(cfg: FakeConfig) -> dict[str, Any]:
    """A picklable stand-in for ``run_replay``: more host blocks, more hits, lower TTFT.

    ``host_blocks=666`` fails the way a replay can fail mid-run.
    """
    if cfg.host_blocks == 666:
        raise ConfigError("host tier of the beast")
    hb = cfg.host_blocks or 0
    host = round(0.3 * hb / (hb + 2000), 6)
    dev = 0.2 + {"lru": 0.0, "lfu": 0.01, "s3fifo": 0.02}[cfg.eviction]
    rep = make_report(
        mode=cfg.mode,
        n=40,
        seed=cfg.seed,
        hit=(dev, host, 0.0),
        ttft_scale=0.5 - host,
        host_blocks=hb,
        eviction=cfg.eviction,
        write_policy=cfg.write_policy,
        trace=cfg.trace,
    )
    rep["pid"] = os.getpid()  # which process ran it
    return rep
