"""Issue 20 item 11: a storage tier under a device with no host tier works.

``kvflow replay --host-blocks 0`` used to report storage at its full size with
0.0% hits and 0 bytes written: ``finish`` wrote down only through a host tier,
while ``plan`` already read storage hits straight to the device. Now blocks go
down device -> storage (write_through backups, write_back evictions) and come
back up at admission, whatever the prefetch policy (with no host tier there
is nothing to prefetch into).
"""

from __future__ import annotations

import pytest

from kvflow.manager import CacheManager, Capacities, OpKind
from kvflow.radix import ABSENT, READY, Tier
from kvflow.replay import ReplayConfig, run_replay


def complete_all(m: CacheManager, ops: list) -> None:
    while ops:
        ops += m.complete(ops.pop(0))


def serve(m: CacheManager, rid: int, keys: str) -> list:
    p = m.plan(rid, keys)
    complete_all(m, list(p.ops))
    m.commit(p)
    return m.finish(p)


def test_write_through_backs_up_straight_to_storage_and_reads_it_back() -> None:
    m = CacheManager(Capacities(2, host=0, storage=8), write_policy="write_through")
    ops = serve(m, 1, "ab")
    assert [(o.kind, o.src_tier, o.dst_tier, o.num_blocks) for o in ops] == [
        (OpKind.BACKUP, Tier.DEVICE, Tier.STORAGE, 2)]
    complete_all(m, ops)
    assert all(n.state == [READY, ABSENT, READY] for n in m.index)
    complete_all(m, serve(m, 2, "cd"))  # pushes "ab" off the 2-block device
    assert m.index.get("a").best_tier() == Tier.STORAGE
    p = m.plan(3, "ab")
    assert p.hits(Tier.STORAGE) == 2
    assert [(o.kind, o.src_tier, o.dst_tier) for o in p.ops] == [
        (OpKind.SWAP_IN, Tier.STORAGE, Tier.DEVICE)]
    complete_all(m, list(p.ops))
    m.commit(p)
    complete_all(m, m.finish(p))
    m.check_invariants()
    m.drop_all()
    assert [pool.num_used for pool in m.pools] == [0, 0, 0]


def test_write_back_evicts_straight_to_storage() -> None:
    m = CacheManager(Capacities(2, host=0, storage=8), write_policy="write_back")
    assert serve(m, 1, "ab") == []  # write_back: nothing at insert
    p = m.plan(2, "cd")
    assert [(o.kind, o.src_tier, o.dst_tier, o.num_blocks) for o in p.ops] == [
        (OpKind.EVICT, Tier.DEVICE, Tier.STORAGE, 2)]
    complete_all(m, list(p.ops))
    m.commit(p)
    complete_all(m, m.finish(p))
    assert [n.best_tier() for n in m.match("ab")] == [Tier.STORAGE, Tier.STORAGE]
    m.check_invariants()


@pytest.mark.parametrize("mode", ["cache", "full"])
@pytest.mark.parametrize("prefetch", ["best_effort", "wait_complete"])
def test_a_replay_without_a_host_tier_uses_its_storage(mode: str, prefetch: str) -> None:
    r = run_replay(ReplayConfig(limit=200, host_blocks=0, device_blocks=200,
                                storage_blocks=4000, mode=mode, prefetch_policy=prefetch))
    assert r["hit_rate"]["host"] == 0 and r["hit_rate"]["storage"] > 0, r["hit_rate"]
    if mode == "full":
        assert r["bytes"]["storage_write"] > 0 and r["bytes"]["storage_read"] > 0
        assert r["bytes"]["h2d"] == r["bytes"]["d2h"] == 0
