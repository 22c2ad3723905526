"""``kvflow trace ...``: inspect, generate and convert request traces.

Rich tables by default, JSON with ``--json``. A user's mistake (a missing
file, a bad trace line, an unknown generator kind, an existing output without
``--force``, a malformed option) exits with code 2 and one line on stderr,
never a traceback.
"""

from __future__ import annotations

import inspect
import itertools
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperCommand, TyperGroup

from traces import generate as gen_mod
from traces import sample_path
from traces.loaders import Trace, open_trace
from traces.schema import FORMATS, TraceError
from traces.stats import TraceStats, trace_stats
from traces.writer import write_generic

SAMPLE_PREFIX = "sample:"


def _fail(message: str) -> NoReturn:
    """One line on stderr, exit 2: the contract for every user error."""
    text = " ".join(str(message).split())
    sys.stderr.write(f"error: {text}\n")
    raise typer.Exit(2)


# typer vendors its own click; find its UsageError without importing a private module.
_UsageError: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError"
)


def _usage_line(exc: Exception) -> str:
    fmt = getattr(exc, "format_message", None)
    return fmt() if callable(fmt) else str(exc)


class _OneLineCommand(TyperCommand):
    """Turns click's multi-line usage errors (bad option value, missing argument) into one."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except _UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # prints the help; leave it be
                raise
            _fail(f"{ctx.command_path}: {_usage_line(exc)}")


class _OneLineGroup(TyperGroup):
    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        try:
            return super().resolve_command(ctx, args)
        except _UsageError as exc:
            commands = ", ".join(self.list_commands(ctx))
            _fail(f"{ctx.command_path}: {_usage_line(exc)} (commands: {commands})")


trace_app = typer.Typer(
    help="Inspect, generate and convert request traces.",
    no_args_is_help=True,
    cls=_OneLineGroup,
    pretty_exceptions_enable=False,
)


@contextmanager
def user_errors(*also: type[Exception]) -> Iterator[None]:
    """Bad input becomes the one-line exit 2: trace errors, OS errors on files,
    and whatever other error types the caller names (kvflow's own, say —
    ``traces`` does not import the rest of kvflow)."""
    try:
        yield
    except TraceError as exc:
        _fail(str(exc))
    except OSError as exc:
        if exc.filename is not None and exc.strerror:
            _fail(f"{exc.filename}: {exc.strerror}")
        _fail(str(exc) or type(exc).__name__)
    except also as exc:
        _fail(str(exc))


# The same plumbing serves every ``kvflow`` command (see cli.py).
fail = _fail
OneLineCommand = _OneLineCommand
OneLineGroup = _OneLineGroup


def _resolve(path: str) -> Path:
    """A path, or ``sample:NAME`` for a bundled sample (works from any directory)."""
    if path.startswith(SAMPLE_PREFIX) and not Path(path).exists():
        return sample_path(path[len(SAMPLE_PREFIX) :] or "conversation_1k.jsonl")
    return Path(path)


resolve_path = _resolve


def _open(path: str, fmt: str, skip_bad: bool, block_tokens: int | None) -> Trace:
    if fmt not in FORMATS:
        _fail(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return open_trace(_resolve(path), fmt=fmt, skip_bad=skip_bad, block_tokens=block_tokens)


def _warn_skipped(tr: Trace) -> None:
    if tr.skipped:
        first = tr.errors[0] if tr.errors else ""
        sys.stderr.write(f"warning: skipped {tr.skipped} bad line(s); first: {first}\n")


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
) -> None:
    """Requests, arrival rate, lengths, unique blocks, hit ceilings, reuse distances."""
    err = Console(stderr=True)
    with user_errors():
        tr = _open(file, fmt, skip_bad, block_tokens)
        if err.is_terminal and not as_json:
            with err.status(f"reading {tr.path} ...", spinner="dots"):
                s = trace_stats(tr, reuse=reuse)
        else:
            s = trace_stats(tr, reuse=reuse)
    _warn_skipped(tr)
    if as_json:
        out = {"path": tr.path, "format": tr.format, **s.to_dict()}
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return
    _render(tr, s, Console())


# -- gen -------------------------------------------------------------------------------

# Which generator parameters each kind takes (CLI options map 1:1 onto them).
_KIND_PARAMS: dict[str, set[str]] = {
    "shared-prefix": {"groups", "prompts_per_group", "system_len", "question_len", "output_len"},
    "multi-turn": {
        "sessions", "turns", "system_len", "user_len", "output_len", "think_time_s",
        "shared_system",
    },
    "agentic": {
        "workflows", "steps", "context_len", "task_len", "call_len", "tool_len", "branches",
        "branch_steps", "shared_context", "tool_time_s",
    },
}  # fmt: skip
_OPTION_NAMES = {
    "prompts_per_group": "--prompts",
    "think_time_s": "--think-time",
    "tool_time_s": "--tool-time",
    "shared_system": "--shared-system/--private-system",
    "shared_context": "--shared-context/--private-context",
}


def _h(name: str, text: str) -> str:
    """Help for a kind-specific option: which kinds take it, and their defaults."""
    kinds = [k for k, ps in _KIND_PARAMS.items() if name in ps]
    defaults = [
        str(inspect.signature(gen_mod.GENERATORS[k]).parameters[name].default) for k in kinds
    ]
    return f"{', '.join(kinds)}: {text} (default {' / '.join(defaults)})."


def _opt(name: str) -> str:
    return _OPTION_NAMES.get(name, "--" + name.replace("_", "-"))


@trace_app.command(cls=_OneLineCommand)
def gen(
    kind: str = typer.Argument(..., metavar="KIND", help="shared-prefix | multi-turn | agentic"),
    output: str = typer.Option(..., "--output", "-o", help="Output file (generic JSONL; .gz ok)."),
    force: bool = typer.Option(False, "--force", help="Replace the output if it exists."),
    seed: int = typer.Option(0, "--seed", help="Random seed; same seed, same trace."),
    rate: float | None = typer.Option(
        None,
        "--rate",
        help="Arrivals per second: prompts (shared-prefix, default 2.0), "
        "sessions (multi-turn, 0.5) or workflows (agentic, 0.2).",
    ),
    arrival: str = typer.Option("poisson", "--arrival", help="poisson | gamma"),
    cv: float = typer.Option(1.0, "--cv", help="Gamma inter-arrival coefficient of variation."),
    block_tokens: int = typer.Option(512, "--block-tokens", "-b", help="Tokens per block."),
    with_tokens: bool = typer.Option(
        False, "--with-tokens", help="Also write seeded token ids (larger files)."
    ),
    groups: int | None = typer.Option(None, help=_h("groups", "system prompts")),
    prompts_per_group: int | None = typer.Option(
        None, "--prompts", help=_h("prompts_per_group", "questions per system prompt")
    ),
    system_len: int | None = typer.Option(None, help=_h("system_len", "tokens")),
    question_len: int | None = typer.Option(None, help=_h("question_len", "tokens")),
    output_len: int | None = typer.Option(None, help=_h("output_len", "tokens")),
    sessions: int | None = typer.Option(None, help=_h("sessions", "chat sessions")),
    turns: int | None = typer.Option(None, help=_h("turns", "turns per session")),
    user_len: int | None = typer.Option(None, help=_h("user_len", "tokens per user message")),
    think_time_s: float | None = typer.Option(
        None, "--think-time", help=_h("think_time_s", "mean seconds between turns")
    ),
    shared_system: bool | None = typer.Option(
        None,
        "--shared-system/--private-system",
        help=_h("shared_system", "one system prompt for all"),
    ),
    workflows: int | None = typer.Option(None, help=_h("workflows", "workflows")),
    steps: int | None = typer.Option(None, help=_h("steps", "trunk steps (tool calls)")),
    context_len: int | None = typer.Option(None, help=_h("context_len", "shared context tokens")),
    task_len: int | None = typer.Option(None, help=_h("task_len", "task prompt tokens")),
    call_len: int | None = typer.Option(None, help=_h("call_len", "tokens per tool call (output)")),
    tool_len: int | None = typer.Option(None, help=_h("tool_len", "tokens per tool result")),
    branches: int | None = typer.Option(
        None, help=_h("branches", "parallel branches after the trunk")
    ),
    branch_steps: int | None = typer.Option(None, help=_h("branch_steps", "steps per branch")),
    shared_context: bool | None = typer.Option(
        None, "--shared-context/--private-context", help=_h("shared_context", "one context for all")
    ),
    tool_time_s: float | None = typer.Option(
        None, "--tool-time", help=_h("tool_time_s", "mean tool latency, seconds")
    ),
) -> None:
    """Generate a seeded synthetic trace and write it in the generic JSONL form."""
    if kind not in gen_mod.GENERATORS:
        _fail(f"unknown generator kind {kind!r}; expected one of {', '.join(gen_mod.GENERATORS)}")
    local = locals()
    given = {k: local[k] for ks in _KIND_PARAMS.values() for k in ks if local[k] is not None}
    wrong = sorted(k for k in given if k not in _KIND_PARAMS[kind])
    if wrong:
        _fail(f"{', '.join(_opt(k) for k in wrong)} does not apply to {kind}")
    params: dict[str, Any] = dict(given)
    params.update(seed=seed, arrival=arrival, cv=cv, block_tokens=block_tokens)
    params["with_tokens"] = with_tokens
    if rate is not None:
        params["rate"] = rate
    with user_errors():
        if Path(output).exists() and not force:
            _fail(f"{output} exists; pass --force to replace it")
        try:
            reqs = gen_mod.generate(kind, **params)
        except ValueError as exc:
            _fail(f"{kind}: {exc}")
        meta = {"generator": kind, "seed": seed}
        n = write_generic(reqs, output, block_tokens=block_tokens, force=force, **meta)
    line = f"wrote {n:,} requests to {output} ({kind}, seed {seed}"
    if kind == "shared-prefix":
        defaults = inspect.signature(gen_mod.shared_prefix).parameters
        p, sl, ql = (
            params.get(k, defaults[k].default)
            for k in ("prompts_per_group", "system_len", "question_len")
        )
        ideal = gen_mod.shared_prefix_hit_ratio(p, sl, ql, block_tokens)
        line += f"; ideal token hit ratio {100 * ideal:.1f}%"
    Console(highlight=False, soft_wrap=True).print(line + ")")


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
) -> None:
    """Convert a trace to the generic JSONL form (e.g. Azure CSV at a chosen block size)."""
    if limit is not None and limit < 0:
        _fail(f"--limit must be >= 0, got {limit}")
    with user_errors():
        tr = _open(file, fmt, skip_bad, block_tokens)
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


if __name__ == "__main__":  # python -m traces.cli, for use without the kvflow entry point
    trace_app()
