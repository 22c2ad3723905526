"""CPU tests of the pinned-staging ring allocator (offsets only, no GPU)."""

from __future__ import annotations

import random

import pytest

from kernels.staging import ALIGN, RingAllocator


def test_alloc_aligns_and_packs() -> None:
    r = RingAllocator(4 * ALIGN)
    a, b = r.alloc(1), r.alloc(ALIGN + 1)
    assert (a.offset, a.size) == (0, ALIGN)
    assert (b.offset, b.size) == (ALIGN, 2 * ALIGN)
    assert r.bytes_in_use == 3 * ALIGN
    assert r.alloc(2 * ALIGN) is None  # only one ALIGN left at the end, nothing freed yet
    assert r.alloc(5 * ALIGN) is None  # larger than the ring


def test_wraps_after_oldest_frees_and_reclaims_out_of_order() -> None:
    r = RingAllocator(4 * ALIGN)
    a, b, c = r.alloc(ALIGN), r.alloc(ALIGN), r.alloc(ALIGN)
    r.free(b)  # out of order: not reclaimable while a lives
    assert r.alloc(2 * ALIGN) is None
    r.free(a)  # now a and b go; free space is [3A, 4A) and [0, 2A)
    d = r.alloc(2 * ALIGN)
    assert d.offset == 0  # wrapped: [3A, 4A) waits until the tail passes it
    assert r.alloc(ALIGN) is None
    r.free(c)
    assert r.alloc(2 * ALIGN).offset == 2 * ALIGN


def test_empty_ring_restarts_at_zero() -> None:
    r = RingAllocator(4 * ALIGN)
    s = r.alloc(3 * ALIGN)
    r.free(s)
    assert r.bytes_in_use == 0
    assert r.alloc(4 * ALIGN).offset == 0


def test_rejects_tiny_capacity() -> None:
    with pytest.raises(ValueError, match="at least"):
        RingAllocator(ALIGN - 1)


@pytest.mark.parametrize("seed", range(10))
def test_random_live_slices_never_overlap(seed: int) -> None:
    rng = random.Random(seed)
    r = RingAllocator(64 * ALIGN)
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            r.free(live.pop(rng.randrange(len(live))))
        else:
            s = r.alloc(rng.randint(1, 8 * ALIGN))
            if s is not None:
                assert s.offset >= 0 and s.offset + s.size <= r.capacity
                for o in live:
                    assert s.offset + s.size <= o.offset or o.offset + o.size <= s.offset
                live.append(s)
    for s in live:
        r.free(s)
    assert r.bytes_in_use == 0
