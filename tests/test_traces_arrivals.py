"""Arrival processes: bench_serving's burstiness, seeded, streamed equal to batched."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from traces.arrivals import arrival_times, iter_arrival_times

rates = st.one_of(st.floats(1e-3, 1e4), st.just(math.inf))
burstiness = st.floats(0.05, 20.0)
seeds = st.integers(0, 2**32 - 1)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 300), rate=rates, b=burstiness, seed=seeds)
def test_invariants(n: int, rate: float, b: float, seed: int) -> None:
    t = arrival_times(n, rate, burstiness=b, rng=seed)
    assert t.shape == (n,) and t.dtype == np.float64
    if n:
        assert t[0] == 0.0
    assert np.all(np.diff(t) >= 0) and np.all(np.isfinite(t))
    assert np.array_equal(t, arrival_times(n, rate, burstiness=b, rng=seed))  # seeded
    if math.isinf(rate):
        assert not t.any()  # bench_serving's rate=inf: everything at time 0


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9000), rate=rates, b=st.sampled_from([1.0, 0.3, 2.0]), seed=seeds)
@example(n=8200, rate=3.0, b=1.0, seed=5)
@example(n=8200, rate=3.0, b=0.3, seed=5)
def test_streamed_equals_batched(n: int, rate: float, b: float, seed: int) -> None:
    # streaming draws gaps in batches of 4096: crossing a batch must not change a single bit
    streamed = list(itertools.islice(iter_arrival_times(rate, burstiness=b, rng=seed), n))
    assert streamed == arrival_times(n, rate, burstiness=b, rng=seed).tolist()


@pytest.mark.parametrize("b", [1.0, 0.25, 4.0])
def test_gamma_gaps_have_bench_serving_moments(b: float) -> None:
    # gamma(shape=b, scale=1/(rate*b)): mean 1/rate, coefficient of variation 1/sqrt(b)
    gaps = np.diff(arrival_times(60_000, 5.0, burstiness=b, rng=1))
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(b**-0.5, rel=0.05)


def test_poisson_is_exponential_draws() -> None:
    # burstiness 1 draws exponentials (not gamma(1)): the textbook Poisson stream of the seed
    want = np.cumsum(np.random.default_rng(3).exponential(0.5, 99))
    assert np.array_equal(arrival_times(100, 2.0, rng=3)[1:], want)
    gen = np.random.default_rng(3)
    arrival_times(10, 2.0, rng=gen)
    assert gen.exponential() == np.random.default_rng(3).exponential(size=10)[9]  # 9 drawn


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"n": 3, "rate": 0}, "rate must be a number > 0"),
        ({"n": 3, "rate": -2.0}, "rate must be a number > 0"),
        ({"n": 3, "rate": math.nan}, "rate must be a number > 0"),
        ({"n": 3, "rate": True}, "rate must be a number > 0"),
        ({"n": 3, "rate": 1.0, "burstiness": 0}, "burstiness must be a finite number > 0"),
        ({"n": 3, "rate": 1.0, "burstiness": math.inf}, "burstiness must be"),
        ({"n": -1, "rate": 1.0}, "n must be an integer >= 0"),
        ({"n": 2.0, "rate": 1.0}, "n must be an integer >= 0"),
    ],
)
def test_bad_parameters(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        arrival_times(**kwargs)
    if "n" in kwargs and kwargs["n"] == 3:
        with pytest.raises(ValueError, match=words):
            iter_arrival_times(kwargs["rate"], burstiness=kwargs.get("burstiness", 1.0))
