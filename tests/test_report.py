"""``kvflow report``: tables carry the JSON's numbers, plots and HTML embed, errors are one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer
from cli_helpers import AppCli
from test_report_helpers import FULL_PLOTS, embedded_pngs, make_report, rendered

from kvflow.reports import page as P
from kvflow.reports import render as R
from kvflow.reports.cli import register

app = typer.Typer(pretty_exceptions_enable=False)
register(app)
cli = AppCli(app, columns=160)
run, user_error = cli.run, cli.user_error
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write(tmp_path: Path, report: dict, name: str = "run.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(report))
    return p


# -- formatting and tables --------------------------------------------------------------


def test_formatting() -> None:
    assert (R.fmt_pct(0.2), R.fmt_pct(0.0512), R.fmt_pct(None)) == ("20.0%", "5.1%", "-")
    assert [R.fmt_secs(x) for x in (0.4, 0.0123, 1.5, 25.26, 123.4, 4.2e-5, 0)] == [
        "400 ms",
        "12.3 ms",
        "1.50 s",
        "25.3 s",
        "123 s",
        "42.0 µs",
        "0 s",
    ]
    assert [R.fmt_bytes(x) for x in (1.5e12, 5.1e11, 999, 2.5e3)] == [
        "1.50 TB",
        "510 GB",
        "999 B",
        "2.50 kB",
    ]
    assert (R.fmt_count(1234), R.fmt_rate(30123.0, "tok/s"), R.fmt_rate(3.1, "req/s")) == (
        "1,234",
        "30,123 tok/s",
        "3.10 req/s",
    )
    assert (R.fmt_delta("pct", 0.05), R.fmt_delta("secs", -0.123), R.fmt_delta("count", 0)) == (
        "+5.0 pp",
        "-123 ms",
        "0",
    )
    assert (R.fmt_ratio(1.25), R.fmt_ratio(None)) == ("1.25×", "-")


def test_tables_contain_the_numbers_of_the_json() -> None:
    report = make_report()
    text = rendered(report, "run.json")
    # by hand, from the fixture's known values
    for words in (
        "20.0%",
        "5.0%",
        "1.0%",
        "26.0%",
        "1,234",
        "1.25 TB",
        "510 GB",
        "31.0%",
        "10.4%",
        "30,123 tok/s",
        "300 s",
        "2.50 s",
        "llama-3-8b",
        "write_through",
        "4,000",
        "20,000",
    ):
        assert words in text, words
    # and every metric the report has, formatted the one way both views use
    flat = R.flatten(report)
    for m in R.METRICS:
        if flat[m.key] is not None:
            assert R.fmt_value(m.kind, flat[m.key]) in text, m.key
    assert R.fmt_secs(report["ttft_s"]["p99"]) in text
    assert R.fmt_secs(report["e2e_s"]["mean"]) in text


def test_unknown_counters_are_shown_not_hidden() -> None:
    report = make_report()
    report["prefetch"]["timed_out"] = 4321
    text = rendered(report, "run.json")
    assert "prefetch timed out" in text and "4,321" in text


def test_cache_mode_report_says_no_timing() -> None:
    report = make_report(mode="cache")
    text = rendered(report, "run.json")
    assert "not simulated in cache mode" in text
    assert "26.0%" in text and "truncated" in text
    assert "TTFT" not in text
    assert R.flatten(report)["ttft_s.p50"] is None


def test_flatten_and_get_path() -> None:
    report = make_report()
    flat = R.flatten(report)
    assert flat["hit_rate.total"] == pytest.approx(0.26)
    assert flat["ttft_s.p99"] == report["ttft_s"]["p99"]
    assert flat["errors.replans"] is None  # absent: None, not an error
    assert R.get_path({"a": None}, "a.b") is None
    assert set(flat) == {m.key for m in R.METRICS}


# -- plots and HTML -----------------------------------------------------------------------


def test_plots_full_and_cache() -> None:
    plots = P.make_plots(make_report())
    assert list(plots) == list(FULL_PLOTS)
    for png in plots.values():
        assert png.startswith(PNG_MAGIC) and 5_000 < len(png) < 200_000
    assert list(P.make_plots(make_report(mode="cache"))) == ["hit_rate_tiers"]


def test_html_is_self_contained() -> None:
    report = make_report()
    plots = P.make_plots(report)
    page = P.render_html(report, plots, source="run.json")
    assert embedded_pngs(page) == list(plots.values())
    assert not re.search(r"(src|href)=\"(?!data:)", page)  # nothing fetched from anywhere
    assert "<script" not in page and "http://" not in page and "https://" not in page
    for words in ("26.0%", "1.25 TB", R.fmt_secs(report["ttft_s"]["p50"]), "lru"):
        assert words in page


def test_html_escapes_config_values() -> None:
    page = P.render_html(make_report(trace="<b>evil</b>.jsonl"), {})
    assert "<b>evil" not in page and "&lt;b&gt;evil" in page


# -- the command ---------------------------------------------------------------------------


def test_report_cli_tables_pngs_and_html(tmp_path: Path) -> None:
    report = make_report()
    src = write(tmp_path, report)
    out, page = tmp_path / "plots", tmp_path / "run.html"
    code, stdout, _ = run("report", src, "--png", out, "--html", page)
    assert code == 0
    assert "26.0%" in stdout and R.fmt_secs(report["ttft_s"]["p50"]) in stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.png" for n in FULL_PLOTS)
    html = page.read_text()
    assert html.count("data:image/png;base64,") == 6
    assert f"wrote 6 plot(s) to {out}" in stdout and f"wrote {page}" in stdout
    assert not list(tmp_path.glob("**/*.tmp"))


def test_report_cli_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    src = write(tmp_path, make_report())
    out, page = tmp_path / "plots", tmp_path / "run.html"
    assert run("report", src, "--png", out)[0] == 0
    page.write_text("mine")
    line = user_error("report", src, "--png", out, "--html", page)
    assert line == f"error: {page} exists; pass --force to replace it"
    assert page.read_text() == "mine"
    line = user_error("report", src, "--png", out)
    assert "exists (and 5 more); pass --force" in line
    assert run("report", src, "--png", out, "--html", page, "--force")[0] == 0
    assert page.read_text().startswith("<!DOCTYPE html>")


def test_report_cli_json(tmp_path: Path) -> None:
    report = make_report(mode="cache")
    src = write(tmp_path, report)
    code, out, _ = run("report", src, "--json", "--png", tmp_path / "p")
    assert code == 0
    d = json.loads(out)
    assert d["metrics"]["hit_rate.total"] == pytest.approx(0.26)
    assert d["metrics"]["ttft_s.p50"] is None
    assert d["files"] == [str(tmp_path / "p" / "hit_rate_tiers.png")]


def test_report_cli_user_errors(tmp_path: Path) -> None:
    assert user_error("report", tmp_path / "nope.json") == (
        f"error: {tmp_path / 'nope.json'}: no such report file"
    )
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "not JSON" in user_error("report", bad)
    bad.write_text('{"hello": 1}')
    assert "not a kvflow report" in user_error("report", bad)
    bad.write_text('{"kvflow_report": 2, "config": {}, "hit_rate": {}}')
    assert "report format 2 is not supported" in user_error("report", bad)
    bad.write_text('{"kvflow_report": 1, "config": {}}')
    assert "'hit_rate' missing" in user_error("report", bad)
    src = write(tmp_path, make_report())
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "is not a directory" in user_error("report", src, "--png", afile)
    assert "is a directory" in user_error("report", src, "--html", tmp_path)
    assert "is a directory" in user_error("report", tmp_path)
    assert "No such option" in user_error("report", src, "--pgn", "x")


def test_help_has_examples() -> None:
    for cmd in ("report", "sweep", "compare"):
        code, out, _ = run(cmd, "--help")
        assert code == 0 and "Examples" in out and f"kvflow {cmd}" in out
