"""``kvflow trace ...``: inspect, generate, convert and reshape request traces.

Rich tables by default, JSON with ``--json``. A user's mistake (a missing
file, a bad trace line, an unknown generator kind, an existing output without
``--force``, a malformed option) exits with code 2 and one line on stderr,
never a traceback.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from traces.cli_common import (
    MAX_REQUEST_TOKENS_HELP,
    MAX_TRACE_BYTES_HELP,
    SAMPLE_PREFIX,
    OneLineCommand,
    OneLineGroup,
    fail,
    max_request_tokens_option,
    max_trace_bytes_option,
    open_cli_trace,
    resolve_path,
    user_errors,
    warn_skipped,
)
from traces.cli_gen import gen
from traces.cli_load import load, scale
from traces.loaders import Trace
from traces.stats import TraceStats, trace_stats
from traces.writer import write_generic

__all__ = [
    "MAX_REQUEST_TOKENS_HELP",
    "MAX_TRACE_BYTES_HELP",
    "SAMPLE_PREFIX",
    "OneLineCommand",
    "OneLineGroup",
    "fail",
    "resolve_path",
    "trace_app",
    "user_errors",
]

# the names this module's commands were written with
_fail, _OneLineCommand, _open, _warn_skipped = fail, OneLineCommand, open_cli_trace, warn_skipped

trace_app = typer.Typer(
    help="Inspect, generate, convert and reshape request traces, and measure their load.",
    no_args_is_help=True,
    cls=OneLineGroup,
    pretty_exceptions_enable=False,
)


# -- stats ---------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}"


def _render(tr: Trace, s: TraceStats, console: Console) -> None:
    console.print(f"[bold]{tr.path}[/bold] ({tr.format}, {tr.block_tokens}-token blocks)")
    over = Table(show_header=False)
    over.add_column("metric")
    over.add_column("value", justify="right")
    over.add_row("requests", f"{s.requests:,}")
    over.add_row("duration", f"{s.duration_s:,.1f} s")
    over.add_row("arrival rate", f"{_num(s.arrival_rate, 3)} req/s")
    over.add_row("inter-arrival CV", _num(s.interarrival_cv, 2))
    if s.sessions or s.tenants:
        over.add_row("sessions / tenants", f"{s.sessions:,} / {s.tenants:,}")
    if s.skipped:
        over.add_row("bad lines skipped", f"{s.skipped:,}")
    over.add_row("block accesses", f"{s.total_blocks:,}")
    over.add_row("unique blocks", f"{s.unique_blocks:,}")
    over.add_row("infinite-cache hit ceiling (blocks)", _pct(s.block_hit_ceiling))
    over.add_row("infinite-cache hit ceiling (tokens)", _pct(s.token_hit_ceiling))
    over.add_row("blocks used once", _pct(s.blocks_used_once))
    console.print(over)

    lengths = Table(title="lengths (tokens)", title_justify="left")
    for col in ("", "mean", "p50", "p90", "p99", "max", "total"):
        lengths.add_column(col, justify="right" if col else "left")
    for name, d in (("input", s.input_len), ("output", s.output_len)):
        lengths.add_row(
            name, _num(d.mean, 1), _num(d.p50), _num(d.p90), _num(d.p99), _num(d.max),
            _num(d.total),
        )  # fmt: skip
    console.print(lengths)

    if s.reuse_distance is not None and s.reuse_distance.count:
        r = s.reuse_distance
        reuse = Table(title="reuse distance (distinct blocks between uses)", title_justify="left")
        for col in ("re-accesses", "p50", "p90", "p99", "max"):
            reuse.add_column(col, justify="right")
        reuse.add_row(f"{r.count:,}", _num(r.p50), _num(r.p90), _num(r.p99), _num(r.max))
        console.print(reuse)
        curve = Table(title="LRU cache hit ratio by capacity", title_justify="left")
        for col in ("blocks", "tokens", "hit ratio", "of ceiling"):
            curve.add_column(col, justify="right")
        rows = [(c, h) for c, h in s.lru_hit_curve if h > 0]
        for cap, hit in rows:
            of = hit / s.block_hit_ceiling if s.block_hit_ceiling else None
            curve.add_row(f"{cap:,}", f"{cap * s.block_tokens:,}", _pct(hit), _pct(of))
        console.print(curve)
    if s.optimum_hit_curve:
        opt = Table(title="offline optimum (Belady's MIN: reads the future) hit ratio by "
                          "capacity", title_justify="left")
        for col in ("blocks", "tokens", "hit ratio", "of ceiling", "LRU"):
            opt.add_column(col, justify="right")
        lru = dict(s.lru_hit_curve)
        for cap, hit in s.optimum_hit_curve:
            if hit <= 0:
                continue
            of = hit / s.block_hit_ceiling if s.block_hit_ceiling else None
            opt.add_row(f"{cap:,}", f"{cap * s.block_tokens:,}", _pct(hit), _pct(of),
                        _pct(lru.get(cap)))
            if of is not None and of >= 1:
                break
        console.print(opt)


@trace_app.command(cls=_OneLineCommand)
def stats(
    file: str = typer.Argument(
        ..., metavar="FILE", help="Trace file (.gz ok), or sample:NAME for a bundled one."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    fmt: str = typer.Option("auto", "--format", "-f", help="auto|mooncake|azure|generic"),
    block_tokens: int | None = typer.Option(
        None, "--block-tokens", "-b", help="Block size where the trace leaves it open (Azure)."
    ),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="Skip bad lines, report the count."),
    reuse: bool = typer.Option(
        True, "--reuse/--no-reuse", help="Compute the reuse-distance distribution (n log n)."
    ),
    optimum: bool = typer.Option(
        True, "--optimum/--no-optimum",
        help="Compute the offline optimum's (Belady's MIN) hit curve: one pass per capacity.",
    ),
    max_request_tokens: int | None = max_request_tokens_option(),
    max_trace_bytes: int | None = max_trace_bytes_option(),
) -> None:
    """Requests, arrival rate, lengths, unique blocks, hit ceilings, reuse distances,
    and the offline optimum's hit ratio by capacity."""
    err = Console(stderr=True)
    with user_errors():
        tr = _open(file, fmt, skip_bad, block_tokens, max_request_tokens, max_trace_bytes)
        if err.is_terminal and not as_json:
            with err.status(f"reading {tr.path} ...", spinner="dots"):
                s = trace_stats(tr, reuse=reuse, optimum=optimum)
        else:
            s = trace_stats(tr, reuse=reuse, optimum=optimum)
    _warn_skipped(tr)
    if as_json:
        out = {"path": tr.path, "format": tr.format, **s.to_dict()}
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return
    _render(tr, s, Console())


# -- validate ----------------------------------------------------------------------------


@trace_app.command(cls=_OneLineCommand)
def validate(
    file: str = typer.Argument(
        ..., metavar="FILE", help="Trace file (.gz ok), or sample:NAME for a bundled one."
    ),
    fmt: str = typer.Option("auto", "--format", "-f", help="auto|mooncake|azure|generic"),
    block_tokens: int | None = typer.Option(
        None, "--block-tokens", "-b", help="Block size where the trace leaves it open (Azure)."
    ),
    max_request_tokens: int | None = max_request_tokens_option(),
    max_trace_bytes: int | None = max_trace_bytes_option(),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a line."),
) -> None:
    """Check every line of a trace; exit 0 if a replay can read all of it, else exit 2
    naming the first bad line (file:line: field '...': what is wrong)."""
    with user_errors():
        tr = _open(file, fmt, False, block_tokens, max_request_tokens, max_trace_bytes)
        n = tokens = 0
        for req in tr:
            n += 1
            tokens += req.input_len
    if as_json:
        out = {"path": tr.path, "format": tr.format, "block_tokens": tr.block_tokens,
               "requests": n, "input_tokens": tokens, "valid": True}
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return
    Console(highlight=False, soft_wrap=True).print(
        f"{tr.path}: valid {tr.format} trace, {n:,} requests, {tokens:,} prompt tokens "
        f"({tr.block_tokens}-token blocks)")


# -- convert -----------------------------------------------------------------------------


@trace_app.command(cls=_OneLineCommand)
def convert(
    file: str = typer.Argument(..., metavar="FILE", help="Input trace (.gz ok), or sample:NAME."),
    output: str = typer.Option(..., "--output", "-o", help="Output file (generic JSONL; .gz ok)."),
    fmt: str = typer.Option("auto", "--from", "-f", help="auto|mooncake|azure|generic"),
    block_tokens: int | None = typer.Option(
        None, "--block-tokens", "-b", help="Block size for traces that leave it open (Azure)."
    ),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="Skip bad lines, report the count."),
    limit: int | None = typer.Option(None, "--limit", help="Keep only the first N requests."),
    force: bool = typer.Option(False, "--force", help="Replace the output if it exists."),
    max_request_tokens: int | None = max_request_tokens_option(),
    max_trace_bytes: int | None = max_trace_bytes_option(),
) -> None:
    """Convert a trace to the generic JSONL form (e.g. Azure CSV at a chosen block size)."""
    if limit is not None and limit < 0:
        _fail(f"--limit must be >= 0, got {limit}")
    with user_errors():
        tr = _open(file, fmt, skip_bad, block_tokens, max_request_tokens, max_trace_bytes)
        if Path(output).exists() and not force:
            _fail(f"{output} exists; pass --force to replace it")
        if Path(output).resolve() == Path(tr.path).resolve():
            _fail(f"{output} is the input file")
        reqs = iter(tr) if limit is None else itertools.islice(tr, limit)
        meta = {"source": Path(tr.path).name, "source_format": tr.format}
        n = write_generic(reqs, output, block_tokens=tr.block_tokens, force=force, **meta)
    _warn_skipped(tr)
    Console(highlight=False, soft_wrap=True).print(
        f"converted {n:,} requests from {tr.path} ({tr.format}) to {output} "
        f"({tr.block_tokens}-token blocks)"
    )


trace_app.command(cls=OneLineCommand)(gen)
trace_app.command(cls=OneLineCommand)(scale)
trace_app.command(cls=OneLineCommand)(load)

if __name__ == "__main__":  # python -m traces.cli, for use without the kvflow entry point
    trace_app()
