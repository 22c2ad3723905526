"""Offered load: what a trace asks of a cluster per second, before any cluster is chosen.

A replay's latencies mean nothing until they are read against the load: a
trace offered at three times what a configuration can prefill makes TTFT a
queueing time that grows with the trace's length. :func:`offered_load` gives
the arrival side of that comparison (the cost model gives the capacity side):
requests, prompt tokens and output tokens per second, overall and at the
busiest window, and the *new* prompt tokens per second, those not in any
earlier prompt, which even an infinite cache must prefill.

Rates are per mean arrival gap: over a span ``T`` between the first and the
last of ``n`` arrivals, ``requests/s = (n - 1) / T`` (the ``arrival_rate`` of
:func:`traces.stats.trace_stats`, and the ``rate`` a Poisson trace was made
at), and each token rate is that times the mean tokens per request. The
peaks are the most arriving in any window ``[t, t + window_s)`` starting at
an arrival, divided by ``window_s``; each is maximised on its own (the
busiest window for requests need not be the busiest for tokens).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from traces.ceiling import InfiniteCache
from traces.loaders import Trace
from traces.schema import DEFAULT_BLOCK_TOKENS, Request

__all__ = ["OfferedLoad", "offered_load"]


@dataclass(frozen=True)
class OfferedLoad:
    """The arrival side of a utilisation; ``to_dict()`` is ``kvflow trace load --json``.

    Rates are ``None`` when undefined (fewer than two requests) and ``inf``
    when every request arrives at the same instant; peaks are ``None`` when
    the trace spans less than one window.
    """

    requests: int
    span_s: float
    """Last arrival minus first."""
    window_s: float
    block_tokens: int
    prompt_tokens: int
    """Total over the trace (likewise the next two)."""
    new_prompt_tokens: int
    """Prompt tokens no earlier prompt had (infinite-cache misses): the least prefill work."""
    output_tokens: int
    request_rate: float | None
    prompt_tokens_rate: float | None
    new_prompt_tokens_rate: float | None
    output_tokens_rate: float | None
    peak_request_rate: float | None
    peak_prompt_tokens_rate: float | None
    peak_new_prompt_tokens_rate: float | None

    @property
    def new_token_fraction(self) -> float:
        """New prompt tokens over all prompt tokens (1 - the token hit ceiling)."""
        return self.new_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "new_token_fraction": self.new_token_fraction}


def _peak(t: np.ndarray, values: np.ndarray, window: float) -> float:
    """Largest sum of ``values`` over arrivals in ``[t_i, t_i + window)``, per second."""
    cum = np.concatenate(([0], np.cumsum(values)))
    ends = np.searchsorted(t, t + window, side="left")
    return float((cum[ends] - cum[: t.size]).max() / window)


def offered_load(
    source: Trace | Iterable[Request],
    *,
    block_tokens: int | None = None,
    window_s: float = 60.0,
) -> OfferedLoad:
    """Offered load of a trace, streamed once.

    ``block_tokens`` (default: that of a :class:`Trace` or a view of one,
    else 512) only matters for the new prompt tokens, counted exactly as the
    token hit ceiling of :func:`traces.stats.trace_stats` counts hits. Holds
    three numbers per request and, for the new tokens, the set of distinct
    block ids (as the hit ceiling does: ~1.5M ids, ~100 MB, for the
    conversation trace repeated 8 times with fresh ids).
    """
    own = getattr(source, "block_tokens", None)  # a Trace's, or a reshaped view's
    if own is not None and block_tokens is not None and block_tokens != own:
        name = source.path if isinstance(source, Trace) else "the trace"
        raise ValueError(
            f"{name} has {own}-token blocks; block_tokens={block_tokens} would misread its ids"
        )
    bt = block_tokens or own or DEFAULT_BLOCK_TOKENS
    ok = isinstance(window_s, (int, float)) and not isinstance(window_s, bool)
    if not ok or not math.isfinite(window_s) or window_s <= 0:
        raise ValueError(f"window must be a finite number > 0, got {window_s!r}")
    cache = InfiniteCache(bt)
    arrivals = array("d")
    prompt = array("q")
    new = array("q")
    output_tokens = 0
    for r in source:
        arrivals.append(r.arrival_s)
        prompt.append(r.input_len)
        new.append(r.input_len - cache.admit(r))
        output_tokens += r.output_len
    n = len(arrivals)
    t = np.frombuffer(arrivals, dtype=np.float64)
    p = np.frombuffer(prompt, dtype=np.int64)
    w = np.frombuffer(new, dtype=np.int64)
    back = np.flatnonzero(np.diff(t) < 0)
    if back.size:
        i = int(back[0]) + 1
        raise ValueError(f"request {i}: arrival {t[i]} s is before the previous one ({t[i - 1]} s)")
    span = float(t[-1] - t[0]) if n else 0.0
    total_p, total_new = int(p.sum()), int(w.sum())

    rate: float | None = None
    if n >= 2:
        rate = (n - 1) / span if span > 0 else math.inf

    def per_s(total: int) -> float | None:
        if rate is None:
            return None
        if total == 0:  # nothing to do, however fast it arrives (inf * 0 would be nan)
            return 0.0
        return math.inf if math.isinf(rate) else rate * total / n

    peaks: list[float | None] = [None, None, None]
    if n >= 2 and span >= window_s:
        peaks = [_peak(t, v, float(window_s)) for v in (np.ones(n, np.int64), p, w)]
    return OfferedLoad(
        requests=n,
        span_s=span,
        window_s=float(window_s),
        block_tokens=bt,
        prompt_tokens=total_p,
        new_prompt_tokens=total_new,
        output_tokens=output_tokens,
        request_rate=rate,
        prompt_tokens_rate=per_s(total_p),
        new_prompt_tokens_rate=per_s(total_new),
        output_tokens_rate=per_s(output_tokens),
        peak_request_rate=peaks[0],
        peak_prompt_tokens_rate=peaks[1],
        peak_new_prompt_tokens_rate=peaks[2],
    )
