"""ARC, length-aware, cost-aware and Belady, one by one, on real index nodes.

The manager-level checks (invariants under random operations, the offline
optimum as their bound) are in test_manager_stateful.py and
test_offline_optimum.py; these pin down each policy's own order.
"""

from __future__ import annotations

import pytest

from kvflow.arc import ARC
from kvflow.belady import Belady, FutureUses
from kvflow.cost import DEFAULT_COSTS, BlockCosts
from kvflow.errors import ConfigError
from kvflow.index_core import FILLING, READY, Node
from kvflow.manager import CacheManager, Capacities
from kvflow.policy import EVICTION_POLICIES, eviction_label, make_eviction_policy
from kvflow.ranked import CostAware, LengthAware

COSTS = BlockCosts(recompute_s=1.0, recompute_per_depth_s=0.25, load_s=(0.0, 0.2, 0.6))


def chain(*keys, hits=0):
    """Nodes of one prompt, root first."""
    out, parent = [], None
    for k in keys:
        parent = Node(k, parent)
        parent.hits = hits
        out.append(parent)
    return out


def release(policy, nodes):
    """As the index releases a request's blocks: tail first."""
    policy.unref_all(nodes[::-1])


# -- ARC ------------------------------------------------------------------------------------
def test_arc_new_blocks_in_t1_reused_in_t2_and_t1_goes_first():
    p = ARC(capacity=4)
    a, b = Node("a"), Node("b")
    release(p, [a])
    release(p, [b])
    p.ref(a)  # a hit on a: it is frequent now
    release(p, [a])
    assert list(p._t1) == [b] and list(p._t2) == [a]
    assert p.first() is b  # T1 holds more than its target (0)
    assert list(p.candidates()) == [b, a]


def test_arc_ghost_hits_move_the_target():
    p = ARC(capacity=2)
    a, b = Node("a"), Node("b")
    release(p, [a])
    release(p, [b])
    assert p.pop_front(1) == [a]  # evicted from T1: a ghost in B1
    assert "a" in p._b1 and p.p == 0
    release(p, [Node("a")])  # it comes back: T1 was too small
    assert p.p == 1 and "a" not in p._b1
    assert [n.key for n in p._t2] == ["a"]
    p.remove(next(iter(p._t2)))  # evicted from T2: a ghost in B2
    release(p, [Node("a")])  # it comes back: T2 was too small
    assert p.p == 0


def test_arc_push_front_restores_the_lists_and_forgets_the_ghosts():
    p = ARC(capacity=8)
    ns = [Node(i) for i in range(4)]
    for n in ns:
        release(p, [n])
    taken = p.pop_front(3)
    assert taken == ns[:3] and set(p._b1) == {0, 1, 2}
    p.push_front(taken[1:])
    assert list(p._t1) == ns[1:] and set(p._b1) == {0}
    assert p.tracked() == set(ns[1:])


def test_arc_ghosts_stay_within_the_capacity():
    p = ARC(capacity=3)
    for i in range(10):
        n = Node(i)
        release(p, [n])
        p.remove(n)
    assert len(p._b1) + len(p._b2) <= 3


# -- length-aware -----------------------------------------------------------------------------
def test_length_aware_fewest_hits_then_deepest_then_oldest():
    p = LengthAware()
    a = chain("a0", "a1", "a2", hits=1)
    b = chain("b0", "b1")
    c = chain("c0", "c1")
    for ch in (a, b, c):
        release(p, ch)
    # hits 0 first, deepest first (b1 before c1: released earlier), then a's, leaf first
    assert list(p) == [b[1], c[1], b[0], c[0], a[2], a[1], a[0]]
    assert p.first() is b[1]


def test_length_aware_pop_front_across_buckets_and_back():
    p = LengthAware()
    a = chain("a0", "a1", "a2")
    release(p, a)
    taken = p.pop_front(2)
    assert taken == [a[2], a[1]] and p.tracked() == {a[0]}
    p.push_front(taken[1:])
    assert list(p) == [a[1], a[0]]
    p.ref(a[1])  # a plan takes it: out of the order until released
    assert list(p) == [a[0]]


# -- cost-aware -------------------------------------------------------------------------------
def tiers(costs=COSTS, caps=(4, 4, 4)):
    ps = [CostAware(caps[t], t, costs) for t in range(3)]
    for p in ps:
        p.bind(ps)
    return ps


def test_cost_aware_a_device_block_also_on_host_is_worth_less():
    dev = tiers()[0]
    on_host, alone = Node("h"), Node("x")
    on_host.state[1] = READY
    release(dev, [alone])
    release(dev, [on_host])
    assert list(dev) == [on_host, alone]  # its loss costs a host load, not a prefill


def test_cost_aware_reranks_when_a_lower_copy_comes_and_goes():
    dev, host, _ = tiers()
    a, b = Node("a"), Node("b")
    release(dev, [a])
    release(dev, [b])
    assert list(dev) == [a, b]  # same worth: oldest first
    b.state[1] = READY  # b's backup lands on host...
    host.insert(b)
    assert dev.first() is b  # ...so it is the cheaper one to lose now
    b.state[1] = 0  # the host copy goes (evicted there)
    host.remove(b)
    assert dev.pop_front(1) == [a]  # b's stale rank is found and raised on the way


def test_cost_aware_deeper_blocks_worth_more_but_parents_go_last():
    dev = tiers()[0]
    (x,) = chain("x")
    release(dev, [x])
    deep = chain("r", "r1", "r2")
    release(dev, deep)
    order = list(dev)
    assert order.index(deep[2]) < order.index(deep[1]) < order.index(deep[0])
    assert order[0] is x  # a depth-0 block alone is worth the least


def test_cost_aware_clock_ages_what_was_not_used():
    """GDSF's clock: a block hit 3 times, but not since, loses to fresh blocks once
    the victims' ranks have caught up with its own."""
    dev = tiers(caps=(4, 0, 0))[0]
    (old,) = chain("o", hits=3)
    release(dev, [old])
    victims = []
    for i in range(4):
        (n,) = chain(f"n{i}")
        release(dev, [n])
        victims += dev.pop_front(1)
    assert [v.key for v in victims] == ["n0", "n1", "n2", "o"]
    assert dev.clock > 0


def test_cost_aware_costs_from_a_model():
    c = DEFAULT_COSTS
    assert c.recompute(10) > c.recompute(0) > c.load_s[2] > c.load_s[1] > 0
    with pytest.raises(ConfigError, match="block_bytes"):
        BlockCosts(1, 0, (0, 1, 2), block_bytes=0)


def test_cost_aware_filling_below_counts_as_a_route():
    dev = tiers()[0]
    n = Node("f")
    n.state[2] = FILLING
    assert dev._route(n) == 2


# -- Belady -----------------------------------------------------------------------------------
def test_future_uses_and_the_clock():
    f = FutureUses([["a", "b"], ["c"], ["a"], ["b", "a"]])
    assert (f.next_use("a"), f.next_use("b"), f.next_use("zz")) == (0, 0, f.never)
    f.advance(0)
    assert (f.next_use("a"), f.next_use("b"), f.next_use("c")) == (2, 3, 1)
    f.advance(2)
    assert (f.next_use("a"), f.next_use("c")) == (3, f.never)
    f.advance(1)  # the clock never goes back
    assert f.now == 2
    f.advance("probe")  # a request it does not know leaves the clock alone
    assert f.now == 2


def test_future_uses_with_request_ids():
    f = FutureUses([["a"], ["a"]], ids=["r7", "r9"])
    f.advance("r7")
    assert f.now == 0 and f.next_use("a") == 1


def test_belady_farthest_first_deeper_on_ties_and_stale_ranks_redone():
    f = FutureUses([["x"], ["r", "r1"], ["y"], ["x"], ["r", "r1"]])
    p = Belady(4, f)
    x, (r, r1), y = Node("x"), chain("r", "r1"), Node("y")
    f.advance(2)
    release(p, [x])
    release(p, [r, r1])
    release(p, [y])
    assert list(p) == [y, r1, r, x]  # y never again; r1 and r both at 4, r1 deeper
    f.advance(3)  # x's use went by without it (say the request stopped short)
    assert p.pop_front(3) == [y, r1, r]
    assert p.first() is x  # re-ranked on the way: never used again now


def test_belady_needs_the_future_and_is_labelled_offline():
    with pytest.raises(ConfigError, match="offline"):
        make_eviction_policy("belady", 10)
    assert eviction_label("belady") == "belady (offline)"
    assert eviction_label("arc") == "arc"


# -- every policy -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_every_policy_offers_each_node_once_and_restores_pop_front(name):
    future = FutureUses([[f"k{i}" for i in range(6)]] * 2)
    p = make_eviction_policy(name, 8, 0, future=future, costs=COSTS)
    nodes = chain(*[f"k{i}" for i in range(6)])
    if p.orders_referenced:  # S3-FIFO orders a block from the moment it is ready
        for n in nodes:
            p.insert(n)
    release(p, nodes)
    tracked = p.tracked()
    assert tracked == set(nodes)
    scan = list(p.candidates())  # the caller declines everything
    assert sorted(n.key for n in scan) == sorted(n.key for n in nodes)
    assert p.tracked() == tracked
    if name == "s3fifo":
        return  # no O(1) order: pop_front hands out nothing
    taken = p.pop_front(4)
    assert len(taken) == 4 and p.tracked() == tracked - set(taken)
    assert taken[0].depth == 5  # the leaf first
    p.push_front(taken[1:])
    assert p.tracked() == tracked - {taken[0]}
    assert p.first() is taken[1]


def test_cost_aware_rerank_below_the_bucket_being_emptied(core):
    """Regression (found by the stateful test): a block re-ranked while ``pop_front``
    empties a bucket landed in a lower new bucket, and the emptied one was then
    taken off the heap in its place."""
    m = CacheManager(Capacities(2, 1, 0), eviction="cost_aware", index_core=core, costs=COSTS)

    def land(ops):
        queue = list(ops)
        while queue:
            queue += m.complete(queue.pop(0), True)

    p = m.plan(0, [(0,)])
    land(p.ops)
    m.commit(p)
    land(m.finish(p))
    p = m.plan(1, [(0,), (0, 0)])  # its backups stay in flight
    m.commit(p)
    m.finish(p)
    m.plan(2, [(0,)], 1)
    m.check_invariants()


def test_commit_makes_a_request_ready_leaf_first(core):
    """S3-FIFO orders a block from the moment it is ready; a request's blocks must
    enter its queue tail-first (as they are released), or each eviction scans past
    the inner blocks the index has to decline (it ran ~90x LRU's time)."""
    m = CacheManager(Capacities(4), eviction="s3fifo", index_core=core)
    keys = [(0,), (0, 1), (0, 1, 2)]
    p = m.plan(0, keys)
    m.commit(p)
    assert [n.key for n in m.index.policies[0]._small] == keys[::-1]
    m.finish(p)
    m.check_invariants()


def test_native_length_aware_keeps_the_python_order():
    """``LinkedLengthAware`` (native nodes, buckets linked through them) against
    ``LengthAware`` on the same operations: the same order at every step."""
    from kvflow.policy import NATIVE_CORE, LinkedLengthAware

    if LinkedLengthAware is None:
        pytest.skip("kvflow._index_core is not built (or predates LinkedBuckets)")
    py, nat = LengthAware(), LinkedLengthAware(0)
    sides = []
    for make in (Node, NATIVE_CORE.Node):
        a = [make("a0")]
        a.append(make("a1", a[0]))
        a.append(make("a2", a[1]))
        b = [make("b0")]
        b.append(make("b1", b[0]))
        for n in a[:2]:
            n.hits = 1
        sides.append(a + b)

    def keys(p):
        return [n.key for n in p]

    for p, ns in zip((py, nat), sides, strict=True):
        p.unref_all(ns[:3][::-1])
        p.unref_all(ns[3:][::-1])
    # a2: 0 hits, depth 2; b1: 0, 1; b0: 0, 0; a1: 1 hit, depth 1; a0: 1, 0
    assert keys(py) == keys(nat) == ["a2", "b1", "b0", "a1", "a0"]
    for p, ns in zip((py, nat), sides, strict=True):
        taken = p.pop_front(3)
        assert [n.key for n in taken] == ["a2", "b1", "b0"]
        p.push_front(taken[1:])
        p.ref(ns[1])  # a1 referenced: out of the order
    assert keys(py) == keys(nat) == ["b1", "b0", "a0"]
    assert nat.ranks() == [-1, 0, 1 << 20]  # buckets by rank, none empty
    assert py.first().key == nat.first().key == "b1"
    assert {n.key for n in nat.tracked()} == {"b1", "b0", "a0"} and len(nat) == 3
    with pytest.raises(KeyError):
        nat.ref(sides[1][1])
    with pytest.raises(KeyError):
        py.ref(sides[0][1])
