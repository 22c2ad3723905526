"""The best hit count any cache of a given size could reach on a trace (offline).

Belady's MIN ("A study of replacement algorithms for a virtual-storage
computer", IBM Systems Journal 5(2), 1966) evicts the block whose next use is
farthest in the future; no other choice of victims hits more. The model is
kvflow's, request by request: a request hits the leading run of its blocks
that are cached, then all its blocks must be cached at once (a block of the
running request is never a victim), and a request longer than the cache keeps
only its first ``truncate`` blocks (the rest are recomputed, never cached).
Ties go to the deeper block, so a block is never kept without its parent
(prefix closure: every request using a block uses its parent, so a parent's
next use is never later than its child's) and the leading run is every cached
block of the request.

This package imports nothing of kvflow; ``kvflow.headroom`` builds the per
tier figures on this, and ``traces.stats`` the curve over capacities.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Sequence

__all__ = ["optimum_curve", "optimum_hits"]

_DEPTH_BITS = 20  # a prompt has fewer than 2**20 blocks


def optimum_hits(requests: Sequence[Sequence[Hashable]], capacity: int,
                 truncate: int | None = None) -> int:
    """Blocks hit by Belady's MIN with ``capacity`` blocks over ``requests``.

    ``requests[i]`` are request ``i``'s block keys in prompt order (prefix-chained:
    a key stands for its whole prefix). Each request keeps its first ``truncate``
    keys (default ``capacity``; a replay truncates to the device tier). About
    0.2 s per capacity for the 290k block accesses of the Mooncake conversation
    trace: one pass backwards for next uses, one forwards with a heap of the
    cached blocks by next use (blocks never used again are evicted first, from
    a queue, without the heap).
    """
    if capacity <= 0:
        return 0
    cut = capacity if truncate is None else min(truncate, capacity)
    reqs = [r[:cut] for r in requests]
    n = len(reqs)
    # Next use of each access (-1: never again), by a backward pass.
    last: dict[Hashable, int] = {}
    nexts: list[list[int]] = [[]] * n
    for i in range(n - 1, -1, -1):
        keys = reqs[i]
        get = last.get
        nexts[i] = [get(k, -1) for k in keys]
        for k in keys:
            last[k] = i
    cache: dict[Hashable, int] = {}  # key -> its next use
    dead: deque[Hashable] = deque()  # cached keys never used again, oldest first
    heap: list[tuple[int, int, Hashable]] = []  # (-(next use, depth), seq, key)
    hits = seq = 0
    for i in range(n):
        keys = reqs[i]
        for k in keys:
            if k in cache:
                hits += 1
            else:
                break
        fresh_dead = 0
        for d, (k, nu) in enumerate(zip(keys, nexts[i], strict=True)):
            cache[k] = nu
            if nu < 0:
                dead.append(k)
                fresh_dead += 1
            else:
                heapq.heappush(heap, (-((nu << _DEPTH_BITS) | d), seq, k))
                seq += 1
        over = len(cache) - capacity
        if over <= 0:
            continue
        while over > 0 and len(dead) > fresh_dead:  # this request's blocks stay
            k = dead.popleft()
            if cache.get(k) == -1:
                del cache[k]
                over -= 1
        if over > 0:
            mine = set(keys)
            held = []
            while over > 0:
                e = heapq.heappop(heap)
                k = e[2]
                if cache.get(k) != (-e[0]) >> _DEPTH_BITS:
                    continue  # stale: the key was used (and re-queued) since
                if k in mine:
                    held.append(e)
                    continue
                del cache[k]
                over -= 1
            for e in held:
                heapq.heappush(heap, e)
        if len(heap) > 2 * len(cache) + 4096:
            heap = [e for e in heap if cache.get(e[2]) == (-e[0]) >> _DEPTH_BITS]
            heapq.heapify(heap)
    return hits


def optimum_curve(requests: Sequence[Sequence[Hashable]], capacities: Sequence[int],
                  ceiling: int | None = None) -> list[tuple[int, int]]:
    """``(capacity, optimum_hits)`` for each capacity, ascending. ``ceiling``: the hits
    of an infinite cache, if known; once a capacity reaches it, larger ones are not
    simulated (they reach it too)."""
    out: list[tuple[int, int]] = []
    reached = ceiling is not None and ceiling <= 0  # nothing is ever used twice
    if reached:
        return [(c, 0) for c in sorted(capacities)]
    for c in sorted(capacities):
        if reached:
            out.append((c, out[-1][1]))
            continue
        h = optimum_hits(requests, c)
        out.append((c, h))
        reached = ceiling is not None and h >= ceiling
    return out


def tier_optimum_hits(requests: Sequence[Sequence[Hashable]],
                      capacities: Sequence[int]) -> list[int]:
    """Blocks the optimum serves from each of three exclusive tiers (device, host,
    storage): one ``optimum_hits`` run per tier over the stacked capacities, each
    request cut to the device's capacity. The straightforward form, one full run per
    tier over every request's keys: ``kvflow.headroom.tier_hits`` gives the same figures
    from a compact access log, and is checked against this."""
    dev = capacities[0]
    out: list[int] = []
    total = prev = 0
    for cap in capacities[:3]:
        if cap <= 0:
            out.append(0)
            continue
        total += cap
        h = optimum_hits(requests, total, truncate=dev)
        out.append(h - prev)
        prev = h
    return out
