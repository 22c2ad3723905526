"""Device-only LRU through the manager == a plain OrderedDict block LRU.

Hit = the longest run of a request's leading block ids resident at arrival,
looked up before inserting; the request's blocks are then touched tail-first
(the order kvflow releases them in), and the cache trimmed to capacity.
"""

import json
from collections import OrderedDict
from pathlib import Path

import pytest

from kvflow.manager import CacheManager, Capacities
from traces import sample_path

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def oracle(requests, capacity):
    cache: OrderedDict = OrderedDict()
    hits = 0
    for ids in requests:
        for h in ids:
            if h not in cache:
                break
            hits += 1
        for h in reversed(ids):
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def through_manager(requests, capacity, core):
    m = CacheManager(Capacities(capacity), eviction="lru", index_core=core)
    for i, ids in enumerate(requests):
        p = m.plan(i, ids[:capacity])  # what does not fit is recomputed, uncached
        m.commit(p)
        m.finish(p)
    m.check_invariants()
    return m.stats.hits[0]


def load(path):
    with open(path) as f:
        return [json.loads(line)["hash_ids"] for line in f]


@pytest.mark.parametrize("capacity", [64, 512, 4096])
def test_sample_trace(capacity, core):
    reqs = load(sample_path("conversation_1k.jsonl"))
    assert through_manager(reqs, capacity, core) == oracle(reqs, capacity)


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [1000, 5000, 20000])
def test_full_conversation_trace(capacity, core):
    path = SHARED / "conversation_trace.jsonl"
    if not path.exists():
        pytest.skip(f"shared trace not found at {path}")
    reqs = load(path)
    hits = oracle(reqs, capacity)
    assert hits > 0
    assert through_manager(reqs, capacity, core) == hits
