"""Issue 20 item 9: a ``timeout`` prefetch that gives up bounds the request's wait.

A store read cannot be interrupted: a cancelled read still holds its host
blocks until it returns. The swap-in that was to read them used to wait for
it anyway, so the request's TTFT became the store's delay (30 s here) instead
of the deadline. Now cancelling a transfer fails its readers at once and the
request recomputes what did not arrive. Virtual time: the numbers are exact,
whatever the machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.replay import ReplayConfig, run_replay

STORE_DELAY_S = 30.0


def late_reuse_trace(path: Path) -> Path:
    """Request 0's prefix is pushed down to storage by 1-4, then reused by 5 at t=100."""
    recs: list[dict] = [{"kvflow_trace": 1, "block_tokens": 512}]
    recs.append({"arrival_s": 0, "input_length": 2048, "output_length": 2,
                 "hash_ids": [1, 2, 3, 4]})
    for i in range(1, 5):
        recs.append({"arrival_s": i, "input_length": 2048, "output_length": 2,
                     "hash_ids": [100 * i + k for k in range(4)]})
    recs.append({"arrival_s": 100, "input_length": 2560, "output_length": 2,
                 "hash_ids": [1, 2, 3, 4, 999]})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def slow_storage_profile(path: Path) -> Path:
    path.write_text(f'base = "h100"\nname = "slow-storage"\n[storage_read]\n'
                    f"bandwidth_Bps = 6e9\nlatency_s = {STORE_DELAY_S}\n")
    return path


def replay(tmp_path: Path, policy: str) -> dict:
    return run_replay(ReplayConfig(
        trace=str(late_reuse_trace(tmp_path / "late.jsonl")),
        profile=str(slow_storage_profile(tmp_path / "slow.toml")),
        device_blocks=8, host_blocks=8, storage_blocks=100, prefetch_policy=policy))


def test_a_timed_out_prefetch_does_not_hold_the_request_to_the_store_delay(
        tmp_path: Path) -> None:
    r = replay(tmp_path, "timeout")
    assert r["prefetch"]["cancelled"] == 1  # the deadline passed; the read was given up
    assert r["errors"]["recomputed_blocks"] == 4  # and its blocks were recomputed
    # every TTFT is the deadline (at most 0.5 s) plus compute, not the 30 s read
    assert r["ttft_s"]["p99"] < 1.0, r["ttft_s"]


def test_waiting_for_the_whole_prefetch_still_waits(tmp_path: Path) -> None:
    # The contrast (and proof the setup reaches storage): wait_complete takes the hit.
    r = replay(tmp_path, "wait_complete")
    assert r["hit_rate"]["storage"] > 0 and r["errors"]["recomputed_blocks"] == 0
    assert r["ttft_s"]["p99"] > STORE_DELAY_S * 0.9


@pytest.mark.asyncio
@pytest.mark.virtual_time
async def test_cancelling_a_transfer_fails_its_readers_at_once() -> None:
    import asyncio

    from kvflow.layout import preset
    from kvflow.manager import CacheManager, Capacities, OpKind
    from kvflow.profile import Link
    from kvflow.radix import Tier
    from kvflow.runtime import Runtime
    from sim.hierarchy import Hierarchy, SimBackend

    loop = asyncio.get_running_loop()
    spec = preset("llama-3-8b")
    links = Hierarchy.default("h100")
    slow = Hierarchy(links.h2d, links.d2h, Link(6e9, STORE_DELAY_S), links.storage_write)
    m = CacheManager(Capacities(4, 4, 8), write_policy="write_through")
    rt = Runtime(m, SimBackend(loop.env, spec, slow), spec.bytes_per_block, loop)
    p = m.plan(0, ["a", "b"])
    m.commit(p)
    for t in rt.submit_all(m.finish(p)):  # device -> host -> storage
        await t
    await rt.drain()
    for n in m.index:  # leave "a", "b" in storage only
        for tier in (Tier.DEVICE, Tier.HOST):
            m.pools[tier].free([m.index.drop_copy(n, tier)])
    p = m.plan(1, ["a", "b"])
    (read,) = [rt.submit(o) for o in p.ops if o.kind is OpKind.PREFETCH]
    (swap,) = [rt.submit(o) for o in p.ops if o.kind is OpKind.SWAP_IN]
    await asyncio.sleep(0.1)
    read.cancel("deadline")
    await asyncio.sleep(0.01)
    assert swap.finished and not swap.ok  # at 0.11 s of virtual time, not at 30 s
    assert not read.finished  # the read itself ends only when the store returns
    m.commit(p)
    rt.submit_all(m.finish(p))
    await rt.drain()
    assert read.finished and not read.ok
    m.check_invariants()
