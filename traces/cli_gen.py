"""``kvflow trace gen``: seeded synthetic traces, written in the generic JSONL form.

One command for every generator of :mod:`traces.generate`: each generator
parameter is an option, refused (exit 2, one line) for kinds that do not
take it, so a typo in a long command line cannot silently fall back to a
default. Arrivals take ``--rate`` and ``--burstiness`` as SGLang's
``bench_serving`` does; ``--duration`` and ``--limit`` cut the result.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from traces import generate as gen_mod
from traces.cli_common import fail as _fail
from traces.cli_common import user_errors
from traces.reshape import bound
from traces.writer import write_generic

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
    "tool-agent": {
        "sessions", "templates", "system_len", "task_len", "call_len", "tool_len", "mean_steps",
        "zipf", "length_cv", "tool_time_s",
    },
}  # fmt: skip
_OPTION_NAMES = {
    "prompts_per_group": "--prompts",
    "think_time_s": "--think-time",
    "tool_time_s": "--tool-time",
    "shared_system": "--shared-system/--private-system",
    "shared_context": "--shared-context/--private-context",
}
_RATE_OF = {
    "shared-prefix": "prompts",
    "multi-turn": "sessions",
    "agentic": "workflows",
    "tool-agent": "sessions",
}


def _default(kind: str, name: str) -> Any:
    return inspect.signature(gen_mod.GENERATORS[kind]).parameters[name].default


def _h(name: str, text: str) -> str:
    """Help for a kind-specific option: which kinds take it, and their defaults."""
    kinds = [k for k, ps in _KIND_PARAMS.items() if name in ps]
    defaults = [f"{_default(k, name):g}" if isinstance(_default(k, name), float)
                else str(_default(k, name)) for k in kinds]  # fmt: skip
    return f"{', '.join(kinds)}: {text} (default {' / '.join(defaults)})."


def _rate_help() -> str:
    each = ", ".join(f"{what} ({k}, {_default(k, 'rate'):.4g})" for k, what in _RATE_OF.items())
    return f"Arrivals per second (inf: all at time 0, bench_serving's default): {each}."


def _opt(name: str) -> str:
    return _OPTION_NAMES.get(name, "--" + name.replace("_", "-"))


def _json_safe(value: Any) -> Any:
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def gen(
    kind: str = typer.Argument(..., metavar="KIND", help=" | ".join(gen_mod.GENERATORS)),
    output: str = typer.Option(..., "--output", "-o", help="Output file (generic JSONL; .gz ok)."),
    force: bool = typer.Option(False, "--force", help="Replace the output if it exists."),
    seed: int = typer.Option(0, "--seed", help="Random seed; same seed, same trace."),
    rate: float | None = typer.Option(None, "--rate", help=_rate_help()),
    burstiness: float = typer.Option(
        1.0,
        "--burstiness",
        help="Gamma shape of the gaps between arrivals, as bench_serving's: 1 = Poisson, "
        "< 1 burstier (gap CV 1/sqrt(burstiness)), > 1 smoother.",
    ),
    duration: float | None = typer.Option(
        None, "--duration", help="Keep only requests arriving in the first SECONDS."
    ),
    limit: int | None = typer.Option(None, "--limit", help="Keep only the first N requests."),
    block_tokens: int = typer.Option(512, "--block-tokens", "-b", help="Tokens per block."),
    with_tokens: bool = typer.Option(
        False, "--with-tokens", help="Also write seeded token ids (larger files)."
    ),
    groups: int | None = typer.Option(None, help=_h("groups", "system prompts")),
    prompts_per_group: int | None = typer.Option(
        None, "--prompts", help=_h("prompts_per_group", "questions per system prompt")
    ),
    system_len: int | None = typer.Option(None, help=_h("system_len", "tokens (mean)")),
    question_len: int | None = typer.Option(None, help=_h("question_len", "tokens")),
    output_len: int | None = typer.Option(None, help=_h("output_len", "tokens")),
    sessions: int | None = typer.Option(None, help=_h("sessions", "sessions")),
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
    templates: int | None = typer.Option(None, help=_h("templates", "agents (system prompts)")),
    mean_steps: float | None = typer.Option(
        None, help=_h("mean_steps", "mean requests per session (geometric)")
    ),
    zipf: float | None = typer.Option(None, help=_h("zipf", "agent popularity exponent")),
    length_cv: float | None = typer.Option(
        None, help=_h("length_cv", "lognormal CV of every length (0: fixed)")
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
    params.update(seed=seed, burstiness=burstiness, block_tokens=block_tokens)
    params["with_tokens"] = with_tokens
    if rate is not None:
        params["rate"] = rate
    effective = {
        name: _json_safe(params.get(name, p.default))
        for name, p in inspect.signature(gen_mod.GENERATORS[kind]).parameters.items()
        if name not in ("with_tokens", "vocab_size", "seed", "block_tokens")
    }
    with user_errors():
        if Path(output).exists() and not force:
            _fail(f"{output} exists; pass --force to replace it")
        try:
            reqs = bound(gen_mod.generate(kind, **params), duration_s=duration, limit=limit)
        except ValueError as exc:
            _fail(f"{kind}: {exc}")
        meta = {"generator": kind, "seed": seed, "params": effective}
        n = write_generic(reqs, output, block_tokens=block_tokens, force=force, **meta)
    line = f"wrote {n:,} requests to {output} ({kind}, seed {seed}"
    if kind == "shared-prefix" and duration is None and limit is None:
        p, sl, ql = (effective[k] for k in ("prompts_per_group", "system_len", "question_len"))
        ideal = gen_mod.shared_prefix_hit_ratio(p, sl, ql, block_tokens)
        line += f"; ideal token hit ratio {100 * ideal:.1f}%"
    Console(highlight=False, soft_wrap=True).print(line + ")")
