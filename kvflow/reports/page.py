"""The report as a page: PNG plots and one self-contained HTML file, written safely.

* :func:`make_plots` — PNG images (matplotlib, Agg, no pyplot global state): TTFT
  and TPOT CDFs, hit rate per tier, link utilisation and queue length over time.
* :func:`render_html` — one self-contained page: the tables of
  ``kvflow.reports.render.sections``, inline CSS, the PNGs embedded as base64
  ``data:`` URIs, no script and no network access, so it can be mailed or
  archived and still opens.

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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvflow.reports.render import (
    LINK_COLORS,
    LINK_LABELS,
    LINKS,
    TIER_COLORS,
    TIERS,
    ReportError,
    Section,
    as_number,
    fmt_pct,
    fmt_secs,
    get_path,
    sections,
)
from traces.writer import replaceable

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
    return [float(v) if as_number(v) is not None else math.nan for v in values]


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
        v = as_number(get_path(report, f"{key}.{stat}"))
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
    interval = as_number(ts.get("interval_s"))
    ax.set_xlabel("simulated time (s)" + (f", {interval:g} s intervals" if interval else ""))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(PLOT_TITLES[name], fontsize=10)
    fig.suptitle(_caption(report), fontsize=8, color="#555555")
    return figure_png(fig)


def _tier_bar_plot(report: Mapping[str, Any]) -> bytes | None:
    vals = [as_number(get_path(report, f"hit_rate.{t}")) for t in (*TIERS, "total")]
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
        if not replaceable(p):  # a device node or FIFO: in place, never renamed over
            with open(p, "wb") as fh:
                fh.write(blob)
            written.append(p)
            continue
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
