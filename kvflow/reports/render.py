"""Turn a replay report (the JSON ``kvflow replay`` writes) into tables people read.

People sizing a cluster or picking a policy read tables and curves, not JSON, so
one report is rendered from one intermediate form:

* :func:`sections` — the report as titled tables of already-formatted strings;
  :func:`print_report` prints them with rich, ``kvflow.reports.page.render_html``
  writes them as HTML. Both views show the same strings, so what the terminal
  says and what the page says cannot drift apart.
* ``kvflow.reports.page`` — the PNG plots and the self-contained HTML page.

:data:`METRICS` names every scalar of a report once (dotted path, unit, which
direction is better); :func:`flatten` reads them. ``kvflow compare`` and the
sweep CSV use the same list, so a new metric is added in one place.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
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
    kind: str  # pct | secs | bytes | count | req_rate | tok_rate | ratio
    better: int = 0


def _latency(name: str, label: str) -> list[Metric]:
    stats = ("mean", "p50", "p90", "p99")
    return [Metric(f"{name}.{s}", f"{label} {s}", "secs", -1) for s in stats]


METRICS: tuple[Metric, ...] = (
    Metric("requests", "requests", "count"),
    Metric("rejected", "rejected", "count", -1),
    *(Metric(f"hit_rate.{t}", f"hit rate {t}", "pct", +1) for t in (*TIERS, "total")),
    *(Metric(f"headroom.optimum.{t}", f"offline optimum {t}", "pct", +1)
      for t in (*TIERS, "total")),
    *_latency("ttft_s", "TTFT"),
    *_latency("tpot_s", "TPOT"),
    *_latency("e2e_s", "E2E"),
    *_latency("queue_s", "queue"),
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
    Metric("load.offered.requests_per_s", "offered requests", "req_rate"),
    Metric("load.offered.prompt_tokens_per_s", "offered prompt tokens", "tok_rate"),
    Metric("load.utilization_predicted", "predicted utilisation", "ratio", -1),
    Metric("load.compute_busy_share", "compute busy", "pct"),
    Metric("slo.attainment", "SLO attainment", "pct", +1),
    Metric("slo.goodput_requests_per_s", "goodput", "req_rate", +1),
    Metric("cluster.imbalance_requests", "load imbalance (max/mean)", "ratio", -1),
    Metric("cluster.prefix_routed_share", "routed to a cached prefix", "pct"),
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


def as_number(v: Any) -> float | int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def flatten(report: Mapping[str, Any]) -> dict[str, float | int | None]:
    """Every metric of :data:`METRICS` by dotted key; ``None`` where absent or not a number."""
    return {m.key: as_number(get_path(report, m.key)) for m in METRICS}


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
    if kind == "ratio":
        return DASH if x is None else f"{x:.2f}"
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


def is_cache_mode(report: Mapping[str, Any]) -> bool:
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
        cap = as_number(cfg.get(f"{t}_blocks"))
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
    head = headroom_rows(report)
    if head is not None:
        out.append(Section("headroom", head[0], head[1], note=head[2]))

    stats = ("mean", "p50", "p90", "p99")
    lat = tuple(
        (label, *(fmt_secs(flat[f"{name}.{s}"]) for s in stats))
        for name, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E"),
                            ("queue_s", "queue"))
        if name != "queue_s" or flat["queue_s.p50"] is not None
    )
    if is_cache_mode(report):
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
                if f"{group}.{k}" not in METRIC_BY_KEY and as_number(v) is not None:
                    pe.append((f"{group} {k}".replace("_", " "), fmt_count(as_number(v))))
    out.append(
        Section("prefetch and errors", ("", "count"), tuple(pe), note="" if pe else "none recorded")
    )
    out.extend(_load_sections(report, flat))
    return out


def headroom_rows(report: Mapping[str, Any]
                  ) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...], str] | None:
    """Columns, rows and note of the policy's hit rate beside the offline optimum's at
    the same capacities, tier by tier down the hierarchy (each row: the tiers down to
    it together, where the optimum is a bound); None if the report has no optimum."""
    head = report.get("headroom")
    if not isinstance(head, Mapping) or not isinstance(head.get("optimum"), Mapping):
        return None
    cfg, hit, opt = report.get("config") or {}, report.get("hit_rate") or {}, head["optimum"]
    rows = []
    names: list[str] = []
    blocks = 0
    mine = best = 0.0
    for t in TIERS:
        cap = as_number(cfg.get(f"{t}_blocks"))
        h, o = as_number(hit.get(t)), as_number(opt.get(t))
        if not cap or h is None or o is None:
            continue
        names.append(t)
        blocks += cap
        mine += h
        best += o
        rows.append((" + ".join(names), fmt_count(blocks), fmt_pct(mine), fmt_pct(best),
                     fmt_pct(mine / best if best else None)))
    policy = str(head.get("eviction") or cfg.get("eviction") or "policy")
    note = f"offline optimum: {head.get('method', 'Belady')}"
    return ("tiers", "blocks", policy, "offline optimum", "of optimum"), tuple(rows), note


def _load_sections(report: Mapping[str, Any], flat: Mapping[str, Any]) -> list[Section]:
    """Offered load against capacity, service targets, and the cluster's instances."""
    out: list[Section] = []
    load = report.get("load")
    if isinstance(load, Mapping):
        cap = load.get("capacity_per_instance") or {}
        verdict = "overloaded: TTFT is mostly queueing" if load.get("overloaded") else "keeps up"
        rows = (
            ("offered", fmt_value("req_rate", flat["load.offered.requests_per_s"])),
            ("offered prompt tokens", fmt_value("tok_rate",
                                                flat["load.offered.prompt_tokens_per_s"])),
            ("instances", _plain(load.get("instances"))),
            ("prefill per instance", fmt_value("tok_rate", as_number(
                cap.get("prefill_tokens_per_s")))),
            ("decode per instance", fmt_value("tok_rate", as_number(
                cap.get("decode_tokens_per_s")))),
            ("predicted utilisation", fmt_value("ratio", flat["load.utilization_predicted"])),
            ("compute busy", fmt_pct(flat["load.compute_busy_share"])),
            ("verdict", verdict),
            ("instances for 0.7", _plain(load.get("instances_suggested"))),
        )
        out.append(Section("load", ("", "value"), rows,
                           note="capacity from the cost model; utilisation without cache reuse"))
    slo = report.get("slo")
    if isinstance(slo, Mapping):
        out.append(Section("service targets", ("", "value"), (
            ("TTFT target", fmt_secs(as_number(slo.get("ttft_s")))),
            ("TPOT target", fmt_secs(as_number(slo.get("tpot_s")))),
            ("attainment", fmt_pct(flat["slo.attainment"])),
            ("goodput", fmt_value("req_rate", flat["slo.goodput_requests_per_s"])))))
    rows_in = report.get("instances")
    cluster = report.get("cluster")
    if isinstance(rows_in, list) and isinstance(cluster, Mapping):
        rows = tuple(
            (str(r.get("instance")), fmt_count(as_number(r.get("requests"))),
             fmt_pct(as_number(get_path(r, "hit_rate.total"))),
             fmt_secs(as_number(get_path(r, "ttft_s.p50"))),
             fmt_secs(as_number(get_path(r, "queue_s.p50"))),
             fmt_pct(as_number(r.get("compute_utilization"))))
            for r in rows_in if isinstance(r, Mapping))
        note = (f"router {cluster.get('router')} ({cluster.get('view')} view); load imbalance "
                f"{fmt_value('ratio', flat['cluster.imbalance_requests'])}, routed to a cached "
                f"prefix {fmt_pct(flat['cluster.prefix_routed_share'])}")
        out.append(Section("instances", ("instance", "requests", "hit rate", "TTFT p50",
                                         "queue p50", "compute busy"), rows, note=note))
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
