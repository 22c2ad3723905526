"""Native eviction orders against the Python classes they replace, call by call.

The native core runs ``LinkedARC`` where the Python core runs ``ARC``
(``kvflow.radix.NATIVE_ORDERS``). Here both get one random sequence of the
calls an index makes (a copy arrives, a reference comes and goes, a release of
several, a copy dropped, victims popped in bulk and some handed back, a full
scan with some candidates taken and some declined), on the same nodes (the
Python class keeps its own dicts; the native one links through the nodes'
per-tier fields, which nothing else here uses). Every result, and after every
call the two lists, the ghost lists, ``p`` and what each referenced node was
in, must be equal: the native order evicts exactly what the Python one did.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.arc import ARC, LinkedARC
from kvflow.policy import NATIVE_CORE

pytestmark = pytest.mark.skipif(LinkedARC is None, reason="kvflow._index_core not built")

N = 12  # node objects; their keys repeat (a new node of an evicted key is a ghost hit)
node_i = st.integers(0, N - 1)
ops = st.lists(st.one_of(
    st.tuples(st.just("arrive"), node_i),
    st.tuples(st.just("ref"), node_i),
    st.tuples(st.just("unref"), node_i),
    st.tuples(st.just("release"), st.lists(node_i, max_size=5)),
    st.tuples(st.just("remove"), node_i),
    st.tuples(st.just("pop"), st.integers(0, 6), st.integers(0, 6)),
    st.tuples(st.just("scan"), st.integers(0, 2**12 - 1), st.integers(0, 14)),
    st.tuples(st.just("renew"), node_i),
    st.tuples(st.just("arrive_all"), st.just(0)),
    st.tuples(st.just("reuse"), st.lists(node_i, max_size=6)),
), min_size=4, max_size=60)


def state(py: ARC, nat) -> tuple:
    return ([n.key for n in py._t1], [n.key for n in py._t2], list(py._b1), list(py._b2),
            py.p, py.first())


def nat_state(nat, nodes) -> tuple:
    return ([n.key for n in nat._t1], [n.key for n in nat._t2], list(nat._b1), list(nat._b2),
            nat.p, nat.first())


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.integers(0, 2), st.lists(st.integers(0, 5), min_size=N,
                                                     max_size=N), ops)
def test_linked_arc_matches_arc(capacity, tier, keys, calls):
    make = NATIVE_CORE.Node
    nodes = [make(k) for k in keys]
    py, nat = ARC(capacity), LinkedARC(tier, capacity)
    where: dict[int, str] = {}  # node index -> "ordered" | "held" (absent: out)
    last_pop: list = []

    def check():
        assert state(py, nat) == nat_state(nat, nodes)
        for i, n in enumerate(nodes):
            assert py._held.get(n, 0) == nat.held(n), i
        assert set(py.tracked()) == set(nat.tracked())

    for call in calls:
        kind = call[0]
        if kind == "arrive":
            i = call[1]
            if i in where:
                continue
            py.insert(nodes[i])
            nat.insert(nodes[i])
            where[i] = "ordered" if nodes[i].ref == 0 else "unordered"
        elif kind == "ref":
            i = call[1]
            if where.get(i) == "ordered":
                nodes[i].ref += 1
                py.ref(nodes[i])
                nat.ref(nodes[i])
                where[i] = "held"
            elif where.get(i) is not None:
                nodes[i].ref += 1
        elif kind == "unref":
            i = call[1]
            if nodes[i].ref > 0:
                nodes[i].ref -= 1
                if nodes[i].ref == 0 and i in where:
                    py.unref(nodes[i])
                    nat.unref(nodes[i])
                    where[i] = "ordered"
        elif kind == "release":
            rel = []
            for i in dict.fromkeys(call[1]):
                if nodes[i].ref > 0 and i in where:
                    nodes[i].ref = 0
                    where[i] = "ordered"
                    rel.append(nodes[i])
            py.unref_all(rel)
            nat.unref_all(rel)
        elif kind == "remove":
            i = call[1]
            py.remove(nodes[i])
            nat.remove(nodes[i])
            if where.get(i) in ("ordered", "held"):
                del where[i]
        elif kind == "pop":
            k, back = call[1], call[2]
            a, b = py.pop_front(k), nat.pop_front(k)
            assert a == b
            back = min(back, len(a))
            kept = a[len(a) - back:]
            py.push_front(kept)
            nat.push_front(kept)
            for n in a[:len(a) - back]:  # dropped, as the core drops popped victims
                del where[nodes.index(n)]
            last_pop = a
        elif kind == "scan":
            mask, steps = call[1], call[2]
            ga, gb = py.candidates(), nat.candidates()
            for j in range(steps):
                a, b = next(ga, None), next(gb, None)
                assert a is b
                if a is None:
                    break
                if mask >> j & 1:  # taken: the index drops the copy (policy.remove)
                    py.remove(a)
                    nat.remove(a)
                    del where[nodes.index(a)]
            ga.close()
            gb.close()
        elif kind == "arrive_all":  # every node out of the tier arrives (unreferenced)
            for i, n in enumerate(nodes):
                if i not in where and n.ref == 0:
                    py.insert(n)
                    nat.insert(n)
                    where[i] = "ordered"
        elif kind == "reuse":  # a request uses these ordered nodes and releases them
            used = [i for i in dict.fromkeys(call[1]) if where.get(i) == "ordered"]
            for i in used:
                nodes[i].ref = 1
                py.ref(nodes[i])
                nat.ref(nodes[i])
            for i in used:
                nodes[i].ref = 0
                where[i] = "ordered"
            py.unref_all([nodes[i] for i in used[::-1]])
            nat.unref_all([nodes[i] for i in used[::-1]])
        elif kind == "renew":  # a node object gone from the tier, replaced by a fresh one
            i = call[1]
            if i not in where and nodes[i].ref == 0:
                nodes[i] = make(nodes[i].key)
        check()
    assert last_pop is not None
