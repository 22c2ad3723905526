"""``kvflow compare``: deltas, ratios and verdicts, the table, JSON, and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from test_report_helpers import make_report
from typer.testing import CliRunner

from kvflow.reports import render as R
from kvflow.reports.cli import register
from kvflow.reports.compare import compare_reports

app = typer.Typer(pretty_exceptions_enable=False)
register(app)
runner = CliRunner()


def run(*args: str | Path) -> tuple[int, str, str]:
    res = runner.invoke(app, list(map(str, args)), env={"COLUMNS": "160"})
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res.exit_code, res.stdout, res.stderr


def pair(tmp_path: Path) -> tuple[dict, dict, Path, Path]:
    a = make_report()
    b = make_report(seed=1, hit=(0.25, 0.08, 0.01), eviction="s3fifo", ttft_scale=0.3)
    b["rejected"] = 0
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    return a, b, pa, pb


def test_compare_numbers(tmp_path: Path) -> None:
    a, b, _, _ = pair(tmp_path)
    cmp = compare_reports(a, b)
    hit = cmp.row("hit_rate.total")
    assert (hit.a, hit.b) == (pytest.approx(0.26), pytest.approx(0.34))
    assert hit.delta == pytest.approx(0.08) and hit.ratio == pytest.approx(0.34 / 0.26)
    assert hit.verdict == 1  # more hits: B better
    p99 = cmp.row("ttft_s.p99")
    assert p99.delta == pytest.approx(b["ttft_s"]["p99"] - a["ttft_s"]["p99"])
    assert p99.verdict == (1 if p99.delta < 0 else -1)  # lower latency is better
    rej = cmp.row("rejected")
    assert (rej.delta, rej.ratio, rej.verdict) == (-3, 0.0, 1)
    assert cmp.row("bytes.d2h").verdict == 0  # neutral metric
    assert cmp.row("evictions.storage").ratio == 1.0  # 0 vs 0
    assert dict((k, (x, y)) for k, x, y in cmp.config_diff) == {
        "eviction": ("lru", "s3fifo"),
        "seed": (0, 1),
    }


def test_compare_cache_mode_drops_timing_rows() -> None:
    cmp = compare_reports(make_report(mode="cache"), make_report(mode="cache"))
    keys = {r.metric.key for r in cmp.rows}
    assert "hit_rate.total" in keys and "ttft_s.p50" not in keys
    assert cmp.config_diff == ()
    mixed = compare_reports(make_report(mode="cache"), make_report())
    row = mixed.row("ttft_s.p50")
    assert row.a is None and row.delta is None and row.ratio is None
    with pytest.raises(KeyError):
        cmp.row("ttft_s.p50")


def test_compare_cli_table(tmp_path: Path) -> None:
    a, b, pa, pb = pair(tmp_path)
    code, out, _ = run("compare", pa, pb)
    assert code == 0
    assert f"A = {pa}" in out and f"B = {pb}" in out
    assert "eviction" in out and "s3fifo" in out
    line = next(ln for ln in out.splitlines() if "hit rate total" in ln)
    for cell in ("26.0%", "34.0%", "+8.0 pp", "1.31×"):
        assert cell in line
    line = next(ln for ln in out.splitlines() if "TTFT p99" in ln)
    va, vb = a["ttft_s"]["p99"], b["ttft_s"]["p99"]
    for cell in (
        R.fmt_secs(va),
        R.fmt_secs(vb),
        R.fmt_delta("secs", vb - va),
        R.fmt_ratio(vb / va),
    ):
        assert cell in line
    same = run("compare", pa, pa)[1]
    assert "same configuration" in same


def test_compare_cli_json(tmp_path: Path) -> None:
    _, _, pa, pb = pair(tmp_path)
    code, out, _ = run("compare", pa, pb, "--json")
    assert code == 0
    d = json.loads(out)
    assert (d["a"], d["b"]) == (str(pa), str(pb))
    assert d["config_diff"]["eviction"] == {"a": "lru", "b": "s3fifo"}
    m = d["metrics"]["hit_rate.total"]
    assert m["delta"] == pytest.approx(0.08) and m["better"] == "b"
    assert d["metrics"]["bytes.d2h"]["better"] is None


def test_compare_cli_user_errors(tmp_path: Path) -> None:
    _, _, pa, _ = pair(tmp_path)
    for args, words in (
        ((pa, tmp_path / "missing.json"), "missing.json: no such report file"),
        ((pa,), "Missing argument"),
    ):
        code, _, err = run("compare", *args)
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
        assert words in err
