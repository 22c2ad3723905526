"""``kvflow trace scale`` and ``kvflow trace load``: reshape a trace's load, and measure it.

``scale`` writes a new trace offered faster or slower (``--rate-scale``),
re-timed (``--rate``, ``--burstiness``), repeated (``--repeat``) and bounded
(``--duration``, ``--limit``), the same transformations, in the same order,
that the replay driver applies from :mod:`traces.reshape`. ``load`` prints
the offered load (:func:`traces.load.offered_load`) of a trace after those
transformations, so "what does this trace ask per second at 8x" is one
command.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from traces.cli_common import fail, open_cli_trace, user_errors, warn_skipped
from traces.load import offered_load
from traces.loaders import Trace
from traces.reshape import bound, poisson_arrivals, rate_scale, repeat
from traces.schema import Request
from traces.writer import write_generic

_FMT = typer.Option("auto", "--format", "-f", help="auto|mooncake|azure|generic")
_BLOCK = typer.Option(
    None, "--block-tokens", "-b", help="Block size where the trace leaves it open (Azure)."
)
_SKIP = typer.Option(False, "--skip-bad", help="Skip bad lines, report the count.")
_SCALE = typer.Option(
    None,
    "--rate-scale",
    help="Offer the trace X times faster: every timestamp divided by X (0.5: half as fast).",
)
_RATE = typer.Option(
    None,
    "--rate",
    help="Re-time the requests, in their order, as arrivals at R per second (for traces "
    "without timestamps; inf: all at time 0).",
)
_BURST = typer.Option(
    None,
    "--burstiness",
    help="With --rate: gamma shape of the gaps, as bench_serving (1 = Poisson).",
)
_SEED = typer.Option(None, "--seed", help="With --rate: random seed (default 0).")
_REPEAT = typer.Option(
    None, "--repeat", help="Concatenate K copies of the trace, each with block ids of its own."
)
_GAP = typer.Option(
    None,
    "--gap",
    help="With --repeat: seconds from one copy's last arrival to the next one's first, before "
    "--rate-scale (default: the trace's mean gap).",
)
_SHARE = typer.Option(
    False, "--share-ids", help="With --repeat: copies keep the same block ids (same prompts)."
)
_DURATION = typer.Option(
    None, "--duration", help="Keep requests arriving in the first SECONDS (after scaling)."
)
_LIMIT = typer.Option(None, "--limit", help="Keep only the first N requests.")


def _reshape(
    tr: Trace,
    *,
    scale: float | None,
    rate: float | None,
    burstiness: float | None,
    seed: int | None,
    copies: int | None,
    gap: float | None,
    share_ids: bool,
    duration: float | None,
    limit: int | None,
) -> tuple[Iterable[Request], dict[str, Any]]:
    """The trace after repeat -> re-time or scale -> bound, and what was done (for headers)."""
    if scale is not None and rate is not None:
        fail("pass --rate-scale or --rate, not both")
    if rate is None and (burstiness is not None or seed is not None):
        fail("--burstiness and --seed apply only with --rate")
    if copies is None and (gap is not None or share_ids):
        fail("--gap and --share-ids apply only with --repeat")
    done: dict[str, Any] = {}
    out: Iterable[Request] = tr
    try:
        if copies is not None:
            out = repeat(out, copies, gap_s=gap, share_ids=share_ids)
            done.update(repeat=copies, gap_s=gap, share_ids=share_ids or None)
        if scale is not None:
            out = rate_scale(out, scale)
            done["rate_scale"] = scale
        if rate is not None:
            b, s = 1.0 if burstiness is None else burstiness, 0 if seed is None else seed
            out = poisson_arrivals(out, rate, burstiness=b, seed=s)
            done.update(rate=rate if math.isfinite(rate) else "inf", burstiness=b, seed=s)
        if duration is not None or limit is not None:
            out = bound(out, duration_s=duration, limit=limit)
            done.update(duration_s=duration, limit=limit)
    except ValueError as exc:
        fail(str(exc))
    return out, {k: v for k, v in done.items() if v is not None}


def scale(
    file: str = typer.Argument(..., metavar="FILE", help="Input trace (.gz ok), or sample:NAME."),
    output: str = typer.Option(..., "--output", "-o", help="Output file (generic JSONL; .gz ok)."),
    rate_scale_: float | None = _SCALE,
    rate: float | None = _RATE,
    burstiness: float | None = _BURST,
    seed: int | None = _SEED,
    copies: int | None = _REPEAT,
    gap: float | None = _GAP,
    share_ids: bool = _SHARE,
    duration: float | None = _DURATION,
    limit: int | None = _LIMIT,
    fmt: str = _FMT,
    block_tokens: int | None = _BLOCK,
    skip_bad: bool = _SKIP,
    force: bool = typer.Option(False, "--force", help="Replace the output if it exists."),
) -> None:
    """Write a trace offered faster, re-timed, repeated or cut (generic JSONL)."""
    with user_errors(ValueError):
        tr = open_cli_trace(file, fmt, skip_bad, block_tokens)
        if Path(output).exists() and not force:
            fail(f"{output} exists; pass --force to replace it")
        if Path(output).resolve() == Path(tr.path).resolve():
            fail(f"{output} is the input file")
        reqs, done = _reshape(
            tr, scale=rate_scale_, rate=rate, burstiness=burstiness, seed=seed, copies=copies,
            gap=gap, share_ids=share_ids, duration=duration, limit=limit,
        )  # fmt: skip
        meta: dict[str, Any] = {"source": Path(tr.path).name, "source_format": tr.format}
        if tr.header:
            meta["source_header"] = tr.header
        n = write_generic(reqs, output, block_tokens=tr.block_tokens, force=force,
                          **meta, reshape=done)  # fmt: skip
    warn_skipped(tr)
    what = ", ".join(f"{k} {v}" for k, v in done.items()) or "unchanged"
    Console(highlight=False, soft_wrap=True).print(
        f"wrote {n:,} requests from {tr.path} to {output} ({what})"
    )


def _rate(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:,.{digits}f}"


def load(
    file: str = typer.Argument(..., metavar="FILE", help="Trace file (.gz ok), or sample:NAME."),
    window: float = typer.Option(60.0, "--window", help="Seconds per window for the peaks."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    rate_scale_: float | None = _SCALE,
    rate: float | None = _RATE,
    burstiness: float | None = _BURST,
    seed: int | None = _SEED,
    copies: int | None = _REPEAT,
    gap: float | None = _GAP,
    share_ids: bool = _SHARE,
    duration: float | None = _DURATION,
    limit: int | None = _LIMIT,
    fmt: str = _FMT,
    block_tokens: int | None = _BLOCK,
    skip_bad: bool = _SKIP,
) -> None:
    """Offered load: requests, prompt, new (uncached) and output tokens per second."""
    with user_errors(ValueError):
        tr = open_cli_trace(file, fmt, skip_bad, block_tokens)
        reqs, done = _reshape(
            tr, scale=rate_scale_, rate=rate, burstiness=burstiness, seed=seed, copies=copies,
            gap=gap, share_ids=share_ids, duration=duration, limit=limit,
        )  # fmt: skip
        o = offered_load(reqs, window_s=window)
    warn_skipped(tr)
    if as_json:
        out = {"path": tr.path, "format": tr.format, "reshape": done, **o.to_dict()}
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return
    console = Console()
    what = ", ".join(f"{k} {v}" for k, v in done.items())
    console.print(f"[bold]{tr.path}[/bold] ({tr.format}{', ' + what if what else ''})")
    console.print(
        f"{o.requests:,} requests over {o.span_s:,.1f} s; {100 * o.new_token_fraction:.1f}% "
        f"of prompt tokens are new (infinite cache, {o.block_tokens}-token blocks)"
    )
    t = Table(title="offered load", title_justify="left")
    for col in ("per second", "overall", f"peak {o.window_s:g} s"):
        t.add_column(col, justify="right" if col != "per second" else "left")
    t.add_row("requests", _rate(o.request_rate, 3), _rate(o.peak_request_rate, 3))
    t.add_row("prompt tokens", _rate(o.prompt_tokens_rate), _rate(o.peak_prompt_tokens_rate))
    t.add_row(
        "new prompt tokens", _rate(o.new_prompt_tokens_rate), _rate(o.peak_new_prompt_tokens_rate)
    )
    t.add_row("output tokens", _rate(o.output_tokens_rate), "-")
    console.print(t)
