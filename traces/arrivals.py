"""Seeded arrival processes: Poisson, or gamma renewals with a burstiness knob.

Serving benchmarks describe load as a request rate and a burstiness; kvflow
uses the same knob as SGLang's and vLLM's ``bench_serving`` so that a load
quoted for one reads the same here. Gaps between arrivals are independent
gamma draws with shape ``burstiness`` and mean ``1 / rate``: ``burstiness = 1``
is a Poisson process (exponential gaps), below 1 is burstier (the gaps'
coefficient of variation is ``1 / sqrt(burstiness)``), above 1 smoother. A rate
of ``inf`` sends every request at time 0, as ``bench_serving``'s default does.
The first arrival is always at 0 (``bench_serving`` sends its first request at
once and sleeps after it).

:func:`arrival_times` draws ``n`` arrivals at once; :func:`iter_arrival_times`
streams them for traces of unknown length and yields exactly the same floats.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["arrival_times", "check_burstiness", "check_rate", "iter_arrival_times", "rng_from"]

#: Gaps drawn per batch when streaming (any size gives the same arrivals).
_CHUNK = 4096


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_rate(rate: Any, name: str = "rate") -> float:
    """``rate`` as a float: a number > 0, ``inf`` allowed (everything at time 0)."""
    if not _number(rate) or math.isnan(rate) or rate <= 0:
        raise ValueError(f"{name} must be a number > 0 (inf: all at time 0), got {rate!r}")
    return float(rate)


def check_burstiness(burstiness: Any) -> float:
    """``burstiness`` as a float: finite and > 0 (1 = Poisson)."""
    if not _number(burstiness) or not math.isfinite(burstiness) or burstiness <= 0:
        raise ValueError(
            f"burstiness must be a finite number > 0 (1 = Poisson), got {burstiness!r}"
        )
    return float(burstiness)


def rng_from(rng: np.random.Generator | int | None) -> np.random.Generator:
    """A generator as given, or a fresh one seeded with ``rng``."""
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def _gaps(gen: np.random.Generator, n: int, rate: float, burstiness: float) -> np.ndarray:
    if burstiness == 1.0:  # exponential draws: the Poisson process, bit for bit
        return gen.exponential(1.0 / rate, n)
    return gen.gamma(burstiness, 1.0 / (rate * burstiness), n)


def arrival_times(
    n: int,
    rate: float,
    *,
    burstiness: float = 1.0,
    rng: np.random.Generator | int | None = 0,
) -> np.ndarray:
    """``n`` arrival times in seconds (first at 0) at mean rate ``rate`` per second.

    Gaps are ``gamma(shape=burstiness, scale=1/(rate*burstiness))``, exponential
    when ``burstiness == 1``; ``rate = inf`` gives ``n`` zeros and draws nothing.
    ``rng`` is a seed or a generator to draw from (advanced by ``n - 1`` gaps).
    """
    if type(n) is not int or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    rate = check_rate(rate)
    burstiness = check_burstiness(burstiness)
    gen = rng_from(rng)
    if n == 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    return np.concatenate(([0.0], np.cumsum(_gaps(gen, n - 1, rate, burstiness))))


def iter_arrival_times(
    rate: float,
    *,
    burstiness: float = 1.0,
    rng: np.random.Generator | int | None = 0,
) -> Iterator[float]:
    """Endless arrival times, equal float for float to :func:`arrival_times` with the same seed.

    For streaming a trace of unknown length through new arrivals: gaps are
    drawn in batches and summed left to right, the order ``np.cumsum`` uses.
    """
    return _stream(check_rate(rate), check_burstiness(burstiness), rng_from(rng))


def _stream(rate: float, burstiness: float, gen: np.random.Generator) -> Iterator[float]:
    t = 0.0
    yield t
    if math.isinf(rate):
        while True:
            yield 0.0
    while True:
        for gap in _gaps(gen, _CHUNK, rate, burstiness).tolist():
            t += gap
            yield t
