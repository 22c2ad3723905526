"""Fixed-size pools of integer block ids, one per tier.

The seed system's pool emptied its free list on ``allocate(0)`` and accepted
double frees; this one validates every id before it changes anything, so a
caller's mistake leaves the pool exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

from kvflow.errors import InvalidBlockId, PoolExhausted

_INT = {int}


class BlockPool:
    """Ids ``0 .. capacity-1``; O(k) allocate and free of k ids.

    Free ids sit on a stack (recently freed ids are handed out first, which
    keeps the touched part of a real pool small); ``_used`` answers membership
    in O(1) so double frees and foreign ids are caught. Ids never handed out are
    not listed: they are ``_fresh .. capacity-1``, below the freed ones on the
    stack, so a pool of a million blocks (a cluster's shared pool, seen by each
    instance) costs a bytearray, not a list of a million ints.
    """

    __slots__ = ("_free", "_fresh", "_used", "capacity", "name")

    def __init__(self, capacity: int, name: str = "pool") -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"BlockPool capacity must be an integer >= 0, got {capacity!r}")
        self.name = name
        self.capacity = capacity
        self._free: list[int] = []  # freed ids, the most recent last
        self._fresh = 0  # the lowest id never handed out
        self._used = bytearray(capacity)

    @property
    def num_free(self) -> int:
        return len(self._free) + self.capacity - self._fresh

    @property
    def num_used(self) -> int:
        return self._fresh - len(self._free)

    def is_used(self, block_id: int) -> bool:
        return 0 <= block_id < self.capacity and bool(self._used[block_id])

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free ids; all or nothing."""
        if n < 0:
            raise ValueError(f"pool {self.name!r}: cannot allocate {n} blocks")
        if n == 0:
            return []
        free = self._free
        short = n - len(free)
        if short <= 0:
            ids = free[-n:]
            del free[-n:]
        else:  # the stack as if every id were on it: fresh ids, highest first, under the freed
            fresh = self._fresh
            if fresh + short > self.capacity:
                raise PoolExhausted(self.name, n, self.num_free)
            self._fresh = fresh + short
            ids = list(range(fresh + short - 1, fresh - 1, -1))
            ids += free
            free.clear()
        any(map(self._used.__setitem__, ids, repeat(1)))  # used[i] = 1 for each, in C
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return ids to the pool; all or nothing."""
        ids = list(ids)
        if not ids:
            return
        used = self._used
        cap = self.capacity
        # The common case checked at C speed: plain ints, in range, allocated, distinct.
        if (set(map(type, ids)) == _INT and min(ids) >= 0 and max(ids) < cap
                and all(map(used.__getitem__, ids)) and len(set(ids)) == len(ids)):
            any(map(used.__setitem__, ids, repeat(0)))
            self._free.extend(ids)
            return
        seen: set[int] = set()
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < cap:
                raise InvalidBlockId(f"pool {self.name!r}: block id {i!r} out of range [0, {cap})")
            if not used[i] or i in seen:
                raise InvalidBlockId(f"pool {self.name!r}: block id {i} is not allocated")
            seen.add(i)
        for i in ids:
            used[i] = 0
        self._free.extend(ids)

    def __repr__(self) -> str:
        return f"BlockPool({self.name!r}, used={self.num_used}/{self.capacity})"
