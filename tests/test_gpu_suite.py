"""The GPU suite's fidelity table over several GPU runs (pure bookkeeping, no GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"
_spec = importlib.util.spec_from_file_location("gpu_suite", _PATH)
assert _spec is not None and _spec.loader is not None
suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite)


def report(service: float, ttft: float, device_hits: float = 0.5) -> dict[str, Any]:
    return {"transfers": {"swap_in": {"service_per_block_s": service, "service_mean_s": service,
                                      "ops": 3, "blocks": 4}},
            "ttft_s": {"p50": ttft}, "tpot_s": {},
            "hit_rate": {"device": device_hits, "host": 0.1, "total": device_hits + 0.1},
            "sim_time_s": 3.0, "requests": 4}


def by_metric(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["metric"]: r for r in rows}


def test_simulator_is_compared_with_the_median_gpu_run_and_the_range_is_kept() -> None:
    sim = report(1.0e-3, 1.0)
    gpus = [report(0.90e-3, 1.30), report(1.02e-3, 1.05), report(1.30e-3, 0.95)]
    rows = by_metric(suite.combine([suite.fidelity(sim, g) for g in gpus]))
    swap = rows["swap_in: service per block"]
    assert swap["gpu"] == pytest.approx(1.02)  # ms, the median run
    assert swap["spread"] == pytest.approx((0.90, 1.30))
    assert swap["diff"] == pytest.approx(1.0 / 1.02 - 1)
    assert swap["met"] is True  # within 5% of the median, not of every run
    ttft = rows["TTFT p50"]
    assert ttft["gpu"] == pytest.approx(1050.0) and ttft["met"] is True
    table = suite.table(list(rows.values()))
    assert "0.9 ms..1.3 ms" in table


def test_a_hit_rate_differing_in_any_run_fails_even_if_the_median_matches() -> None:
    sim = report(1.0e-3, 1.0)
    gpus = [report(1.0e-3, 1.0), report(1.0e-3, 1.0, device_hits=0.49), report(1.0e-3, 1.0)]
    rows = by_metric(suite.combine([suite.fidelity(sim, g) for g in gpus]))
    assert rows["hit rate device"]["met"] is False
    assert rows["hit rate host"]["met"] is True


def test_one_run_gives_the_single_run_table() -> None:
    sim, gpu = report(1.0e-3, 1.0), report(1.2e-3, 1.0)
    one = by_metric(suite.combine([suite.fidelity(sim, gpu)]))
    assert "spread" not in one["swap_in: service per block"]
    assert one["swap_in: service per block"]["met"] is False
