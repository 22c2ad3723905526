"""Issue 20, item 2: a replay's cost follows events, not virtual time.

A trace with an arrival far in the future (10^7 s after the one before) once made the
time-series sampler wake every ``sample_interval_s`` through the empty gap: a million
samples, seconds of CPU and a GB of memory for five requests. Now an idle stretch
(nothing queued, running or in flight, the next arrival intervals away) is one sample
spanning it, so the samples, the sampler's wakeups and the memory are the same for a gap
of 10^4 s and of 10^7 s.
"""

from __future__ import annotations

import itertools
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from kvflow.replay import ReplayConfig, Sampler, run_replay


def _trace(path: Path, gap: float) -> Path:
    with open(path, "w") as f:
        f.write(json.dumps({"kvflow_trace": 1, "block_tokens": 16}) + "\n")
        for a in (0.0, 1.0, 2.0, gap, gap + 1.0):
            f.write(json.dumps({"arrival_s": a, "input_length": 300, "output_length": 20}) + "\n")
    return path


def _replay(tmp_path: Path, gap: float, monkeypatch: pytest.MonkeyPatch,
            **kw: Any) -> tuple[dict[str, Any], int]:
    wakeups = 0
    sample = Sampler.sample

    def counted(self: Sampler) -> None:
        nonlocal wakeups
        wakeups += 1
        sample(self)

    monkeypatch.setattr(Sampler, "sample", counted)
    report = run_replay(ReplayConfig(trace=str(_trace(tmp_path / f"gap{gap:g}.jsonl", gap)),
                                     **kw))
    monkeypatch.setattr(Sampler, "sample", sample)
    return report, wakeups


@pytest.mark.parametrize("instances", [1, 2])
def test_samples_and_wakeups_do_not_grow_with_an_idle_gap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, instances: int) -> None:
    near, near_wakeups = _replay(tmp_path, 1e4, monkeypatch, instances=instances)
    tracemalloc.start()
    try:
        far, far_wakeups = _replay(tmp_path, 1e7, monkeypatch, instances=instances)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert far["requests"] == near["requests"] == 5
    ts_near, ts_far = near["timeseries"], far["timeseries"]
    # The same number of samples and wakeups, and few: the busy intervals around the
    # arrivals, and the idle stretch between them as (at most) two samples.
    assert far_wakeups == near_wakeups <= 8 * instances
    assert len(ts_far["t"]) == len(ts_near["t"]) <= 8
    for key, values in ts_far.items():
        if key != "interval_s":
            assert len(values) == len(ts_far["t"]), key
    assert peak < 30 * 2**20  # a million samples held ~1 GB


def test_an_idle_stretch_is_one_sample_spanning_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, _ = _replay(tmp_path, 1e7, monkeypatch)
    ts = report["timeseries"]
    t, interval = ts["t"], ts["interval_s"]
    spans = [b - a for a, b in zip([0.0, *t], t, strict=False)]
    long = [i for i, s in enumerate(spans) if s > interval + 1e-6]
    assert len(long) == 1 and spans[long[0]] > 1e7 - 3 * interval
    i = long[0]
    # Nothing queued, running or moving, and no arrivals, in the stretch it stands for.
    assert ts["queue_len"][i] == ts["running"][i] == 0
    assert all(v[i] == 0.0 for k, v in ts.items() if k.startswith("link_util_"))
    assert ts["hit_rate_device"][i] is None
    # Every sample that holds arrivals has a hit rate, at the interval that holds them:
    # the first three in the first sample, the last two in the sample ending past 10^7 + 1.
    rated = [j for j, v in enumerate(ts["hit_rate_device"]) if v is not None]
    assert rated[0] == 0 and t[0] > 2.0
    after = next(j for j, x in enumerate(t) if x > 1e7 + 1.0)
    assert after in rated and t[after] - interval <= 1e7
    # Times only increase and the last is the end of the replay.
    assert all(b > a for a, b in itertools.pairwise(t))
    assert t[-1] == pytest.approx(report["sim_time_s"], abs=1e-6)


def test_sampling_runs_to_the_end_when_a_step_outlasts_the_interval() -> None:
    """A run of decode steps taken in one go (or one long step) spans several sampling
    intervals with the step counter still: the sampler once took that for a stall and
    stopped, so at a 1 s interval the bundled sample's series ended at 27 s of 876 s."""
    report = run_replay(ReplayConfig(limit=200, sample_interval_s=1.0, headroom=False))
    t = report["timeseries"]["t"]
    spans = [b - a for a, b in itertools.pairwise([0.0, *t])]
    # Every sample spans one interval, but the last (partial) one and idle stretches.
    busy_long = [s for s in spans[:-1] if s > 1.0 + 1e-6]
    assert len(t) >= report["sim_time_s"] / 2, (len(t), report["sim_time_s"])
    assert spans[-1] <= 1.0 + 1e-6 and len(busy_long) <= 2
