"""Prefill/decode disaggregation in the simulated cluster (``--pd P:D``).

On hand-built traces, PD gives the first token and the decode start the cost
model and the link predict, to the virtual second's last bit, layer by layer
and whole; a transfer waits for the one before it on the same NIC; blocks the
decode device holds are not sent; decode runs cut short for a landing give
what step-by-step decoding gives; bad ``pd`` values are clear errors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvflow.cost import CostModel
from kvflow.engine import Engine
from kvflow.errors import ConfigError
from kvflow.layout import preset
from kvflow.profile import load_profile
from kvflow.replay import ReplayConfig, run_replay
from kvflow.replay.config import resolve

BT = 512  # Mooncake traces' block size
SPEC = preset("llama-3-8b", block_tokens=BT)
COST = CostModel(SPEC, load_profile("h100"))
L = SPEC.num_layers
LAYER_BYTES = SPEC.bytes_per_layer_block
LAT = 5e-6


def write_trace(path: Path, rows: list[tuple[float, int, int, list[int]]]) -> str:
    """Mooncake JSONL: (arrival s, input tokens, output tokens, hash ids) per request."""
    with path.open("w") as f:
        for t, n_in, n_out, ids in rows:
            f.write(json.dumps({"timestamp": int(t * 1000), "input_length": n_in,
                                "output_length": n_out, "hash_ids": ids}) + "\n")
    return str(path)


def link(ready: list[float], blocks: int, gb_per_s: float, free: float = 0.0
         ) -> tuple[float, float]:
    """(first start, last landing) of one transfer, written out as the docs say it."""
    wire = blocks * LAYER_BYTES / (gb_per_s * 1e9)
    starts, t = [], free
    for r in ready:
        s = max(t, r + LAT)
        starts.append(s)
        t = s + wire
    return starts[0], t


def decode_end(start: float, context: int, steps: int) -> float:
    """A lone request's decode steps run as one (the simulator's multi-step run)."""
    total = 0.0
    for k in range(steps):
        total += COST.decode_step_time(1, context + k)
    return start + total


@pytest.mark.parametrize("layerwise", [True, False])
@pytest.mark.parametrize("gb_per_s", [50.0, 0.5])
def test_one_request_times_are_the_models(tmp_path: Path, layerwise: bool,
                                          gb_per_s: float) -> None:
    n_in, n_out = 1500, 4  # 3 blocks, the last one partial
    trace = write_trace(tmp_path / "t.jsonl", [(0.0, n_in, n_out, [1, 2, 3])])
    rep = run_replay(ReplayConfig(trace=trace, pd="1:1", pd_gb_per_s=gb_per_s,
                                  pd_layerwise=layerwise))
    assert rep["requests"] == 1 and rep["rejected"] == 0
    # Prefill: one step from 0; its layers end one layer time apart, its token at the end.
    ft = COST.step_time([(n_in, 0)], [])
    per_layer = COST.layer_time([(n_in, 0)], [])
    ready = [(i + 1) * per_layer for i in range(L)] if layerwise else [ft] * L
    start, landed = link(ready, 3, gb_per_s)
    decode_from = max(landed, ft)
    finish = decode_end(decode_from, n_in + 1, n_out - 1)
    assert rep["ttft_s"]["mean"] == ft
    assert rep["e2e_s"]["mean"] == finish
    assert rep["tpot_s"]["mean"] == (finish - ft) / (n_out - 1)
    pd = rep["pd"]
    assert pd["transfers"] == 1 and pd["blocks"] == 3
    assert pd["bytes"] == 3 * LAYER_BYTES * L
    assert pd["transfer_s"]["mean"] == landed - start
    assert pd["decode_wait_s"]["mean"] == decode_from - ft
    assert pd["after_prefill_s"]["mean"] == max(0.0, landed - ft)
    if gb_per_s == 50.0 and layerwise:  # streamed under the prefill: nothing left after it
        assert landed < ft and pd["decode_wait_s"]["mean"] == 0.0
    if gb_per_s == 0.5:  # a slow link: the wire, not the compute, sets the decode start
        assert landed > ft
    roles = [(r["role"], r["requests"]) for r in rep["instances"]]
    assert roles == [("prefill", 1), ("decode", 1)]
    assert rep["instances"][0]["pd_bytes_sent"] == rep["instances"][1]["pd_bytes_received"] \
        == pd["bytes"]


def test_layerwise_lands_sooner_than_whole(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [(0.0, 4000, 8, list(range(8)))])
    runs = {lw: run_replay(ReplayConfig(trace=trace, pd="1:1", pd_gb_per_s=2.0,
                                        pd_layerwise=lw)) for lw in (True, False)}
    assert runs[True]["ttft_s"] == runs[False]["ttft_s"]
    assert runs[True]["pd"]["decode_wait_s"]["mean"] < runs[False]["pd"]["decode_wait_s"]["mean"]
    assert runs[True]["pd"]["bytes"] == runs[False]["pd"]["bytes"]


def test_second_transfer_waits_for_the_first_on_the_nic(tmp_path: Path) -> None:
    """Two prompts prefilled in one step: the second's layers go after the first's last."""
    trace = write_trace(tmp_path / "t.jsonl", [(0.0, 1024, 2, [1, 2]),
                                               (0.0, 1024, 2, [3, 4])])
    gb = 0.5
    rep = run_replay(ReplayConfig(trace=trace, pd="1:1", pd_gb_per_s=gb))
    batch = [(1024, 0), (1024, 0)]
    ft = COST.step_time(batch, [])
    per_layer = COST.layer_time(batch, [])
    ready = [(i + 1) * per_layer for i in range(L)]
    s1, land1 = link(ready, 2, gb)
    s2, land2 = link(ready, 2, gb, free=land1)
    assert s2 == land1 + 0.0 and land2 > land1
    assert sorted(rep["samples"]["ttft_s"]) == [round(ft, 6)] * 2
    pd = rep["pd"]
    assert pd["transfer_s"]["mean"] == pytest.approx(((land1 - s1) + (land2 - s2)) / 2,
                                                     rel=1e-12)
    assert pd["decode_wait_s"]["mean"] == pytest.approx(((land1 - ft) + (land2 - ft)) / 2,
                                                        rel=1e-12)


def test_blocks_the_decode_device_holds_are_not_sent(tmp_path: Path) -> None:
    """A second turn decoded on the instance that decoded the first sends only what is new."""
    first = [1, 2, 3]
    trace = write_trace(tmp_path / "t.jsonl", [(0.0, 1536, 4, first),
                                               (30.0, 2500, 4, [*first, 4, 5])])
    rep = run_replay(ReplayConfig(trace=trace, pd="1:1"))
    pd = rep["pd"]
    assert pd["transfers"] == 2
    assert pd["reused_blocks"] == 3
    assert pd["blocks"] == 3 + 2
    assert pd["bytes"] == 5 * LAYER_BYTES * L


def test_decode_runs_cut_for_a_landing_match_step_by_step(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Decode steps run as one sleep are cut when a received request lands, so it joins
    the batch at the same step boundary as when every step is run on its own."""
    cfg = ReplayConfig(pd="2:2", limit=60, router="round_robin")
    fast = run_replay(cfg)
    monkeypatch.setattr(Engine, "_can_fast_forward", lambda self: False)
    slow = run_replay(cfg)
    assert fast["requests"] == slow["requests"] == 60
    for key in ("ttft_s", "tpot_s"):
        assert fast["samples"][key] == pytest.approx(slow["samples"][key], abs=2e-6)
    assert fast["pd"]["decode_wait_s"]["mean"] == pytest.approx(
        slow["pd"]["decode_wait_s"]["mean"], rel=1e-9)


def test_every_request_is_served_once() -> None:
    rep = run_replay(ReplayConfig(pd="2:1", limit=120, router="prefix"))
    assert rep["requests"] + rep["rejected"] == 120
    rows = rep["instances"]
    assert [r["role"] for r in rows] == ["prefill", "prefill", "decode"]
    assert sum(r["requests"] for r in rows if r["role"] == "prefill") == 120
    # A request of one output token ends on its prefill instance; the rest are decoded.
    one_token = sum(1 for r in resolve(ReplayConfig(limit=120)).requests if r.output_len <= 1)
    assert one_token > 0
    assert rows[2]["requests"] == rep["pd"]["requests"] == 120 - one_token
    assert len(rep["cluster"]["routed"]) == 2  # the router sees prefill instances only
    assert sum(rep["cluster"]["routed"]) == 120
    assert rep["pd"]["utilization_predicted"]["decode"] > 0


@pytest.mark.parametrize("offload", [True, False])
def test_decode_offload_follows_the_write_policy_or_is_off(offload: bool) -> None:
    rep = run_replay(ReplayConfig(pd="1:1", limit=40, pd_decode_offload=offload))
    prefill, decode = rep["instances"]
    assert prefill["bytes"]["d2h"] > 0  # write_through backs prefilled blocks up
    assert (decode["bytes"]["d2h"] > 0) is offload
    assert rep["requests"] == 40


@pytest.mark.parametrize("value", ["2", "2:2:2", "a:b", "0:2", "2:0", "-1:2", "2:", " : ",
                                   "1.5:2", 4])
def test_bad_pd_is_a_clear_error(value: object) -> None:
    with pytest.raises(ConfigError, match="pd"):
        ReplayConfig(pd=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"instances": 3}, "runs 4 instances"),
    ({"instances": "auto"}, "runs 4 instances"),
    ({"mode": "cache"}, "full mode"),
    ({"backend": "cuda"}, "simulated"),
    ({"pd_gb_per_s": 0}, "pd_gb_per_s"),
    ({"pd_gb_per_s": math.inf}, "pd_gb_per_s"),
    ({"pd_latency_s": -1e-6}, "pd_latency_s"),
    ({"pd_layerwise": "yes"}, "pd_layerwise"),
    ({"pd_decode_offload": 1}, "pd_decode_offload"),
])
def test_pd_conflicts_are_clear_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ReplayConfig(pd="2:2", **kwargs)  # type: ignore[arg-type]


def test_pd_sets_instances() -> None:
    assert ReplayConfig(pd="3:1").instances == 4
    assert ReplayConfig(pd="3:1", instances=4).instances == 4
    assert ReplayConfig().pd is None


def test_cli_prints_pd_and_refuses_bad_values(tmp_path: Path) -> None:
    from cli_helpers import AppCli

    from cli import app

    cli = AppCli(app, "replay", columns=200)
    trace = write_trace(tmp_path / "t.jsonl", [(0.0, 1500, 4, [1, 2, 3]),
                                               (0.5, 700, 3, [1, 4])])
    code, out, _ = cli.run(trace, "--pd", "1:1", "--pd-whole", "--pd-gb-per-s", "25")
    assert code == 0
    assert "PD 1:1 (whole after prefill, 25 GB/s, 5 us)" in out
    assert "wait from first token to decode mean" in out
    assert "prefill" in out and "decode" in out  # the instance rows' roles
    code, _, err = cli.run(trace, "--pd", "1")
    assert code == 2 and err.startswith("error: pd must be 'P:D'")
    code, _, err = cli.run(trace, "--pd", "1:1", "--instances", "3")
    assert code == 2 and "runs 2 instances" in err


def test_a_pd_replay_lets_requests_go_as_they_leave(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under PD, neither the engines nor the disaggregation keep a request once it has
    left both sides: its figures are folded into the report's arrays (they used to keep
    every request's state on both sides to the end, ~10 KB a request)."""
    import gc
    import weakref

    from kvflow.engine import RequestState

    refs: list[weakref.ref[RequestState]] = []
    left, release = Engine._left, Engine.release

    def spy_left(self: Engine, st: RequestState) -> None:
        refs.append(weakref.ref(st))
        left(self, st)

    def spy_release(self: Engine, st: RequestState) -> None:
        refs.append(weakref.ref(st))
        release(self, st)

    monkeypatch.setattr(Engine, "_left", spy_left)
    monkeypatch.setattr(Engine, "release", spy_release)
    alive: list[int] = []

    def inspect(_m: object, _rt: object) -> None:
        if not alive:  # the replay is over, its objects still there
            gc.collect()
            alive.append(sum(r() is not None for r in refs))

    cfg = ReplayConfig(instances=4, pd="2:2", router="prefix", limit=120, pool_blocks=3000)
    report = run_replay(cfg, inspect=inspect)
    assert report["pd"]["requests"] > 100 and len(refs) >= 2 * report["pd"]["requests"]
    assert alive == [0]
