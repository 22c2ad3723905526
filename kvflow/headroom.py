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
from typing import Any

from traces.optimum import optimum_curve, optimum_hits

__all__ = ["METHOD", "TIER_NAMES", "headroom_section", "optimum_curve", "optimum_hit_rates",
           "optimum_hits", "tier_hits"]

#: How the report's optimum was computed, in one line (reports print it).
METHOD = ("Belady's MIN over the whole trace (offline: it reads the future), cache mode, "
          "tiers exclusive; a bound for the tiers down to each one together")

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


def headroom_section(requests: Sequence[Sequence[Hashable]], capacities: Sequence[int],
                     eviction: str, instances: int = 1) -> dict[str, Any]:
    """The report's ``headroom``: the offline optimum's hit rates per tier at the
    replay's capacities (``optimum``, as the report's ``hit_rate``), the policy they
    are set against and how they were computed (its time is in the report's
    ``wall_s``). A cluster's instances each see part of the trace: no single-cache
    optimum applies (``optimum`` None)."""
    from kvflow.policy import eviction_label

    out: dict[str, Any] = {"eviction": eviction_label(eviction), "method": METHOD,
                           "optimum": None}
    if instances != 1:
        out["note"] = "not computed for a cluster of instances"
        return out
    out["optimum"] = optimum_hit_rates(requests, capacities)
    return out
