"""How far a policy's hit rates are from the offline optimum at the same capacities.

The optimum is Belady's MIN (offline: it reads the whole trace) in the cache
mode's model (``traces.optimum``): requests in arrival order, every copy at
once. Per tier it is cumulative over the tiers down to it, with the tiers
exclusive: no policy, write policy or hierarchy of these sizes serves more
blocks from the device than MIN with the device's capacity, nor more from
device or host together than MIN with both capacities summed (what device
and host hold together is a cache of that size that only a request puts blocks
into), and so on down. The per-tier figures are the differences. In full mode
the same bound holds for the total; a storage prefetch at arrival can count as
a host hit there, so the host line is a bound for cache mode only.

A replay keeps each request's first ``device`` blocks (what does not fit on
the device is recomputed, never cached), and so does the optimum here; hit
rates are over all prompt blocks, as the replay's.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from traces.optimum import optimum_curve, optimum_hits

__all__ = ["TIER_NAMES", "optimum_curve", "optimum_hit_rates", "optimum_hits",
           "tier_hits"]

TIER_NAMES = ("device", "host", "storage")


def tier_hits(requests: Sequence[Sequence[Hashable]],
              capacities: Sequence[int]) -> list[int]:
    """Blocks the offline optimum serves from each tier (exclusive tiers, see above)."""
    dev = capacities[0]
    out: list[int] = []
    total = prev = 0
    for t in range(3):
        if capacities[t] <= 0:
            out.append(0)
            continue
        total += capacities[t]
        h = optimum_hits(requests, total, truncate=dev)
        out.append(h - prev)
        prev = h
    return out


def optimum_hit_rates(requests: Sequence[Sequence[Hashable]], capacities: Sequence[int],
                      blocks: int | None = None) -> dict[str, float]:
    """Per tier and ``total``, the offline optimum's hit rates at ``capacities``
    (device, host, storage blocks). ``blocks``: the denominator (default: every
    block of every request, untruncated, as a replay counts them)."""
    if blocks is None:
        blocks = sum(len(r) for r in requests)
    hits = tier_hits(requests, capacities)
    d = {name: (h / blocks if blocks else 0.0) for name, h in zip(TIER_NAMES, hits, strict=True)}
    d["total"] = sum(hits) / blocks if blocks else 0.0
    return d
