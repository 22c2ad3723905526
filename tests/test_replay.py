"""Replays through the engine on the simulated world: reports, determinism,
drains, failures, prefetch policies, and the ``kvflow replay`` command."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from test_lru_oracle import oracle
from typer.testing import CliRunner

from cli import app
from kvflow.manager import CacheManager, Capacities, OpKind
from kvflow.radix import COMPUTING, Tier
from kvflow.replay import ReplayConfig, run_replay
from kvflow.runtime import Runtime
from sim.hierarchy import Hierarchy, SimBackend
from traces import Request, sample_path, write_generic

SAMPLE = str(sample_path("conversation_1k.jsonl"))
SHARED_TRACE = Path(__file__).resolve().parents[1].parent / "shared/traces/conversation_trace.jsonl"


def check_drained(manager: CacheManager, runtime: Runtime | None) -> None:
    """After a replay: nothing in flight, nothing referenced, and a drain frees everything."""
    assert runtime is None or not runtime.tasks
    assert not manager.inflight
    manager.check_invariants()
    assert all(n.ref == 0 and n.state[Tier.DEVICE] != COMPUTING for n in manager.index)
    manager.drop_all()
    assert [p.num_used for p in manager.pools] == [0, 0, 0]


def test_cache_mode_device_only_equals_the_lru_oracle():
    cap = 2000
    r = run_replay(ReplayConfig(trace=SAMPLE, mode="cache", device_blocks=cap,
                                host_blocks=0, storage_blocks=0))
    from test_lru_oracle import load

    reqs = load(SAMPLE)
    total = sum(map(len, reqs))
    assert r["hit_rate"]["device"] == oracle(reqs, cap) / total
    assert r["hit_rate"]["host"] == r["hit_rate"]["storage"] == 0


def test_full_replay_report_is_complete_and_deterministic():
    cfg = ReplayConfig(trace=SAMPLE, limit=60, sample_interval_s=5.0)
    a, b = run_replay(cfg), run_replay(cfg)
    for key in ("requests", "hit_rate", "ttft_s", "tpot_s", "e2e_s", "throughput", "bytes",
                "link_utilization", "evictions", "prefetch", "sim_time_s", "wall_s",
                "timeseries", "samples", "config", "errors"):
        assert key in a, key
    assert a["requests"] == 60
    for q in ("mean", "p50", "p90", "p99"):
        assert a["ttft_s"][q] > 0
    assert len(a["samples"]["ttft_s"]) == 60
    ts = a["timeseries"]
    assert len(ts["t"]) == len(ts["queue_len"]) == len(ts["link_util_h2d"]) > 0
    a.pop("wall_s"), b.pop("wall_s")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.parametrize("eviction", ["lru", "lfu", "s3fifo"])
@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective",
                                          "write_back"])
def test_full_replay_with_all_tiers_drains_clean(eviction, write_policy):
    cfg = ReplayConfig(trace=SAMPLE, limit=120, device_blocks=300, host_blocks=200,
                       storage_blocks=600, eviction=eviction, write_policy=write_policy)
    r = run_replay(cfg, inspect=check_drained)
    assert r["requests"] == 120 and r["rejected"] == 0
    assert r["evictions"]["device"] > 0
    assert r["hit_rate"]["total"] > 0


def test_failed_loads_degrade_to_recompute(tmp_path):
    def fail_swap_ins(backend: SimBackend) -> None:
        backend.inject_failure(lambda op: op.kind is OpKind.SWAP_IN)

    trace = repeated_prefix_trace(tmp_path / "t.jsonl")
    cfg = ReplayConfig(trace=trace, device_blocks=40, host_blocks=200, storage_blocks=0)
    clean = run_replay(cfg)
    faulty = run_replay(cfg, configure_backend=fail_swap_ins, inspect=check_drained)
    assert clean["hit_rate"]["host"] > 0 and clean["bytes"]["h2d"] > 0
    assert faulty["requests"] == clean["requests"] == 8
    assert clean["errors"]["failed_transfers"] == 0
    assert faulty["errors"]["failed_transfers"] > 0
    assert faulty["errors"]["recomputed_blocks"] == 16
    assert faulty["bytes"]["h2d"] == 0  # nothing failed was counted as moved
    assert faulty["ttft_s"]["p99"] > clean["ttft_s"]["p99"]


def repeated_prefix_trace(path) -> str:
    """A 16-block prompt, then enough unrelated prompts to push it to storage, then it again."""
    reqs = [Request(0, 0.0, 16 * 512, 8, block_hashes=tuple(range(1000, 1016)))]
    for i in range(1, 7):
        reqs.append(Request(i, float(i), 16 * 512, 8,
                            block_hashes=tuple(range(i * 100, i * 100 + 16))))
    reqs.append(Request(7, 20.0, 16 * 512, 8, block_hashes=tuple(range(1000, 1016))))
    write_generic(reqs, path, block_tokens=512)
    return str(path)


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_policies_when_scheduled_at_once(tmp_path, policy):
    # The repeated prompt finds an idle GPU: it is scheduled on arrival, long
    # before its 1 GiB from storage (4 ops of 4 blocks, started at arrival) lands.
    trace = repeated_prefix_trace(tmp_path / "t.jsonl")
    r = run_replay(ReplayConfig(trace=trace, device_blocks=40, host_blocks=20,
                                storage_blocks=200, prefetch_policy=policy),
                   inspect=check_drained)
    pf = r["prefetch"]
    assert r["requests"] == 8 and pf["issued"] == 4
    if policy == "wait_complete":  # waits (layer by layer, behind the reads)
        assert pf == {"issued": 4, "completed": 4, "cancelled": 0, "failed": 0}
        assert r["errors"]["recomputed_blocks"] == 0 and r["hit_rate"]["storage"] == 16 / 128
    elif policy == "best_effort":
        # Cut at once, and none of it planned: no load of a block still on its
        # way up (it would wait for the read just cancelled, then fail anyway).
        assert pf["cancelled"] == 4 and r["hit_rate"]["storage"] == 0
        assert r["errors"]["recomputed_blocks"] == 0 and r["bytes"]["h2d"] == 0
        ttft = r["samples"]["ttft_s"]
        assert ttft[-1] == pytest.approx(ttft[0])  # the repeat computes like the first time
    else:  # the default timeout (21 ms) cuts it soon after: the planned loads fail
        assert pf["cancelled"] == 4 and r["hit_rate"]["storage"] == 0
        assert r["errors"]["recomputed_blocks"] == 16


def test_best_effort_serves_what_landed_while_queued(tmp_path):
    reqs = [Request(0, 0.0, 16 * 512, 8, block_hashes=tuple(range(1000, 1016)))]
    for i in range(1, 7):
        reqs.append(Request(i, float(i), 16 * 512, 8,
                            block_hashes=tuple(range(i * 100, i * 100 + 16))))
    # A long prompt holds the device; the repeat queues behind it meanwhile.
    reqs.append(Request(7, 20.0, 38 * 512, 8, block_hashes=tuple(range(5000, 5038))))
    reqs.append(Request(8, 20.001, 16 * 512, 8, block_hashes=tuple(range(1000, 1016))))
    path = tmp_path / "q.jsonl"
    write_generic(reqs, path, block_tokens=512)
    r = run_replay(ReplayConfig(trace=str(path), device_blocks=40, host_blocks=100,
                                storage_blocks=400, prefetch_policy="best_effort"),
                   inspect=check_drained)
    pf = r["prefetch"]
    assert pf["issued"] == pf["completed"] > 0 and pf["cancelled"] == pf["failed"] == 0
    assert r["errors"]["recomputed_blocks"] == 0
    blocks = 7 * 16 + 38 + 16
    # Every block of the repeat is served: the ones still on host, and the
    # rest from storage (4 blocks per prefetch op), which landed in the queue.
    assert r["hit_rate"]["storage"] == 4 * pf["completed"] / blocks
    assert r["hit_rate"]["host"] + r["hit_rate"]["storage"] == 16 / blocks


@pytest.mark.asyncio
@pytest.mark.virtual_time
async def test_one_in_flight_load_is_shared():
    loop = asyncio.get_running_loop()
    from kvflow.layout import preset
    from kvflow.profile import load_profile

    spec = preset("llama-3-8b", block_tokens=16)
    m = CacheManager(Capacities(4, host=8), write_policy="write_through")
    backend = SimBackend(loop.env, spec, Hierarchy.from_profile(load_profile("h100")))
    rt = Runtime(m, backend, spec.bytes_per_block, loop)
    p = m.plan("seed", "ab")
    m.commit(p)
    rt.submit_all(m.finish(p))
    await rt.drain()
    filler = m.plan("filler", "wxyz")  # a, b leave the device; their host copies stay
    m.commit(filler)
    m.finish(filler)
    r1, r2 = m.plan("r1", "ab"), m.plan("r2", "abc")
    (load,) = r1.ops
    assert load.kind is OpKind.SWAP_IN and r2.ops == [] and r2.shared == [load]
    task = rt.submit(load)
    assert rt.task_of(r2.shared[0]) is task
    await task
    assert rt.metrics.ops["swap_in"] == 1
    assert r2.device_ids[:2] == r1.device_ids


runner = CliRunner()


def test_cli_replay_writes_report_and_refuses_overwrite(tmp_path):
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["replay", SAMPLE, "--limit", "30", "--mode", "cache",
                              "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["requests"] == 30
    res = runner.invoke(app, ["replay", SAMPLE, "--limit", "30", "--out", str(out)])
    assert res.exit_code == 2
    assert "exists" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("args,needle", [
    (["--eviction", "mru"], "lru, lfu, s3fifo, arc"),
    (["--write-policy", "never"], "write_back"),
    (["--model", "gpt-9"], "llama-3-8b"),
    (["--profile", "tpu"], "h100"),
    (["--device-blocks", "1", "--limit", "5"], "device"),
])
def test_cli_replay_user_errors_are_one_line(args, needle):
    res = runner.invoke(app, ["replay", SAMPLE, *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.output


def test_cli_replay_missing_trace():
    res = runner.invoke(app, ["replay", "/nonexistent/trace.jsonl"])
    assert res.exit_code == 2 and "nonexistent" in res.output


def test_requests_too_big_for_the_device_are_rejected_not_hung():
    r = run_replay(ReplayConfig(trace=SAMPLE, limit=40, device_blocks=30, host_blocks=0,
                                storage_blocks=0))
    assert r["rejected"] > 0 and r["requests"] + r["rejected"] == 40
    assert math.isfinite(r["sim_time_s"])


def test_waiting_reservations_never_deadlock_the_queue():
    # A real stall, seen on the first 1,500 requests of the conversation trace:
    # waiting requests' prefetch reservations held host blocks, backups were
    # skipped for lack of host room, and device parents of held host children
    # became undroppable (prefix closure) until the head of the queue could
    # never fit with nothing running. The sampler's timer then kept virtual
    # time running forever instead of letting the loop report the deadlock.
    path = SHARED_TRACE
    if not path.exists():
        pytest.skip(f"shared trace not found at {path}")
    r = run_replay(ReplayConfig(trace=str(path), limit=1500), inspect=check_drained)
    assert r["requests"] + r["rejected"] == 1500
