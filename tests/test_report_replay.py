"""The views on real replays: tiny ``run_replay`` runs (cache and full mode) rendered,
compared and swept through the real ``ReplayConfig``, locally and on a Dask LocalCluster."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from cli_helpers import AppCli
from test_report_helpers import FULL_PLOTS, embedded_pngs, rendered

from cli import app
from kvflow.replay import ReplayConfig, run_replay
from kvflow.reports import page as P
from kvflow.reports import render as R
from kvflow.reports import sweep as S
from kvflow.reports import sweep_plots as SP
from kvflow.reports.compare import compare_reports

cli = AppCli(app, columns=160).run


@pytest.fixture(scope="module")
def cache_report() -> dict:
    return run_replay(ReplayConfig(limit=50, mode="cache"))


@pytest.fixture(scope="module")
def full_report() -> dict:
    return run_replay(ReplayConfig(limit=30, sample_interval_s=2.0))


def every_metric_shown(report: dict, text: str) -> None:
    flat = R.flatten(report)
    for m in R.METRICS:
        if flat[m.key] is not None:
            assert R.fmt_value(m.kind, flat[m.key]) in text, m.key


def test_cache_mode_replay_renders(cache_report: dict) -> None:
    R.check_report(cache_report)
    text = rendered(cache_report)
    every_metric_shown(cache_report, text)
    assert "not simulated in cache mode" in text and "50" in text
    plots = P.make_plots(cache_report)
    assert list(plots) == ["hit_rate_tiers"]
    page = P.render_html(cache_report, plots)
    assert page.count("data:image/png;base64,") == 1


def test_full_mode_replay_renders(full_report: dict) -> None:
    R.check_report(full_report)
    text = rendered(full_report)
    every_metric_shown(full_report, text)
    assert R.fmt_secs(full_report["ttft_s"]["p50"]) in text
    plots = P.make_plots(full_report)
    assert list(plots) == list(FULL_PLOTS)
    page = P.render_html(full_report, plots)
    assert embedded_pngs(page) == list(plots.values())
    cmp = compare_reports(full_report, full_report)
    assert all(r.delta in (0, None) for r in cmp.rows if r.metric.key != "wall_s")


def test_replay_report_compare_commands(tmp_path: Path) -> None:
    a, b, page = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "a.html"
    assert cli("replay", "--limit", "30", "--out", a)[0] == 0
    assert cli("replay", "--limit", "30", "--host-blocks", "0", "--out", b)[0] == 0
    code, out, _ = cli("report", a, "--html", page, "--png", tmp_path / "png")
    assert code == 0 and page.read_text().count("data:image/png;base64,") == 6
    assert R.fmt_pct(json.loads(a.read_text())["hit_rate"]["total"]) in out
    code, out, _ = cli("compare", a, b, "--json")
    assert code == 0
    d = json.loads(out)
    assert d["config_diff"]["host_blocks"]["b"] == 0
    assert d["metrics"]["requests"] == {"a": 30, "b": 30, "delta": 0, "ratio": 1.0, "better": None}


def test_sweep_params_against_the_real_config() -> None:
    ps = S.parse_params(ReplayConfig, ["host_gb=0.5,1", "device_blocks=none,400", "skip_bad=no"])
    assert ps == [("host_gb", [0.5, 1.0]), ("device_blocks", [None, 400]), ("skip_bad", [False])]
    with pytest.raises(S.SweepError, match="give host_blocks or host_gb, not both"):
        S.expand_grid(ReplayConfig(host_blocks=10), ps)
    with pytest.raises(S.SweepError, match="unknown parameter 'hbm'; valid: trace, model"):
        S.parse_params(ReplayConfig, ["hbm=1"])


def test_real_sweep_local_pool_and_dask_agree(tmp_path: Path) -> None:
    distributed = pytest.importorskip("distributed")
    base = ReplayConfig(limit=40, mode="cache")
    ps = S.parse_params(ReplayConfig, ["host_blocks=0,300", "eviction=lru,s3fifo"])
    local = S.run_grid(base, ps, workers=2)  # the real run_replay, in spawned processes
    assert all(r.ok for r in local)
    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None
    ) as cluster:
        remote = S.run_grid(base, ps, scheduler=cluster.scheduler_address)
    assert all(r.ok for r in remote)

    def hits(results: list[S.PointResult]) -> list[tuple[str, ...]]:
        rows = csv.DictReader(io.StringIO(SP.csv_text(results, [n for n, _ in ps])))
        return [(r["host_blocks"], r["eviction"], r["hit_rate.total"]) for r in rows]

    assert hits(local) == hits(remote)
    by = {(r.point.params["host_blocks"]): r.report["hit_rate"]["host"] for r in local}
    assert by[0] == 0.0


def test_sweep_command_with_the_real_replay(tmp_path: Path) -> None:
    out = tmp_path / "s"
    code, stdout, stderr = cli(
        "sweep",
        "sample:conversation_1k.jsonl",
        "-p",
        "host_blocks=0,300",
        "-p",
        "limit=30",
        "-p",
        "mode=full,cache",
        "-o",
        out,
        "-j",
        "2",
    )
    assert code == 0, stderr
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [(r["host_blocks"], r["mode"]) for r in rows] == [
        ("0", "full"),
        ("0", "cache"),
        ("300", "full"),
        ("300", "cache"),
    ]
    assert rows[0]["ttft_s.p50"] and not rows[1]["ttft_s.p50"]
    assert (out / "hit_rate.png").exists() and (out / "ttft.png").exists()
    assert "sweep: 4 point(s); limit=30" in stdout
