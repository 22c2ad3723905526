"""Cluster replay: routers route as documented, load shaping is exact, overload is detected."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
from cli_helpers import AppCli

from kvflow.cluster.router import (
    InstanceView,
    Prediction,
    make_router,
)
from kvflow.engine import EngineRequest
from kvflow.errors import ConfigError
from kvflow.replay import ReplayConfig, resolve, run_replay
from kvflow.replay.load import instances_for, queue_growth, slo_section

BT = 16


def req(rid: str, keys: list[str], tokens: int | None = None, out: int = 4,
        t: float = 0.0) -> EngineRequest:
    return EngineRequest(rid, t, tuple(keys), tokens if tokens is not None else len(keys) * BT,
                         out)


def views(n: int, hits: dict[int, tuple[int, int, int]] | None = None,
          backlog: tuple[float, float] = (0.0, 0.0)) -> list[InstanceView]:
    hits = hits or {}
    return [InstanceView(i, BT, 1000, lookup=lambda keys, i=i: hits.get(i, (0, 0, 0)),
                         backlog_s=lambda: backlog) for i in range(n)]


PREDICT = Prediction(queue_s_per_token=1e-4, prefill_s=lambda tokens, ctx: tokens * 1e-4,
                     h2d_s_per_block=1e-3, storage_s_per_block=1e-2, decode_step_s=0.01)


def test_round_robin_cycles() -> None:
    r = make_router("round_robin", views(3))
    assert [r.route(req(str(k), ["a"]), 0.0) for k in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_random_is_seeded() -> None:
    def picks(seed: int) -> list[int]:
        r = make_router("random", views(4), seed=seed)
        return [r.route(req(str(k), ["a"]), 0.0) for k in range(32)]

    assert picks(1) == picks(1)
    assert picks(1) != picks(2)
    assert set(picks(1)) == {0, 1, 2, 3}


def test_least_loaded_takes_the_instance_with_least_outstanding_work() -> None:
    r = make_router("least_loaded", views(2))
    big, small = req("big", ["a"], 1000), req("small", ["b"], 100)
    assert r.route(big, 0.0) == 0
    assert r.route(small, 0.0) == 1          # 0 has 1000 prefill tokens queued
    assert r.route(req("c", ["c"], 100), 0.0) == 1   # 100 < 1000
    r.first_token(0, big, blocks=2)           # big's prefill is done: 2 decode blocks left
    assert r.views[0].pending_prefill_tokens == 0
    assert r.route(req("d", ["d"], 10), 0.0) == 0    # 2 * 16 < 200
    r.finished(0, big, blocks=2, decoded=True)
    assert r.views[0].decode_blocks == 0


def test_prefix_router_weighs_cached_tiers_against_load() -> None:
    # Instance 1 holds 6 of the 8 blocks on device, instance 2 all 8 on storage.
    r = make_router("prefix", views(3, {1: (6, 0, 0), 2: (0, 0, 8)}))
    assert r.route(req("a", list("abcdefgh")), 0.0) == 1   # cost 2 vs 8 vs 8 - 0.5 * 8 = 4
    # Now 1 has 8 tokens / 16 = 0.5 block... plus the routed prompt queued: 8 blocks.
    assert r.views[1].pending_prefill_tokens == 8 * BT
    assert r.route(req("b", list("abcdefgh")), 0.0) == 2   # 1: 8 + 2 = 10 > 2: 4
    assert r.stats()["prefix_routed_share"] == 1.0


def test_prefix_router_with_no_cache_balances_load() -> None:
    r = make_router("prefix", views(2))
    assert [r.route(req(str(k), ["x"]), 0.0) for k in range(4)] == [0, 1, 0, 1]


def test_ttft_router_trades_a_cached_prefix_against_a_queue() -> None:
    v = views(2, {0: (0, 8, 0)})  # instance 0 has the prompt on host
    r = make_router("ttft", v, predict=PREDICT)
    prompt = req("a", list("abcdefgh"), 8 * BT)
    # Both idle: 0 loads 8 blocks in 8 ms under a 1.6 ms prefill -> 8 ms; 1 prefills 12.8 ms.
    assert r.predicted_ttft(v[0], prompt) == pytest.approx(8e-3)
    assert r.predicted_ttft(v[1], prompt) == pytest.approx(8 * BT * 1e-4)
    assert r.route(prompt, 0.0) == 0
    v[0].pending_prefill_tokens = 1000  # 100 ms of queue on 0
    assert r.route(req("b", list("abcdefgh"), 8 * BT), 0.0) == 1


def test_ttft_router_counts_the_links_backlog() -> None:
    v = views(2, {0: (0, 8, 0), 1: (0, 8, 0)})
    v[0].backlog_s = lambda: (0.5, 0.0)  # half a second of copies queued on 0's h2d
    r = make_router("ttft", v, predict=PREDICT)
    assert r.route(req("a", list("abcdefgh")), 0.0) == 1


def test_approximate_view_remembers_what_it_routed() -> None:
    r = make_router("prefix", views(2), view="approx", predict=PREDICT)
    assert r.route(req("a1", ["s", "a"]), 0.0) == 0
    assert r.route(req("b1", ["t", "b"]), 0.0) == 1
    # Much later (queues drained by the record's own predictions): turns follow their session.
    assert r.route(req("b2", ["t", "b", "b2"]), 100.0) == 1
    assert r.route(req("a2", ["s", "a", "a2"]), 100.0) == 0


def test_approximate_view_ages_its_queue_by_the_cost_model() -> None:
    r = make_router("least_loaded", views(2), view="approx", predict=PREDICT)
    r.route(req("a", ["a"], 10_000), 0.0)            # 1 s of prefill on 0
    assert r.route(req("b", ["b"], 10), 0.5) == 1
    assert r.route(req("c", ["c"], 10), 5.0) == 0     # 0's prefill predicted done by now


def _multi_turn_trace(path: Path) -> Path:
    lines = []
    for turn in range(3):
        for s in range(4):
            ids = [1000 * s + k for k in range(2 + turn * 2)]
            lines.append(json.dumps({"timestamp": turn * 60_000,  # sessions side by side
                                     "input_length": len(ids) * 512 - 100,
                                     "output_length": 8, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("view", ["exact", "approx"])
def test_prefix_router_keeps_each_session_on_one_instance(tmp_path: Path, view: str) -> None:
    trace = _multi_turn_trace(tmp_path / "t.jsonl")
    report = run_replay(ReplayConfig(trace=str(trace), instances=4, router="prefix",
                                     router_view=view))
    assert report["requests"] == 12
    # Every later turn found its session's earlier turns: 2 of 4 blocks, then 4 of 6.
    assert report["hit_rate"]["total"] == pytest.approx((4 * 2 + 4 * 4) / (4 * (2 + 4 + 6)))
    assert report["cluster"]["routed"] == [3, 3, 3, 3]


def test_round_robin_scatters_sessions_and_loses_their_prefix(tmp_path: Path) -> None:
    trace = _multi_turn_trace(tmp_path / "t.jsonl")
    report = run_replay(ReplayConfig(trace=str(trace), instances=3, router="round_robin"))
    assert report["hit_rate"]["total"] < 0.1


def test_one_instance_is_the_plain_replay() -> None:
    """``instances=1`` takes no cluster path: same report as the defaults, no cluster section."""
    a = run_replay(ReplayConfig(limit=120))
    b = run_replay(ReplayConfig(limit=120, instances=1, router="ttft"))
    for r in (a, b):
        r.pop("wall_s")
        r["config"].pop("router")
    assert a == b
    assert "cluster" not in a


def test_rate_scaling_halves_inter_arrival_gaps_exactly() -> None:
    base = resolve(ReplayConfig(limit=200)).requests
    fast = resolve(ReplayConfig(limit=200, rate_scale=2.0)).requests
    assert [r.request_id for r in fast] == [r.request_id for r in base]
    for (a0, a1), (b0, b1) in zip(pairwise(base), pairwise(fast), strict=True):
        assert (b1.arrival_s - b0.arrival_s) == (a1.arrival_s - a0.arrival_s) / 2


def test_duration_and_poisson_arrivals() -> None:
    reqs = resolve(ReplayConfig(rate_scale=4.0, duration_s=30.0)).requests
    assert reqs and max(r.arrival_s for r in reqs) < 30.0
    a = resolve(ReplayConfig(limit=50, rate=5.0, seed=3)).requests
    b = resolve(ReplayConfig(limit=50, rate=5.0, seed=3)).requests
    assert [r.arrival_s for r in a] == [r.arrival_s for r in b]
    assert a[0].arrival_s == 0.0 and a[-1].arrival_s > 0


def test_overload_is_detected_and_a_cluster_size_suggested() -> None:
    one = run_replay(ReplayConfig(limit=400))
    assert one["load"]["overloaded"] and one["load"]["queue_grew"]
    assert one["load"]["utilization_predicted"] > 1
    n = one["load"]["instances_suggested"]
    assert n > 1
    enough = run_replay(ReplayConfig(limit=400, instances=n, router="least_loaded"))
    assert not enough["load"]["overloaded"]
    assert enough["ttft_s"]["p50"] < one["ttft_s"]["p50"] / 10


def test_instances_auto_sizes_the_cluster() -> None:
    report = run_replay(ReplayConfig(limit=400, instances="auto", router="prefix"))
    assert report["config"]["instances"] == report["load"]["instances_suggested"] > 1
    assert report["load"]["instances_auto"] is True


def test_instances_for() -> None:
    assert instances_for(None) == 1
    assert instances_for(0.5) == 1
    assert instances_for(0.71) == 2
    assert instances_for(2.6) == 4


def test_queue_growth_and_slo_sections() -> None:
    assert queue_growth([(t, 0.0) for t in range(7)]) is None
    first, last = queue_growth([(float(t), float(t)) for t in range(8)])  # type: ignore[misc]
    assert (first, last) == (0.5, 6.5)
    slo = slo_section([0.5, 1.5, 0.2], [0.01, None, 0.2], 1, 10.0, 1.0, 0.1)
    assert slo == {"ttft_s": 1.0, "tpot_s": 0.1, "met": 1, "requests": 4, "attainment": 0.25,
                   "goodput_requests_per_s": 0.1}
    assert slo_section([1.0], [None], 0, 1.0, None, None) is None


def test_replay_report_carries_slo_and_load() -> None:
    r = run_replay(ReplayConfig(limit=100, instances=2, slo_ttft_s=5.0, slo_tpot_s=0.5))
    assert 0 <= r["slo"]["attainment"] <= 1 and r["slo"]["requests"] == 100
    assert len(r["instances"]) == 2
    assert sum(row["requests"] for row in r["instances"]) == r["requests"]


@pytest.mark.parametrize("bad, msg", [
    ({"instances": 0}, "instances must be an integer >= 1 or 'auto'"),
    ({"instances": "many"}, "instances must be an integer >= 1 or 'auto'"),
    ({"router": "magic"}, "unknown router 'magic'"),
    ({"router_view": "psychic"}, "unknown router_view"),
    ({"instances": 2, "mode": "cache"}, "full mode only"),
    ({"rate_scale": 0.0}, "rate_scale must be a finite number > 0"),
    ({"slo_ttft_s": -1.0}, "slo_ttft_s must be a finite number > 0"),
])
def test_bad_cluster_settings_are_clear_errors(bad: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        ReplayConfig(**bad)


def test_cli_replay_prints_the_cluster_and_the_offered_load() -> None:
    from cli import app

    cli = AppCli(app, "replay", columns=200)
    code, out, err = cli.run("--limit", "200", "--instances", "2", "--router", "least_loaded")
    assert code == 0, err
    assert "2 instances, router least_loaded" in out
    assert "offered load" in out and "predicted utilisation" in out
    code, out, _ = cli.run("--limit", "300", "--instances", "1")
    assert code == 0 and "overloaded:" in out
    code, _, err = cli.run("--instances", "lots")
    assert code == 2 and err.strip().startswith("error: --instances must be a whole number")
