"""Offered load: exact figures on a hand-built trace, agreement with the statistics, edges."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces import Request, open_trace, sample_path
from traces.generate import shared_prefix, tool_agent
from traces.load import offered_load
from traces.reshape import rate_scale
from traces.stats import trace_stats

# 4-token blocks. new tokens: r0 all 10; r1 hits block 0 (4) -> 2 new; r2 hits 0, 1 (8) -> 1 new
# (its last block holds 1 token); r3 is lengths-only -> 4 new.
HAND = [
    Request(0, 0.0, 10, 5, (0, 1, 2)),
    Request(1, 1.0, 6, 1, (0, 3)),
    Request(2, 3.0, 9, 2, (0, 1, 4)),
    Request(3, 4.0, 4, 0),
]


def test_hand_built_trace() -> None:
    o = offered_load(HAND, block_tokens=4, window_s=2.0)
    assert (o.requests, o.span_s, o.prompt_tokens, o.new_prompt_tokens, o.output_tokens) == (
        4, 4.0, 29, 17, 8,
    )  # fmt: skip
    assert o.request_rate == 3 / 4  # (n - 1) / span: one request per mean gap
    assert o.prompt_tokens_rate == 0.75 * 29 / 4
    assert o.new_prompt_tokens_rate == 0.75 * 17 / 4
    assert o.output_tokens_rate == 0.75 * 8 / 4
    # windows [0, 2): r0, r1 (16 tokens, 12 new); [3, 5): r2, r3 (13 tokens, 5 new)
    assert (o.peak_request_rate, o.peak_prompt_tokens_rate, o.peak_new_prompt_tokens_rate) == (
        1.0, 8.0, 6.0,
    )  # fmt: skip
    assert o.new_token_fraction == 17 / 29
    d = o.to_dict()
    assert d["new_token_fraction"] == 17 / 29 and d["window_s"] == 2.0
    short = offered_load(HAND, block_tokens=4, window_s=4.5)  # the trace spans less than that
    assert short.peak_request_rate is None and short.request_rate == 0.75


def test_agrees_with_trace_stats() -> None:
    tr = open_trace(sample_path())
    o, s = offered_load(tr), trace_stats(tr, reuse=False)
    assert o.request_rate == s.arrival_rate and o.span_s == s.duration_s
    assert o.new_token_fraction == pytest.approx(1 - s.token_hit_ceiling, abs=1e-12)
    assert o.prompt_tokens == s.input_len.total and o.output_tokens == s.output_len.total
    fast = offered_load(rate_scale(tr, 2), window_s=30.0)  # twice the rate, half the window
    assert fast.request_rate == 2 * o.request_rate
    assert fast.new_prompt_tokens_rate == 2 * o.new_prompt_tokens_rate
    assert fast.peak_prompt_tokens_rate == 2 * o.peak_prompt_tokens_rate


def test_generated_shapes() -> None:
    # bench_serving's shared prefix at 4 prompts/s: 11.8% of 2,176 tokens are new
    o = offered_load(shared_prefix(rate=4.0, seed=1))
    assert o.request_rate == pytest.approx(4.0, rel=0.1)
    assert o.new_token_fraction == pytest.approx(1 - 15 / 16 * 2048 / 2176)
    assert o.prompt_tokens_rate == pytest.approx(o.request_rate * 2176)
    ta = offered_load(tool_agent(sessions=2000, seed=2))
    assert ta.request_rate == pytest.approx(2 * 11_804 / 3600, rel=0.1)  # 2 requests a session


def test_edges() -> None:
    empty = offered_load([])
    assert (empty.requests, empty.request_rate, empty.peak_request_rate) == (0, None, None)
    assert empty.new_token_fraction == 0.0
    assert offered_load(HAND[:1]).request_rate is None
    burst = offered_load([Request(i, 0.0, 8 * i, 0) for i in range(3)], block_tokens=4)
    assert burst.request_rate == math.inf and burst.prompt_tokens_rate == math.inf
    assert burst.output_tokens_rate == 0.0  # nothing to produce, however fast it arrives
    assert burst.peak_request_rate is None
    with pytest.raises(ValueError, match=r"request 2: arrival 0.5 s is before"):
        offered_load([Request(0, 0.0, 1, 1), Request(1, 1.0, 1, 1), Request(2, 0.5, 1, 1)])
    with pytest.raises(ValueError, match="window must be a finite number > 0"):
        offered_load(HAND, window_s=0)
    with pytest.raises(ValueError, match="has 512-token blocks; block_tokens=16"):
        offered_load(open_trace(sample_path()), block_tokens=16)


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.floats(0, 50, allow_nan=False),
            st.integers(0, 40),
            st.integers(0, 9),
            st.integers(0, 3),
        ),
        min_size=2,
        max_size=40,
    ),
    window=st.floats(0.5, 20),
)
def test_invariants(data: list[tuple[float, int, int, int]], window: float) -> None:
    data.sort()
    t0 = data[0][0]
    # prompts drawn from a few shared prefixes: ids chain on (family, block)
    reqs = [
        Request(i, t - t0, n, out, tuple(fam * 100 + k for k in range(-(-n // 4))))
        for i, (t, n, out, fam) in enumerate(data)
    ]
    o = offered_load(reqs, block_tokens=4, window_s=window)
    s = trace_stats(reqs, block_tokens=4, reuse=False)
    assert 0 <= o.new_prompt_tokens <= o.prompt_tokens
    assert o.new_token_fraction == pytest.approx(1 - s.token_hit_ceiling if o.prompt_tokens else 0)
    if o.peak_request_rate is not None:
        count = o.peak_request_rate * window
        assert count == pytest.approx(round(count)) and 1 <= round(count) <= len(reqs)
        assert o.peak_new_prompt_tokens_rate <= o.peak_prompt_tokens_rate + 1e-9
