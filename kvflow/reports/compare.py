"""Two replay reports side by side: what changed, by how much, and whether for the better.

The usual question is "what did this change buy": another eviction policy, a
bigger host tier, a faster link. :func:`compare_reports` lines up every metric of
:data:`kvflow.reports.render.METRICS` (so it never drifts from what ``kvflow report`` shows),
gives the difference ``B - A`` and the ratio ``B / A``, and says which side is
better where that has a direction (hit rate up, latency down). Configuration
fields that differ come first, because a comparison of two runs that differ in
more than one setting is easy to misread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvflow.reports.render import (
    METRICS,
    Metric,
    flatten,
    fmt_delta,
    fmt_ratio,
    fmt_value,
)

# Where the metric table gets a separator line: the start of each group.
_GROUP_STARTS = (
    "hit_rate.device",
    "ttft_s.mean",
    "throughput.requests_per_s",
    "bytes.h2d",
    "evictions.device",
    "prefetch.issued",
    "sim_time_s",
)


@dataclass(frozen=True)
class Row:
    """One metric of both reports; ``verdict`` is +1 when B is better, -1 when worse, else 0."""

    metric: Metric
    a: float | int | None
    b: float | int | None
    delta: float | None
    ratio: float | None
    verdict: int

    def to_dict(self) -> dict[str, Any]:
        better = {1: "b", -1: "a"}.get(self.verdict)
        return {
            "a": self.a,
            "b": self.b,
            "delta": self.delta,
            "ratio": self.ratio,
            "better": better,
        }


@dataclass(frozen=True)
class Comparison:
    """The result of :func:`compare_reports`; :meth:`to_dict` is the ``--json`` output."""

    a_source: str
    b_source: str
    config_diff: tuple[tuple[str, Any, Any], ...]
    rows: tuple[Row, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a_source,
            "b": self.b_source,
            "config_diff": {k: {"a": a, "b": b} for k, a, b in self.config_diff},
            "metrics": {r.metric.key: r.to_dict() for r in self.rows},
        }

    def row(self, key: str) -> Row:
        """The row of a metric by dotted key (``KeyError`` if neither report has it)."""
        for r in self.rows:
            if r.metric.key == key:
                return r
        raise KeyError(key)


def _delta_ratio(a: float | None, b: float | None) -> tuple[float | None, float | None]:
    if a is None or b is None:
        return None, None
    ratio = b / a if a != 0 else (1.0 if b == 0 else None)
    return b - a, ratio


def compare_reports(
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    a_source: str = "A",
    b_source: str = "B",
) -> Comparison:
    """Compare report ``b`` against report ``a`` (``a`` is the baseline).

    Metrics absent from both reports (timing in two cache-mode runs) are left
    out; absent from one, they are kept with ``None`` on that side.
    """
    fa, fb = flatten(a), flatten(b)
    rows = []
    for m in METRICS:
        va, vb = fa[m.key], fb[m.key]
        if va is None and vb is None:
            continue
        delta, ratio = _delta_ratio(va, vb)
        verdict = 0
        if delta is not None and m.better and delta != 0:
            verdict = 1 if delta * m.better > 0 else -1
        rows.append(Row(m, va, vb, delta, ratio, verdict))
    ca, cb = a.get("config") or {}, b.get("config") or {}
    keys = list(ca) + [k for k in cb if k not in ca]
    diff = tuple((k, ca.get(k), cb.get(k)) for k in keys if ca.get(k) != cb.get(k))
    return Comparison(a_source, b_source, diff, tuple(rows))


def print_comparison(cmp: Comparison, console: Any) -> None:
    """Rich tables: the differing configuration, then every metric with delta and ratio.

    Deltas are green where B is better and red where it is worse; colour is a
    hint only, the sign and the ratio carry the information in plain text too.
    """
    from rich.table import Table
    from rich.text import Text

    console.print(Text.assemble(("A", "bold"), f" = {cmp.a_source}"))
    console.print(Text.assemble(("B", "bold"), f" = {cmp.b_source}"))
    if cmp.config_diff:
        cfg = Table(title="configuration differences", title_justify="left", title_style="bold")
        for col in ("setting", "A", "B"):
            cfg.add_column(col)
        for k, va, vb in cmp.config_diff:
            cfg.add_row(*(Text("-" if v is None else str(v)) for v in (k, va, vb)))
        console.print(cfg)
    else:
        console.print("same configuration")

    t = Table(title="metrics", title_justify="left", title_style="bold")
    t.add_column("metric")
    for col in ("A", "B", "Δ (B − A)", "B / A"):
        t.add_column(col, justify="right")
    for i, r in enumerate(cmp.rows):
        style = {1: "green", -1: "red"}.get(r.verdict, "")
        delta = fmt_delta(r.metric.kind, r.delta)
        nxt = cmp.rows[i + 1].metric.key if i + 1 < len(cmp.rows) else None
        t.add_row(
            r.metric.label,
            fmt_value(r.metric.kind, r.a),
            fmt_value(r.metric.kind, r.b),
            Text(delta, style=style),
            fmt_ratio(r.ratio),
            end_section=nxt in _GROUP_STARTS,
        )
    console.print(t)
