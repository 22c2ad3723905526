"""Change a trace's load without changing its requests: scale, bound, re-time, repeat.

Every public trace was served by a cluster; replaying it against a smaller or
larger one means offering it faster or slower, shorter, or longer. These are
the transformations the replay driver applies (``--rate-scale``,
``--duration``, ``--limit``, ``--rate``) and ``kvflow trace scale`` writes
out. They are lazy views that stream: each holds O(1) requests however long
the trace, and a view of something readable more than once (a list, a
:class:`~traces.loaders.Trace`, another view) can be read more than once
too, so they compose in any order (``repeat(rate_scale(trace, 8), 8)``).
Arrivals keep the schema's contract (never decreasing, first at 0 when the
source's is) and a well-indexed source stays indexed 0, 1, 2, ...
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from traces.arrivals import check_burstiness, check_rate, iter_arrival_times
from traces.schema import Request

__all__ = ["Reshaped", "bound", "poisson_arrivals", "rate_scale", "repeat"]


class Reshaped:
    """A lazy view of ``source``: each iteration applies ``fn`` to a fresh iteration of it.

    ``block_tokens`` passes the source's block size on (a Trace's), so that
    statistics of the view read its ids right.
    """

    __slots__ = ("_fn", "_source", "block_tokens")

    def __init__(
        self, source: Iterable[Request], fn: Callable[[Iterator[Request]], Iterator[Request]]
    ) -> None:
        self._source = source
        self._fn = fn
        self.block_tokens: int | None = getattr(source, "block_tokens", None)

    def __iter__(self) -> Iterator[Request]:
        return self._fn(iter(self._source))

    @property
    def reiterable(self) -> bool:
        """Whether iterating again reads the source again (False over a one-shot iterator)."""
        return reiterable(self._source)


def reiterable(source: Iterable[Any]) -> bool:
    """Whether ``source`` yields its items again when iterated again."""
    if isinstance(source, Reshaped):
        return source.reiterable
    return iter(source) is not source


def _finite_pos(name: str, value: Any, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        what = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def _at(r: Request, arrival_s: float) -> Request:
    return Request(
        r.index, arrival_s, r.input_len, r.output_len, r.block_hashes, r.token_ids,
        r.session_id, r.tenant,
    )  # fmt: skip


def rate_scale(requests: Iterable[Request], factor: float) -> Reshaped:
    """Offer ``requests`` ``factor`` times faster: every arrival divided by ``factor``.

    Each time is divided once (not rebuilt from gaps), so at ``factor = 2``
    every arrival, and so every gap between two of them, is exactly half the
    original (dividing by a power of two is exact in binary floating point,
    for any time above 1e-300 s); other factors are within one rounding of
    the ideal. ``factor < 1`` slows
    the trace down.
    """
    x = _finite_pos("rate scale", factor)
    return Reshaped(requests, lambda it: (_at(r, r.arrival_s / x) for r in it))


def bound(
    requests: Iterable[Request], *, duration_s: float | None = None, limit: int | None = None
) -> Reshaped:
    """The requests arriving before ``duration_s`` seconds, and at most ``limit`` of them.

    Arrivals never decrease, so reading stops at the first request past the
    bound: bounding the start of a long trace costs only that start.
    ``duration_s`` is measured on the trace as given (apply it after
    :func:`rate_scale` to bound the replay's own time).
    """
    d = None if duration_s is None else _finite_pos("duration", duration_s, allow_zero=True)
    if limit is not None and (type(limit) is not int or limit < 0):
        raise ValueError(f"limit must be an integer >= 0, got {limit!r}")
    return Reshaped(requests, lambda it: _bound(it, d, limit))


def _bound(requests: Iterator[Request], d: float | None, limit: int | None) -> Iterator[Request]:
    if limit == 0:
        return
    for count, r in enumerate(requests, 1):
        if d is not None and r.arrival_s >= d:
            return
        yield r
        if count == limit:
            return


def poisson_arrivals(
    requests: Iterable[Request],
    rate: float,
    *,
    burstiness: float = 1.0,
    seed: int | None = 0,
) -> Reshaped:
    """``requests`` in their order, re-timed as a Poisson process at ``rate`` per second.

    For traces without meaningful timestamps (a dataset of prompts, a trace
    whose times were lost). ``burstiness`` other than 1 gives gamma gaps of
    the same mean, as ``bench_serving`` does; ``rate = inf`` puts every
    request at 0; the same seed gives the same times on every iteration
    (:func:`traces.arrivals.iter_arrival_times`). The requests' own order is
    kept, so a multi-turn trace stays in order, but its think times are lost;
    to keep them, use :func:`rate_scale`.
    """
    r_, b_ = check_rate(rate), check_burstiness(burstiness)

    def retime(it: Iterator[Request]) -> Iterator[Request]:
        times = iter_arrival_times(r_, burstiness=b_, rng=seed)
        return (_at(r, t) for r, t in zip(it, times, strict=False))  # times never end

    return Reshaped(requests, retime)


def repeat(
    requests: Iterable[Request],
    copies: int,
    *,
    gap_s: float | None = None,
    share_ids: bool = False,
) -> Reshaped:
    """The trace ``copies`` times, each copy starting ``gap_s`` after the last one's last arrival.

    For scale tests on traces longer than any published one (12,031 requests
    at 8x their rate, eight times over, make ~100k). ``requests`` must be
    readable more than once (a list, a :class:`~traces.loaders.Trace`, a view
    of one): copy ``k`` reads it again, so memory stays flat. ``gap_s``
    defaults to the trace's mean gap between arrivals, so the seam looks like
    the rest of the trace.

    Copy ``k`` shifts every arrival by ``k * (last arrival + gap_s)``, renames
    sessions ``"<id>#<k>"`` (a copy is other users) and, unless ``share_ids``,
    moves its block ids to a range of their own: non-negative id ``h`` becomes
    ``h + k * (max id + 1)`` and negative (unique) id ``h`` becomes
    ``h + k * min id``, so copies share nothing, as a trace's next hour shares
    nothing with its first. With ``share_ids`` every copy is the same prompts
    again. Requests carrying only ``token_ids`` repeat their tokens: whoever
    hashes them sees the copies share blocks whatever ``share_ids`` says.
    """
    if type(copies) is not int or copies < 1:
        raise ValueError(f"copies must be an integer >= 1, got {copies!r}")
    gap = None if gap_s is None else _finite_pos("gap", gap_s, allow_zero=True)
    if not reiterable(requests):
        raise ValueError(
            "repeat needs a trace it can read again (a list, an open_trace() Trace or a "
            "view of one), not a one-shot iterator"
        )
    return Reshaped(requests, lambda _: _repeat(requests, copies, gap, share_ids))


def _repeat(
    requests: Iterable[Request], copies: int, gap: float | None, share_ids: bool
) -> Iterator[Request]:
    n = 0
    first = last = 0.0
    hi = -1  # largest non-negative id
    lo = 0  # smallest negative id
    for r in requests:
        yield r if r.index == n else Request(n, *_fields(r))
        if n == 0:
            first = r.arrival_s
        n += 1
        last = r.arrival_s
        ids = r.block_hashes
        if ids:
            hi = max(hi, max(ids))
            lo = min(lo, min(ids))
    if copies == 1 or n == 0:
        return
    if gap is None:
        if n < 2:
            raise ValueError("a one-request trace has no mean gap: pass gap_s to repeat it")
        gap = (last - first) / (n - 1)
    shift = last - first + gap
    for k in range(1, copies):
        up, down = k * (hi + 1), k * lo
        offset = k * shift
        for i, r in enumerate(requests):
            ids = r.block_hashes
            if ids is not None and not share_ids:
                ids = tuple(h + up if h >= 0 else h + down for h in ids)
            session = None if r.session_id is None else f"{r.session_id}#{k}"
            yield Request(
                k * n + i, r.arrival_s + offset, r.input_len, r.output_len, ids,
                r.token_ids, session, r.tenant,
            )  # fmt: skip


def _fields(r: Request) -> tuple[Any, ...]:
    """Everything but the index, in the constructor's order."""
    return (
        r.arrival_s, r.input_len, r.output_len, r.block_hashes, r.token_ids, r.session_id,
        r.tenant,
    )  # fmt: skip
