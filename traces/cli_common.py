"""Plumbing shared by the ``kvflow trace`` commands (and, through ``traces.cli``, by ``kvflow``).

A user's mistake exits with code 2 and one line on stderr, never a
traceback: :func:`fail` is that exit, :func:`user_errors` turns trace and
file errors into it, and the one-line command and group classes do the same
for click's usage errors. Kept apart from the commands so that the modules
holding them (``cli``, ``cli_gen``, ``cli_load``) share it without importing
each other.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import typer
from typer.core import TyperCommand, TyperGroup

from traces import sample_path
from traces.loaders import Trace, open_trace
from traces.schema import FORMATS, TraceError, TraceLimits

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


def _open(path: str, fmt: str, skip_bad: bool, block_tokens: int | None,
          max_request_tokens: int | None = None, max_trace_bytes: int | None = None) -> Trace:
    if fmt not in FORMATS:
        _fail(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    limits = TraceLimits.from_env(max_request_tokens=max_request_tokens,
                                  max_trace_bytes=max_trace_bytes)
    return open_trace(_resolve(path), fmt=fmt, skip_bad=skip_bad, block_tokens=block_tokens,
                      limits=limits)


# Help of the limit options every command that reads a trace takes (``kvflow replay`` too).
MAX_REQUEST_TOKENS_HELP = (
    "Longest request (prompt + answer) a trace may hold, in tokens "
    f"(default {TraceLimits.max_request_tokens:,}, or KVFLOW_MAX_REQUEST_TOKENS).")
MAX_TRACE_BYTES_HELP = (
    "Most bytes read from a trace, after gzip "
    f"(default {TraceLimits.max_trace_bytes:,}, or KVFLOW_MAX_TRACE_BYTES).")


def max_request_tokens_option() -> Any:
    return typer.Option(None, "--max-request-tokens", min=1, help=MAX_REQUEST_TOKENS_HELP)


def max_trace_bytes_option() -> Any:
    return typer.Option(None, "--max-trace-bytes", min=1, help=MAX_TRACE_BYTES_HELP)


def _warn_skipped(tr: Trace) -> None:
    if tr.skipped:
        first = tr.errors[0] if tr.errors else ""
        sys.stderr.write(f"warning: skipped {tr.skipped} bad line(s); first: {first}\n")


open_cli_trace = _open
warn_skipped = _warn_skipped
