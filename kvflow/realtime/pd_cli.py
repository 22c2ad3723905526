"""``kvflow serve-pd``: registered on the root app by ``register`` (cli.py), so the
command lives beside what it runs. Conventions as every ``kvflow`` command: a rich
summary by default, ``--json`` for machines, ``--out`` for the full report,
a user's mistake exits 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from kvflow.errors import KvflowError
from traces.cli import OneLineCommand, fail, resolve_path, user_errors

_EPILOG = """\
Examples:

  kvflow serve-pd                                   # 40 requests of the bundled sample

  kvflow serve-pd trace.jsonl --start 480 --limit 100 --time-scale 0.5 --out pd.json

  kvflow serve-pd --decode-device-blocks 64 --deadline-s 2 --on-failure fail

  kvflow serve-pd --backend cuda --check-tokens     # both on one GPU; tokens vs colocated
"""


def _ms(summary: dict[str, float] | None, key: str) -> str:
    return "-" if not summary else f"{summary[key] * 1e3:.1f} ms"


def print_pd_summary(report: dict[str, Any], console: Console) -> None:
    cfg = report["config"]
    xfer = report["transfer"]
    t = Table(title=f"kvflow serve-pd — {report['requests']} requests, {cfg['model']} "
                    f"({cfg['num_layers']} layers, {cfg['block_tokens']}-token blocks), "
                    f"TCP, {report['world']}, {report['wall_s']:.1f} s wall")
    t.add_column("")
    for k in ("mean", "p50", "p90", "p99"):
        t.add_column(k, justify="right")
    rows = (("TTFT", report["ttft_s"]), ("TPOT", report["tpot_s"]), ("E2E", report["e2e_s"]),
            ("KV wait at decode admission", xfer["wait_at_admission_s"]),
            ("KV landed after first token", xfer["after_prefill_s"]))
    for name, s in rows:
        t.add_row(name, *(_ms(s, k) for k in ("mean", "p50", "p90", "p99")))
    console.print(t)
    console.print(f"moved {xfer['bytes'] / 1e6:,.1f} MB of KV ({xfer['wire_bytes'] / 1e6:,.1f} MB "
                  f"on the wire, {xfer['frames']} frames) in {xfer['transfers']} transfers: "
                  f"{xfer['ok']} landed, {xfer['failed']} failed, {xfer['skipped']} not needed "
                  f"(decode held the prompt), {xfer['recomputed']} recomputed on decode")
    tokens = report.get("tokens")
    if tokens is not None:
        colour = "green" if tokens["mismatched"] == 0 else "red"
        console.print(f"[{colour}]tokens against a colocated run: {tokens['equal']} of "
                      f"{tokens['requests']} requests equal[/{colour}]"
                      + "".join(f"\n  {x}" for x in tokens["examples"]))
    bad = report["errors"]["corrupt_reads"]
    if bad or report["failed"]:
        console.print(f"[red]{bad} corrupt reads; {len(report['failed'])} requests failed: "
                      f"{'; '.join(report['failed'][:5])}[/red]")


def serve_pd_cmd(
    trace: Annotated[str | None, typer.Argument(
        help="Trace file or sample:NAME (default: the bundled Mooncake sample).")] = None,
    start: Annotated[int, typer.Option(help="First request of the slice (0-based).")] = 0,
    limit: Annotated[int, typer.Option(help="Requests in the slice.")] = 40,
    time_scale: Annotated[float, typer.Option(
        help="Arrival times multiplied by this (0.5: twice as fast).")] = 1.0,
    model: Annotated[str, typer.Option(
        help="'tiny' (KB-sized blocks, real bytes) or a preset.")] = "tiny",
    prefill_device_blocks: Annotated[int, typer.Option(help="0: 4x the largest request.")] = 0,
    decode_device_blocks: Annotated[int, typer.Option(help="0: 4x the largest request.")] = 0,
    host_blocks: Annotated[int, typer.Option(help="Host tier of each; 0: as the device.")] = 0,
    step_s: Annotated[float, typer.Option(help="Compute per step (s).")] = 0.002,
    token_s: Annotated[float, typer.Option(help="Compute per token (s).")] = 2e-6,
    verify_decode: Annotated[bool, typer.Option(
        help="Check every block at every decode step too (the decode side's first step "
             "checks the received KV either way).")] = False,
    deadline_s: Annotated[float, typer.Option(help="Deadline of each transfer (s).")] = 30.0,
    on_failure: Annotated[str, typer.Option(
        help="A transfer that fails: recompute on decode, or fail the request.")] = "recompute",
    out: Annotated[Path | None, typer.Option(help="Write the full report (JSON) here.")] = None,
    force: Annotated[bool, typer.Option(help="Overwrite --out.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    backend: Annotated[str, typer.Option(
        help="cpu (the real-time CPU world) or cuda (both engines on one GPU).")] = "cpu",
    executor: Annotated[str, typer.Option(
        help="cuda: exact (batch-invariant: tokens comparable) or fast.")] = "exact",
    check_tokens: Annotated[bool, typer.Option(
        help="cuda: run the requests colocated too and compare every request's tokens.")]
        = False,
) -> None:
    """Run a prefill and a decode engine as two processes over TCP (real-time CPU world,
    or one GPU); report transfer bytes, the KV wait at decode admission, TTFT and TPOT."""
    from kvflow.realtime.pd_instance import InstanceConfig
    from kvflow.realtime.pd_serve import ServeConfig, serve_pd

    if out is not None and out.exists() and not force:
        fail(f"{out} exists; pass --force to overwrite")
    with user_errors(KvflowError):
        path = None if trace is None else str(resolve_path(trace))

        def inst(device: int) -> InstanceConfig:
            return InstanceConfig(device_blocks=device, host_blocks=host_blocks, step_s=step_s,
                                  token_s=token_s, verify_decode=verify_decode)

        cfg = ServeConfig(trace=path, start=start, limit=limit, time_scale=time_scale,
                          model=model, prefill=inst(prefill_device_blocks),
                          decode=inst(decode_device_blocks), deadline_s=deadline_s,
                          on_failure=on_failure, backend=backend, executor=executor,
                          check_tokens=check_tokens)
        report = serve_pd(cfg)
    if out is not None:
        out.write_text(json.dumps(report, indent=1, default=str))
    if json_out:
        typer.echo(json.dumps(report, indent=1, default=str))
    else:
        print_pd_summary(report, Console(highlight=False))


def register(app: typer.Typer) -> None:
    """Add ``serve-pd`` to the root ``kvflow`` app."""
    app.command("serve-pd", cls=OneLineCommand, epilog=_EPILOG)(serve_pd_cmd)
