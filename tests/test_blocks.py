import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.blocks import BlockPool
from kvflow.errors import InvalidBlockId, PoolExhausted


def test_allocate_zero_touches_nothing():
    # Seed-system bug: allocate(0) emptied the free list (free[-0:] is everything).
    p = BlockPool(8)
    assert p.allocate(0) == []
    assert p.num_free == 8
    assert len(p.allocate(8)) == 8


def test_over_ask_allocates_nothing():
    p = BlockPool(4, "device")
    p.allocate(3)
    with pytest.raises(PoolExhausted, match="device") as e:
        p.allocate(2)
    assert (e.value.wanted, e.value.free) == (2, 1)
    assert p.num_free == 1


def test_double_free_and_foreign_ids_are_errors_and_atomic():
    p = BlockPool(4)
    a = p.allocate(2)
    p.free([a[0]])
    with pytest.raises(InvalidBlockId):
        p.free([a[1], a[0]])  # a[0] already free: a[1] must stay allocated
    assert p.is_used(a[1]) and p.num_free == 3
    with pytest.raises(InvalidBlockId, match="out of range"):
        p.free([4])
    with pytest.raises(InvalidBlockId):
        p.free([a[1], a[1]])
    assert p.is_used(a[1])


def test_negative_allocate_is_error():
    with pytest.raises(ValueError):
        BlockPool(2).allocate(-1)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60), st.integers(0, 20))
def test_accounting_under_random_ops(ops, cap):
    p = BlockPool(cap)
    held: list[int] = []
    for alloc, k in ops:
        if alloc:
            if k > p.num_free:
                with pytest.raises(PoolExhausted):
                    p.allocate(k)
            else:
                ids = p.allocate(k)
                assert len(set(ids)) == k and not set(ids) & set(held)
                held += ids
        else:
            give, held = held[:k], held[k:]
            p.free(give)
        assert p.num_free + p.num_used == cap
        assert p.num_used == len(held)
    p.free(held)
    assert p.num_free == cap


class _StackPool:
    """The pool as it was before ids never handed out stopped being listed: every free id
    on one stack, highest first. The lazy pool must hand out exactly what it did."""

    def __init__(self, cap: int) -> None:
        self.free_ids = list(range(cap - 1, -1, -1))

    def allocate(self, n: int) -> list[int]:
        ids = self.free_ids[-n:] if n else []
        del self.free_ids[len(self.free_ids) - n:]
        return ids

    def free(self, ids: list[int]) -> None:
        self.free_ids.extend(ids)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.integers(0, 5)), max_size=60),
       st.integers(0, 20))
def test_same_ids_as_a_pool_listing_every_free_id(ops, cap):
    p, ref = BlockPool(cap), _StackPool(cap)
    held: list[int] = []
    for alloc, k, at in ops:
        if alloc and k <= p.num_free:
            ids = p.allocate(k)
            assert ids == ref.allocate(k)
            held += ids
        elif not alloc:
            give = held[at:at + k]
            del held[at:at + k]
            p.free(give)
            ref.free(give)
        assert p.num_free == len(ref.free_ids) and p.num_used == cap - len(ref.free_ids)


def test_a_large_pool_lists_no_ids():
    p = BlockPool(10**7)
    assert p.num_free == 10**7 and p.allocate(3) == [2, 1, 0] and p.num_used == 3
