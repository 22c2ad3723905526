import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.errors import ConfigError
from kvflow.policy import (
    LFU,
    LRU,
    S3FIFO,
    PrefetchPolicy,
    WritePolicy,
    make_eviction_policy,
)


class N:
    def __init__(self, key, hits=0):
        self.key, self.hits, self.ref = key, hits, 0

    def __repr__(self):
        return f"N({self.key})"


def test_lru_order_and_refs():
    p = LRU()
    a, b, c = N("a"), N("b"), N("c")
    for n in (a, b, c):
        p.insert(n)
    p.ref(a)  # referenced blocks leave the order...
    assert list(p.candidates()) == [b, c]
    p.unref(a)  # ...and come back as most recent
    assert list(p.candidates()) == [b, c, a]
    assert p.first() is b


def test_lfu_orders_by_hits_then_recency():
    p = LFU()
    a, b, c = N("a", 3), N("b", 1), N("c", 1)
    for n in (a, b, c):
        p.insert(n)
    assert list(p.candidates()) == [b, c, a]
    p.ref(b)
    b.hits = 5
    p.unref(b)
    assert list(p.candidates()) == [c, a, b]
    assert p.first() is c


def test_s3fifo_promotes_reused_and_remembers_ghosts():
    p = S3FIFO(capacity=10)
    nodes = [N(i) for i in range(5)]
    for n in nodes:
        p.insert(n)
    p.ref(nodes[0])  # accessed while in small: promoted to main on the scan
    order = list(p.candidates())
    assert order[0] is nodes[1] and nodes[0] in order
    p.remove(nodes[1])  # evicted from small: its key becomes a ghost
    again = N(1)
    p.insert(again)
    assert again in p._main


def test_candidates_survive_removal_while_scanning():
    p = LRU()
    ns = [N(i) for i in range(4)]
    for n in ns:
        p.insert(n)
    seen = []
    for n in p.candidates():
        seen.append(n)
        if n.key % 2 == 0:
            p.remove(n)  # taken; odd ones declined
    assert seen == ns


def test_unknown_names_list_valid_ones():
    with pytest.raises(ConfigError, match="lru, lfu, s3fifo, arc, length_aware, cost_aware, bel"):
        make_eviction_policy("mru", 10)
    with pytest.raises(ConfigError, match="write_back"):
        WritePolicy("sometimes")
    with pytest.raises(ConfigError, match="wait_complete"):
        PrefetchPolicy("eventually")


def test_write_policies():
    assert WritePolicy("write_through").backup_on_insert(0)
    sel = WritePolicy("write_through_selective", threshold=2)
    assert not sel.backup_on_insert(1) and sel.backup_on_insert(2)
    assert not WritePolicy("write_back").backup_on_insert(10)
    assert WritePolicy("write_back").copy_on_evict


def test_prefetch_deadlines():
    assert PrefetchPolicy("wait_complete").deadline_s(10_000) is None
    assert PrefetchPolicy("best_effort").deadline_s(10_000) == 0.0
    t = PrefetchPolicy("timeout", base_s=0.01, per_1k_tokens_s=0.002, max_s=0.05)
    assert t.deadline_s(5000) == pytest.approx(0.02)
    assert t.deadline_s(10**6) == 0.05
    with pytest.raises(ConfigError, match="base_s"):
        PrefetchPolicy("timeout", base_s=-1)


@pytest.mark.parametrize("make", [LRU, LFU])
def test_pop_front_then_push_front_restores_the_order(make):
    p = make()
    ns = [N(i) for i in range(5)]
    for n in ns:
        p.insert(n)
    taken = p.pop_front(3)
    assert taken == ns[:3] and p.tracked() == set(ns[3:])
    p.push_front(taken[1:])  # the caller kept ns[0]
    assert list(p.candidates()) == ns[1:] and p.tracked() == set(ns[1:])
    assert p.pop_front(10) == ns[1:] and p.pop_front(1) == []


def test_lfu_pop_front_takes_from_the_lowest_bucket_only():
    p = LFU()
    a, b, c = N("a", 0), N("b", 2), N("c", 0)
    for n in (a, b, c):
        p.insert(n)
    assert p.pop_front(3) == [a, c]
    p.push_front([c])
    assert list(p.candidates()) == [c, b]


def test_s3fifo_pop_front_hands_out_nothing():
    p = S3FIFO(capacity=4)
    a = N("a")
    p.insert(a)
    assert p.pop_front(1) == [] and p.tracked() == {a}


@given(name=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
       threshold=st.integers(0, 5) | st.floats(0, 6) | st.just(math.inf),
       hits=st.integers(0, 8))
def test_backup_min_hits_is_backup_on_insert_as_a_bound(name, threshold, hits):
    """The manager's bulk paths ask the index core for the nodes with at least
    ``backup_min_hits`` hits: the same blocks ``backup_on_insert`` picks, one by one."""
    wp = WritePolicy(name, threshold=threshold)
    bound = wp.backup_min_hits
    assert (bound is not None and hits >= bound) == wp.backup_on_insert(hits)
