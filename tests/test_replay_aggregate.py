"""``Finished`` folds requests into compact arrays; its figures must be the ones the report
computed from per-request lists and dicts before (the reference implementations here)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.engine import EngineRequest, RequestState
from kvflow.replay.aggregate import Finished, merged
from kvflow.replay.load import queue_growth, slo_section

# Times on a coarse grid so that ties (equal arrivals, equal waits) are common.
_t = st.integers(0, 40).map(lambda x: x * 2.5)
_request = st.tuples(_t, _t, st.integers(0, 30).map(lambda x: x * 0.1), st.integers(1, 4),
                     st.integers(0, 6), st.tuples(*[st.integers(0, 3)] * 3))


def _states(rows: list[tuple[float, float, float, int, int, tuple[int, int, int]]],
            start: float) -> list[RequestState]:
    out = []
    for i, (arrival, wait, prefill, generated, blocks, hits) in enumerate(rows):
        req = EngineRequest(i, arrival, tuple(range(blocks)), 100 * blocks, generated)
        s = RequestState(req)
        s.admit_s = start + arrival + wait
        s.first_token_s = s.admit_s + prefill
        s.finish_s = s.first_token_s + 0.01 * (generated - 1)
        s.generated = generated
        s.hits = tuple(min(h, blocks) for h in hits)  # type: ignore[assignment]
        out.append(s)
    return out


def _by_interval_reference(states: list[RequestState], start: float,
                           interval: float) -> dict[int, list[int]]:
    """What ``Finished`` kept before: a dict of lists, interval -> [blocks, hits...]."""
    out: dict[int, list[int]] = {}
    for s in states:
        b = math.floor(s.req.arrival_s / interval)
        row = out.setdefault(b, [0, 0, 0, 0])
        row[0] += len(s.req.keys)
        for t in (0, 1, 2):
            row[t + 1] += s.hits[t]
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(_request, max_size=25), min_size=1, max_size=3),
       st.sampled_from([1.0, 2.5, 10.0]), st.sampled_from([0.0, 7.25]))
def test_finished_gives_the_figures_of_per_request_lists(
        instances: list[list[tuple[float, float, float, int, int, tuple[int, int, int]]]],
        interval: float, start: float) -> None:
    parts, every = [], []
    for rows in instances:
        fin = Finished(start, interval)
        states = _states(rows, start)
        for s in states:
            fin.add(s)
        parts.append(fin)
        every += states
    fin = merged(parts)
    # queue growth: the pairs, sorted, summed as before
    pairs = [(s.req.arrival_s, (s.admit_s - start) - s.req.arrival_s) for s in every]
    assert fin.queue_growth() == queue_growth(pairs)
    # per-interval counts, every interval with a request (zero rows add nothing)
    got = {b: list(row) for b, row in fin.by_interval()}
    want = {b: row for b, row in _by_interval_reference(every, start, interval).items()
            if any(row)}
    assert got == want
    # TPOT per request, None where there is none; the SLO section over them
    tpot = [None if s.generated <= 1 else
            ((s.finish_s - start) - (s.first_token_s - start)) / (s.generated - 1)
            for s in every]
    assert list(fin.tpot_or_none()) == tpot
    ttft = [(s.first_token_s - start) - s.req.arrival_s for s in every]
    assert list(fin.ttft) == ttft
    assert slo_section(fin.ttft, fin.tpot_or_none(), 1, 10.0, 1.0, 0.05) == \
        slo_section(ttft, tpot, 1, 10.0, 1.0, 0.05)
