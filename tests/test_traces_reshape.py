"""Reshaping a trace's load: exact rate scaling, bounds, re-timing, repetition, composition."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces import Request, open_trace, sample_path, write_generic
from traces.arrivals import arrival_times
from traces.generate import multi_turn
from traces.reshape import bound, poisson_arrivals, rate_scale, repeat
from traces.stats import trace_stats

CONV = sample_path("conversation_1k.jsonl")  # Mooncake timestamps, ms ticks
AZURE = sample_path("azure_code_500.csv")  # lengths only: negative (unique) ids


def arrivals(reqs: object) -> np.ndarray:
    return np.array([r.arrival_s for r in reqs])  # type: ignore[attr-defined]


def same_but_time(a: Request, b: Request) -> bool:
    return (a.index, a.input_len, a.output_len, a.block_hashes, a.token_ids, a.session_id,
            a.tenant) == (b.index, b.input_len, b.output_len, b.block_hashes, b.token_ids,
                          b.session_id, b.tenant)  # fmt: skip


# -- rate scaling -----------------------------------------------------------------------


def test_rate_scale_2_halves_every_gap_exactly() -> None:
    tr = open_trace(CONV)
    t = arrivals(tr)
    fast = list(rate_scale(tr, 2))
    assert np.array_equal(np.diff(arrivals(fast)), np.diff(t) / 2)  # bit for bit
    assert np.array_equal(arrivals(fast), t / 2)
    assert all(same_but_time(a, b) for a, b in zip(fast, tr, strict=True))
    slow = list(rate_scale(tr, 0.5))
    assert np.array_equal(np.diff(arrivals(slow)), np.diff(t) * 2)
    assert trace_stats(fast, reuse=False).arrival_rate == 2 * trace_stats(tr).arrival_rate


@settings(max_examples=60, deadline=None)
@given(
    # real times are 0 or far above the subnormals (< 2.2e-308), where halving is not exact
    times=st.lists(st.just(0.0) | st.floats(1e-9, 1e6), min_size=1, max_size=40).map(sorted),
    x=st.floats(1e-3, 1e3),
)
def test_rate_scale_divides_each_time_once(times: list[float], x: float) -> None:
    times = [t - times[0] for t in times]
    reqs = [Request(i, t, 1, 1) for i, t in enumerate(times)]
    out = list(rate_scale(reqs, x))
    assert [r.arrival_s for r in out] == [t / x for t in times]  # not a sum of scaled gaps
    assert out[0].arrival_s == 0.0 and arrivals(out).tolist() == sorted(arrivals(out).tolist())
    twice = list(rate_scale(reqs, 2 * x))  # powers of two commute exactly
    assert [r.arrival_s for r in twice] == [r.arrival_s / 2 for r in out]


# -- bounds -----------------------------------------------------------------------------


def counting(reqs: list[Request], seen: list[int]) -> Iterator[Request]:
    for r in reqs:
        seen.append(r.index)
        yield r


def test_bound_duration_is_half_open_and_reads_no_further() -> None:
    reqs = [Request(i, t, 1, 1) for i, t in enumerate([0.0, 1.0, 1.0, 2.0, 2.5, 9.0])]
    seen: list[int] = []
    out = list(bound(counting(reqs, seen), duration_s=2.0))
    assert [r.index for r in out] == [0, 1, 2] and seen == [0, 1, 2, 3]  # stopped at 2.0
    assert list(bound(reqs, duration_s=0)) == []
    assert list(bound(reqs, duration_s=100)) == reqs
    seen.clear()
    assert [r.index for r in bound(counting(reqs, seen), limit=2)] == [0, 1] and seen == [0, 1]
    assert list(bound(reqs, limit=0)) == [] and list(bound(reqs)) == reqs
    assert [r.index for r in bound(reqs, duration_s=2.6, limit=4)] == [0, 1, 2, 3]
    assert [r.index for r in bound(reqs, duration_s=2.1, limit=9)] == [0, 1, 2, 3]


def test_bound_after_rate_scale_bounds_replay_time() -> None:
    tr = open_trace(CONV)
    fast = list(bound(rate_scale(tr, 4), duration_s=30))
    assert fast == [r for r in rate_scale(tr, 4) if r.arrival_s < 30]
    assert len(fast) == sum(1 for r in tr if r.arrival_s < 120)


# -- re-timing ---------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 60),
    rate=st.floats(0.01, 1e3),
    b=st.sampled_from([1.0, 0.5, 3.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_poisson_arrivals_retime_in_order(n: int, rate: float, b: float, seed: int) -> None:
    reqs = [Request(i, 0.0, i + 1, 1, session_id=f"s{i % 3}") for i in range(n)]
    out = poisson_arrivals(reqs, rate, burstiness=b, seed=seed)
    got = list(out)
    assert arrivals(got).tolist() == arrival_times(n, rate, burstiness=b, rng=seed).tolist()
    assert all(same_but_time(a, r) for a, r in zip(got, reqs, strict=True))
    assert list(out) == got  # reading the view again draws the same times


def test_poisson_arrivals_inf_and_errors() -> None:
    reqs = multi_turn(3, 2)
    assert {r.arrival_s for r in poisson_arrivals(reqs, math.inf)} == {0.0}
    with pytest.raises(ValueError, match="rate must be a number > 0"):
        poisson_arrivals(reqs, 0)
    with pytest.raises(ValueError, match="burstiness must be"):
        poisson_arrivals(reqs, 1.0, burstiness=-1)
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="rate scale must be a finite number > 0"):
            rate_scale(reqs, bad)
    with pytest.raises(ValueError, match="duration must be a finite number >= 0"):
        bound(reqs, duration_s=-1)
    with pytest.raises(ValueError, match="limit must be an integer >= 0"):
        bound(reqs, limit=1.5)  # type: ignore[arg-type]


# -- repetition ---------------------------------------------------------------------------


def test_repeat_shifts_by_span_plus_mean_gap_with_fresh_ids() -> None:
    tr = open_trace(CONV)
    one = list(tr)
    n, span = len(one), one[-1].arrival_s
    gap = span / (n - 1)
    out = list(repeat(tr, 3))
    assert len(out) == 3 * n and [r.index for r in out] == list(range(3 * n))
    assert out[:n] == one
    hi = max(max(r.block_hashes) for r in one)
    for k in (1, 2):
        for a, r in zip(out[k * n : (k + 1) * n], one, strict=True):
            assert a.arrival_s == r.arrival_s + k * (span + gap)
            assert a.block_hashes == tuple(h + k * (hi + 1) for h in r.block_hashes)
            assert (a.input_len, a.output_len) == (r.input_len, r.output_len)
    t = arrivals(out)
    assert np.all(np.diff(t) >= 0) and t[n] - t[n - 1] == pytest.approx(gap)
    s1, s3 = trace_stats(one, reuse=False), trace_stats(out, reuse=False)
    assert s3.unique_blocks == 3 * s1.unique_blocks  # copies share nothing
    assert s3.token_hit_ceiling == pytest.approx(s1.token_hit_ceiling)
    shared = trace_stats(repeat(tr, 3, share_ids=True), reuse=False)
    assert shared.unique_blocks == s1.unique_blocks  # the same prompts again: all hits


def test_repeat_sessions_negative_ids_and_gap() -> None:
    reqs = multi_turn(2, 2, think_time_s=1.0)
    out = list(repeat(reqs, 2, gap_s=0.0))
    assert [r.session_id for r in out[4:]] == [f"{r.session_id}#1" for r in reqs]
    assert out[4].arrival_s == reqs[-1].arrival_s  # gap 0: the next copy starts at once
    az = list(open_trace(AZURE, block_tokens=64))
    lo = min(min(r.block_hashes) for r in az)
    twice = list(repeat(az, 2))
    ids = [h for r in twice for h in r.block_hashes]
    assert len(set(ids)) == len(ids) and max(ids) < 0  # unique and still negative
    assert twice[len(az)].block_hashes[0] == az[0].block_hashes[0] + lo
    alone = [Request(0, 0.0, 3, 1, (7,))]
    assert list(repeat(alone, 1)) == alone
    assert [r.arrival_s for r in repeat(alone, 3, gap_s=2.5)] == [0.0, 2.5, 5.0]
    with pytest.raises(ValueError, match="no mean gap"):
        list(repeat(alone, 2))


def test_repeat_needs_a_trace_it_can_read_again() -> None:
    reqs = multi_turn(2, 2)
    with pytest.raises(ValueError, match="read again"):
        repeat(iter(reqs), 2)
    with pytest.raises(ValueError, match="read again"):
        repeat(rate_scale(iter(reqs), 2), 2)  # a view of a one-shot iterator is one-shot too
    with pytest.raises(ValueError, match="copies must be an integer >= 1"):
        repeat(reqs, 0)
    with pytest.raises(ValueError, match="gap must be a finite number >= 0"):
        repeat(reqs, 2, gap_s=-1)


def test_views_compose_and_carry_block_size(tmp_path: Path) -> None:
    tr = open_trace(AZURE, block_tokens=16)
    view = bound(repeat(rate_scale(tr, 8), 4), limit=1500)
    assert view.block_tokens == 16  # statistics of the view read its ids at the trace's size
    got = list(view)
    assert got == list(view) and len(got) == 1500
    direct = list(itertools.islice(repeat([_fast(r) for r in tr], 4), 1500))
    assert got == direct
    out = tmp_path / "x.jsonl"
    write_generic(view, out, block_tokens=16)
    # the copies' unique ids are the ones a reader gives the concatenated file's blocks
    assert list(open_trace(out)) == got


def _fast(r: Request) -> Request:
    return Request(r.index, r.arrival_s / 8, r.input_len, r.output_len, r.block_hashes)


record = st.fixed_dictionaries(
    {"gap": st.floats(0, 100, allow_nan=False), "n": st.integers(0, 40), "out": st.integers(0, 9)},
    optional={"fam": st.integers(0, 3), "session": st.sampled_from(["a", "b", "7"])},
)


@settings(max_examples=40, deadline=None)
@given(
    records=st.lists(record, min_size=2, max_size=25),
    x=st.floats(0.01, 100),
    copies=st.integers(1, 3),
    limit=st.none() | st.integers(0, 60),
)
def test_reshaped_traces_survive_the_generic_parser(
    tmp_path_factory: pytest.TempPathFactory,
    records: list[dict],
    x: float,
    copies: int,
    limit: int | None,
) -> None:
    # a source written and parsed like any trace (lengths-only records get the loader's
    # negative ids), reshaped, written again: the parser must read back exactly the view
    d = tmp_path_factory.mktemp("rt")
    t, lines = 0.0, [{"kvflow_trace": 1, "block_tokens": 4}]
    for rec in records:
        t += rec["gap"]
        line = {"arrival_s": t, "input_length": rec["n"], "output_length": rec["out"]}
        if "fam" in rec:  # prefix-chained ids shared by a family
            line["hash_ids"] = [rec["fam"] * 100 + k for k in range(-(-rec["n"] // 4))]
        if "session" in rec:
            line["session_id"] = rec["session"]
        lines.append(line)
    src = d / "src.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    view = bound(rate_scale(repeat(open_trace(src), copies), x), limit=limit)
    out = d / "out.jsonl"
    write_generic(view, out, block_tokens=4)
    assert list(open_trace(out)) == list(view)
