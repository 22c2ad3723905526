"""Turn a replay report (the JSON ``kvflow replay`` writes) into what people look at.

People sizing a cluster or picking a policy read tables and curves, not JSON, so
this module renders one report three ways from one intermediate form:

* :func:`sections` — the report as titled tables of already-formatted strings;
  :func:`print_report` prints them with rich, :func:`render_html` writes them as
  HTML. Both views show the same strings, so what the terminal says and what the
  page says cannot drift apart.
* :func:`make_plots` — PNG images (matplotlib, Agg, no pyplot global state): TTFT
  and TPOT CDFs, hit rate per tier, link utilisation and queue length over time.
* :func:`render_html` — one self-contained page: inline CSS, the PNGs embedded as
  base64 ``data:`` URIs, no script and no network access, so it can be mailed or
  archived and still opens.

:data:`METRICS` names every scalar of a report once (dotted path, unit, which
direction is better); :func:`flatten` reads them. ``kvflow compare`` and the
sweep CSV use the same list, so a new metric is added in one place.

Outputs are written with :func:`write_files`: every target is checked before the
first byte is written (an existing file without ``force`` is refused), and each
file appears atomically, so a refused or failed run leaves nothing half-written.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvflow.errors import KvflowError

REPORT_VERSION = 1
TIERS = ("device", "host", "storage")
LINKS = ("h2d", "d2h", "storage_read", "storage_write")
LINK_LABELS = {
    "h2d": "host → device",
    "d2h": "device → host",
    "storage_read": "storage read",
    "storage_write": "storage write",
}
TIER_COLORS = {"device": "#1f77b4", "host": "#ff7f0e", "storage": "#2ca02c", "total": "#222222"}
LINK_COLORS = {
    "h2d": "#1f77b4",
    "d2h": "#ff7f0e",
    "storage_read": "#2ca02c",
    "storage_write": "#d62728",
}


class ReportError(KvflowError, ValueError):
    """A report file or an output path is unusable; the message names which and why."""


# -- loading ----------------------------------------------------------------------------


def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a report file; a user's wrong file is a :class:`ReportError`."""
    p = Path(path)
    if p.is_dir():
        raise ReportError(f"{p}: is a directory, not a report file")
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReportError(f"{p}: no such report file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{p}: cannot read: {exc}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportError(f"{p}: not JSON ({exc.msg} at line {exc.lineno})") from None
    return check_report(obj, str(p))


def check_report(obj: Any, source: str = "report") -> dict[str, Any]:
    """Check the little every view relies on; everything else may be absent (shown as ``-``).

    Strict about identity and version (rendering a different format would show
    wrong numbers), lenient about missing sections (older or partial reports).
    """
    if not isinstance(obj, dict) or "kvflow_report" not in obj:
        raise ReportError(f"{source}: not a kvflow report (no 'kvflow_report' key)")
    if obj["kvflow_report"] != REPORT_VERSION:
        raise ReportError(
            f"{source}: report format {obj['kvflow_report']!r} is not supported "
            f"(this kvflow reads format {REPORT_VERSION})"
        )
    for key in ("config", "hit_rate"):
        if not isinstance(obj.get(key), dict):
            raise ReportError(f"{source}: '{key}' missing or not an object")
    return obj


# -- metrics ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    """One scalar of a report: where it lives, how to print it, which way is better.

    ``better`` is +1 when higher is better, -1 when lower is better, 0 when
    neither (bytes moved, say): compare colours deltas by it.
    """

    key: str
    label: str
    kind: str  # pct | secs | bytes | count | req_rate | tok_rate
    better: int = 0


def _latency(name: str, label: str) -> list[Metric]:
    stats = ("mean", "p50", "p90", "p99")
    return [Metric(f"{name}.{s}", f"{label} {s}", "secs", -1) for s in stats]


METRICS: tuple[Metric, ...] = (
    Metric("requests", "requests", "count"),
    Metric("rejected", "rejected", "count", -1),
    *(Metric(f"hit_rate.{t}", f"hit rate {t}", "pct", +1) for t in (*TIERS, "total")),
    *_latency("ttft_s", "TTFT"),
    *_latency("tpot_s", "TPOT"),
    *_latency("e2e_s", "E2E"),
    Metric("throughput.requests_per_s", "throughput", "req_rate", +1),
    Metric("throughput.output_tokens_per_s", "output tokens", "tok_rate", +1),
    Metric("throughput.prompt_tokens_per_s", "prompt tokens", "tok_rate", +1),
    *(Metric(f"bytes.{k}", f"bytes {LINK_LABELS[k]}", "bytes") for k in LINKS),
    *(Metric(f"link_utilization.{k}", f"util {LINK_LABELS[k]}", "pct") for k in LINKS),
    *(Metric(f"evictions.{t}", f"evictions {t}", "count") for t in TIERS),
    Metric("prefetch.issued", "prefetch issued", "count"),
    Metric("prefetch.completed", "prefetch completed", "count"),
    Metric("prefetch.cancelled", "prefetch cancelled", "count"),
    Metric("prefetch.failed", "prefetch failed", "count", -1),
    Metric("errors.failed_transfers", "failed transfers", "count", -1),
    Metric("errors.recomputed_blocks", "recomputed blocks", "count", -1),
    Metric("errors.recomputed_tokens", "recomputed tokens", "count", -1),
    Metric("errors.replans", "replans", "count", -1),
    Metric("truncated", "truncated (longer than device)", "count", -1),
    Metric("sim_time_s", "simulated time", "secs"),
    Metric("wall_s", "wall time", "secs", -1),
)
METRIC_BY_KEY: dict[str, Metric] = {m.key: m for m in METRICS}


def get_path(report: Mapping[str, Any], key: str) -> Any:
    """``report["a"]["b"]`` for ``"a.b"``; ``None`` where any step is missing."""
    cur: Any = report
    for part in key.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _number(v: Any) -> float | int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def flatten(report: Mapping[str, Any]) -> dict[str, float | int | None]:
    """Every metric of :data:`METRICS` by dotted key; ``None`` where absent or not a number."""
    return {m.key: _number(get_path(report, m.key)) for m in METRICS}


# -- formatting -------------------------------------------------------------------------

DASH = "-"


def _sig3(x: float) -> str:
    """Three significant digits without scientific notation (400, 12.3, 1.50)."""
    a = abs(x)
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def fmt_pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal: 0.2 -> ``20.0%``."""
    return DASH if x is None else f"{100 * x:.1f}%"


def fmt_secs(x: float | None) -> str:
    """Seconds in the unit that keeps three significant digits: 0.4 -> ``400 ms``."""
    if x is None:
        return DASH
    a = abs(x)
    if a == 0:
        return "0 s"
    if a < 1e-3:
        return f"{_sig3(x * 1e6)} µs"
    if a < 1:
        return f"{_sig3(x * 1e3)} ms"
    return f"{_sig3(x)} s"


_BYTE_UNITS = (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def fmt_bytes(x: float | None) -> str:
    """Decimal units, as link bandwidths are quoted: 1.5e12 -> ``1.50 TB``."""
    if x is None:
        return DASH
    for unit, scale in _BYTE_UNITS:
        if abs(x) >= scale:
            return f"{_sig3(x / scale)} {unit}"
    return f"{x:,.0f} B"


def fmt_count(x: float | None) -> str:
    """An integer with thousands separators: 1000 -> ``1,000``."""
    if x is None:
        return DASH
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.2f}"


def fmt_rate(x: float | None, unit: str) -> str:
    """A rate: three significant digits below 1,000, whole numbers above."""
    if x is None:
        return DASH
    return f"{x:,.0f} {unit}" if abs(x) >= 1000 else f"{_sig3(x)} {unit}"


def fmt_value(kind: str, x: float | None) -> str:
    """Format a metric value by its :attr:`Metric.kind`."""
    if kind == "pct":
        return fmt_pct(x)
    if kind == "secs":
        return fmt_secs(x)
    if kind == "bytes":
        return fmt_bytes(x)
    if kind == "req_rate":
        return fmt_rate(x, "req/s")
    if kind == "tok_rate":
        return fmt_rate(x, "tok/s")
    return fmt_count(x)


def fmt_delta(kind: str, d: float | None) -> str:
    """A signed difference in the metric's unit; percentages differ in points (``pp``)."""
    if d is None:
        return DASH
    if d == 0:
        return "0"
    sign = "+" if d > 0 else "-"
    if kind == "pct":
        return f"{sign}{abs(100 * d):.1f} pp"
    return sign + fmt_value(kind, abs(d))


def fmt_ratio(r: float | None) -> str:
    """``B / A`` as a multiplier: ``1.23×``."""
    return DASH if r is None else f"{r:.2f}×" if abs(r) < 100 else f"{r:,.0f}×"


def _plain(v: Any) -> str:
    if v is None:
        return DASH
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


# -- sections: the report as tables of strings ------------------------------------------


@dataclass(frozen=True)
class Section:
    """A titled table of formatted strings; the first column is a label, the rest numbers."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""


def _is_cache_mode(report: Mapping[str, Any]) -> bool:
    return get_path(report, "config.mode") == "cache"


def sections(report: Mapping[str, Any]) -> list[Section]:
    """The report as the tables both the terminal and the HTML page show."""
    flat = flatten(report)
    out: list[Section] = []

    cfg = report.get("config") or {}
    out.append(
        Section(
            "configuration",
            ("setting", "value"),
            tuple((str(k), _plain(v)) for k, v in cfg.items()),
        )
    )

    sim_t, wall = flat["sim_time_s"], flat["wall_s"]
    speed = sim_t / wall if sim_t is not None and wall else None
    summary = [
        ("requests", fmt_count(flat["requests"])),
        ("rejected", fmt_count(flat["rejected"])),
        ("simulated time", fmt_secs(sim_t)),
        ("wall time", fmt_secs(wall)),
        ("simulated / wall", fmt_ratio(speed)),
        ("throughput", fmt_value("req_rate", flat["throughput.requests_per_s"])),
        ("output tokens", fmt_value("tok_rate", flat["throughput.output_tokens_per_s"])),
        ("prompt tokens", fmt_value("tok_rate", flat["throughput.prompt_tokens_per_s"])),
    ]
    out.append(Section("summary", ("metric", "value"), tuple(summary)))

    tiers = []
    for t in TIERS:
        cap = _number(cfg.get(f"{t}_blocks"))
        tiers.append(
            (t, fmt_count(cap), fmt_pct(flat[f"hit_rate.{t}"]), fmt_count(flat[f"evictions.{t}"]))
        )
    tiers.append(("total", "", fmt_pct(flat["hit_rate.total"]), ""))
    out.append(
        Section(
            "tiers",
            ("tier", "blocks", "hit rate", "evictions"),
            tuple(tiers),
            note="hit rate: share of prompt blocks",
        )
    )

    stats = ("mean", "p50", "p90", "p99")
    lat = tuple(
        (label, *(fmt_secs(flat[f"{name}.{s}"]) for s in stats))
        for name, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E"))
    )
    if _is_cache_mode(report):
        out.append(Section("latency", ("", *stats), (), note="not simulated in cache mode"))
    else:
        out.append(Section("latency", ("", *stats), lat))

    links = tuple(
        (LINK_LABELS[k], fmt_bytes(flat[f"bytes.{k}"]), fmt_pct(flat[f"link_utilization.{k}"]))
        for k in LINKS
    )
    out.append(Section("links", ("link", "bytes", "utilisation"), links))

    pe = [
        (m.label, fmt_count(flat[m.key]))
        for m in METRICS
        if (m.key.startswith(("prefetch.", "errors.")) or m.key == "truncated")
        and flat[m.key] is not None
    ]
    for group in ("prefetch", "errors"):  # counters newer than METRICS: shown, not hidden
        extra = report.get(group)
        if isinstance(extra, Mapping):
            for k, v in extra.items():
                if f"{group}.{k}" not in METRIC_BY_KEY and _number(v) is not None:
                    pe.append((f"{group} {k}".replace("_", " "), fmt_count(_number(v))))
    out.append(
        Section("prefetch and errors", ("", "count"), tuple(pe), note="" if pe else "none recorded")
    )
    return out


def print_report(report: Mapping[str, Any], console: Any, source: str | None = None) -> None:
    """Print :func:`sections` as rich tables on ``console`` (a ``rich.console.Console``).

    Tables are laid out side by side as the terminal width allows, so a report
    fits on one screen of a wide terminal and still reads on an 80-column one.
    """
    from rich.columns import Columns
    from rich.table import Table
    from rich.text import Text

    if source:
        console.print(Text(source, style="bold"))
    tables = []
    for sec in sections(report):
        if not sec.rows:
            tables.append(Text.assemble((sec.title, "bold"), f": {sec.note}"))
            continue
        is_cfg = sec.title == "configuration"
        table = Table(
            title=sec.title,
            title_justify="left",
            title_style="bold",
            caption=sec.note or None,
            caption_justify="left",
            show_header=not is_cfg,
        )
        for i, col in enumerate(sec.columns):
            table.add_column(col, justify="left" if i == 0 or is_cfg else "right")
        for row in sec.rows:
            table.add_row(*(Text(c) for c in row))  # values are data, not markup
        tables.append(table)
    console.print(tables[0])  # the configuration, full width: trace paths are long
    console.print(Columns(tables[1:], padding=(0, 2)))


# -- plots ------------------------------------------------------------------------------

PLOT_TITLES = {
    "hit_rate_tiers": "Hit rate by tier",
    "ttft_cdf": "Time to first token (CDF)",
    "tpot_cdf": "Time per output token (CDF)",
    "hit_rate": "Hit rate per tier over time",
    "link_util": "Link utilisation over time",
    "queue": "Queue length over time",
}


def new_figure(width: float = 7.0, height: float = 3.8) -> Any:
    """A matplotlib Figure on its own Agg canvas: no pyplot, no global backend state,
    so rendering works headless, in threads and in worker processes alike."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def figure_png(fig: Any) -> bytes:
    """The figure as PNG bytes (no timestamp metadata, so equal plots give equal bytes)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def _series(values: Any) -> list[float]:
    if not isinstance(values, list):
        return []
    return [float(v) if _number(v) is not None else math.nan for v in values]


def _caption(report: Mapping[str, Any]) -> str:
    cfg = report.get("config") or {}
    trace = cfg.get("trace")
    parts = [
        Path(str(trace)).name if trace else None,
        cfg.get("model"),
        cfg.get("profile"),
        cfg.get("eviction"),
        cfg.get("write_policy"),
    ]
    return " · ".join(str(p) for p in parts if p)


def _cdf_plot(report: Mapping[str, Any], key: str, title: str) -> bytes | None:
    xs = sorted(v for v in _series(get_path(report, f"samples.{key}")) if not math.isnan(v))
    if not xs:
        return None
    n = len(xs)
    fig = new_figure()
    ax = fig.add_subplot()
    ax.step(xs, [(i + 1) / n for i in range(n)], where="post", color="#1f77b4")
    for stat, style in (("p50", "--"), ("p99", ":")):
        v = _number(get_path(report, f"{key}.{stat}"))
        if v is not None:
            ax.axvline(
                v, color="#555555", linestyle=style, linewidth=1, label=f"{stat} = {fmt_secs(v)}"
            )
    if xs[0] > 0 and xs[-1] / xs[0] >= 100:
        ax.set_xscale("log")
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"{title}  (n = {n:,})", fontsize=10)
    fig.suptitle(_caption(report), fontsize=8, color="#555555")
    return figure_png(fig)


def _percent_axis(ax: Any) -> None:
    from matplotlib.ticker import PercentFormatter

    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))


def _timeseries_plot(report: Mapping[str, Any], name: str) -> bytes | None:
    ts = report.get("timeseries")
    if not isinstance(ts, Mapping):
        return None
    t = _series(ts.get("t"))
    if not t:
        return None

    lines: list[tuple[str, list[float], str]] = []
    if name == "hit_rate":
        per = {tier: _series(ts.get(f"hit_rate_{tier}")) for tier in TIERS}
        for tier, ys in per.items():
            if len(ys) == len(t):
                lines.append((tier, ys, TIER_COLORS[tier]))
        if lines:
            total = [sum(v) for v in zip(*(ys for _, ys, _ in lines), strict=True)]
            lines.append(("total", total, TIER_COLORS["total"]))
        ylabel = "hit rate (prompt blocks)"
    elif name == "link_util":
        for k in LINKS:
            ys = _series(ts.get(f"link_util_{k}"))
            if len(ys) == len(t):
                lines.append((LINK_LABELS[k], ys, LINK_COLORS[k]))
        ylabel = "utilisation"
    else:  # queue
        for k, label, color in (
            ("queue_len", "waiting", "#d62728"),
            ("running", "running", "#1f77b4"),
        ):
            ys = _series(ts.get(k))
            if len(ys) == len(t):
                lines.append((label, ys, color))
        ylabel = "requests"
    if not lines:
        return None

    fig = new_figure()
    ax = fig.add_subplot()
    for label, ys, color in lines:
        lw = 2.0 if label == "total" else 1.3
        ax.plot(t, ys, drawstyle="steps-pre", label=label, color=color, linewidth=lw)
    if name in ("hit_rate", "link_util"):
        _percent_axis(ax)
        top = max((v for _, ys, _ in lines for v in ys if not math.isnan(v)), default=1.0)
        ax.set_ylim(0, max(1.0 if name == "link_util" else 0.0, top * 1.08, 0.05))
    else:
        ax.set_ylim(bottom=0)
    interval = _number(ts.get("interval_s"))
    ax.set_xlabel("simulated time (s)" + (f", {interval:g} s intervals" if interval else ""))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(PLOT_TITLES[name], fontsize=10)
    fig.suptitle(_caption(report), fontsize=8, color="#555555")
    return figure_png(fig)


def _tier_bar_plot(report: Mapping[str, Any]) -> bytes | None:
    vals = [_number(get_path(report, f"hit_rate.{t}")) for t in (*TIERS, "total")]
    if all(v is None for v in vals):
        return None
    fig = new_figure(5.5, 3.4)
    ax = fig.add_subplot()
    names = [*TIERS, "total"]
    heights = [v or 0.0 for v in vals]
    bars = ax.bar(names, heights, color=[TIER_COLORS[n] for n in names])
    for bar, v in zip(bars, vals, strict=True):
        ax.annotate(
            fmt_pct(v),
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )
    _percent_axis(ax)
    ax.set_ylim(0, max(max(heights) * 1.18, 0.05))
    ax.set_ylabel("fraction of prompt blocks")
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(PLOT_TITLES["hit_rate_tiers"], fontsize=10)
    fig.suptitle(_caption(report), fontsize=8, color="#555555")
    return figure_png(fig)


def make_plots(report: Mapping[str, Any]) -> dict[str, bytes]:
    """PNG bytes by plot name (see :data:`PLOT_TITLES`), for the plots the report has data for.

    A cache-mode report (no timing, no time series) still gets the per-tier bar.
    """
    made: dict[str, bytes | None] = {
        "hit_rate_tiers": _tier_bar_plot(report),
        "ttft_cdf": _cdf_plot(report, "ttft_s", "Time to first token"),
        "tpot_cdf": _cdf_plot(report, "tpot_s", "Time per output token"),
        "hit_rate": _timeseries_plot(report, "hit_rate"),
        "link_util": _timeseries_plot(report, "link_util"),
        "queue": _timeseries_plot(report, "queue"),
    }
    return {k: v for k, v in made.items() if v is not None}


# -- HTML -------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:2em auto;
max-width:1100px;padding:0 1em;color:#222}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.15em;margin-top:1.6em}
.meta{color:#666;font-size:.9em}
.tables{display:flex;flex-wrap:wrap;gap:1.5em 2.5em;align-items:flex-start}
table{border-collapse:collapse;font-size:.9em}
caption{text-align:left;font-weight:600;padding-bottom:.3em}
th,td{padding:.2em .7em;border-bottom:1px solid #e3e3e3}
th{text-align:right;color:#555;font-weight:600}th:first-child,td:first-child{text-align:left}
td{text-align:right;font-variant-numeric:tabular-nums}
.note{color:#777;font-size:.85em;padding-top:.3em}
.plots{display:flex;flex-wrap:wrap;gap:1em}
figure{margin:0}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{color:#555;font-size:.85em}
details{margin-top:2em}pre{background:#f6f6f6;padding:1em;overflow:auto;font-size:.8em}
"""


def _html_table(sec: Section) -> str:
    e = html.escape
    head = "".join(f"<th>{e(c)}</th>" for c in sec.columns)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in sec.rows)
    note = f'<div class="note">{e(sec.note)}</div>' if sec.note else ""
    return (
        f"<div><table><caption>{e(sec.title)}</caption><thead><tr>{head}</tr></thead>"
        f"<tbody>{body}</tbody></table>{note}</div>"
    )


def render_html(
    report: Mapping[str, Any],
    plots: Mapping[str, bytes],
    title: str = "kvflow report",
    source: str | None = None,
) -> str:
    """One self-contained HTML page: tables, plots as ``data:`` URIs, the report itself.

    No external reference at all (no CDN, no font, no script), so the page opens
    offline and stays readable when archived.
    """
    e = html.escape
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = f"{e(source)} · " if source else ""
    figs = "".join(
        f'<figure><img alt="{e(PLOT_TITLES.get(name, name))}" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'
        f"<figcaption>{e(PLOT_TITLES.get(name, name))}</figcaption></figure>"
        for name, png in plots.items()
    )
    raw = {k: v for k, v in report.items() if k not in ("samples", "timeseries")}
    raw_json = e(json.dumps(raw, indent=2, default=str))
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<style>{_CSS}</style></head><body>\n"
        f'<h1>{e(title)}</h1><p class="meta">{meta}rendered {e(when)}</p>\n'
        f'<div class="tables">{"".join(_html_table(s) for s in sections(report))}</div>\n'
        + (f'<h2>Plots</h2><div class="plots">{figs}</div>\n' if figs else "")
        + "<details><summary>report (without samples and time series)</summary>"
        f"<pre>{raw_json}</pre></details>\n</body></html>\n"
    )


# -- writing ----------------------------------------------------------------------------


def check_targets(paths: Iterable[Path], force: bool) -> None:
    """Refuse before writing anything: an existing target without ``force``, or a directory."""
    existing = []
    for p in paths:
        if p.is_dir():
            raise ReportError(f"{p} is a directory; cannot write a file there")
        if p.exists() and not force:
            existing.append(p)
    if existing:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise ReportError(f"{existing[0]} exists{more}; pass --force to replace it")


def check_dir(path: Path) -> None:
    """An output directory may exist; it must not be a file."""
    if path.exists() and not path.is_dir():
        raise ReportError(f"{path} exists and is not a directory")


def write_files(files: Mapping[Path, bytes | str], force: bool = False) -> list[Path]:
    """Write all files or none of them: check every target first, then write each atomically."""
    check_targets(files, force)
    for p in files:
        check_dir(p.parent)
    written = []
    for p, data in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        blob = data.encode("utf-8") if isinstance(data, str) else data
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(blob)
            os.chmod(tmp, 0o644)
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        written.append(p)
    return written


def png_targets(out_dir: Path, names: Sequence[str]) -> dict[str, Path]:
    """Where each plot goes under ``--png DIR``."""
    return {n: out_dir / f"{n}.png" for n in names}
