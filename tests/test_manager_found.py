"""``CacheManager.found``: copies another instance wrote to a shared tier become this
manager's ready copies (the inverse of ``lost``), with prefix closure kept."""

from kvflow.manager import CacheManager, Capacities, OpKind
from kvflow.radix import ABSENT, COMPUTING, READY, Tier

S = Tier.STORAGE


def chain(keys):
    """(key, parent) pairs of a prompt whose keys are its blocks in order."""
    return [(k, keys[i - 1] if i else None) for i, k in enumerate(keys)]


def test_found_blocks_are_storage_hits_read_like_own_copies():
    m = CacheManager(Capacities(8, 8, 8))
    assert m.found(S, chain("abc")) == 3
    m.check_invariants()
    assert [n.state[S] for n in m.match("abcd")] == [READY] * 3
    p = m.plan(1, "abcd")
    assert p.source_tiers == [S] * 3
    assert [op.kind for op in p.ops] == [OpKind.PREFETCH, OpKind.SWAP_IN]  # via host
    assert m.stats.found_copies == 3
    m.check_invariants()


def test_found_keeps_prefix_closure():
    m = CacheManager(Capacities(8, 8, 8))
    # 'b' hangs under 'a', which nobody holds: neither goes in, nor 'c' below it.
    assert m.found(S, [("b", "a"), ("c", "b")]) == 0
    assert len(m.index) == 0
    # A parent the manager holds itself (on device) takes children from the pool.
    p = m.plan(1, "a")
    m.commit(p)
    m.finish(p)
    assert m.found(S, [("b", "a"), ("c", "b")]) == 2
    assert [n.key for n in m.match("abc")] == list("abc")
    m.check_invariants()


def test_found_leaves_own_copies_and_computing_blocks_alone():
    m = CacheManager(Capacities(8, 8, 8))
    p = m.plan(1, "ab")  # 'a', 'b' are being computed: not matchable
    assert m.index.get("a").state[0] == COMPUTING
    assert m.found(S, chain("abc")) == 0  # 'a' computing: nothing hangs below it
    assert m.index.get("a").state[S] == ABSENT
    m.commit(p)
    m.finish(p)
    assert m.found(S, chain("abc")) == 3  # now matchable: copies on storage too
    assert m.found(S, chain("abc")) == 0  # already there: left as it is
    assert m.stats.found_copies == 3
    m.check_invariants()


def test_found_evicts_for_room_but_never_what_it_hangs_on():
    m = CacheManager(Capacities(8, 0, 2))
    assert m.found(S, chain("ab")) == 2  # storage full
    # 'c' under 'b' needs a block: the only leaf, 'b', is what 'c' hangs on, and 'a'
    # cannot go before its child: no room, nothing added, nothing lost.
    assert m.found(S, [("c", "b")]) == 0
    assert [n.key for n in m.match("ab")] == ["a", "b"]
    # An unrelated chain evicts the older one, leaf first.
    assert m.found(S, chain("x")) == 1
    assert [n.key for n in m.match("ab")] == ["a"]
    m.check_invariants()


def test_found_partial_when_the_tier_is_short_keeps_parents_first():
    m = CacheManager(Capacities(8, 0, 2))
    assert m.found(S, chain("abcd")) == 2
    assert [n.key for n in m.match("abcd")] == ["a", "b"]
    m.check_invariants()


def test_lost_undoes_found():
    m = CacheManager(Capacities(8, 8, 8))
    m.found(S, chain("abc"))
    assert m.lost(S, ["a"]) == 1  # the root's last copy: its subtree goes with it
    assert len(m.index) == 0 and m.pools[S].num_free == 8
    m.check_invariants()
