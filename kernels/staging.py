"""An allocator for per-op id staging inside one pinned buffer allocated up front.

Why: ``cudaHostAlloc`` synchronizes with the device — measured on an H100, a
64 KB allocation waited 50 ms for a busy GPU — so nothing on the submission
path may allocate pinned memory. Each op's id pairs go into a slice of one
buffer allocated at start-up, given back when the op has finished.

Slices come in power-of-two size classes carved from the buffer on first
use and recycled per class, so ops may finish in any order (a long-lived op
never blocks the others, as it would in a ring). Pure Python (offsets only),
so it is tested without a GPU.
"""

from __future__ import annotations

#: Smallest slice; slices start on this boundary (the kernel reads ids as
#: 8-byte pairs; 256 keeps each op's ids in their own cache lines).
ALIGN = 256


class Slice:
    """One allocation: ``[offset, offset + size)`` bytes of the buffer."""

    __slots__ = ("offset", "released", "size")

    def __init__(self, offset: int, size: int) -> None:
        self.offset = offset
        self.size = size
        self.released = False


class SlabAllocator:
    """Power-of-two slices of a ``capacity``-byte buffer; frees in any order.

    Memory carved for one size class stays in that class, so a workload whose
    op sizes drift can run out early; ``alloc`` then returns ``None`` and the
    caller falls back (and warns). Size the buffer for the ops in flight.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < ALIGN:
            raise ValueError(f"staging buffer needs at least {ALIGN} bytes, got {capacity}")
        self.capacity = capacity - capacity % ALIGN
        self.bytes_in_use = 0
        self._top = 0
        self._free: dict[int, list[int]] = {}

    def alloc(self, nbytes: int) -> Slice | None:
        """A slice of at least ``nbytes``, or ``None`` if none is free."""
        size = max(ALIGN, 1 << (max(nbytes, 1) - 1).bit_length())
        free = self._free.get(size)
        if free:
            offset = free.pop()
        elif self._top + size <= self.capacity:
            offset = self._top
            self._top += size
        else:
            return None
        self.bytes_in_use += size
        return Slice(offset, size)

    def free(self, s: Slice) -> None:
        """Give ``s`` back (a second free of the same slice is ignored)."""
        if s.released:
            return
        s.released = True
        self.bytes_in_use -= s.size
        self._free.setdefault(s.size, []).append(s.offset)
