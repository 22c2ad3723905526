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

from array import array
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Protocol

from traces.optimum import optimum_curve, optimum_hits

__all__ = ["METHOD", "TIER_NAMES", "AccessLog", "headroom_section", "new_access_log",
           "optimum_curve", "optimum_hit_rates", "optimum_hits", "record_accesses",
           "tier_hits"]

#: How the report's optimum was computed, in one line (reports print it).
METHOD = ("Belady's MIN over the whole trace (offline: it reads the future), cache mode, "
          "tiers exclusive; a bound for the tiers down to each one together")

TIER_NAMES = ("device", "host", "storage")


class AccessLog(Protocol):
    """A trace's block accesses, each request cut to its first ``cut`` keys, as int ids.

    ``kvflow._index_core.AccessLog`` where the extension is built (about 4 bytes an
    access and 8 a request, plus a table of the distinct int keys while recording:
    a 96k-request replay no longer holds every request's key objects while its
    report is built, and MIN runs over int arrays, ~40x faster than over keys);
    ``PyAccessLog`` otherwise. ``hits(c)`` for ``c >= cut`` equals
    ``traces.optimum.optimum_hits(requests, c, truncate=cut)``.
    """

    cut: int
    blocks: int  # every key of every request, uncut

    def add(self, keys: Sequence[Hashable]) -> None: ...
    def finish(self) -> None: ...
    def hits(self, capacity: int) -> int: ...


class PyAccessLog:
    """``AccessLog`` in Python, where the extension was not built (and the reference
    the tests hold the native one to): keys interned to ints by a dict, MIN by
    ``traces.optimum`` over the id lists."""

    def __init__(self, cut: int) -> None:
        self.cut = cut
        self.blocks = 0
        self._ids: dict[Hashable, int] = {}
        self._acc = array("i")
        self._starts = array("q", [0])

    def add(self, keys: Sequence[Hashable]) -> None:
        ids = self._ids
        self.blocks += len(keys)
        self._acc.extend([ids.setdefault(k, len(ids)) for k in keys[:self.cut]])
        self._starts.append(len(self._acc))

    def finish(self) -> None:
        self._ids = {}

    def hits(self, capacity: int) -> int:
        if capacity < self.cut:
            raise ValueError(f"AccessLog.hits: capacity {capacity} below the cut {self.cut}")
        acc, st = self._acc, self._starts
        reqs = [acc[st[i]:st[i + 1]].tolist() for i in range(len(st) - 1)]
        return optimum_hits(reqs, capacity, truncate=self.cut)


def _native_log() -> Any:
    from kvflow.policy import NATIVE_CORE
    return getattr(NATIVE_CORE, "AccessLog", None)


def new_access_log(cut: int, native: bool | None = None) -> AccessLog:
    """An empty ``AccessLog`` (``add`` each request's keys, then ``finish``): what a
    replay that reads the trace anyway fills as it goes, instead of reading it again.
    ``native``: None, the extension's where built; False, Python's."""
    make = _native_log() if native is not False else None
    if native and make is None:
        raise RuntimeError("kvflow._index_core has no AccessLog: rebuild the extension")
    return make(cut) if make is not None else PyAccessLog(cut)


def record_accesses(requests: Iterable[Sequence[Hashable]], cut: int,
                    native: bool | None = None) -> AccessLog:
    """Read ``requests`` (each a request's block keys) once into an ``AccessLog``.
    ``native``: None, the extension's where built; False, Python's."""
    log = new_access_log(cut, native)
    add = log.add
    for keys in requests:
        add(keys)
    log.finish()
    return log


def tier_hits(requests: Iterable[Sequence[Hashable]] | AccessLog,
              capacities: Sequence[int]) -> list[int]:
    """Blocks the offline optimum serves from each tier (exclusive tiers, see above).
    ``requests``: each request's keys, or an ``AccessLog`` of them cut to the device
    tier's capacity."""
    dev = capacities[0]
    log = requests if hasattr(requests, "hits") else record_accesses(requests, dev)  # type: ignore[arg-type]
    if log.cut != dev:  # type: ignore[union-attr]
        raise ValueError(f"tier_hits: the log keeps {log.cut} blocks a request, "  # type: ignore[union-attr]
                         f"the device holds {dev}")
    out: list[int] = []
    total = prev = 0
    for t in range(3):
        if capacities[t] <= 0:
            out.append(0)
            continue
        total += capacities[t]
        h = log.hits(total) if total >= dev else 0  # type: ignore[union-attr]
        out.append(h - prev)
        prev = h
    return out


def optimum_hit_rates(requests: Iterable[Sequence[Hashable]] | AccessLog,
                      capacities: Sequence[int],
                      blocks: int | None = None) -> dict[str, float]:
    """Per tier and ``total``, the offline optimum's hit rates at ``capacities``
    (device, host, storage blocks). ``requests`` is read once (a generator will do:
    only int ids are kept), or is an ``AccessLog`` of them already, finished and cut
    to the device's capacity. ``blocks``: the denominator (default: every block of
    every request, untruncated, as a replay counts them)."""
    log = requests if hasattr(requests, "hits") else record_accesses(
        requests, capacities[0])  # type: ignore[arg-type]
    if blocks is None:
        blocks = log.blocks
    hits = tier_hits(log, capacities)
    d = {name: (h / blocks if blocks else 0.0) for name, h in zip(TIER_NAMES, hits, strict=True)}
    d["total"] = sum(hits) / blocks if blocks else 0.0
    return d


def headroom_section(requests: Iterable[Sequence[Hashable]] | AccessLog,
                     capacities: Sequence[int],
                     eviction: str, instances: int = 1) -> dict[str, Any]:
    """The report's ``headroom``: the offline optimum's hit rates per tier at the
    replay's capacities (``optimum``, as the report's ``hit_rate``), the policy they
    are set against and how they were computed (its time is in the report's
    ``wall_s``). A cluster's instances each see part of the trace: no single-cache
    optimum applies (``optimum`` None). ``requests`` is read once, only if needed
    (or is an ``AccessLog`` of them, see ``optimum_hit_rates``)."""
    from kvflow.policy import eviction_label

    out: dict[str, Any] = {"eviction": eviction_label(eviction), "method": METHOD,
                           "optimum": None}
    if instances != 1:
        out["note"] = "not computed for a cluster of instances"
        return out
    out["optimum"] = optimum_hit_rates(requests, capacities)
    return out
