"""A sweep's outputs: one CSV row per point, and curves of a metric against a setting.

:func:`csv_text` writes the swept values, then every metric of
:data:`kvflow.reports.render.METRICS`; :func:`sweep_plots` draws hit rate and
TTFT p50/p99 against a numeric setting (:func:`choose_x`), one line per
combination of the rest; :func:`summary` is the terminal's table.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections.abc import Sequence
from typing import Any

from kvflow.reports.page import figure_png, new_figure
from kvflow.reports.render import METRICS, flatten
from kvflow.reports.sweep import Param, PointResult, SweepError, value_word


def csv_header(names: Sequence[str]) -> list[str]:
    """``point``, the swept settings, every metric by dotted key, ``error``."""
    return ["point", *names, *(m.key for m in METRICS), "error"]


def csv_text(results: Sequence[PointResult], names: Sequence[str]) -> str:
    """One row per point in grid order; empty cells where a metric is absent or a point failed."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(csv_header(names))
    for r in results:
        flat = flatten(r.report) if r.report is not None else {}
        row: list[Any] = [r.point.index]
        row += ["" if r.point.params[n] is None else value_word(r.point.params[n]) for n in names]
        row += ["" if flat.get(m.key) is None else flat[m.key] for m in METRICS]
        row.append(r.error or "")
        w.writerow(row)
    return buf.getvalue()


def _numeric(values: Sequence[Any]) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def choose_x(params: Sequence[Param], x: str | None = None) -> str | None:
    """The setting for the plots' x axis: ``x`` if given, else a numeric axis of the grid
    (capacities first: ``*_blocks``), else the first axis; ``None`` for a single point."""
    axes = [(n, vs) for n, vs in params if len(vs) > 1]
    if x is not None:
        if x not in dict(params):
            raise SweepError(f"--x {x}: not a swept parameter ({', '.join(n for n, _ in params)})")
        return x
    numeric = [n for n, vs in axes if _numeric(vs)]
    for n in numeric:
        if n.endswith("_blocks"):
            return n
    if numeric:
        return numeric[0]
    return axes[0][0] if axes else None


def sweep_plots(
    results: Sequence[PointResult],
    params: Sequence[Param],
    x: str | None = None,
    caption: str = "",
) -> dict[str, bytes]:
    """PNG bytes by name: ``hit_rate`` and (full mode) ``ttft`` against the x setting,
    one line per combination of the other swept settings.

    ``caption`` goes above each plot (say, the trace and the settings held
    fixed), so a PNG separated from its CSV still says what it shows."""
    xname = choose_x(params, x)
    if xname is None:
        return {}
    xvals = dict(params)[xname]
    numeric = _numeric(xvals)
    others = [n for n, vs in params if n != xname and len(vs) > 1]

    series: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for r in results:
        if r.report is None:
            continue
        label = ", ".join(f"{n}={value_word(r.point.params[n])}{_offline(n, r.point.params[n])}"
                          for n in others)
        xv = r.point.params[xname]
        xpos = float(xv) if numeric else float(xvals.index(xv))
        series.setdefault(label, []).append((xpos, flatten(r.report)))
    if not series:
        return {}
    for pts in series.values():
        pts.sort(key=lambda p: p[0])

    def axes(title: str, ylabel: str) -> tuple[Any, Any]:
        fig = new_figure(7.0, 4.2)
        ax = fig.add_subplot()
        ax.set_title(title, fontsize=10)
        if caption:
            fig.suptitle(caption, fontsize=8, color="#555555")
        ax.set_xlabel(xname)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if not numeric:
            ax.set_xticks(range(len(xvals)), [value_word(v) for v in xvals])
        else:
            xs = sorted(float(v) for v in xvals)
            if xs[0] > 0 and xs[-1] / xs[0] >= 100:
                ax.set_xscale("log")
        return fig, ax

    def finish(fig: Any, ax: Any) -> bytes:
        if any(label for label in series):  # a single unnamed line needs no legend
            ax.legend(fontsize=8, loc="best")
        return figure_png(fig)

    out: dict[str, bytes] = {}
    from matplotlib.ticker import PercentFormatter

    fig, ax = axes(f"Total hit rate against {xname}", "hit rate (prompt blocks)")
    for label, pts in series.items():
        ax.plot(
            [p[0] for p in pts],
            [_nan(p[1]["hit_rate.total"]) for p in pts],
            marker="o",
            label=label or None,
        )
    _optimum_lines(ax, series)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_ylim(bottom=0)
    out["hit_rate"] = finish(fig, ax)

    if any(p[1]["ttft_s.p50"] is not None for pts in series.values() for p in pts):
        fig, ax = axes(f"TTFT against {xname} (p50 solid, p99 dashed)", "seconds")
        for i, (label, pts) in enumerate(series.items()):
            color = f"C{i % 10}"
            xs = [p[0] for p in pts]
            ax.plot(
                xs,
                [_nan(p[1]["ttft_s.p50"]) for p in pts],
                marker="o",
                color=color,
                label=label or None,
            )
            ax.plot(
                xs, [_nan(p[1]["ttft_s.p99"]) for p in pts], marker="s", color=color, linestyle="--"
            )
        ax.set_ylim(bottom=0)
        out["ttft"] = finish(fig, ax)
    return out


def _offline(name: str, value: Any) -> str:
    """`` (offline)`` after a policy that reads the future (``belady``)."""
    from kvflow.policy import OFFLINE_POLICIES

    return " (offline)" if name == "eviction" and value in OFFLINE_POLICIES else ""


def _optimum_lines(ax: Any, series: dict[str, list[tuple[float, dict[str, Any]]]]) -> None:
    """The offline optimum (reports' ``headroom``) as the upper line: one per distinct
    curve (it depends on the capacities and the trace, not on the policies), dashed."""
    curves: dict[tuple[tuple[float, float], ...], list[str]] = {}
    for label, pts in series.items():
        line = tuple((p[0], p[1]["headroom.optimum.total"]) for p in pts
                     if p[1].get("headroom.optimum.total") is not None)
        if line:
            curves.setdefault(line, []).append(label)
    for i, (line, labels) in enumerate(curves.items()):
        name = "offline optimum (Belady)"
        if len(curves) > 1:
            name += f": {labels[0]}" if len(labels) == 1 else f" {i + 1}"
        ax.plot([x for x, _ in line], [y for _, y in line], color="black", linestyle="--",
                linewidth=1.2, label=name)


def _nan(v: float | None) -> float:
    return math.nan if v is None else float(v)


def summary(
    base: Any,
    params: Sequence[Param],
    results: Sequence[PointResult],
    files: Sequence[str] = (),
) -> dict[str, Any]:
    """The sweep as one JSON-able dict: base config, grid, per-point metrics and errors."""
    base_cfg = dataclasses.asdict(base) if dataclasses.is_dataclass(base) else dict(base)
    return {
        "kvflow_sweep": 1,
        "base_config": base_cfg,
        "params": {n: vs for n, vs in params},
        "points": [
            {
                "point": r.point.index,
                "params": r.point.params,
                "metrics": flatten(r.report) if r.report is not None else None,
                "error": r.error,
                "seconds": round(r.seconds, 3),
            }
            for r in results
        ],
        "failed": sum(not r.ok for r in results),
        "files": list(files),
    }
