"""A replay folds finished requests into its report and lets them go (issue 19): nothing
of a finished request outlives it but a few floats per metric; per-op transfer records
are kept only where a world reads them, and summarise the same either way; the
per-request CSV, if asked for, is written as requests finish."""

from __future__ import annotations

import csv
import gc
import json
import math
import weakref
from pathlib import Path
from typing import Any

import pytest

import sim.world
from kvflow.engine import Engine, RequestState
from kvflow.replay import ReplayConfig, run_replay
from kvflow.replay.aggregate import CSV_COLUMNS

CFG = ReplayConfig(limit=150, host_blocks=600, storage_blocks=3000)


def test_finished_requests_are_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    refs: list[weakref.ref[RequestState]] = []
    left = Engine._left

    def spy(self: Engine, st: RequestState) -> None:
        refs.append(weakref.ref(st))
        left(self, st)

    monkeypatch.setattr(Engine, "_left", spy)
    report = run_replay(CFG)
    gc.collect()
    assert len(refs) == CFG.limit == report["requests"] + report["rejected"]
    alive = [r() for r in refs if r() is not None]
    assert alive == []  # the engine kept none (keep_done=False), nor did anything else


def _digest(report: dict[str, Any]) -> str:
    r = dict(report)
    r.pop("wall_s")
    return json.dumps(r, sort_keys=True)


def test_transfer_records_and_columns_give_the_same_report(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ReplayConfig(limit=150, host_blocks=600, storage_blocks=3000, instances=2,
                       write_policy="write_back")
    columns = run_replay(cfg)
    monkeypatch.setattr(sim.world.SimSite, "keep_transfer_records", True)
    records = run_replay(cfg)
    assert columns["transfers"] and set(columns["transfers"]) >= {"evict", "swap_in", "write"}
    assert _digest(columns) == _digest(records)


def test_requests_csv_is_written_as_they_finish(tmp_path: Path) -> None:
    out = tmp_path / "requests.csv"
    report = run_replay(CFG, requests_csv=out)
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert len(rows) == report["requests"] + report["rejected"]
    done = [r for r in rows if not r["error"]]
    ttft = [float(r["ttft_s"]) for r in done]
    assert [round(x, 6) for x in ttft] == report["samples"]["ttft_s"]
    assert math.fsum(ttft) / len(ttft) == pytest.approx(report["ttft_s"]["mean"], rel=1e-12)
    blocks = sum(int(r["blocks"]) for r in done)
    hits = sum(int(r[f"hits_{t}"]) for r in done for t in ("device", "host", "storage"))
    assert hits / blocks == pytest.approx(report["hit_rate"]["total"], rel=1e-12)


def test_requests_csv_needs_full_mode(tmp_path: Path) -> None:
    from kvflow.errors import ConfigError

    with pytest.raises(ConfigError, match="full replay only"):
        run_replay(ReplayConfig(limit=10, mode="cache"), requests_csv=tmp_path / "r.csv")
    assert not (tmp_path / "r.csv").exists()


def test_requests_are_read_from_the_trace_not_held(tmp_path: Path) -> None:
    from kvflow.replay import resolve
    from kvflow.replay.requests import Requests

    setup = resolve(ReplayConfig(limit=40))
    reqs = setup.requests
    assert isinstance(reqs, Requests) and len(reqs) == 40
    listed = list(reqs)
    assert [r.arrival_s for r in listed] == list(reqs.arrival_s)
    assert [r.input_len for r in listed] == list(reqs.input_len)
    assert reqs[0] == listed[0] and reqs[-1] == listed[-1] and reqs[3:5] == listed[3:5]
    assert list(reqs) == listed  # a second pass reads the same requests
    with pytest.raises(IndexError):
        reqs[40]


def test_a_finished_request_leaves_no_garbage_cycles() -> None:
    """What a request used is freed by reference counting as it finishes: no reference
    cycle (task <-> backend handle, plan <-> op) waits for the cycle collector, which a
    replay runs rarely (its full passes walk the whole heap)."""
    from kvflow.manager import Plan, TransferOp
    from kvflow.runtime import TransferTask
    from sim.links import SimTransfer

    kinds = (TransferTask, SimTransfer, TransferOp, Plan, RequestState)
    gc.collect()
    # Objects other tests still hold (their own plans and states) are not this replay's.
    before = {id(o) for o in gc.get_objects() if isinstance(o, kinds)}
    gc.disable()
    try:
        report = run_replay(CFG)
        left = [o for o in gc.get_objects() if isinstance(o, kinds) and id(o) not in before]
    finally:
        gc.enable()
    assert report["requests"] > 100
    assert left == []


def test_requests_counted_by_their_first_whole_pass() -> None:
    """``Requests(count=False)`` reads nothing up front: the first pass that reads the
    whole source records the numbers (and calls ``on_counted`` once); one left part-way
    records nothing, and asking for the length before any whole pass counts first."""
    from kvflow.replay.config import request_keys
    from kvflow.replay.requests import Requests
    from traces import open_trace, sample_path
    from traces.reshape import bound

    src = bound(open_trace(sample_path()), limit=30)
    eager = Requests(src, lambda r: request_keys(r, None))
    calls: list[int] = []
    lazy = Requests(src, lambda r: request_keys(r, None), count=False,
                    on_counted=lambda: calls.append(1))
    assert lazy._numbers is None and calls == []
    it = iter(lazy)
    next(it), next(it)
    it.close()  # a pass left part-way: nothing recorded
    assert lazy._numbers is None and calls == []
    assert list(lazy) == list(eager) and calls == [1]
    assert (lazy.arrival_s, lazy.input_len, lazy.output_len, len(lazy)) == (
        eager.arrival_s, eager.input_len, eager.output_len, 30)
    assert list(lazy) == list(eager) and calls == [1]
    again = Requests(src, lambda r: request_keys(r, None), count=False,
                     on_counted=lambda: calls.append(2))
    assert len(again) == 30 and calls == [1, 2] and list(again) == list(eager)


def test_a_cache_replay_reads_the_trace_once_and_still_counts_its_skipped_lines(
        tmp_path: Path) -> None:
    """Cache mode counts the requests in the replay's own pass: the report's skipped
    lines are still the trace's (set when that pass ends), and the report is the same
    as from a setup counted up front."""
    from kvflow.replay import resolve
    from traces import sample_path

    lines = sample_path().read_text().splitlines()[:60]
    lines.insert(20, '{"timestamp": "soon"}')
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cfg = ReplayConfig(trace=str(path), mode="cache", skip_bad=True)
    report = run_replay(cfg)
    assert report["config"]["skipped_lines"] == 1 and report["requests"] == 60
    assert resolve(cfg).skipped == 1
    lazy = resolve(cfg, count=False)
    assert lazy.requests._numbers is None and lazy.skipped == 0  # (nothing read yet)
    assert len(list(lazy.requests)) == 60 and lazy.skipped == 1
