"""Trace statistics on hand-built traces with answers worked out by hand."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces import Request, open_trace, sample_path, write_generic
from traces.stats import reuse_distances, summarize, trace_stats

# block_tokens = 4
HAND = [
    Request(0, 0.0, 8, 1, (1, 2), session_id="a"),
    Request(1, 1.0, 10, 3, (1, 2, 3), session_id="a"),  # block 3 holds 2 tokens
    Request(2, 3.0, 6, 5, (1, 4), session_id="b"),  # block 4 holds 2 tokens
    Request(3, 4.0, 10, 7, (1, 2, 3), tenant="t"),  # same prompt as request 1
]


def test_hand_built_trace() -> None:
    s = trace_stats(HAND, block_tokens=4)
    assert s.requests == 4 and s.block_tokens == 4
    assert s.duration_s == 4.0
    assert s.arrival_rate == 0.75  # 3 gaps over 4 s
    assert s.interarrival_cv == pytest.approx(math.sqrt(2) / 4)  # gaps 1, 2, 1
    assert (s.input_len.mean, s.input_len.p50, s.input_len.p90) == (8.5, 9.0, 10.0)
    assert (s.input_len.min, s.input_len.max, s.input_len.total) == (6, 10, 34)
    assert (s.output_len.p50, s.output_len.p90) == (4.0, pytest.approx(6.4))
    assert s.output_len.p99 == pytest.approx(6.94)
    # accesses 1 2 | 1 2 3 | 1 4 | 1 2 3: 10 accesses, 4 distinct blocks
    assert (s.total_blocks, s.unique_blocks) == (10, 4)
    assert s.block_hit_ceiling == pytest.approx(0.6)
    # hit tokens: request 1: 4 + 4; request 2: 4; request 3: 4 + 4 + 2 (partial block)
    assert s.token_hit_ceiling == pytest.approx(22 / 34)
    assert s.blocks_used_once == 0.25  # only block 4
    # stack distances: 1, 1, 2, 1, 3, 3 (see the access string above)
    assert s.reuse_distance is not None
    assert s.reuse_distance.count == 6
    assert s.reuse_distance.mean == pytest.approx(11 / 6)
    assert (s.reuse_distance.p50, s.reuse_distance.max) == (1.5, 3.0)
    assert s.reuse_histogram == [(1, 0), (2, 3), (4, 3)]
    assert s.lru_hit_curve == [(1, 0.0), (2, 0.3), (4, 0.6)]
    # The offline optimum, request by request (kvflow keeps a request's first C blocks):
    # C=1: block 1 each time, 3 hits; C=2: 1,2 | 1,2 hit | 1 hit, 4 evicts 2 | 1 hit: 4;
    # C=4: everything fits, the ceiling.
    assert s.optimum_hit_curve == [(1, 0.3), (2, 0.4), (4, 0.6)]
    assert (s.sessions, s.tenants, s.skipped) == (2, 1, 0)
    d = s.to_dict()
    assert d["input_len"]["p50"] == 9.0 and d["lru_hit_curve"][-1] == [4, 0.6]
    assert d["optimum_hit_curve"][-1] == [4, 0.6]


def test_reuse_off_and_empty() -> None:
    s = trace_stats(HAND, block_tokens=4, reuse=False)
    assert s.reuse_distance is None and s.lru_hit_curve == []
    assert s.optimum_hit_curve[-1] == (4, 0.6)
    assert trace_stats(HAND, block_tokens=4, optimum=False).optimum_hit_curve == []
    e = trace_stats([])
    assert (e.requests, e.total_blocks, e.arrival_rate, e.block_hit_ceiling) == (0, 0, None, 0.0)
    one = trace_stats([Request(0, 0.0, 3, 1, (5,))])
    assert one.duration_s == 0.0 and one.arrival_rate is None and one.interarrival_cv is None


def test_tokens_and_lengths_only() -> None:
    toks = tuple(range(10))
    reqs = [
        Request(0, 0.0, 10, 1, None, toks),
        Request(1, 0.5, 10, 1, None, toks),  # same tokens: all 3 blocks hit
        Request(2, 0.6, 6, 1, None, (*toks[:4], 99, 98)),  # first block hits only
        Request(3, 0.7, 8, 1, (0, 1)),  # trace ids 0, 1 never meet token-chained ids
        Request(4, 0.8, 8, 1),  # lengths only: unique
    ]
    s = trace_stats(reqs, block_tokens=4)
    assert s.total_blocks == 3 + 3 + 2 + 2 + 2
    assert s.unique_blocks == 3 + 1 + 2 + 2
    assert s.token_hit_ceiling == pytest.approx((10 + 4) / (10 + 10 + 6 + 8 + 8))


def test_stats_of_trace_carry_skipped(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    write_generic(HAND, p, block_tokens=4)
    with p.open("a") as f:
        f.write("oops\n")
    tr = open_trace(p, skip_bad=True)
    s = trace_stats(tr)
    assert (s.requests, s.block_tokens, s.skipped) == (4, 4, 1)
    assert s.token_hit_ceiling == pytest.approx(22 / 34)
    with pytest.raises(ValueError, match="misread"):
        trace_stats(tr, block_tokens=16)


def test_sample_trace_numbers() -> None:
    s = trace_stats(open_trace(sample_path()))
    assert s.requests == 1000 and s.duration_s == 330.0
    assert s.total_blocks == sum(r.num_blocks(512) for r in open_trace(sample_path()))
    assert 0 < s.block_hit_ceiling < 1 and s.lru_hit_curve[-1][1] == s.block_hit_ceiling


def naive_distances(seq: list[int]) -> list[int]:
    stack: list[int] = []  # most recent last
    out = []
    for h in seq:
        if h in stack:
            pos = stack.index(h)
            out.append(len(stack) - 1 - pos)
            stack.pop(pos)
        stack.append(h)
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 12), max_size=60))
def test_reuse_distance_matches_lru_stack(seq: list[int]) -> None:
    assert reuse_distances(seq).tolist() == naive_distances(seq)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=1, max_size=60), st.integers(1, 10))
def test_lru_curve_matches_simulation(seq: list[int], capacity: int) -> None:
    # an LRU cache of C blocks hits exactly the re-accesses at distance < C
    cache: list[int] = []
    hits = 0
    for h in seq:
        if h in cache:
            hits += 1
            cache.remove(h)
        elif len(cache) == capacity:
            cache.pop(0)
        cache.append(h)
    d = reuse_distances(seq)
    assert int((d < capacity).sum()) == hits


def test_summarize() -> None:
    s = summarize(np.arange(101))
    assert (s.count, s.p50, s.p90, s.p99, s.min, s.max) == (101, 50, 90, 99, 0, 100)
    assert summarize([]).count == 0
