"""``kvflow sweep``: files written, CSV contents, JSON, dry run, overwrite refusal, error paths.

The replay is replaced by ``fake_run`` (through the CLI's ``_replay_api`` seam),
so these tests exercise the command, not the simulator.
"""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import typer
from cli_helpers import AppCli
from test_report_helpers import FakeConfig, fake_run

import kvflow.reports.cli as report_cli
from traces import sample_path

app = typer.Typer(pretty_exceptions_enable=False)
report_cli.register(app)
cli = AppCli(app, columns=160)
run, user_error = cli.run, cli.user_error
GRID = ["-p", "host_blocks=0,1000,4000", "-p", "eviction=lru,s3fifo"]


@pytest.fixture(autouse=True)
def fake_replay(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(report_cli, "_replay_api", lambda: (FakeConfig, fake_run))
    monkeypatch.chdir(tmp_path)  # the default output directory is ./sweep


def test_sweep_writes_csv_json_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "s"
    code, stdout, stderr = run("sweep", "sample:conversation_1k.jsonl", *GRID, "-o", out)
    assert code == 0, stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "hit_rate.png",
        "sweep.csv",
        "sweep.json",
        "ttft.png",
    ]
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [(r["host_blocks"], r["eviction"]) for r in rows] == [
        ("0", "lru"),
        ("0", "s3fifo"),
        ("1000", "lru"),
        ("1000", "s3fifo"),
        ("4000", "lru"),
        ("4000", "s3fifo"),
    ]
    expect = fake_run(FakeConfig(host_blocks=4000, eviction="s3fifo"))
    assert float(rows[5]["hit_rate.total"]) == pytest.approx(expect["hit_rate"]["total"])
    assert float(rows[5]["ttft_s.p50"]) == pytest.approx(expect["ttft_s"]["p50"])
    summ = json.loads((out / "sweep.json").read_text())
    assert summ["base_config"]["trace"] == str(sample_path().resolve())
    assert summ["params"] == {"host_blocks": [0, 1000, 4000], "eviction": ["lru", "s3fifo"]}
    assert summ["failed"] == 0 and len(summ["points"]) == 6
    assert str(out / "sweep.csv") in summ["files"]
    # progress: one line per point when stderr is not a terminal
    assert len([ln for ln in stderr.splitlines() if ln.startswith("[")]) == 6
    assert "[6/6]" in stderr
    # the table
    assert "sweep: 6 point(s)" in stdout and "s3fifo" in stdout and "TTFT p99" in stdout
    assert f"wrote {out / 'sweep.csv'}" in stdout


def test_sweep_json_and_keep_reports(tmp_path: Path) -> None:
    out = tmp_path / "s"
    code, stdout, _ = run(
        "sweep",
        sample_path(),
        "-p",
        "host_blocks=0,1000",
        "-p",
        "mode=cache",
        "-o",
        out,
        "--json",
        "--keep-reports",
        "-j",
        "1",
    )
    assert code == 0
    d = json.loads(stdout)
    assert d == json.loads((out / "sweep.json").read_text())
    assert [p["params"] for p in d["points"]] == [
        {"host_blocks": 0, "mode": "cache"},
        {"host_blocks": 1000, "mode": "cache"},
    ]
    assert d["points"][1]["metrics"]["ttft_s.p50"] is None  # cache mode: no timing
    assert not (out / "ttft.png").exists() and (out / "hit_rate.png").exists()
    kept = out / "reports" / "point-001.json"
    assert json.loads(kept.read_text())["config"]["host_blocks"] == 1000
    code, stdout, _ = run("report", kept)  # a kept report renders
    assert code == 0 and "cache" in stdout


def test_sweep_refuses_to_overwrite_before_running(tmp_path: Path) -> None:
    out = tmp_path / "s"
    assert run("sweep", sample_path(), "-p", "seed=1,2", "-o", out, "--no-plots")[0] == 0
    before = (out / "sweep.csv").read_text()
    line = user_error("sweep", sample_path(), "-p", "seed=3,4", "-o", out)
    assert line == f"error: {out / 'sweep.csv'} exists (and 1 more); pass --force to replace it"
    assert (out / "sweep.csv").read_text() == before
    assert run("sweep", sample_path(), "-p", "seed=3,4", "-o", out, "--force")[0] == 0
    assert (out / "sweep.csv").read_text() != before


def test_sweep_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "s"
    code, stdout, _ = run("sweep", sample_path(), *GRID, "-o", out, "--dry-run")
    assert code == 0 and "6 point(s)" in stdout and "s3fifo" in stdout
    assert not out.exists()
    code, stdout, _ = run("sweep", sample_path(), *GRID, "--dry-run", "--json")
    assert json.loads(stdout)[1] == {"point": 1, "params": {"host_blocks": 0, "eviction": "s3fifo"}}


def test_sweep_failed_points_exit_1_with_csv(tmp_path: Path) -> None:
    out = tmp_path / "s"
    code, stdout, stderr = run("sweep", sample_path(), "-p", "host_blocks=0,666,10", "-o", out)
    assert code == 1
    assert stderr.splitlines()[-1] == (
        "error: 1 of 3 point(s) failed; first: host_blocks=666: host tier of the beast"
    )
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [r["error"] for r in rows] == ["", "host tier of the beast", ""]
    assert "host tier of the beast" in stdout  # the table's error column


def test_sweep_user_errors(tmp_path: Path) -> None:
    t = sample_path()
    assert "no such trace file" in user_error("sweep", tmp_path / "no.jsonl", "-p", "seed=1")
    assert "unknown parameter 'cache_size'; valid: trace, model" in user_error(
        "sweep", t, "-p", "cache_size=1"
    )
    assert "eviction=fifo: unknown value" in user_error("sweep", t, "-p", "eviction=fifo")
    assert "Missing option '--param'" in user_error("sweep", t)
    assert "--x seed: not a swept parameter" in user_error(
        "sweep", t, "-p", "host_blocks=0,1", "--x", "seed"
    )
    assert "--workers" in user_error("sweep", t, "-p", "seed=1", "-j", "0")
    afile = tmp_path / "f"
    afile.write_text("")
    assert "is not a directory" in user_error("sweep", t, "-p", "seed=1", "-o", afile)
    assert "limit 13 is unlucky" in user_error("sweep", t, "-p", "limit=12,13")
    assert "missing.jsonl: no such trace file" in user_error(
        "sweep", t, "-p", f"trace={t},missing.jsonl"
    )
    assert "--workers is for local runs" in user_error(
        "sweep", t, "-p", "seed=1", "--scheduler", "tcp://127.0.0.1:1", "-j", "2"
    )
    line = user_error("sweep", t, "-p", "seed=1", "--scheduler", "tcp://127.0.0.1:1")
    if importlib.util.find_spec("distributed") is None:  # an install without the dask extra
        assert "--scheduler needs dask.distributed: pip install 'kvflow[dask]'" in line
    else:
        assert "cannot reach the Dask scheduler at tcp://127.0.0.1:1" in line
    assert list(tmp_path.iterdir()) == [afile]  # nothing written, not even ./sweep


def test_sweep_without_replay_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> None:
        report_cli.fail("the replay engine is not available (No module named 'sim.cost')")

    monkeypatch.setattr(report_cli, "_replay_api", missing)
    assert "replay engine is not available" in user_error("sweep", sample_path(), "-p", "seed=1")
