"""CPU tests of the pinned-staging allocator (offsets only, no GPU)."""

from __future__ import annotations

import random

import pytest

from kernels.staging import ALIGN, SlabAllocator


def test_sizes_round_up_to_power_of_two_classes() -> None:
    a = SlabAllocator(16 * ALIGN)
    s1, s2, s3 = a.alloc(1), a.alloc(ALIGN + 1), a.alloc(3 * ALIGN)
    assert (s1.offset, s1.size) == (0, ALIGN)
    assert (s2.offset, s2.size) == (ALIGN, 2 * ALIGN)
    assert (s3.offset, s3.size) == (3 * ALIGN, 4 * ALIGN)
    assert a.bytes_in_use == 7 * ALIGN
    assert a.alloc(32 * ALIGN) is None  # larger than the buffer


def test_frees_in_any_order_are_reused_by_class() -> None:
    a = SlabAllocator(4 * ALIGN)
    s = [a.alloc(ALIGN) for _ in range(4)]
    assert a.alloc(ALIGN) is None
    a.free(s[2])  # out of order: still reusable at once
    assert a.alloc(ALIGN).offset == s[2].offset
    a.free(s[0])
    a.free(s[0])  # double free ignored
    assert a.bytes_in_use == 3 * ALIGN
    assert a.alloc(2 * ALIGN) is None  # no 2-slot class carved, no room to carve one


def test_rejects_tiny_capacity() -> None:
    with pytest.raises(ValueError, match="at least"):
        SlabAllocator(ALIGN - 1)


@pytest.mark.parametrize("seed", range(10))
def test_random_live_slices_never_overlap(seed: int) -> None:
    rng = random.Random(seed)
    a = SlabAllocator(256 * ALIGN)
    live = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            s = a.alloc(rng.randint(1, 8 * ALIGN))
            if s is not None:
                assert s.offset >= 0 and s.offset + s.size <= a.capacity
                for o in live:
                    assert s.offset + s.size <= o.offset or o.offset + o.size <= s.offset
                live.append(s)
        assert a.bytes_in_use == sum(s.size for s in live)
    for s in live:
        a.free(s)
    assert a.bytes_in_use == 0
