"""``kvflow trace scale|load``: the reshaped trace written, its offered load, user errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from cli_helpers import AppCli

from traces import open_trace, sample_path
from traces.cli import trace_app
from traces.load import offered_load
from traces.reshape import bound, poisson_arrivals, rate_scale, repeat

app = typer.Typer(pretty_exceptions_enable=False)
app.add_typer(trace_app, name="trace")
cli = AppCli(app, "trace", columns=120)
run, user_error = cli.run, cli.user_error


def test_scale_writes_what_the_library_gives(tmp_path: Path) -> None:
    out = tmp_path / "c.jsonl.gz"
    code, stdout, _ = run(
        "scale", "sample:", "--rate-scale", "8", "--repeat", "3", "--duration", "100", "-o", out
    )
    assert code == 0 and "rate_scale 8.0" in stdout
    src = open_trace(sample_path())
    want = list(bound(rate_scale(repeat(src, 3), 8), duration_s=100))
    tr = open_trace(out)
    assert list(tr) == want and tr.block_tokens == 512
    assert tr.header["source"] == "conversation_1k.jsonl"
    assert tr.header["reshape"] == {"repeat": 3, "rate_scale": 8.0, "duration_s": 100.0}
    # gaps halve exactly at 2x, through the file too (JSON floats round-trip)
    half = tmp_path / "half.jsonl"
    assert run("scale", "sample:", "--rate-scale", "2", "-o", half)[0] == 0
    assert [r.arrival_s for r in open_trace(half)] == [r.arrival_s / 2 for r in src]


def test_scale_retimes_and_keeps_generator_header(tmp_path: Path) -> None:
    gen = tmp_path / "sp.jsonl"
    assert run("gen", "shared-prefix", "--groups", "2", "--rate", "inf", "-o", gen)[0] == 0
    out = tmp_path / "poisson.jsonl"
    args = ("--rate", "5", "--burstiness", "0.5", "--seed", "3", "--limit", "20", "-o", out)
    assert run("scale", gen, *args)[0] == 0
    tr = open_trace(out)
    want = list(bound(poisson_arrivals(open_trace(gen), 5, burstiness=0.5, seed=3), limit=20))
    assert list(tr) == want and len(want) == 20
    assert tr.header["source_header"]["generator"] == "shared-prefix"
    assert tr.header["reshape"] == {"rate": 5.0, "burstiness": 0.5, "seed": 3, "limit": 20}


def test_load_table_and_json(tmp_path: Path) -> None:
    code, out, _ = run("load", "sample:", "--rate-scale", "4", "--window", "30")
    assert code == 0
    for words in ("offered load", "requests", "new prompt tokens", "peak 30 s", "rate_scale 4.0"):
        assert words in out
    code, out, _ = run("load", "sample:", "--rate-scale", "4", "--window", "30", "--json")
    d = json.loads(out)
    want = offered_load(rate_scale(open_trace(sample_path()), 4), window_s=30).to_dict()
    assert {k: d[k] for k in want} == want and d["reshape"] == {"rate_scale": 4.0}
    code, out, _ = run("load", "sample:azure_code_500.csv", "-b", "16", "--json")
    d = json.loads(out)
    assert (d["block_tokens"], d["new_token_fraction"]) == (16, 1.0)  # Azure: nothing shared


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--rate-scale", "2", "--rate", "3"], "pass --rate-scale or --rate, not both"),
        (["--burstiness", "2"], "--burstiness and --seed apply only with --rate"),
        (["--share-ids"], "--gap and --share-ids apply only with --repeat"),
        (["--rate-scale", "0"], "rate scale must be a finite number > 0"),
        (["--rate-scale", "inf"], "rate scale must be a finite number > 0"),
        (["--rate", "-1"], "rate must be a number > 0"),
        (["--repeat", "0"], "copies must be an integer >= 1"),
        (["--duration", "-5"], "duration must be a finite number >= 0"),
        (["--limit", "-1"], "limit must be an integer >= 0"),
        (["--rate-scale", "fast"], "Invalid value for '--rate-scale'"),
    ],
)
def test_user_errors(tmp_path: Path, args: list[str], words: str) -> None:
    out = tmp_path / "o.jsonl"
    assert words in user_error("scale", "sample:", *args, "-o", out)
    assert words in user_error("load", "sample:", *args)
    assert not out.exists()


def test_scale_file_errors(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    assert "no such trace file" in user_error("scale", tmp_path / "none.jsonl", "-o", out)
    one = tmp_path / "one.jsonl"
    one.write_text('{"kvflow_trace": 1}\n{"arrival_s": 0, "input_length": 3, "output_length": 1}\n')
    assert "no mean gap" in user_error("scale", one, "--repeat", "2", "-o", out)
    assert not out.exists()  # failed half-way: nothing left behind
    assert run("scale", one, "--repeat", "2", "--gap", "1", "-o", out)[0] == 0
    assert [r.arrival_s for r in open_trace(out)] == [0.0, 1.0]
    assert "exists; pass --force" in user_error("scale", one, "-o", out)
    assert "is the input file" in user_error("scale", out, "-o", out, "--force")
