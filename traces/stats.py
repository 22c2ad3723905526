"""What a trace offers a KV cache, before any cache is simulated.

The numbers here bound every replay: no policy beats the infinite-cache hit
ceiling, and the reuse-distance distribution says how large an LRU tier must
be to approach it (an access hits an LRU cache of ``C`` blocks exactly when
fewer than ``C`` distinct other blocks were touched since its last use). The
offline optimum's curve (Belady's MIN, ``traces.optimum``) is the tighter
bound at each capacity: no eviction policy with ``C`` blocks hits more.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from traces.ceiling import InfiniteCache
from traces.loaders import Trace
from traces.optimum import optimum_curve
from traces.schema import DEFAULT_BLOCK_TOKENS, Request

__all__ = ["Summary", "TraceStats", "reuse_distances", "summarize", "trace_stats"]


@dataclass(frozen=True)
class Summary:
    """Count, total, mean, min, percentiles (linear interpolation) and max of a sample."""

    count: int
    total: float
    mean: float
    min: float
    p50: float
    p90: float
    p99: float
    max: float


def summarize(values: Iterable[float] | np.ndarray) -> Summary:
    """:class:`Summary` of ``values`` (all zeros for an empty sample)."""
    a = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64)
    if a.size == 0:
        return Summary(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return Summary(
        int(a.size),
        float(a.sum()),
        float(a.mean()),
        float(a.min()),
        float(p50),
        float(p90),
        float(p99),
        float(a.max()),
    )


@dataclass(frozen=True)
class TraceStats:
    """Statistics of one trace; ``to_dict()`` is what ``kvflow trace stats --json`` prints."""

    requests: int
    duration_s: float
    """Last arrival minus first."""
    arrival_rate: float | None
    """Requests per second, ``(requests - 1) / duration_s`` (1 / mean gap); None if no span."""
    interarrival_cv: float | None
    """Std / mean of the gaps between arrivals: 1 for Poisson, > 1 bursty."""
    block_tokens: int
    input_len: Summary
    output_len: Summary
    total_blocks: int
    """Block accesses: the sum over requests of their prompt blocks."""
    unique_blocks: int
    block_hit_ceiling: float
    """Hit ratio of an infinite cache, in blocks: 1 - unique / total."""
    token_hit_ceiling: float
    """The same in prompt tokens (a partial last block counts its own tokens)."""
    blocks_used_once: float
    """Fraction of distinct blocks accessed exactly once (never worth caching)."""
    reuse_distance: Summary | None
    """LRU stack distance of each re-access, in distinct blocks; None if not computed."""
    reuse_histogram: list[tuple[int, int]] = field(default_factory=list)
    """(``upper``, re-accesses with ``upper/2 <= d < upper``); ``upper`` 1 holds d == 0."""
    lru_hit_curve: list[tuple[int, float]] = field(default_factory=list)
    """(capacity in blocks, hit ratio of an LRU cache that large), powers of two."""
    optimum_hit_curve: list[tuple[int, float]] = field(default_factory=list)
    """(capacity in blocks, hit ratio of the offline optimum that large: Belady's MIN
    in kvflow's request model, ``traces.optimum``), powers of two; empty if not computed."""
    sessions: int = 0
    tenants: int = 0
    skipped: int = 0
    """Bad lines the loader passed over (``skip_bad``)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["reuse_histogram"] = [list(x) for x in self.reuse_histogram]
        d["lru_hit_curve"] = [list(x) for x in self.lru_hit_curve]
        d["optimum_hit_curve"] = [list(x) for x in self.optimum_hit_curve]
        return d


def reuse_distances(accesses: list[Any]) -> np.ndarray:
    """LRU stack distance of every re-access in ``accesses`` (first accesses are skipped).

    The distance is the number of distinct *other* blocks touched since the
    block's previous access. A Fenwick tree over access positions marks each
    block's latest position; the distance is the count of marks strictly
    between the previous and the current access. O(n log n), ~0.7 s for the
    290k block accesses of the Mooncake conversation trace.
    """
    n = len(accesses)
    tree = [0] * (n + 1)
    last: dict[Any, int] = {}
    out: list[int] = []
    push = out.append
    for t, h in enumerate(accesses):
        p = last.get(h)
        if p is not None:
            # marks in (p, t) = prefix(t) - prefix(p + 1); position i is tree index i + 1
            s = 0
            i = t
            while i > 0:
                s += tree[i]
                i &= i - 1
            i = p + 1
            while i > 0:
                s -= tree[i]
                i &= i - 1
            push(s)
            i = p + 1
            while i <= n:
                tree[i] -= 1
                i += i & -i
        i = t + 1
        while i <= n:
            tree[i] += 1
            i += i & -i
        last[h] = t
    return np.asarray(out, dtype=np.int64)


def trace_stats(
    source: Trace | Iterable[Request],
    block_tokens: int | None = None,
    *,
    reuse: bool = True,
    optimum: bool = True,
) -> TraceStats:
    """Statistics of a trace (a :class:`Trace`, streamed once, or any iterable of requests).

    ``block_tokens`` defaults to the trace's own (512 for a plain iterable).
    Requests that carry token ids instead of hashes are chained here with
    exact prefix ids; requests with neither count as all-unique blocks.
    ``reuse=False`` skips the reuse-distance pass (n log n); ``optimum=False`` the
    offline optimum's curve (one Belady pass per capacity, ~3 s for the 12k-request
    Mooncake conversation trace).
    """
    if isinstance(source, Trace):
        bt = source.block_tokens
        if block_tokens is not None and block_tokens != bt:
            raise ValueError(
                f"{source.path} has {bt}-token blocks; block_tokens={block_tokens} "
                "would misread its ids (pass block_tokens to open_trace instead)"
            )
    else:
        bt = DEFAULT_BLOCK_TOKENS if block_tokens is None else block_tokens
    if type(bt) is not int or bt <= 0:
        raise ValueError(f"block_tokens must be a positive integer, got {bt!r}")

    arrivals: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    accesses: list[Any] = []
    per_request: list[list[Any]] = []
    sessions: set[str] = set()
    tenants: set[str] = set()
    counts: Counter[Any] = Counter()
    hit_tokens = 0
    cache = InfiniteCache(bt)

    for r in source:
        arrivals.append(r.arrival_s)
        inputs.append(r.input_len)
        outputs.append(r.output_len)
        if r.session_id is not None:
            sessions.add(r.session_id)
        if r.tenant is not None:
            tenants.add(r.tenant)
        ids = list(cache.ids(r))
        hit_tokens += cache.admit(r, ids)
        accesses.extend(ids)
        per_request.append(ids)
        counts.update(ids)

    n_req = len(arrivals)
    t = np.asarray(arrivals, dtype=np.float64)
    duration = float(t.max() - t.min()) if n_req else 0.0
    gaps = np.diff(t)
    rate = (n_req - 1) / duration if duration > 0 else None
    cv = float(gaps.std() / gaps.mean()) if gaps.size and gaps.mean() > 0 else None
    total_blocks = len(accesses)
    unique_blocks = len(counts)
    total_tokens = sum(inputs)

    dist: Summary | None = None
    histogram: list[tuple[int, int]] = []
    curve: list[tuple[int, float]] = []
    if reuse:
        # nothing is ever re-used (Azure): skip the n log n pass
        d = reuse_distances(accesses) if unique_blocks < total_blocks else np.zeros(0, np.int64)
        dist = summarize(d)
        if d.size:
            buckets = np.zeros(d.size, dtype=np.int64)
            nz = d > 0
            buckets[nz] = np.floor(np.log2(d[nz])).astype(np.int64) + 1
            hist = np.bincount(buckets)
            histogram = [(1 << k, int(c)) for k, c in enumerate(hist)]
        cum = np.cumsum([c for _, c in histogram]) if histogram else np.zeros(0)
        k = 0
        while total_blocks:
            hits = int(cum[min(k, cum.size - 1)]) if cum.size else 0
            curve.append((1 << k, hits / total_blocks))
            if (1 << k) >= unique_blocks:
                break
            k += 1

    opt_curve: list[tuple[int, float]] = []
    if optimum and total_blocks:
        caps = [1]
        while caps[-1] < unique_blocks:
            caps.append(caps[-1] * 2)
        ceiling = total_blocks - unique_blocks
        opt_curve = [(c, h / total_blocks)
                     for c, h in optimum_curve(per_request, caps, ceiling=ceiling)]

    return TraceStats(
        requests=n_req,
        duration_s=duration,
        arrival_rate=rate,
        interarrival_cv=cv,
        block_tokens=bt,
        input_len=summarize(inputs),
        output_len=summarize(outputs),
        total_blocks=total_blocks,
        unique_blocks=unique_blocks,
        block_hit_ceiling=(total_blocks - unique_blocks) / total_blocks if total_blocks else 0.0,
        token_hit_ceiling=hit_tokens / total_tokens if total_tokens else 0.0,
        blocks_used_once=(
            sum(1 for c in counts.values() if c == 1) / unique_blocks if unique_blocks else 0.0
        ),
        reuse_distance=dist,
        reuse_histogram=histogram,
        lru_hit_curve=curve,
        optimum_hit_curve=opt_curve,
        sessions=len(sessions),
        tenants=len(tenants),
        skipped=source.skipped if isinstance(source, Trace) else 0,
    )
