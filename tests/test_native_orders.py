"""Native eviction orders against the Python classes they replace, call by call.

The native core runs ``LinkedARC`` where the Python core runs ``ARC``,
``LinkedS3FIFO`` for ``S3FIFO`` and ``LinkedCostAware`` for ``CostAware``
(``kvflow.radix.NATIVE_ORDERS``). Here both get
one random sequence of the calls an index makes (a copy arrives, a reference
comes and goes, a release of several, a copy dropped, victims popped in bulk
and some handed back, a full scan with some candidates taken and some
declined), on the same nodes (the Python class keeps its own dicts; the native
one links through the nodes' per-tier fields, which nothing else here uses).
Every result, and after every call the queues, the ghost lists and every
per-node field, must be equal: the native order evicts exactly what the Python
one did.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.arc import ARC, LinkedARC
from kvflow.cost import BlockCosts
from kvflow.policy import NATIVE_CORE, S3FIFO, LinkedS3FIFO
from kvflow.ranked import CostAware, LinkedCostAware

pytestmark = pytest.mark.skipif(NATIVE_CORE is None, reason="kvflow._index_core not built")

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


@pytest.mark.skipif(LinkedARC is None, reason="kvflow._index_core predates LinkedARC")
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


s3_ops = st.lists(st.one_of(
    st.tuples(st.just("arrive"), node_i),
    st.tuples(st.just("arrive_all"), st.just(0)),
    st.tuples(st.just("ref"), st.lists(node_i, max_size=10)),
    st.tuples(st.just("ref"), st.lists(st.integers(0, 2), max_size=10)),
    st.tuples(st.just("remove"), node_i),
    st.tuples(st.just("scan"), st.integers(0, 2**14 - 1), st.integers(0, 16)),
    st.tuples(st.just("renew"), node_i),
), min_size=4, max_size=60)


@pytest.mark.skipif(LinkedS3FIFO is None, reason="kvflow._index_core not built")
@settings(max_examples=300, deadline=None)
@given(st.integers(1, 30), st.integers(0, 2), st.lists(st.integers(0, 5), min_size=N,
                                                      max_size=N), s3_ops)
def test_linked_s3fifo_matches_s3fifo(capacity, tier, keys, calls):
    """``LinkedS3FIFO`` against ``S3FIFO``: arrivals (a ghost's key goes to main),
    accesses (frequencies), drops (from small: a ghost), scans with candidates taken
    and declined (promotions, second rounds, declined blocks to their queue's end)."""
    make = NATIVE_CORE.Node
    nodes = [make(k) for k in keys]
    py, nat = S3FIFO(capacity), LinkedS3FIFO(tier, capacity)

    def check():
        assert [n.key for n in py._small] == [n.key for n in nat._small]
        assert list(py._small) == nat._small and list(py._main) == nat._main
        assert list(py._ghost) == list(nat._ghost)
        assert py._freq == nat._freq
        assert py.tracked() == nat.tracked()

    for call in calls:
        kind = call[0]
        if kind == "arrive":
            n = nodes[call[1]]
            py.insert(n)  # (a tracked node too: it keeps its place)
            nat.insert(n)
        elif kind == "arrive_all":
            for n in nodes:
                if n not in py._freq:
                    py.insert(n)
                    nat.insert(n)
        elif kind == "ref":
            for i in call[1]:
                if nodes[i] in py._freq:
                    py.ref(nodes[i])
                    nat.ref(nodes[i])
        elif kind == "remove":
            n = nodes[call[1]]
            if n in py._freq:
                py.remove(n)
                nat.remove(n)
            else:
                with pytest.raises(KeyError):
                    nat.remove(n)
        elif kind == "scan":
            mask, steps = call[1], call[2]
            ga, gb = py.candidates(), nat.candidates()
            for j in range(steps):
                a, b = next(ga, None), next(gb, None)
                assert a is b
                if a is None:
                    break
                if mask >> j & 1 and a in py._freq:  # taken: the index drops the copy
                    py.remove(a)
                    nat.remove(a)
        elif kind == "renew":
            i = call[1]
            if nodes[i] not in py._freq:
                nodes[i] = make(nodes[i].key)
        check()


@pytest.mark.skipif(LinkedS3FIFO is None, reason="kvflow._index_core not built")
def test_linked_s3fifo_second_rounds_in_main():
    """A main block met with frequency f goes round again with f - 1 (a case random
    sequences reach rarely: main is scanned only while small is under 10%)."""
    seen = []
    for p in (S3FIFO(20), LinkedS3FIFO(0, 20)):
        nodes = [NATIVE_CORE.Node(k) for k in "abc"]
        for n in nodes:
            p.insert(n)
            p.ref(n)
        first = [n.key for n in p.candidates()]  # promoted to main (frequency 0), offered
        for n, hits in zip(nodes, (3, 2, 0), strict=True):
            for _ in range(hits):
                p.ref(n)
        scan = p.candidates()
        step = next(scan).key
        seen.append((first, step, [p._freq[n] for n in nodes], [n.key for n in p._main]))
    assert seen[0] == seen[1]
    # Small (c) under 10%: main is scanned; a (3) and b (2) go round, one down each
    # time, until b comes up with 0 first.
    assert seen[0] == (["a", "b", "c"], "b", [0, 0, 1], ["b", "a"])


def test_s3fifo_insert_of_a_queued_block_keeps_its_place():
    """``insert`` of a block queued already (a ready copy marked ready again: the
    core's ``mark_computed`` on a ready node) put a block of main in small too, in
    both queues at once; now it keeps its place and its frequency resets, in both
    classes."""
    sides = [S3FIFO(20)] + ([LinkedS3FIFO(0, 20)] if LinkedS3FIFO is not None else [])
    for p in sides:
        n = NATIVE_CORE.Node("a")
        p.insert(n)
        p.ref(n)
        assert list(p.candidates()) == [n]  # promoted to main, then offered
        p.ref(n)
        p.insert(n)
        assert (list(p._small), list(p._main), p._freq) == ([], [n], {n: 0})


tier_ = st.integers(0, 2)
cost_ops = st.lists(st.one_of(
    st.tuples(st.just("arrive"), tier_, node_i),
    st.tuples(st.just("arrive_chain"), tier_, node_i),
    st.tuples(st.just("poke"), st.integers(1, 2), node_i, st.sampled_from([0, 1, 2])),
    st.tuples(st.just("drop"), tier_, node_i),
    st.tuples(st.just("ref"), st.lists(node_i, max_size=5)),
    st.tuples(st.just("release"), st.just(0)),
    st.tuples(st.just("unref1"), node_i),
    st.tuples(st.just("pop"), tier_, st.integers(0, 6), st.integers(0, 6)),
    st.tuples(st.just("scan"), tier_, st.integers(0, 2**12 - 1), st.integers(0, 14)),
    st.tuples(st.just("first"), tier_),
    st.tuples(st.just("stale_pop"), st.integers(0, 1), node_i, st.integers(1, 6)),
    st.tuples(st.just("hit"), node_i),
), min_size=4, max_size=60)


@pytest.mark.skipif(LinkedCostAware is None, reason="kvflow._index_core not built")
@settings(max_examples=300, deadline=None)
@given(st.tuples(st.integers(1, 6), st.integers(0, 6), st.integers(0, 6)),
       st.lists(st.integers(-1, N - 1), min_size=N, max_size=N), cost_ops)
def test_linked_cost_aware_matches_cost_aware(caps, parents, calls):
    """``LinkedCostAware`` against ``CostAware`` on three tiers bound together: copies
    arriving (a chain tail-first too: a parent ranks with the child placed before it),
    lower copies coming and going (ranks above go stale, found so in ``first``,
    ``pop_front`` and scans), references and releases, bulk pops handed back, scans
    with declines (ranked again behind the bucket)."""
    make = NATIVE_CORE.Node
    nodes: list = []
    for i, p in enumerate(parents):
        nodes.append(make(i, nodes[p] if 0 <= p < i else None))
    costs = BlockCosts(load_s=(0.0, 2.0, 5.0), recompute_s=9.0, recompute_per_depth_s=1.5)
    py = [CostAware(caps[t], t, costs) for t in range(3)]
    nat = [LinkedCostAware(t, caps[t], py[t]) for t in range(3)]
    for p in py:
        p.bind(py)
    for p in nat:
        p.bind(nat)
    held: list[list] = [[], [], []]  # per tier: referenced nodes taken out of its order

    def tracked(t, n):
        return n in py[t]._where

    def check():
        for t in range(3):
            a = [(r, [(n, tag) for n, tag in py[t]._buckets[r].items()])
                 for r in sorted(py[t]._buckets) if py[t]._buckets[r]]
            assert a == nat[t].buckets(), t
            assert py[t].clock == nat[t].clock
            assert py[t].tracked() == nat[t].tracked()

    def arrive(t, n):
        if tracked(t, n) or n in held[t] or n.ref:
            return
        n.state[t] = 1
        py[t].insert(n)
        nat[t].insert(n)

    for call in calls:
        kind = call[0]
        if kind == "arrive":
            arrive(call[1], nodes[call[2]])
        elif kind == "arrive_chain":  # a node and its ancestors, tail-first
            n = nodes[call[2]]
            while n is not None:
                arrive(call[1], n)
                n = n.parent
        elif kind == "poke":
            t, n, s = call[1], nodes[call[2]], call[3]
            if not tracked(t, n) and n not in held[t]:
                n.state[t] = s
        elif kind == "drop":
            t, n = call[1], nodes[call[2]]
            if tracked(t, n):
                py[t].remove(n)
                nat[t].remove(n)
                n.state[t] = 0
        elif kind == "ref":
            for i in dict.fromkeys(call[1]):
                n = nodes[i]
                if n.ref == 0:
                    for t in range(3):
                        if tracked(t, n):
                            py[t].ref(n)
                            nat[t].ref(n)
                            held[t].append(n)
                n.ref += 1
        elif kind == "release":  # every reference goes, each chain tail-first
            for n in nodes:
                n.ref = 0
            for t in range(3):
                rel: list = []
                for n in sorted(held[t], key=lambda n: -n.depth):
                    while n is not None and n in held[t] and n not in rel:
                        rel.append(n)
                        n = n.parent
                py[t].unref_all(rel)
                nat[t].unref_all(rel)
                held[t] = []
        elif kind == "unref1":
            n = nodes[call[1]]
            if n.ref == 1:
                n.ref = 0
                for t in range(3):
                    if n in held[t]:
                        held[t].remove(n)
                        py[t].unref(n)
                        nat[t].unref(n)
        elif kind == "pop":
            t, k, back = call[1:]
            a, b = py[t].pop_front(k), nat[t].pop_front(k)
            assert a == b
            back = min(back, len(a))
            py[t].push_front(a[len(a) - back:])
            nat[t].push_front(a[len(a) - back:])
            for n in a[:len(a) - back]:  # dropped by the core (no remove)
                n.state[t] = 0
        elif kind == "scan":
            t, mask, steps = call[1:]
            ga, gb = py[t].candidates(), nat[t].candidates()
            for j in range(steps):
                a, b = next(ga, None), next(gb, None)
                assert a is b
                if a is None:
                    break
                if mask >> j & 1:
                    py[t].remove(a)
                    nat[t].remove(a)
                    a.state[t] = 0
            del ga, gb  # the scans end where they stand (as a broken loop leaves them)
        elif kind == "hit":  # a plan counts a hit while it holds the block
            if nodes[call[1]].ref:
                nodes[call[1]].hits += 1
        elif kind == "stale_pop":  # the copy below goes: the rank above is stale
            t, n, k = call[1:]
            n = nodes[n]
            if tracked(t + 1, n):
                py[t + 1].remove(n)
                nat[t + 1].remove(n)
                n.state[t + 1] = 0
            taken = py[t].pop_front(k)
            assert taken == nat[t].pop_front(k)
            for x in taken:  # dropped by the core
                x.state[t] = 0
        elif kind == "first":
            t = call[1]
            assert py[t].first() is nat[t].first()
        check()


@pytest.mark.skipif(LinkedCostAware is None, reason="kvflow._index_core not built")
def test_linked_cost_aware_release_ranks_parents_with_their_child():
    """A release (tail-first): a parent ranks no lower than the child before it, in
    both classes (its own worth, a shallower recompute, is less)."""
    costs = BlockCosts(load_s=(0.0, 2.0, 5.0), recompute_s=9.0, recompute_per_depth_s=1.5)
    seen = []
    for side in ("py", "nat"):
        chain = [NATIVE_CORE.Node("a")]
        for k in "bc":
            chain.append(NATIVE_CORE.Node(k, chain[-1]))
        other = NATIVE_CORE.Node("x")
        p = CostAware(8, 0, costs)
        if side == "nat":
            p = LinkedCostAware(0, 8, p)
        p.unref_all([*chain[::-1], other])
        seen.append([[n.key for n in p] if side == "nat" else
                     [n.key for r in sorted(p._buckets) for n in p._buckets[r]]])
    assert seen[0] == seen[1] == [["x", "c", "b", "a"]]  # x: depth 0, alone; a, b with c
