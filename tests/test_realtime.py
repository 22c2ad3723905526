"""The real-time replay driver (``kvflow.realtime``): report shape, uvloop, passes, no storage."""

from __future__ import annotations

import json

import pytest

from kvflow.errors import ConfigError
from kvflow.realtime import RealtimeConfig, RealtimeStack, engine_requests, run_realtime, tiny_spec
from kvflow.replay import ReplayConfig, run_replay
from kvflow.reports.render import check_report, flatten, sections
from kvflow.stores import MemoryStore, Namespace
from traces.generate import multi_turn

SPEC = tiny_spec()
REQS = engine_requests(multi_turn(sessions=6, turns=2, system_len=48, user_len=32,
                                  output_len=3, think_time_s=0.2, rate=40, block_tokens=16,
                                  seed=4), time_scale=0.2)


def test_report_has_the_simulator_shape_and_renders() -> None:
    store = MemoryStore(Namespace.for_model(SPEC))
    # No store deadlines: on a loaded machine a 1-2 s deadline on an in-memory store can
    # pass, and the pass-to-pass comparisons below would then measure the machine's load
    # (deadlines have their own tests in test_storage_faults / test_store_backend).
    reports = run_realtime(REQS, RealtimeConfig(device_blocks=16, host_blocks=8,
                                                prefetch_policy="wait_complete",
                                                read_timeout_s=None, write_timeout_s=None),
                           store, SPEC, passes=2, use_uvloop=True)
    sim = run_replay(ReplayConfig(limit=5))
    for r in reports:
        check_report(r)
        missing = set(sim) - set(r)
        assert not missing, missing
        flat = flatten(r)
        assert flat["requests"] == len(REQS) and r["errors"]["corrupt_reads"] == 0
        assert r["transfers"]["swap_in"]["ops"] > 0
        assert r["config"]["world"] == "cpu-realtime"
        assert [s.title for s in sections(r)]  # renders
        json.dumps(r)  # JSON-ready
    first, second = reports
    assert first["config"]["pass_index"] == 0 and second["config"]["pass_index"] == 1
    # counters are per pass: the second pass writes nothing the first already stored
    assert first["store"]["stats"]["put_ok"] > 0
    assert second["store"]["stats"]["put_ok"] < first["store"]["stats"]["put_ok"]
    assert second["hit_rate"]["total"] > first["hit_rate"]["total"]


@pytest.mark.asyncio
async def test_without_a_store_there_is_no_storage_tier() -> None:
    stack = RealtimeStack(SPEC, RealtimeConfig(device_blocks=16, host_blocks=8))
    r = await stack.replay(REQS)
    assert r["requests"] == len(REQS) and r["store"] is None
    assert stack.caps.storage == 0 and r["hit_rate"]["storage"] == 0
    assert r["errors"]["corrupt_reads"] == 0 and r["compute"]["blocks_verified"] > 0
    with pytest.raises(ConfigError, match="host tier"):
        RealtimeStack(SPEC, RealtimeConfig(host_blocks=0), MemoryStore(Namespace.for_model(SPEC)))


@pytest.mark.asyncio
async def test_the_transfer_log_keeps_one_pass_not_every_pass() -> None:
    """Issue 20, item 7: the stack's transfer log grew by every op of every pass (a
    record of nine fields per op, handles included while in flight); it now keeps the
    current pass's ops only, as columns of numbers, and each pass's summary is its own."""
    stack = RealtimeStack(SPEC, RealtimeConfig(device_blocks=16, host_blocks=8),
                          MemoryStore(Namespace.for_model(SPEC)))
    try:
        for _ in range(4):
            before = sum(stack.runtime.metrics.ops.values())
            r = await stack.replay(REQS)
            ops = sum(stack.runtime.metrics.ops.values()) - before
            assert ops > 0 and r["errors"]["corrupt_reads"] == 0
            kept = len(stack.log._ok)  # the log's columns: one entry per op
            assert kept == ops
            assert sum(t["ops"] for t in r["transfers"].values()) <= ops
        assert not stack.log.records  # no per-op records (with handles, while in flight)
    finally:
        await stack.drain()
        stack.close()
