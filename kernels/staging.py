"""A ring allocator for per-op id staging in one pinned buffer allocated up front.

Why: ``cudaHostAlloc`` synchronizes with the device — measured on an H100, a
64 KB allocation waited 50 ms for a busy GPU — so nothing on the submission
path may allocate pinned memory. Each op's id pairs go into a slice of one
buffer allocated at start-up; a slice is reused once its op has finished.

Pure Python (offsets only), so it is tested without a GPU.
"""

from __future__ import annotations

from collections import deque

#: Slices start on this boundary (the kernel reads ids as 8-byte pairs; 256 keeps
#: each op's ids in their own cache lines).
ALIGN = 256


class Slice:
    """One allocation: ``[offset, offset + size)`` bytes of the ring."""

    __slots__ = ("offset", "released", "size")

    def __init__(self, offset: int, size: int) -> None:
        self.offset = offset
        self.size = size
        self.released = False


class RingAllocator:
    """First-in, first-out reuse of ``capacity`` bytes; frees may come in any order.

    Live slices occupy ``[oldest.offset, head)`` going round the ring. A slice
    freed out of order is reclaimed once every older one is free too, which
    suits ops that finish roughly in submission order (one stream each way).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < ALIGN:
            raise ValueError(f"staging ring needs at least {ALIGN} bytes, got {capacity}")
        self.capacity = capacity - capacity % ALIGN
        self._live: deque[Slice] = deque()
        self._head = 0

    @property
    def bytes_in_use(self) -> int:
        if not self._live:
            return 0
        tail = self._live[0].offset
        return self._head - tail if self._head > tail else self.capacity - tail + self._head

    def alloc(self, nbytes: int) -> Slice | None:
        """A slice of at least ``nbytes``, or ``None`` if the ring has no room now."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        if size > self.capacity:
            return None
        self._reclaim()
        if not self._live:
            start = 0
        else:
            tail, head = self._live[0].offset, self._head
            if head > tail:  # free: [head, capacity) then [0, tail)
                if head + size <= self.capacity:
                    start = head
                elif size <= tail:
                    start = 0
                else:
                    return None
            elif head < tail and head + size <= tail:  # free: [head, tail)
                start = head
            else:  # head == tail with live slices: full
                return None
        s = Slice(start, size)
        self._live.append(s)
        self._head = start + size
        return s

    def free(self, s: Slice) -> None:
        s.released = True
        self._reclaim()

    def _reclaim(self) -> None:
        live = self._live
        while live and live[0].released:
            live.popleft()
        if not live:
            self._head = 0
