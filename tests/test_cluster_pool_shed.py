"""What an instance of a cluster keeps of the shared pool (issue 18 (b), memory).

Each instance's storage tier is its view of the pool. It used to keep a node for every
pool block it had met, so a cluster held up to instances x pool blocks nodes while the
pool's own index holds each block once. Now a view block the instance holds nothing
else of leaves its index (``PoolViewManager.shed``) and comes back when a request walks
it (``recall``); these tests hold the count down and every decision unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.cluster.pool import GlobalPool, PoolViewManager
from kvflow.manager import Capacities
from kvflow.radix import READY, Tier
from kvflow.replay import ReplayConfig, run_replay
from traces import Request, write_generic

S = Tier.STORAGE
BT = 16


def _groups_trace(path: Path, groups: int = 7, per_group: int = 8, prefix: int = 30) -> str:
    """``groups`` system prompts of ``prefix`` blocks, each under ``per_group`` requests
    with two blocks of their own, a group's requests 2 s apart (each finds the blocks
    the one before wrote to the pool)."""
    reqs = []
    for g in range(groups):
        for r in range(per_group):
            own = 100_000 + 2 * (g * per_group + r)
            keys = (*(1000 * g + i for i in range(prefix)), own, own + 1)
            reqs.append((2.0 * r + 0.01 * g, keys))
    reqs.sort()
    write_generic([Request(i, t, len(k) * BT, 2, block_hashes=k) for i, (t, k) in
                   enumerate(reqs)], path, block_tokens=BT)
    return str(path)


def test_nodes_across_instances_are_bounded_by_the_tiers_not_instances_times_pool(tmp_path):
    """Eight instances, round robin: every instance reads every system prompt from the
    pool. The nodes the instances hold after the replay are bounded by their own tiers
    (device + host) and the pool's capacity, not by instances x pool blocks (on main:
    1,792 nodes against a bound of 1,040; now 824)."""
    trace = _groups_trace(tmp_path / "groups.jsonl")
    counts = []
    cfg = ReplayConfig(trace=trace, instances=8, router="round_robin", device_blocks=40,
                       host_blocks=40, pool_blocks=400, prefetch_policy="wait_complete")
    r = run_replay(cfg, inspect=lambda m, rt: counts.append(len(m.index)))
    pool = r["pool"]
    assert pool["evicted"] == 0 and pool["imported_copies"] >= 7 * 8 * 20  # read, not computed
    local = 8 * (40 + 40)
    assert sum(counts) <= local + pool["capacity_blocks"]
    assert sum(counts) <= 2 * local  # each instance: its tiers + what has grown since a shed


def _manager() -> PoolViewManager:
    return PoolViewManager(Capacities(8, 8, 16))


def _written(m: PoolViewManager, keys: str) -> None:
    """``m`` computes ``keys``, backs them up to host, then to its storage view (the pool)."""
    p = m.plan(keys, keys)
    m.commit(p)
    ops = m.finish(p)
    while ops:
        ops += m.complete(ops.pop(0), True)


def _drop_local(m: PoolViewManager) -> None:
    """Evict ``m``'s device and host copies (what a busy instance does in time)."""
    for t in (Tier.DEVICE, Tier.HOST):
        ids = m._make_room(t, m.pools[t].capacity, [])
        m.pools[t].free(ids)


def test_a_shed_block_comes_back_as_the_copy_it_was_and_is_dropped_once():
    a, b = _manager(), _manager()
    pool = GlobalPool(4)
    pool.attach([a, b])
    _written(a, "abc")
    reservation = b.prefetch("abc")  # b reads them up to its host
    for op in reservation.ops:
        b.complete(op, True)
    b.release(reservation)
    assert b.stats.found_copies == 3
    assert b.shed() == 0  # on its host: kept
    _drop_local(a)
    _drop_local(b)
    for m in (a, b):
        assert m.shed() == 3 and len(m.index) == 0  # a chain goes leaf first, then its parents
        m.check_invariants()
    assert pool.directory.held == {k: a.bit | b.bit for k in "abc"}
    assert pool.tier_hits(b, "abcd") == (0, 0, 3)  # the router still sees them in the pool
    # Walked again: nodes again, ready in storage, neither imported nor written anew.
    plan = b.plan(2, "abcd")
    assert plan.source_tiers == [S, S, S] and b.stats.found_copies == 3
    assert pool.directory.held == {k: a.bit for k in "abc"}
    b.commit(plan)
    ops = b.finish(plan)
    while ops:
        ops += b.complete(ops.pop(0), True)
    assert pool.directory.published == 4 and pool.directory.rewritten == 0
    assert [n.state[S] for n in b.match("abcd")] == [READY] * 4
    # The pool evicts 'd', then 'c' (leaves first): a's shed copy of 'c' counts as dropped.
    _written(a, "xy")
    assert pool.directory.evicted == 2 and "c" not in pool.directory.held
    assert a.stats.lost_copies == 1 and b.stats.lost_copies == 2
    for m in (a, b):
        assert m.index.get("c") is None or m.index.get("c").state[S] != READY
        m.check_invariants()


def test_orders_that_see_a_nodes_past_keep_every_node():
    """A recalled node starts with no hits: only LRU order and a write policy blind to
    hits may shed (LFU, or write_through_selective, would decide differently)."""
    a = PoolViewManager(Capacities(8, 8, 16), eviction="lfu")
    GlobalPool(4).attach([a])
    _written(a, "abc")
    _drop_local(a)
    assert a.shed() == 0 and len(a.index) == 3
    assert not PoolViewManager(Capacities(8, 8, 16), write_policy="write_through_selective").sheds
    assert PoolViewManager(Capacities(8, 8, 16), write_policy="write_back").sheds


CASES = {
    # Best effort: a stored block the plan does not load is one of its private blocks,
    # and takes its device copy at the end (``PoolViewManager._adopt_private``).
    "round_robin_best_effort": dict(instances=3, pool_blocks=8000, limit=300),
    "ttft_small_tiers": dict(instances=3, router="ttft", pool_blocks=800, device_blocks=150,
                             host_blocks=300, limit=300),
    "prefix_no_host": dict(instances=4, router="prefix", pool_blocks=3000, device_blocks=200,
                           host_blocks=0, limit=300),
    "prefix_wait_complete": dict(instances=5, router="prefix", pool_blocks=6000,
                                 device_blocks=150, host_blocks=300, limit=300,
                                 prefetch_policy="wait_complete"),
    "pd": dict(instances=4, pd="2:2", router="prefix", pool_blocks=3000, device_blocks=300,
               host_blocks=500, limit=200),
}


@pytest.mark.parametrize("case", list(CASES))
def test_shedding_changes_no_number_of_a_report(case, monkeypatch):
    """Shedding at every plan and never shedding give the same report, byte for byte
    (pools that evict, best effort and wait_complete, no host tier, prefill/decode)."""
    reports = []
    for every in (10**9, 1):
        monkeypatch.setattr(PoolViewManager, "shed_every", every)
        r = run_replay(ReplayConfig(seed=0, **CASES[case]))
        r.pop("wall_s")
        reports.append(json.dumps(r, sort_keys=True))
    assert reports[0] == reports[1]
