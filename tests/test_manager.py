"""CacheManager: match -> plan -> commit -> finish, eviction, write policies, failures."""

import pytest

from kvflow.errors import ConfigError, NotEnoughBlocks
from kvflow.manager import CacheManager, Capacities, OpKind
from kvflow.radix import ABSENT, COMPUTING, FILLING, READY, Tier


def run(m, rid, keys, extra=0):
    p = m.plan(rid, keys, extra)
    m.commit(p)
    return p, m.finish(p)


def complete_all(m, ops):
    while ops:
        op = ops.pop(0)
        ops += m.complete(op)


def test_miss_then_device_hit():
    m = CacheManager(Capacities(8))
    p1 = m.plan(1, "abc")
    assert p1.num_cached == 0 and [n.key for n in p1.computing] == list("abc")
    m.commit(p1)
    m.finish(p1)
    assert p1.hits(Tier.DEVICE) == 0 and len(p1.computing) == 0 and len(p1.nodes) == 3
    p2 = m.plan(2, "abcd")
    assert p2.source_tiers == [Tier.DEVICE] * 3
    assert p2.device_ids[:3] == p1.device_ids
    assert p2.ops == [] and [n.key for n in p2.computing] == ["d"]
    m.check_invariants()


def test_blocks_not_matchable_before_commit():
    # Seed-system bug: a block could be matched before its KV was written.
    m = CacheManager(Capacities(8))
    p1 = m.plan(1, "abc")
    assert m.match("abc") == []
    p2 = m.plan(2, "abc")  # computes its own private copy instead of reading garbage
    assert p2.num_cached == 0 and p2.nodes == [] and p2.private == [0, 1, 2]
    m.commit(p1)
    assert [n.key for n in m.match("abc")] == list("abc")
    m.finish(p1)
    m.commit(p2)
    m.finish(p2)  # duplicates of indexed keys are freed, not indexed twice
    m.check_invariants()
    assert m.pools[0].num_used == 3


def test_private_blocks_adopted_when_key_unknown():
    m = CacheManager(Capacities(8))
    p1 = m.plan(1, "ab")
    p2 = m.plan(2, "abx")  # 'a' is being computed by 1: 2 computes a, b, x privately
    m.commit(p1)
    m.finish(p1)
    m.commit(p2)
    m.finish(p2)  # x is new and its parent b is now cached: adopted
    assert [n.key for n in m.match("abx")] == list("abx")
    m.check_invariants()


def test_eviction_is_leaf_first():
    # Seed-system bug: parents were evicted before their children.
    for policy in ("lru", "lfu", "s3fifo"):
        m = CacheManager(Capacities(4), eviction=policy, write_policy="write_back")
        run(m, 1, "abcd")
        run(m, 2, "xy")  # must evict d, c (leaves), never a or b first
        assert [n.key for n in m.match("abcd")] == ["a", "b"], policy
        m.check_invariants()


def test_not_enough_blocks_changes_nothing():
    m = CacheManager(Capacities(4, host=4))
    p1 = m.plan(1, "abc")
    with pytest.raises(NotEnoughBlocks) as e:
        m.plan(2, "xyz")
    assert (e.value.needed, e.value.available) == (3, 1)
    assert m.pools[0].num_used == 3 and all(n.ref == 1 for n in m.index)
    m.commit(p1)
    m.finish(p1)
    m.check_invariants()


def test_write_through_backs_up_and_host_hit_swaps_in():
    m = CacheManager(Capacities(3, host=8), write_policy="write_through")
    _, backups = run(m, 1, "abc")
    assert [(o.kind, o.src_tier, o.dst_tier, o.num_blocks) for o in backups] == [
        (OpKind.BACKUP, Tier.DEVICE, Tier.HOST, 3)]
    assert all(n.state[Tier.HOST] == FILLING for n in m.index)
    complete_all(m, backups)
    assert all(n.state[Tier.HOST] == READY for n in m.index)
    _, b2 = run(m, 2, "xyz")  # evicts a, b, c from device: host copies remain
    complete_all(m, b2)
    p3 = m.plan(3, "abc")
    assert p3.source_tiers == [Tier.HOST] * 3
    (op,) = p3.ops[-1:]
    assert op.kind == OpKind.SWAP_IN and op.dst_ids == p3.device_ids
    m.complete(op)
    m.commit(p3)
    m.finish(p3)
    m.check_invariants()


def test_write_back_copy_out_precedes_reuse():
    # Seed-system bug: a device block was reused before its copy-out read it.
    m = CacheManager(Capacities(2, host=4), write_policy="write_back")
    p1, ops = run(m, 1, "ab")
    assert ops == []  # write_back: no backup at insert
    p2 = m.plan(2, "xy")
    (evict,) = p2.ops
    assert evict.kind == OpKind.EVICT and evict.dst_tier == Tier.HOST
    # The evicted ids are handed to the new request; the plan lists the
    # copy-out first, and its source ids are exactly the reused ones.
    assert sorted(evict.src_ids) == sorted(p1.device_ids) == sorted(p2.device_ids)
    assert all(n.state[Tier.HOST] == FILLING for n in evict.nodes)
    # A host hit on a block still being copied out shares that copy.
    m.commit(p2)
    m.finish(p2)
    p3 = m.plan(3, "ab")
    assert p3.source_tiers == [Tier.HOST, Tier.HOST]
    assert evict in p3.shared
    m.check_invariants()


def test_write_back_eviction_gets_past_host_room_that_closure_pins():
    # Host room is counted as free plus unreferenced ready copies, but such a copy can be
    # pinned by prefix closure: here "ax" lives on host only, under device parent "a" and
    # above device child "axy". Eviction chose "axy" to copy down into that room, found
    # none, put "axy" back and gave up: nothing referenced, nothing in flight, and still
    # a plan for the whole device was refused. Dropping "axy" unpins "ax"; dropping
    # "ax" makes room for "a".
    m = CacheManager(Capacities(3, host=1), write_policy="write_back")
    for rid, keys in enumerate((["a", "ax"], ["p", "pq"], ["a", "ax", "axy"])):
        p = m.plan(rid, keys)
        complete_all(m, list(p.ops))
        m.commit(p)
        complete_all(m, m.finish(p))
    ax = m.index.get("ax")
    assert (ax.state[Tier.DEVICE], ax.state[Tier.HOST]) == (READY, READY)
    assert not m.inflight and all(n.ref == 0 for n in m.index)
    p = m.plan("all", ["z0", "z1", "z2"])
    assert len(p.device_ids) == 3
    assert [n.key for n in m.match(["a"])] == ["a"]  # copied down, not dropped
    complete_all(m, list(p.ops))
    m.check_invariants()


def test_write_back_host_eviction_drops_a_leaf_when_storage_room_is_pinned():
    # The same chain with a one-block storage tier under the one-block host: the first
    # refused plan copies "ax" down to storage and "axy" to host, inverting the chain.
    # Then "a" (device only) is pinned by "ax" (storage only), and host's one block
    # holds "axy", the leaf under it. Host eviction chose "axy" to copy down into the
    # storage room that "ax" seemed to offer, found that "ax" may not go (its child
    # "axy" is on host only), put "axy" back and freed nothing, so "a" could go nowhere:
    # with nothing referenced and nothing in flight the plan was refused for good.
    m = CacheManager(Capacities(3, host=1, storage=1), write_policy="write_back")
    for rid, keys in enumerate((["a", "ax"], ["p", "pq"], ["a", "ax", "axy"])):
        p = m.plan(rid, keys)
        complete_all(m, list(p.ops))
        m.commit(p)
        complete_all(m, m.finish(p))
    with pytest.raises(NotEnoughBlocks):  # copy-outs in flight: it may fit once they land
        m.plan("all", ["z0", "z1", "z2"])
    complete_all(m, m.detached_ops)
    assert [(n.key, n.best_tier()) for n in m.index] == [
        ("a", Tier.DEVICE), ("ax", Tier.STORAGE), ("axy", Tier.HOST)]
    assert not m.inflight and all(n.ref == 0 for n in m.index)
    p = m.plan("all", ["z0", "z1", "z2"])
    assert len(p.device_ids) == 3
    # "axy" was dropped (no room anywhere below); "a" copied down, the prefix kept.
    assert [(n.key, n.best_tier()) for n in m.match(["a", "ax", "axy"])] == [
        ("a", Tier.HOST), ("ax", Tier.STORAGE)]
    complete_all(m, list(p.ops))
    m.check_invariants()


def test_write_through_selective_threshold():
    m = CacheManager(Capacities(8, host=8),
                     write_policy=__import__("kvflow.policy").policy.WritePolicy(
                         "write_through_selective", threshold=2))
    _, ops = run(m, 1, "ab")
    assert ops == []  # hits 0
    _, ops = run(m, 2, "ab")
    assert ops == []  # hits 1
    _, ops = run(m, 3, "ab")
    assert len(ops) == 1 and ops[0].num_blocks == 2


def test_storage_hit_prefetches_then_swaps_in():
    m = CacheManager(Capacities(2, host=2, storage=8), write_policy="write_through")
    _, ops = run(m, 1, "ab")
    complete_all(m, ops)  # device -> host -> storage
    assert all(n.state == [READY, READY, READY] for n in m.index)
    for rid, keys in ((2, "cd"), (3, "ef")):
        _, ops = run(m, rid, keys)
        complete_all(m, ops)
    assert m.index.get("a").best_tier() == Tier.STORAGE
    p = m.plan(4, "ab")
    kinds = [(o.kind, o.src_tier, o.dst_tier) for o in p.ops]
    assert (OpKind.PREFETCH, Tier.STORAGE, Tier.HOST) in kinds
    assert kinds[-1] == (OpKind.SWAP_IN, Tier.HOST, Tier.DEVICE)
    assert kinds.index((OpKind.PREFETCH, Tier.STORAGE, Tier.HOST)) < len(kinds) - 1
    m.check_invariants()


def test_failed_swap_in_degrades_to_recompute():
    m = CacheManager(Capacities(2, host=4), write_policy="write_through")
    _, ops = run(m, 1, "ab")
    complete_all(m, ops)
    run(m, 2, "xy")
    p = m.plan(3, "ab")
    (op,) = [o for o in p.ops if o.kind == OpKind.SWAP_IN]
    m.complete(op, ok=False)
    assert [n.state[Tier.DEVICE] for n in p.computing] == [COMPUTING, COMPUTING]
    assert m.match("ab") == []  # nobody reads what was not written
    assert m.stats.failed_ops == 1
    m.commit(p)  # the request recomputed them
    m.finish(p)
    assert [n.key for n in m.match("ab")] == ["a", "b"]
    m.check_invariants()


def test_failed_backup_drops_the_copy_and_frees_its_block():
    m = CacheManager(Capacities(4, host=4), write_policy="write_through")
    _, ops = run(m, 1, "ab")
    m.complete(ops[0], ok=False)
    assert all(n.state[Tier.HOST] == 0 for n in m.index)
    assert m.pools[Tier.HOST].num_used == 0
    m.check_invariants()


def test_aborted_plan_leaves_nothing():
    m = CacheManager(Capacities(4))
    run(m, 1, "ab")
    p = m.plan(2, "abcd", extra_blocks=0)
    m.finish(p)  # never committed
    assert [n.key for n in m.match("abcd")] == ["a", "b"]
    assert m.pools[0].num_used == 2
    m.check_invariants()


def test_extra_blocks_are_freed():
    m = CacheManager(Capacities(6))
    p = m.plan(1, "ab", extra_blocks=3)
    assert len(p.extra_ids) == 3 and m.pools[0].num_used == 5
    m.commit(p)
    m.finish(p)
    assert m.pools[0].num_used == 2


def test_capacities_validate():
    with pytest.raises(ConfigError, match="device"):
        Capacities(0)
    with pytest.raises(ConfigError, match="host"):
        Capacities(4, host=-1)


def test_finish_twice_is_error():
    m = CacheManager(Capacities(4))
    p, _ = run(m, 1, "a")
    with pytest.raises(ValueError, match="twice"):
        m.finish(p)


def test_backup_when_host_room_is_pinned_by_closure():
    # Found by the stateful test: s3fifo evicted an inner node from the device
    # (it had a host copy), leaving that host copy the only one above a device
    # child; host room then counted it as evictable, and a backup crashed.
    # (S3-FIFO meets leaves first now; cost_aware evicts that inner node, being
    # the one with a copy below, so it makes the same state.)
    m = CacheManager(Capacities(2, 1, 0), eviction="cost_aware", write_policy="write_through")
    p = m.plan(0, ((1,), (1, 0)))
    m.commit(p)
    (op,) = m.finish(p)
    m.complete(op)
    p2 = m.plan(1, ((0,),))
    m.commit(p2)
    inner, child = m.index.get((1,)), m.index.get((1, 0))
    assert inner.state == [ABSENT, READY, ABSENT] and child.state[Tier.DEVICE] == READY
    assert m.finish(p2) == []  # no room for a backup: none is made, nothing breaks
    m.check_invariants()


def test_failed_backup_of_inner_node_takes_its_subtree():
    # Found by the stateful test: both device copies were evicted while their
    # backups were in flight; the backups failed; the parent went, leaving
    # its child (also only ever on host) pointing at nothing.
    m = CacheManager(Capacities(2, 2), write_policy="write_through")
    p = m.plan(0, ((1,), (1, 0)))
    m.commit(p)
    (backup,) = m.finish(p)
    m.plan(1, ((0,), (0, 0)))  # evicts both device copies: host copies are filling
    m.complete(backup, ok=False)
    assert m.match(((1,), (1, 0))) == []
    assert m.pools[Tier.HOST].num_used == 0
    m.check_invariants()


def test_failed_shared_load_goes_to_a_live_sharer():
    # Found by the stateful test: the loading request was aborted, the load
    # then failed, and the block was handed to the aborted request to
    # recompute — so it stayed "computing" forever.
    m = CacheManager(Capacities(2, 4), write_policy="write_through")
    _, ops = run(m, 0, "a")
    complete_all(m, ops)
    run(m, 1, "xy")  # a leaves the device, stays on host
    loader = m.plan(2, "a")
    (load,) = loader.ops
    m.finish(loader)  # aborted while its load is in flight
    sharer = m.plan(3, "a")
    assert sharer.shared == [load]
    m.complete(load, ok=False)
    assert [n.key for n in sharer.computing] == ["a"]
    m.commit(sharer)
    m.finish(sharer)
    assert [n.key for n in m.match("a")] == ["a"]
    m.check_invariants()


def test_committed_sharer_of_a_failed_load_leaves_no_orphan():
    # Found by the stateful test: the loader aborted after its load failed;
    # the sharer committed anyway; the block stayed "computing" forever.
    m = CacheManager(Capacities(2, 1), write_policy="write_through")
    _, ops = run(m, 0, ((0,),))
    complete_all(m, ops)
    with pytest.raises(NotEnoughBlocks):
        m.plan(1, ((1,), (1, 0), (1, 0, 0)))  # evicts (0,) from the device on the way
    loader, sharer = m.plan(2, ((0,),)), m.plan(3, ((0,),))
    (load,) = loader.ops
    m.complete(load, ok=False)
    m.commit(sharer)
    m.finish(loader)
    m.finish(sharer)
    assert all(n.state[Tier.DEVICE] != COMPUTING for n in m.index)
    m.check_invariants()
    m.drop_all()
    assert [p.num_used for p in m.pools] == [0, 0, 0]


def test_aborted_plan_releases_children_before_parents():
    # Found by the stateful test: a failed load made a parent "computing";
    # aborting released it before its child and tripped over the child's ref.
    m = CacheManager(Capacities(2, 1), write_policy="write_through")
    p = m.plan(0, ((0,),))
    m.commit(p)
    (backup,) = m.finish(p)
    with pytest.raises(NotEnoughBlocks):
        m.plan(1, ((1,), (1, 0), (1, 0, 0)))
    p2 = m.plan(2, ((0,), (0, 0)))
    m.complete(backup, ok=False)
    (load,) = [o for o in p2.ops if o.kind == OpKind.SWAP_IN]
    m.complete(load, ok=False)
    m.finish(p2)
    m.check_invariants()
    m.drop_all()
    assert [p.num_used for p in m.pools] == [0, 0, 0]


def test_failed_backup_keeps_a_block_being_recomputed():
    # Found by the stateful test: the load of a block failed (its request now
    # recomputes it), then the backup it was loading from failed too; the
    # block's subtree — the request's own new block — was dropped under it.
    m = CacheManager(Capacities(2, 1), write_policy="write_through")
    p = m.plan(0, ((0,),))
    m.commit(p)
    (backup,) = m.finish(p)
    m.finish(m.plan(1, ((1,), (1, 0))))  # evicts (0,) from the device, then aborts
    p2 = m.plan(2, ((0,), (0, 0)))
    (load,) = [o for o in p2.ops if o.kind == OpKind.SWAP_IN]
    m.complete(load, ok=False)
    m.complete(backup, ok=False)
    assert [n.key for n in p2.computing] == [(0, 0), (0,)]
    m.commit(p2)
    m.finish(p2)
    assert [n.key for n in m.match(((0,), (0, 0)))] == [(0,), (0, 0)]
    m.check_invariants()


def test_aborted_sharer_of_a_failed_load_leaves_no_orphan():
    # Found by the stateful test: loader and sharer both aborted after the
    # shared load failed; the block stayed "computing" with no reference.
    m = CacheManager(Capacities(2, 1), write_policy="write_through")
    _, ops = run(m, 0, ((0,),))
    complete_all(m, ops)
    with pytest.raises(NotEnoughBlocks):
        m.plan(1, ((1,), (1, 0), (1, 0, 0)))
    loader, sharer = m.plan(2, ((0,),)), m.plan(3, ((0,),))
    m.complete(loader.ops[0], ok=False)
    m.finish(loader)
    m.finish(sharer)
    assert all(n.state[Tier.DEVICE] != COMPUTING for n in m.index)
    m.check_invariants()


def test_a_key_repeated_in_one_prompt_makes_the_rest_private():
    # The bulk insert of new blocks must not index a key twice (the second
    # would overwrite the first node): from the repeat on, blocks are private.
    m = CacheManager(Capacities(8))
    p = m.plan(1, ["a", "b", "a", "c"])
    assert [n.key for n in p.computing] == ["a", "b"] and p.private == [2, 3]
    assert len(set(p.device_ids)) == 4
    m.commit(p)
    m.finish(p)
    m.check_invariants()
    assert [n.key for n in m.match("ab")] == ["a", "b"]
    # Adopted at finish under the block before it, as private blocks are.
    assert m.index.get("c").parent is m.index.get("a") and m.pools[0].num_used == 3


def test_eviction_hands_victims_blocks_to_the_plan():
    m = CacheManager(Capacities(4))
    p1, _ = run(m, 1, "abcd")
    p2, _ = run(m, 2, "wxyz")  # evicts all of p1 (leaves first) for its own blocks
    assert sorted(p2.device_ids) == sorted(p1.device_ids)
    assert m.stats.evictions[0] == 4 and m.pools[0].num_free == 0
    assert m.match("abcd") == [] and [n.key for n in m.match("wxyz")] == list("wxyz")
    m.check_invariants()


def test_recomputed_blocks_indexed_below_become_device_copies() -> None:
    """A best-effort plan recomputes blocks that are only in storage (their prefetch
    was given up); the recomputed KV must stay on the device as those nodes' device
    copies, not be thrown away because the keys were known (the next request would
    load or recompute them again)."""
    m = CacheManager(Capacities(device=8, host=4, storage=8))
    assert m.found(Tier.STORAGE, [("a", None), ("b", "a"), ("c", "b")]) == 3
    plan = m.plan("r1", ["a", "b", "c", "d"], use_storage=False)
    assert plan.num_cached == 0 and plan.ops == []  # nothing loaded: all computed
    m.commit(plan)
    for op in m.finish(plan):
        m.complete(op, True)
    again = m.plan("r2", ["a", "b", "c", "d"], use_storage=False)
    assert again.hits(Tier.DEVICE) == 4
    m.check_invariants()


@pytest.mark.parametrize("ok", [True, False])
def test_a_node_keeps_no_inflight_list_once_its_ops_settle(ok):
    """A node's per-tier in-flight slots are a list only while an op is in flight: kept
    for the node's life, they were the second-largest thing a long cluster replay held
    (benchmarks/results/cluster.md, memory)."""
    from kvflow.index_core import NO_INFLIGHT

    m = CacheManager(Capacities(3, host=8), write_policy="write_through")
    _, backups = run(m, 1, "abc")
    assert all(n.inflight is not NO_INFLIGHT for n in m.index)  # the backups in flight
    while backups:
        op = backups.pop(0)
        backups += m.complete(op, ok=ok)
    assert all(n.inflight is NO_INFLIGHT for n in m.index)
    assert all(n.inflight[t] is None for n in m.index for t in range(3))
    m.check_invariants()
