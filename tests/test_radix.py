"""PrefixIndex bulk paths: add_computing, mark_computed, release, drop_front.

Each test runs on both index cores (the ``core`` fixture, tests/conftest.py).
"""

import pytest

from kvflow.radix import ABSENT, COMPUTING, READY, PrefixIndex, Tier


def chain(index, keys, ids, parent=None):
    nodes = index.add_computing(parent, keys, ids, now=1)
    index.mark_computed(nodes)
    return nodes


def test_add_computing_builds_a_referenced_chain(core):
    index = PrefixIndex([8, 0, 0], core=core)
    a, b, c = index.add_computing(None, "abc", [5, 6, 7], now=3)
    assert [n.parent for n in (a, b, c)] == [None, a, b]
    assert [n.depth for n in (a, b, c)] == [0, 1, 2]
    assert [n.children for n in (a, b, c)] == [1, 1, 0]
    assert all(n.ref == 1 and n.state == [COMPUTING, ABSENT, ABSENT] for n in (a, b, c))
    assert [n.loc[0] for n in (a, b, c)] == [5, 6, 7] and c.last_access == 3
    assert not index.match("abc")  # computing: not matchable yet
    (d,) = index.add_computing(c, "d", [8], now=4)
    assert d.parent is c and d.depth == 3 and c.children == 1
    assert index.add_computing(c, "", [], now=4) == [] and c.children == 1


def test_add_computing_stops_at_an_indexed_or_repeated_key(core):
    index = PrefixIndex([8, 0, 0], core=core)
    (a,) = index.add_computing(None, "a", [0], now=1)
    assert index.add_computing(None, "a", [1], now=1) == []
    b, c = index.add_computing(a, "bcbd", [1, 2, 3, 4], now=1)  # stops at the second b
    assert set(index.nodes) == set("abc") and [a.children, b.children, c.children] == [1, 1, 0]
    assert index.nodes["a"] is a and a.loc[0] == 0


def test_add_computing_checks_ids_before_indexing_anything(core):
    index = PrefixIndex([8, 0, 0], core=core)
    with pytest.raises(ValueError, match="2 keys but 1 block ids"):
        index.add_computing(None, "ab", [0], now=1)
    assert not index.nodes


def test_release_makes_ready_nodes_evictable_tail_first(core):
    index = PrefixIndex([8, 0, 0], core=core)
    a, b, c = chain(index, "abc", [0, 1, 2])
    assert index.unreferenced == [0, 0, 0] and index.policies[0].tracked() == set()
    index.ref(a)
    assert index.release([c, b, a]) == [c, b]  # a is still held once
    assert index.unreferenced[0] == 2
    assert index.release([a]) == [a]
    assert list(index.policies[0].candidates()) == [c, b, a]
    with pytest.raises(AssertionError, match="negative"):
        index.release([a])
    assert a.ref == 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_drop_front_takes_leaves_and_hands_back_the_first_it_may_not_drop(policy, core):
    index = PrefixIndex([8, 0, 0], policy, core=core)
    a, b, c = chain(index, "abc", [0, 1, 2])
    d, e = chain(index, "de", [3, 4])
    index.release([c, b, a])
    index.release([e, d])
    assert index.drop_front(Tier.DEVICE, 2) == [2, 1]  # c, b: leaves in turn
    assert set(index.nodes) == set("ade") and a.children == 0
    index.ref(d)  # e's parent stays cached below... e is still a leaf
    assert index.drop_front(Tier.DEVICE, 5) == [0, 4]  # a, then e; d is referenced
    assert set(index.nodes) == {"d"} and index.unreferenced[0] == 0
    assert c.state == [ABSENT] * 3 and c.loc == [-1] * 3
    assert index.drop_front(Tier.DEVICE, 1) == []


def test_drop_front_stops_at_an_inner_node_and_keeps_the_order(core):
    index = PrefixIndex([8, 0, 0], "lru", core=core)
    a, b = chain(index, "ab", [0, 1])
    # Released head-first (against the rule): the parent comes first in the order.
    index.release([a, b])
    before = list(index.policies[0])
    assert index.drop_front(Tier.DEVICE, 2) == []
    assert list(index.policies[0]) == before == [a, b]
    assert index.unreferenced[0] == 2 and set(index.nodes) == {"a", "b"}


def test_drop_front_keeps_a_node_with_another_copy(core):
    index = PrefixIndex([8, 8, 0], "lru", core=core)
    a, b = chain(index, "ab", [0, 1])
    index.set_copy(a, Tier.HOST, 7, READY)
    index.release([a, b])  # head-first again: a, the inner node, is first
    assert index.drop_front(Tier.DEVICE, 1) == [0]  # a may go: host still has it
    assert "a" in index.nodes and a.state == [ABSENT, READY, ABSENT] and a.loc == [-1, 7, -1]
    assert index.unreferenced == [1, 1, 0]


def test_s3fifo_has_no_bulk_front(core):
    index = PrefixIndex([8, 0, 0], "s3fifo", core=core)
    (a,) = chain(index, "a", [0])
    assert index.policies[0].tracked() == {a}  # referenced blocks are ordered too
    index.release([a])
    assert index.drop_front(Tier.DEVICE, 1) == []
    assert [n.key for n in index.victims(Tier.DEVICE)] == ["a"]
