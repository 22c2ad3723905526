"""``kvflow serve-pd``: two processes over TCP on a trace slice, and its report."""

from __future__ import annotations

import json
from pathlib import Path

from cli_helpers import AppCli

from cli import app
from kernels import gpu_unavailable_reason
from kvflow.realtime.pd_instance import tiny_spec
from kvflow.realtime.pd_serve import PDRequest, ServeConfig, build_report, compare_tokens

CLI = AppCli(app, "serve-pd")


def test_serve_pd_runs_a_slice_through_two_processes(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    code, stdout, _ = CLI.run("--start", "480", "--limit", "4", "--time-scale", "0.05",
                              "--step-s", "0.0005", "--out", out)
    assert code == 0 and "serve-pd" in stdout and "TTFT" in stdout
    r = json.loads(out.read_text())
    assert r["kvflow_report"] == "pd-1" and r["mode"] == "pd"
    assert r["requests"] == 4 and r["failed"] == []
    assert r["errors"]["corrupt_reads"] == 0
    assert r["compute"]["decode"]["blocks_verified"] > 0  # received KV was checked
    x = r["transfer"]
    assert x["transfers"] == x["ok"] == 4 and x["failed"] == 0
    per_block = r["config"]["bytes_per_block"]
    assert x["bytes"] > 0 and x["bytes"] % per_block == 0
    assert x["wire_bytes"] > x["bytes"]  # headers, ids, handshake, pulls
    assert x["wait_at_admission_s"]["p50"] > 0 and r["ttft_s"]["p50"] > 0
    assert r["tpot_s"]["p50"] > 0 and len(r["samples"]["ttft_s"]) == 4
    for pools in r["pools_after_drain"].values():
        assert all(free == cap for free, cap in pools.values())


def test_user_mistakes_are_one_line_errors(tmp_path: Path) -> None:
    assert "on_failure" in CLI.user_error("--on-failure", "nope", "--limit", "1")
    assert "limit" in CLI.user_error("--limit", "0")
    assert "nothing.jsonl" in CLI.user_error(str(tmp_path / "nothing.jsonl"))
    (tmp_path / "x.json").write_text("{}")
    assert "--force" in CLI.user_error("--out", str(tmp_path / "x.json"))
    assert "unknown model" in CLI.user_error("--model", "gpt-17", "--limit", "1")


def test_the_report_puts_both_processes_on_one_clock() -> None:
    """The seam the simulator's PD mode is compared on: TTFT from the prefill's first
    token, TPOT over the decode side's tokens, the KV wait from decode admission."""
    spec = tiny_spec(16)
    reqs = [PDRequest(0, 0.0, (1, 2), 30, 5), PDRequest(1, 1.0, (3,), 10, 1)]
    t0 = 100.0
    port = {"bytes": 2 * spec.bytes_per_block, "frames": 4}
    side = {"started": 1, "ok": 1, "failed": 0, "skipped": 0, "recomputed": 0, "aborted": 0}
    counters = {"compute": {"corrupt_reads": 0, "blocks_verified": 3}}
    p = {"t0": t0, "records": {"0": {"first": 100.5}, "1": {"first": 101.2}}, "port": port,
         "side": side, "pools": {}, "config": {}, "counters": counters, "transfer_errors": []}
    d = {"records": {"0": {"admit": 100.1, "kv": 100.6, "finish": 102.5}, "1": {}},
         "port": port, "side": side, "wire_bytes": 9999, "pools": {}, "config": {},
         "counters": counters, "transfer_errors": []}
    r = build_report(ServeConfig(), spec, reqs, p, d)
    assert r["requests"] == 2 and r["failed"] == []
    assert abs(r["ttft_s"]["p50"] - 0.35) < 1e-9  # (0.5 + 0.2) / 2
    assert abs(r["tpot_s"]["mean"] - 2.0 / 4) < 1e-9
    assert abs(r["transfer"]["wait_at_admission_s"]["mean"] - 0.5) < 1e-9
    assert abs(r["transfer"]["after_prefill_s"]["mean"] - 0.1) < 1e-9
    assert r["transfer"]["bytes"] == 2 * spec.bytes_per_block


def test_a_request_the_decode_side_rejects_stops_the_prefill_sides_send(tmp_path: Path) -> None:
    """The decode instance refuses what it cannot hold: the prefill side's send stops at
    once (refused), not at its deadline; the request fails with the reason."""
    out = tmp_path / "pd.json"
    code, _, _ = CLI.run("--start", "480", "--limit", "3", "--time-scale", "0.05",
                         "--step-s", "0.0005", "--decode-device-blocks", "20",
                         "--deadline-s", "60", "--out", out)
    assert code == 0
    r = json.loads(out.read_text())
    assert r["failed"] and all("device blocks" in f for f in r["failed"])
    assert any("refused" in e and "rejected by the decode instance" in e
               for e in r["transfer"]["send_errors"])
    assert r["errors"]["corrupt_reads"] == 0


def test_backend_mistakes_are_one_line_errors() -> None:
    assert "backend" in CLI.user_error("--backend", "tpu", "--limit", "1")
    assert "check_tokens" in CLI.user_error("--check-tokens", "--limit", "1")
    if gpu_unavailable_reason() is not None:  # here: no GPU, said before any process starts
        assert "cuda" in CLI.user_error("--backend", "cuda", "--limit", "1")


def test_tokens_are_compared_with_the_colocated_run() -> None:
    """The decode side's tokens are the colocated run's first ``output_len - 1`` (its first
    recomputed from the received KV), the prefill's first the colocated first; a
    difference anywhere, a short decode, or a request the colocated run dropped is named."""
    reqs = [PDRequest(i, 0.0, (i,), 20, out) for i, out in enumerate((4, 4, 4, 1, 4))]
    colo = {"0": [5, 6, 7, 8], "1": [5, 6, 7, 8], "2": [5, 6, 7, 8], "3": [9], "4": []}
    pre = {"0": [5], "1": [5], "2": [4], "3": [9], "4": [5]}
    dec = {"0": [5, 6, 7], "1": [5, 0, 7], "2": [5, 6, 7], "4": [5, 6, 7]}
    t = compare_tokens(reqs, {"outputs": pre}, {"outputs": dec},
                       {"outputs": colo, "errors": {"4": "rejected"}})
    assert (t["requests"], t["equal"], t["mismatched"]) == (5, 2, 3)
    assert any(x.startswith("1: decode token 1 differs") for x in t["examples"])
    assert any(x.startswith("2: prefill's first token") for x in t["examples"])
    assert any(x.startswith("4: colocated run sampled 0") for x in t["examples"])
    short = compare_tokens(reqs[:1], {"outputs": pre}, {"outputs": {"0": [5, 6]}},
                           {"outputs": colo})
    assert short["mismatched"] == 1 and "2 sampled, 3 expected" in short["examples"][0]
