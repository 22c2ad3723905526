"""``kvflow trace stats|gen|convert``: output, and the exit-2-one-line contract for user errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from cli_helpers import AppCli

from traces import open_trace, sample_path
from traces.cli import trace_app
from traces.generate import generate

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
REPO = Path(__file__).resolve().parents[1]

app = typer.Typer(pretty_exceptions_enable=False)
app.add_typer(trace_app, name="trace")
cli = AppCli(app, "trace")
run, user_error = cli.run, cli.user_error


def test_stats_table() -> None:
    code, out, _ = run("stats", sample_path())
    assert code == 0
    for words in ("requests", "1,000", "mooncake", "hit ceiling", "LRU cache hit ratio",
                  "offline optimum"):
        assert words in out


def test_stats_json_sample_shortcut() -> None:
    code, out, _ = run("stats", "sample:conversation_1k.jsonl", "--json")
    assert code == 0
    d = json.loads(out)
    assert (d["format"], d["requests"], d["duration_s"], d["block_tokens"]) == (
        "mooncake", 1000, 330.0, 512,
    )  # fmt: skip
    assert d["input_len"]["max"] == 121924 and d["lru_hit_curve"]
    lru, opt = dict(map(tuple, d["lru_hit_curve"])), dict(map(tuple, d["optimum_hit_curve"]))
    assert all(opt[c] >= lru[c] for c in lru)  # the LRU curve stays under it here
    assert opt[max(opt)] == d["block_hit_ceiling"]


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"public traces not found at {SHARED}")
def test_stats_json_shared() -> None:
    code, out, _ = run("stats", SHARED / "conversation_trace.jsonl", "--json", "--no-reuse")
    d = json.loads(out)
    assert code == 0 and d["requests"] == 12031
    assert (d["total_blocks"], d["unique_blocks"]) == (288500, 182790)
    assert d["reuse_distance"] is None
    code, out, _ = run("stats", SHARED / "AzureLLMInferenceTrace_conv.csv", "--json", "-b", "16")
    d = json.loads(out)
    assert (d["format"], d["requests"], d["block_tokens"]) == ("azure", 19366, 16)
    assert d["block_hit_ceiling"] == 0.0 and d["blocks_used_once"] == 1.0


def test_stats_user_errors(tmp_path: Path) -> None:
    assert "no such trace file" in user_error("stats", tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [0]}\n'
        '{"timestamp": 1, "input_length": -3, "output_length": 1, "hash_ids": []}\n'
    )
    line = user_error("stats", bad)
    assert line == (
        f"error: {bad}:2: field 'input_length': expected a non-negative integer, got -3"
    )
    assert "unknown format" in user_error("stats", bad, "--format", "parquet")
    assert "re-cut" in user_error("stats", bad, "-b", "16")
    assert "Missing argument" in user_error("stats")
    assert "No such option" in user_error("stats", bad, "--bogus")
    assert "No such command" in user_error("frobnicate")
    assert "is a directory" in user_error("stats", tmp_path)


def test_stats_skip_bad(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [0]}\n'
        "garbage\n"
        '{"timestamp": 2, "input_length": 3, "output_length": 1, "hash_ids": [0]}\n'
    )
    code, out, err = run("stats", bad, "--skip-bad", "--json")
    assert code == 0
    d = json.loads(out)
    assert (d["requests"], d["skipped"], d["block_hit_ceiling"]) == (2, 1, 0.5)
    assert err.startswith("warning: skipped 1 bad line(s)") and f"{bad}:2" in err


@pytest.mark.parametrize(
    ("kind", "opts", "params"),
    [
        ("shared-prefix", ["--groups", "3", "--prompts", "5", "--system-len", "700"],
         {"groups": 3, "prompts_per_group": 5, "system_len": 700}),
        ("multi-turn", ["--sessions", "4", "--turns", "3", "--private-system", "--think-time",
                        "0"],
         {"sessions": 4, "turns": 3, "shared_system": False, "think_time_s": 0.0}),
        ("agentic", ["--workflows", "2", "--branches", "3", "--tool-time", "1.5"],
         {"workflows": 2, "branches": 3, "tool_time_s": 1.5}),
        ("tool-agent", ["--sessions", "30", "--templates", "4", "--mean-steps", "3",
                        "--zipf", "0", "--length-cv", "0", "--task-len", "100"],
         {"sessions": 30, "templates": 4, "mean_steps": 3.0, "zipf": 0.0, "length_cv": 0.0,
          "task_len": 100}),
    ],
)  # fmt: skip
def test_gen_kinds(tmp_path: Path, kind: str, opts: list[str], params: dict) -> None:
    out = tmp_path / f"{kind}.jsonl"
    common = ["--seed", "5", "--rate", "3", "--burstiness", "0.25", "-b", "64"]
    code, stdout, _ = run("gen", kind, *opts, *common, "-o", out)
    assert code == 0 and f"to {out}" in stdout
    tr = open_trace(out)
    assert tr.block_tokens == 64 and tr.header["generator"] == kind and tr.header["seed"] == 5
    recorded = tr.header["params"]  # every parameter the trace was made with, for provenance
    assert (recorded["rate"], recorded["burstiness"]) == (3.0, 0.25)
    assert all(recorded[k] == v for k, v in params.items())
    want = generate(kind, seed=5, rate=3.0, burstiness=0.25, block_tokens=64, **params)
    assert list(tr) == want
    again = tmp_path / "again.jsonl"
    run("gen", kind, *opts, *common, "-o", again)
    assert again.read_bytes() == out.read_bytes()  # seeded: byte-identical


def test_gen_shared_prefix_reports_closed_form(tmp_path: Path) -> None:
    # bench_serving's generated-shared-prefix defaults: 15/16 * 2048/2176 = 0.882
    code, out, _ = run("gen", "shared-prefix", "-o", tmp_path / "x.jsonl.gz", "--with-tokens")
    assert code == 0 and "wrote 1,024 requests" in out and "ideal token hit ratio 88.2%" in out
    assert next(iter(open_trace(tmp_path / "x.jsonl.gz"))).token_ids is not None
    code, out, _ = run("stats", tmp_path / "x.jsonl.gz", "--json", "--no-reuse")
    assert json.loads(out)["token_hit_ceiling"] == pytest.approx(15 / 16 * 2048 / 2176, abs=1e-12)


def test_gen_rate_inf_and_bounds(tmp_path: Path) -> None:
    out = tmp_path / "burst.jsonl"
    assert run("gen", "shared-prefix", "--rate", "inf", "-o", out)[0] == 0
    reqs = list(open_trace(out))
    assert len(reqs) == 1024 and {r.arrival_s for r in reqs} == {0.0}  # bench_serving's default
    assert open_trace(out).header["params"]["rate"] == "inf"  # the header stays strict JSON
    cut = tmp_path / "cut.jsonl"
    code, stdout, _ = run("gen", "tool-agent", "--sessions", "200", "--duration", "30", "-o", cut)
    assert code == 0 and "ideal" not in stdout
    full = generate("tool-agent", sessions=200)
    assert list(open_trace(cut)) == [r for r in full if r.arrival_s < 30]
    assert run("gen", "multi-turn", "--limit", "5", "-o", cut, "--force")[0] == 0
    assert list(open_trace(cut)) == generate("multi-turn")[:5]


def test_gen_user_errors(tmp_path: Path) -> None:
    out = tmp_path / "g.jsonl"
    assert "unknown generator kind 'fractal'" in user_error("gen", "fractal", "-o", out)
    assert "--turns does not apply to shared-prefix" in user_error(
        "gen", "shared-prefix", "--turns", "3", "-o", out
    )
    assert "groups must be an integer >= 1" in user_error(
        "gen", "shared-prefix", "--groups", "0", "-o", out
    )
    assert "burstiness must be a finite number > 0" in user_error(
        "gen", "agentic", "--burstiness", "0", "-o", out
    )
    assert "rate must be a number > 0" in user_error("gen", "agentic", "--rate", "-1", "-o", out)
    assert "No such option: --cv" in user_error("gen", "agentic", "--cv", "2", "-o", out)
    assert "--mean-steps does not apply to agentic" in user_error(
        "gen", "agentic", "--mean-steps", "2", "-o", out
    )
    assert "duration must be" in user_error("gen", "agentic", "--duration", "-1", "-o", out)
    assert not out.exists()
    assert "Invalid value for '--groups'" in user_error(
        "gen", "shared-prefix", "--groups", "many", "-o", out
    )
    assert "Missing option" in user_error("gen", "shared-prefix")
    assert "no such directory" in user_error("gen", "agentic", "-o", tmp_path / "no" / "g.jsonl")
    assert run("gen", "agentic", "-o", out)[0] == 0
    assert "exists; pass --force" in user_error("gen", "agentic", "-o", out)
    assert run("gen", "agentic", "-o", out, "--force", "--seed", "1")[0] == 0


def test_convert_azure_to_generic(tmp_path: Path) -> None:
    out = tmp_path / "az.jsonl"
    src = sample_path("azure_code_500.csv")
    code, stdout, _ = run("convert", src, "-o", out, "-b", "16", "--limit", "100")
    assert code == 0 and "converted 100 requests" in stdout
    tr = open_trace(out)
    assert (tr.format, tr.block_tokens) == ("generic", 16)
    assert tr.header["source"] == "azure_code_500.csv"
    assert tr.header["source_format"] == "azure"
    assert list(tr) == list(open_trace(src, block_tokens=16))[:100]


def test_convert_mooncake_roundtrip(tmp_path: Path) -> None:
    out = tmp_path / "conv.jsonl.gz"
    assert run("convert", "sample:", "-o", out)[0] == 0
    assert list(open_trace(out)) == list(open_trace(sample_path()))


def test_convert_user_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [0]}\n' * 3
        + '{"timestamp": 0, "input_length": 3}\n'
    )
    out = tmp_path / "out.jsonl"
    line = user_error("convert", bad, "-o", out)
    assert f"{bad}:4: field 'output_length'" in line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]
    code, stdout, err = run("convert", bad, "-o", out, "--skip-bad")
    assert code == 0 and "converted 3 requests" in stdout and "skipped 1" in err
    assert "exists; pass --force" in user_error("convert", bad, "-o", out)
    assert "is the input file" in user_error("convert", out, "-o", out, "--force")
    assert "--limit must be >= 0" in user_error("convert", bad, "-o", out, "--limit", "-1")
    assert "cannot be re-cut" in user_error("convert", "sample:", "-o", out, "-b", "8")


def test_module_entry_point_exit_code() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "traces.cli", "stats", "missing-file.jsonl"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert res.returncode == 2
    assert res.stderr == "error: missing-file.jsonl: no such trace file\n"
