"""The offline optimum: Belady's MIN against a brute-force search, and as the bound.

Belady (the manager's ``belady`` policy and ``traces.optimum``) must hit
exactly as often as the best of every possible sequence of eviction choices
that keeps the cache prefix-closed (found by exhaustive search, tiny
capacities), and no online policy may ever hit more: on the device alone, and,
with more tiers, on the device and the tiers below it together (the optimum
with their capacities summed; ``kvflow.headroom``).
"""

from __future__ import annotations

import json
from functools import cache
from itertools import combinations
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvflow.belady import FutureUses
from kvflow.errors import NotEnoughBlocks
from kvflow.headroom import optimum_hit_rates, tier_hits
from kvflow.manager import CacheManager, Capacities
from kvflow.policy import EVICTION_POLICIES, OFFLINE_POLICIES
from traces import sample_path
from traces.optimum import optimum_curve, optimum_hits

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
ONLINE = sorted(set(EVICTION_POLICIES) - OFFLINE_POLICIES)

# Prompts as in test_manager_stateful: a key is the tuple of symbols up to its block,
# so it stands for its whole prefix and its parent is key[:-1].
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=4).map(
    lambda syms: tuple(tuple(syms[: i + 1]) for i in range(len(syms))))
traces_ = st.lists(prompts, min_size=1, max_size=8)


def brute_force(requests, capacity):
    """Most hits over every choice of victims, request by request, that leaves the
    cache prefix-closed (exhaustive; exponential: tiny inputs only)."""
    reqs = [r[:capacity] for r in requests]

    @cache
    def best(i: int, cached: frozenset) -> int:
        if i == len(reqs):
            return 0
        keys = reqs[i]
        hits = 0
        for k in keys:
            if k not in cached:
                break
            hits += 1
        full = cached | set(keys)
        over = len(full) - capacity
        if over <= 0:
            return hits + best(i + 1, frozenset(full))
        choices = []
        for gone in combinations(sorted(cached - set(keys)), over):
            rest = full - set(gone)
            if all(len(k) == 1 or k[:-1] in rest for k in rest):
                choices.append(best(i + 1, frozenset(rest)))
        return hits + max(choices)

    return best(0, frozenset())


class Refused(Exception):
    """A plan refused with nothing in flight: the engine would reject the request.

    It happens in tiny hierarchies under write_back (device parents whose children
    went down to a full storage tier, a host full of the request's own blocks), for
    every policy; a rejected request caches nothing, which MIN's model (every request
    caches its blocks) does not cover, so such examples are set aside."""


def replay(requests, capacities, eviction, core=None, write_policy="write_through"):
    """Cache mode as the replay runs it (every copy lands at once), retrying a plan
    refused while copies it started were in flight, as the engine does. Hits per tier."""
    dev = capacities[0]
    future = FutureUses([r[:dev] for r in requests]) if eviction == "belady" else None
    m = CacheManager(Capacities(*capacities), eviction=eviction, index_core=core,
                     write_policy=write_policy, future=future)

    def land(ops):
        queue = list(ops)
        while queue:
            queue += m.complete(queue.pop(0), True)

    for i, keys in enumerate(requests):
        while True:  # as the engine: a plan refused for copies in flight waits for them
            try:
                p = m.plan(i, keys[:dev])
                break
            except NotEnoughBlocks:
                ops = m.detached_ops[:]
                m.detached_ops.clear()
                if not ops:
                    raise Refused from None
                land(ops)
        land(p.ops)
        m.commit(p)
        land(m.finish(p))
    m.check_invariants()
    return m.stats.hits


def test_belady_on_a_hand_built_trace():
    """Two blocks, requests a b c a b: LRU hits nothing; MIN keeps a for its reuse
    (evicting b, used later) and hits once; so does every policy that can."""
    a, b, c = ("a",), ("b",), ("c",)
    reqs = [(a,), (b,), (c,), (a,), (b,)]
    assert replay(reqs, (2,), "lru")[0] == 0
    assert brute_force(reqs, 2) == optimum_hits(reqs, 2) == 1
    assert replay(reqs, (2,), "belady")[0] == 1


def test_belady_evicts_the_deeper_of_equally_distant_blocks():
    """A chain used again as a whole: its blocks' next uses tie, and the leaf must go
    first or prefix closure pins the parent (the index would refuse it)."""
    ab = (("a",), ("a", "b"))
    reqs = [ab, (("x",),), ab, (("y",),)]
    # 3 blocks: the chain and one more; MIN drops x, keeps the chain for its reuse.
    assert brute_force(reqs, 3) == optimum_hits(reqs, 3) == 2
    assert replay(reqs, (3,), "belady")[0] == 2


@settings(max_examples=150, deadline=None)
@given(reqs=traces_, cap=st.integers(1, 5), core=st.sampled_from(["python", "native"]))
def test_belady_equals_brute_force(reqs, cap, core):
    from kvflow.radix import NATIVE_CORE

    if core == "native" and NATIVE_CORE is None:
        core = "python"
    want = brute_force(reqs, cap)
    assert optimum_hits(reqs, cap) == want
    assert replay(reqs, (cap,), "belady", core)[0] == want


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(prompts, min_size=1, max_size=25), cap=st.integers(1, 8),
       eviction=st.sampled_from(ONLINE))
def test_no_online_policy_beats_the_optimum_on_the_device(reqs, cap, eviction):
    assert replay(reqs, (cap,), eviction)[0] <= optimum_hits(reqs, cap)


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(prompts, min_size=1, max_size=25), dev=st.integers(1, 5),
       host=st.integers(0, 5), storage=st.integers(0, 6),
       eviction=st.sampled_from(sorted(EVICTION_POLICIES)),
       write=st.sampled_from(["write_through", "write_back"]))
def test_no_policy_beats_the_optimum_tier_by_tier(reqs, dev, host, storage, eviction, write):
    """Device hits <= MIN(device); device + host <= MIN(device + host); and so on."""
    caps = (dev, host, storage)
    try:
        hits = replay(reqs, caps, eviction, write_policy=write)
    except Refused:
        assume(False)
    bound = tier_hits(reqs, caps)
    for t in range(3):
        assert sum(hits[: t + 1]) <= sum(bound[: t + 1]), (t, hits, bound)


def test_tier_hits_are_cumulative_differences():
    reqs = [list(range(i, i + 4)) for i in range(0, 40, 4)] * 3  # ten 4-block prompts, 3 times
    caps = (8, 16, 0)
    got = tier_hits(reqs, caps)
    assert got[0] == optimum_hits(reqs, 8)
    assert got[0] + got[1] == optimum_hits(reqs, 24, truncate=8)
    assert got[2] == 0
    rates = optimum_hit_rates(reqs, caps)
    assert rates["total"] == pytest.approx(sum(got) / 120)
    # 40 distinct blocks, all reused twice: 24 blocks hold most, never all.
    assert 0 < got[0] < got[0] + got[1] < 80


def test_optimum_curve_rises_to_the_ceiling():
    reqs = load(sample_path("conversation_1k.jsonl"))
    total = sum(map(len, reqs))
    ceiling = total - len({k for r in reqs for k in r})
    curve = optimum_curve(reqs, [1 << k for k in range(18)], ceiling=ceiling)
    hits = [h for _, h in curve]
    assert hits == sorted(hits) and 0 < hits[0] < hits[-1]  # (1 block: the shared first)
    assert hits[-1] == ceiling  # 128k blocks hold the whole sample


def load(path):
    with open(path) as f:
        return [json.loads(line)["hash_ids"] for line in f]


def test_sample_trace_belady_equals_the_optimum_and_bounds_the_rest():
    reqs = load(sample_path("conversation_1k.jsonl"))
    for cap in (64, 1024):
        best = optimum_hits(reqs, cap)
        assert replay(reqs, (cap,), "belady")[0] == best
        for eviction in ONLINE:
            assert replay(reqs, (cap,), eviction)[0] <= best, eviction


@pytest.mark.slow
@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_shared_traces_no_online_policy_beats_the_optimum(name):
    path = SHARED / name
    if not path.exists():
        pytest.skip(f"shared trace not found at {path}")
    reqs = load(path)
    for cap in (1000, 8000):
        best = optimum_hits(reqs, cap)
        assert replay(reqs, (cap,), "belady")[0] == best
        for eviction in ONLINE:
            assert replay(reqs, (cap,), eviction)[0] <= best, (eviction, cap)


def test_optimum_curve_of_a_trace_without_reuse_is_not_simulated():
    """Nothing used twice (Azure's lengths-only traces): zeros, without a pass per capacity
    (a pass over every block of a 19k-request trace would take seconds each)."""
    never = [[(i, j) for j in range(3)] for i in range(5)]
    assert optimum_curve(never, [1, 4, 16], ceiling=0) == [(1, 0), (4, 0), (16, 0)]
    assert optimum_curve(never, [1, 4, 16]) == [(1, 0), (4, 0), (16, 0)]  # (simulated)
