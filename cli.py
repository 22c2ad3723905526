"""The ``kvflow`` command line: thin wrappers over the library.

User errors exit with code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvflow.errors import KvflowError
from kvflow.policy import EVICTION_HELP
from kvflow.realtime.pd_cli import register as register_pd_commands
from kvflow.reports.cli import register as register_report_commands
from kvflow.reports.render import headroom_rows
from traces.cli import (
    MAX_REQUEST_TOKENS_HELP,
    MAX_TRACE_BYTES_HELP,
    OneLineCommand,
    OneLineGroup,
    fail,
    resolve_path,
    trace_app,
    user_errors,
)
from traces.writer import replaceable

app = typer.Typer(
    help="kvflow: KV-cache tiering for LLM serving — simulate with real traces, or run on a GPU.",
    no_args_is_help=True,
    cls=OneLineGroup,
    pretty_exceptions_enable=False,
)
app.add_typer(trace_app, name="trace")
register_report_commands(app)
register_pd_commands(app)


class Mode(str, Enum):
    full = "full"
    cache = "cache"


class Backend(str, Enum):
    sim = "sim"
    cuda = "cuda"


class Executor(str, Enum):
    fast = "fast"
    exact = "exact"


def _fmt_s(summary: dict[str, float] | None, key: str) -> str:
    if not summary:
        return "-"
    v = summary[key]
    return f"{v * 1e3:.1f} ms" if v < 10 else f"{v:.2f} s"


def _instances(value: str, mode: str, backend: str) -> int | str:
    """``--instances``: a count, or ``auto`` (one where a cluster cannot run)."""
    if value == "auto":
        return "auto" if mode == "full" and backend == "sim" else 1
    try:
        return int(value)
    except ValueError:
        fail(f"--instances must be a whole number or 'auto', got {value!r}")


#: ``ReplayConfig`` fields whose ``kvflow replay`` option is spelt otherwise.
_OPTION_OF = {"duration_s": "duration", "slo_ttft_s": "slo_ttft", "slo_tpot_s": "slo_tpot",
              "nic_latency_s": "nic_latency"}


def _with_cluster_file(ctx: typer.Context, options: dict[str, Any], path: Path
                       ) -> dict[str, Any]:
    """``options`` with those the cluster file sets left to the file, unless given on the
    command line, where they must agree with it (one place for each setting)."""
    from kvflow.replay.config import cluster_file_settings

    settings, groups = cluster_file_settings(str(path))
    out = dict(options, cluster=str(path))
    if groups:
        settings = dict(settings, instances=sum(g.count for g in groups))
    for key, value in settings.items():
        param = _OPTION_OF.get(key, key)
        source = ctx.get_parameter_source(param)  # (by name: typer may carry its own click)
        if (source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")
                and options[key] != value):
            fail(f"--{param.replace('_', '-')} {options[key]} disagrees with {path}'s "
                 f"{key} = {value!r}: give it in one place")
        out.pop(key, None)
    return out


def print_summary(report: dict[str, Any], console: Console) -> None:
    """The replay's headline numbers as rich tables, the offered load beside them."""
    cfg = report["config"]
    n = cfg.get("instances", 1)

    def gpus(profile: str | None, tp: int | None) -> str:
        name = Path(profile or cfg["profile"]).stem
        tp = tp or cfg.get("tp", 1)
        return f"{name} (tp {tp})" if tp > 1 else name

    if cfg.get("groups"):
        where = " + ".join(f"{g['count']} x {gpus(g['profile'], g['tp'])}"
                           for g in cfg["groups"])
    else:
        where = f"{n} x {gpus(None, None)}" if n != 1 else gpus(None, None)
    t = Table(title=f"kvflow replay — {Path(cfg['trace']).name}, {cfg['model']} on "
                    f"{where}, {cfg['mode']} mode")
    t.add_column("tier")
    t.add_column("blocks" if n == 1 else "blocks per instance", justify="right")
    t.add_column("hit rate", justify="right")
    t.add_column("evictions", justify="right")
    pool = report.get("pool")
    for tier in ("device", "host", "storage"):
        label = "pool (shared)" if tier == "storage" and pool else tier
        t.add_row(label, f"{cfg[f'{tier}_blocks']:,}", f"{report['hit_rate'][tier]:.1%}",
                  f"{report['evictions'][tier]:,}" if label == tier else f"{pool['evicted']:,}")
    t.add_row("total", "", f"{report['hit_rate']['total']:.1%}", "", style="bold")
    console.print(t)
    if pool:
        gate = pool["gate"]
        held = "" if gate is None else (
            f"; aggregate {gate['read']['bytes_per_s'] / 1e9:g} GB/s each way held reads "
            f"back {gate['read']['held_s']:.1f} s, writes {gate['write']['held_s']:.1f} s "
            "in all")
        console.print(f"shared pool: {pool['blocks']:,} of {pool['capacity_blocks']:,} blocks "
                      f"held, {pool['published']:,} written, {pool['evicted']:,} evicted, "
                      f"{pool['imported_copies']:,} found by other instances{held}")
    head = headroom_rows(report)
    if head is not None:
        columns, rows, note = head
        h = Table(title="headroom: the policy beside the offline optimum", caption=note)
        for i, col in enumerate(columns):
            h.add_column(col, justify="left" if i == 0 else "right")
        for row in rows:
            h.add_row(*row)
        console.print(h)
    if report.get("ttft_s"):
        world = "on the GPU" if cfg.get("backend") == "cuda" else "simulated"
        lat = Table(title=f"{report['requests']:,} requests in {report['sim_time_s']:.1f} s "
                          f"{world} ({report['wall_s']:.1f} s wall)")
        lat.add_column("latency")
        for k in ("mean", "p50", "p90", "p99"):
            lat.add_column(k, justify="right")
        for name in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
            if report.get(name):
                lat.add_row(name[:-2].upper() if name != "queue_s" else "queue",
                            *(_fmt_s(report[name], k) for k in ("mean", "p50", "p90", "p99")))
        console.print(lat)
        thr = report["throughput"]
        util = report["link_utilization"]
        gb = {k: v / 1e9 for k, v in report["bytes"].items()}
        console.print(
            f"throughput {thr['requests_per_s']:.2f} req/s, "
            f"{thr['output_tokens_per_s']:,.0f} output tok/s; "
            f"moved h2d {gb['h2d']:,.1f} GB ({util['h2d']:.1%} busy), "
            f"d2h {gb['d2h']:,.1f} GB ({util['d2h']:.1%}), "
            f"storage read {gb['storage_read']:,.1f} GB, write {gb['storage_write']:,.1f} GB")
        err = report["errors"]
        if err["failed_transfers"] or report["rejected"]:
            console.print(f"[yellow]{err['failed_transfers']} transfers failed or cancelled, "
                          f"{err['recomputed_blocks']} blocks recomputed, "
                          f"{report['rejected']} requests rejected[/yellow]")
        if report.get("cluster"):
            _print_cluster(report, console)
        if report.get("pd"):
            _print_pd(report["pd"], console)
        if report.get("slo"):
            slo = report["slo"]
            good = slo["goodput_requests_per_s"]
            console.print(f"SLO (TTFT <= {slo['ttft_s']} s, TPOT <= {slo['tpot_s']} s): "
                          f"{slo['attainment']:.1%} of {slo['requests']:,} requests met both; "
                          f"goodput {good:.2f} req/s" if good is not None else "")
    else:
        console.print(f"{report['requests']:,} requests replayed for hit rates in "
                      f"{report['wall_s']:.1f} s")
    _print_load(report, console)


def _print_load(report: dict[str, Any], console: Console) -> None:
    """Offered load against capacity; a plain warning when the run is overloaded."""
    load = report.get("load")
    if not load or load["offered"].get("prompt_tokens_per_s") is None:
        return
    off, cap = load["offered"], load["capacity_per_instance"]
    n = load["instances"]
    util = load["utilization_predicted"]
    how = " (--instances auto)" if load.get("instances_auto") else ""
    console.print(
        f"offered load {off['requests_per_s']:.2f} req/s, {off['prompt_tokens_per_s']:,.0f} "
        f"prompt tok/s, {off['output_tokens_per_s']:,.0f} output tok/s; one instance serves "
        f"{cap['prefill_tokens_per_s']:,.0f} prefill tok/s and {cap['decode_tokens_per_s']:,.0f}"
        f" decode tok/s (cost model): predicted utilisation {util:.2f} on {n} "
        f"instance{'s' if n != 1 else ''}{how}")
    if load["overloaded"] and report.get("ttft_s"):
        console.print(
            f"[bold red]overloaded:[/bold red] requests arrive faster than {n} "
            f"instance{'s' if n != 1 else ''} serve them, so the queue grows for as long as "
            f"they arrive and the TTFT above is mostly queueing, not latency. "
            f"About {load['instances_suggested']} instances serve this trace at a "
            f"utilisation of 0.7 (--instances {load['instances_suggested']} or auto), or slow "
            f"the arrivals (--rate-scale).")


def _print_pd(pd: dict[str, Any], console: Console) -> None:
    """Prefill/decode disaggregation: what crossed the network and what decode waited."""
    how = "layer by layer" if pd["layerwise"] else "whole after prefill"
    util = pd.get("utilization_predicted") or {}
    side = (f"; predicted utilisation prefill {util['prefill']:.2f}, decode {util['decode']:.2f}"
            if util.get("prefill") is not None else "")
    console.print(
        f"PD {pd['prefill_instances']}:{pd['decode_instances']} ({how}, "
        f"{pd['gb_per_s']:g} GB/s, {pd['latency_s'] * 1e6:g} us): {pd['bytes'] / 1e9:,.1f} GB "
        f"of KV in {pd['transfers']:,} transfers ({pd['reused_blocks']:,} blocks already on "
        f"the decode device); transfer mean {_fmt_s(pd['transfer_s'], 'mean')}, p90 "
        f"{_fmt_s(pd['transfer_s'], 'p90')}; wait from first token to decode mean "
        f"{_fmt_s(pd['decode_wait_s'], 'mean')}, p90 {_fmt_s(pd['decode_wait_s'], 'p90')}"
        f"{side}")


def _print_cluster(report: dict[str, Any], console: Console) -> None:
    c = report["cluster"]
    t = Table(title=f"{len(report['instances'])} instances, router {c['router']} "
                    f"({c['view']} view): load imbalance max/mean "
                    f"{c['imbalance_requests']:.2f} (requests), "
                    f"{c['imbalance_prompt_tokens']:.2f} (prompt tokens)")
    pd = bool(report.get("pd"))
    for col in ("instance", *(("role",) if pd else ()), "requests", "hit rate", "TTFT p50",
                *(("TPOT p50",) if pd else ()), "queue p50", "compute busy", "h2d busy"):
        t.add_column(col, justify="right")
    for row in report["instances"]:
        busy = row["compute_utilization"]
        role = (row["role"], ) if pd else ()
        tpot = (_fmt_s(row.get("tpot_s"), "p50"), ) if pd else ()
        decode = pd and row["role"] == "decode"
        t.add_row(str(row["instance"]), *role, f"{row['requests']:,}",
                  "-" if decode else f"{row['hit_rate']['total']:.1%}",
                  "-" if decode else _fmt_s(row["ttft_s"], "p50"), *tpot,
                  "-" if decode else _fmt_s(row["queue_s"], "p50"),
                  "-" if busy is None else f"{busy:.0%}",
                  f"{row['link_utilization']['h2d']:.1%}")
    console.print(t)


@app.command(cls=OneLineCommand, epilog=(
    "Examples:\n\n"
    "  kvflow replay                              # the bundled sample, defaults\n\n"
    "  kvflow replay trace.jsonl --host-gb 128 --eviction s3fifo --out report.json\n\n"
    "  kvflow replay trace.jsonl --mode cache --device-blocks 2000 --host-blocks 0\n\n"
    "  kvflow replay trace.jsonl --pd 12:4 --router prefix   # prefill/decode disaggregated"))
def replay(
    ctx: typer.Context,
    trace: Annotated[str | None, typer.Argument(
        help="Trace file (Mooncake JSONL, Azure CSV, generic JSONL; .gz ok) or "
             "sample:NAME. Default: the bundled 1k-request Mooncake sample.")] = None,
    model: Annotated[str, typer.Option(help="Model preset (see kvflow.layout.PRESETS).")] =
    "llama-3-8b",
    profile: Annotated[str, typer.Option(
        "--profile", "--gpu", help="GPU profile: h100, h200, a100, or a TOML file.")] = "h100",
    device_blocks: Annotated[int | None, typer.Option(
        help="Device tier size in blocks (default: GPU memory left after weights).")] = None,
    host_blocks: Annotated[int | None, typer.Option(
        help="Host tier size in blocks; 0 = no host tier (default 256 GB).")] = None,
    storage_blocks: Annotated[int | None, typer.Option(
        help="Storage tier size in blocks; 0 = none (default 2 TB).")] = None,
    device_gb: Annotated[float | None, typer.Option(help="Device tier in GiB.")] = None,
    host_gb: Annotated[float | None, typer.Option(help="Host tier in GiB.")] = None,
    storage_gb: Annotated[float | None, typer.Option(help="Storage tier in GiB.")] = None,
    eviction: Annotated[str, typer.Option(help=EVICTION_HELP + ".")] = "lru",
    write_policy: Annotated[str, typer.Option(
        help="write_through, write_through_selective or write_back.")] = "write_through",
    write_threshold: Annotated[int, typer.Option(
        help="Hits before backup, for write_through_selective.")] = 1,
    prefetch_policy: Annotated[str, typer.Option(
        help="best_effort, wait_complete or timeout.")] = "best_effort",
    mode: Annotated[Mode, typer.Option(
        help="full: timed simulation; cache: hit rates only, in arrival order.")] = Mode.full,
    seed: Annotated[int, typer.Option(help="Seed (recorded in the report).")] = 0,
    limit: Annotated[int | None, typer.Option(help="Replay only the first N requests.")] = None,
    max_batch_tokens: Annotated[int, typer.Option(help="Token budget per engine step.")] = 8192,
    skip_bad: Annotated[bool, typer.Option(help="Skip malformed trace lines.")] = False,
    max_request_tokens: Annotated[int | None, typer.Option(
        min=1, help=MAX_REQUEST_TOKENS_HELP)] = None,
    max_trace_bytes: Annotated[int | None, typer.Option(min=1, help=MAX_TRACE_BYTES_HELP)] = None,
    backend: Annotated[Backend, typer.Option(
        help="sim: the simulated hierarchy; cuda: the engine on this machine's GPU "
             "(real kernels, wall-clock time; a storage tier needs --store).")] = Backend.sim,
    store: Annotated[str | None, typer.Option(
        help="--backend cuda's storage tier: a real block store, dir:PATH (kept across "
             "runs: a new run indexes what it holds) or redis://host:port/db (blocks "
             "authenticated with KVFLOW_STORE_KEY_FILE's key). Storage -> device goes "
             "through the host tier.")] = None,
    instances: Annotated[str, typer.Option(
        help="Engine instances (each its own GPU, tiers and scheduler), or 'auto': the "
             "fewest that serve the trace at a predicted utilisation of 0.7.")] = "auto",
    router: Annotated[str, typer.Option(
        help="round_robin, random, least_loaded, prefix (cache-aware, Dynamo's cost) or "
             "ttft (predicted time to first token).")] = "prefix",
    router_view: Annotated[str, typer.Option(
        help="exact: the router sees the instances' caches and queues; approx: only its "
             "own record of what it sent where.")] = "exact",
    pd: Annotated[str | None, typer.Option(
        "--pd", help="Prefill/decode disaggregation P:D: P prefill and D decode instances "
                     "(sets --instances to P+D); the KV crosses a network link.")] = None,
    pd_gb_per_s: Annotated[float, typer.Option(
        help="PD link: GB/s per instance NIC (default: one 400 Gb/s RDMA NIC).")] = 50.0,
    pd_latency_s: Annotated[float, typer.Option(
        help="PD link: latency per message (one layer of one request), seconds.")] = 5e-6,
    pd_layerwise: Annotated[bool, typer.Option(
        "--pd-layerwise/--pd-whole",
        help="Send each layer's KV as prefill computes it, or all of it after.")] = True,
    pd_decode_offload: Annotated[bool, typer.Option(
        "--pd-decode-offload/--pd-decode-device-only",
        help="Decode instances back KV up to host and storage per --write-policy, or keep "
             "it on the device only.")] = True,
    rate_scale: Annotated[float, typer.Option(
        help="Replay the trace X times faster (arrival times divided by X).")] = 1.0,
    duration: Annotated[float | None, typer.Option(
        help="Only requests arriving in the first S seconds (after --rate-scale).")] = None,
    rate: Annotated[float | None, typer.Option(
        help="Poisson arrivals at R requests/s (seeded) instead of the trace's times.")]
    = None,
    slo_ttft: Annotated[float | None, typer.Option(
        help="TTFT target in seconds: the report gives SLO attainment and goodput.")] = None,
    slo_tpot: Annotated[float | None, typer.Option(
        help="TPOT target in seconds (with or without --slo-ttft).")] = None,
    executor: Annotated[Executor, typer.Option(
        help="--backend cuda's compute: fast (cuBLAS GEMMs, FlashAttention-style paged "
             "attention) or exact (batch-invariant kernels, bit-identical outputs whatever "
             "the batching; 2-3.7x slower a step).")] = Executor.fast,
    host_layout: Annotated[str, typer.Option(
        help="The pinned host pool's layout: layer_major (a piece per layer and role), "
             "block_major (a block's layers together) or grouped:G (G layers a piece; "
             "their layer futures resolve together).")] = "layer_major",
    tp: Annotated[int, typer.Option(
        help="GPUs per instance (tensor parallelism): weights and KV split that many ways, "
             "one PCIe link per GPU, two all-reduces per layer.")] = 1,
    pool_gb: Annotated[float | None, typer.Option(
        help="A KV pool of this many GiB shared by every instance (Mooncake Store / 3FS "
             "shape), in place of each instance's own storage.")] = None,
    pool_blocks: Annotated[int | None, typer.Option(
        help="The shared pool's size in blocks (instead of --pool-gb).")] = None,
    pool_gb_per_s: Annotated[float | None, typer.Option(
        help="The pool's aggregate bandwidth each way, GB/s (default: only the NICs "
             "limit it).")] = None,
    nic_gb_per_s: Annotated[float | None, typer.Option(
        help="Each instance's network link to the pool, GB/s each way (default 50: one "
             "400 Gb/s port).")] = None,
    nic_latency: Annotated[float | None, typer.Option(
        help="Latency of a request to the pool over that link, seconds (default 10e-6).")]
    = None,
    cluster: Annotated[Path | None, typer.Option(
        help="A TOML file with these options' keys (instances, router, tp, pool_gb, ...) "
             "and group tables for instances that differ; options given here too must "
             "agree with it.")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the JSON report here.")] = None,
    force: Annotated[bool, typer.Option(help="Overwrite --out if it exists.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    requests_csv: Annotated[Path | None, typer.Option(
        help="Full mode: write one CSV row per request here as it finishes.")] = None,
) -> None:
    """Replay a request trace through kvflow on the simulated memory hierarchy (or a GPU)."""
    from kvflow.replay import ReplayConfig, run_replay

    if out is not None and out.exists() and not force:
        fail(f"{out} exists; pass --force to overwrite")
    if requests_csv is not None and requests_csv.exists() and not force:
        fail(f"{requests_csv} exists; pass --force to overwrite")
    console = Console(stderr=as_json)
    with user_errors(KvflowError):
        options: dict[str, Any] = dict(
            model=model, profile=profile,
            device_blocks=device_blocks, host_blocks=host_blocks,
            storage_blocks=storage_blocks, device_gb=device_gb, host_gb=host_gb,
            storage_gb=storage_gb, eviction=eviction, write_policy=write_policy,
            write_threshold=write_threshold, prefetch_policy=prefetch_policy,
            mode=mode.value, seed=seed, limit=limit, max_batch_tokens=max_batch_tokens,
            skip_bad=skip_bad, backend=backend.value, max_request_tokens=max_request_tokens,
            max_trace_bytes=max_trace_bytes,
            instances=(1 if pd is not None and instances == "auto"
                       else _instances(instances, mode.value, backend.value)),
            router=router, router_view=router_view, pd=pd, pd_gb_per_s=pd_gb_per_s,
            pd_latency_s=pd_latency_s, pd_layerwise=pd_layerwise,
            pd_decode_offload=pd_decode_offload, rate_scale=rate_scale,
            duration_s=duration, rate=rate, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot,
            tp=tp, pool_gb=pool_gb, pool_blocks=pool_blocks, pool_gb_per_s=pool_gb_per_s,
            nic_gb_per_s=nic_gb_per_s, nic_latency_s=nic_latency,
            executor=executor.value if backend is Backend.cuda else None,
            host_layout=host_layout, store=store)
        if cluster is not None:
            options = _with_cluster_file(ctx, options, resolve_path(str(cluster)))
        cfg = ReplayConfig(trace=str(resolve_path(trace)) if trace else None, **options)
        with Progress(TextColumn("[bold]replay"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("requests"), TimeElapsedColumn(), console=console,
                      transient=True, disable=not console.is_terminal) as bar:
            task = bar.add_task("replay", total=None)
            report = run_replay(
                cfg, progress=lambda done, total: bar.update(task, completed=done,
                                                             total=total),
                requests_csv=requests_csv)
    if report["requests"] == 0 and report["rejected"]:
        fail(f"all {report['rejected']} requests were rejected: each needs more device blocks "
             f"than the {report['config']['device_blocks']} given")
    if out is not None:
        if replaceable(out):
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text(json.dumps(report, indent=1))
            tmp.replace(out)
        else:  # /dev/null, /dev/stdout, a FIFO: written in place, never renamed over
            with open(out, "w") as f:
                f.write(json.dumps(report, indent=1))
    if as_json:
        typer.echo(json.dumps(report, indent=1))
    else:
        print_summary(report, console)
        if out is not None:
            console.print(f"report written to {out}")


@app.command(cls=OneLineCommand, epilog=(
    "Example:\n\n"
    "  kvflow calibrate --out sim/profiles/h100-calibrated.toml\n\n"
    "  kvflow replay TRACE --model llama-3-8b-l4 --profile sim/profiles/h100-calibrated.toml"))
def calibrate(
    out: Annotated[Path, typer.Option(help="Profile TOML to write.")] =
    Path("gpu-calibrated.toml"),
    model: Annotated[str, typer.Option(
        help="Model whose compute and blocks are measured (the one you will replay).")] =
    "llama-3-8b-l4",
    block_tokens: Annotated[int, typer.Option(help="Tokens per KV block.")] = 512,
    base: Annotated[str, typer.Option(help="Preset the profile overrides.")] = "h100",
    name: Annotated[str | None, typer.Option(help="Profile name (default BASE-calibrated).")]
    = None,
    json_out: Annotated[Path | None, typer.Option(
        "--json", help="Also write every measurement here.")] = None,
    quick: Annotated[bool, typer.Option(help="Fewer repetitions and sizes.")] = False,
    stream_priority: Annotated[int | None, typer.Option(
        help="CUDA priority of the copy streams (as the replay will run them).")] = None,
    force: Annotated[bool, typer.Option(help="Overwrite --out if it exists.")] = False,
    host_layouts: Annotated[str | None, typer.Option(
        help="Also measure the links of these host layouts (comma-separated, as in "
             "'layer_major,grouped:4,block_major'); a replay in one runs on its links.")] = None,
    onto: Annotated[Path | None, typer.Option(
        help="Measure only the --host-layouts links and write them onto this profile TOML "
             "(its other keys kept; --name, if given, renames it).")] = None,
) -> None:
    """Measure this GPU (links, swap kernels, compute, host share); write a profile for
    `replay --profile`.

    Links and the host's share per step are fitted to small GPU replays, as
    `replay --backend cuda` runs; KVFLOW_STREAM_PRIORITY and KVFLOW_COPY_ENGINE
    apply to both commands alike, so calibrate with the settings you replay with.
    """
    import sys

    from kernels.calibrate import calibrate as run_calibration
    from kernels.calibrate import profile_comments, write_profile

    if out.exists() and not force:
        fail(f"{out} exists; pass --force to overwrite")
    command = "kvflow calibrate " + " ".join(sys.argv[2:])
    if onto is not None:
        _calibrate_onto(onto, out, host_layouts, model, block_tokens, stream_priority,
                        command, json_out, name)
        return
    with user_errors(KvflowError):
        layouts = [] if host_layouts is None else _parse_layouts(host_layouts)
        cal = run_calibration(model=model, block_tokens=block_tokens, base=base, name=name,
                              quick=quick, stream_priority=stream_priority,
                              log=lambda m: typer.echo(m, err=True), host_layouts=layouts)
        write_profile(out, cal.profile, profile_comments(cal, command))
    if json_out is not None:
        json_out.write_text(json.dumps(cal.to_json(), indent=1, default=float))
    typer.echo(f"profile written to {out} (mfu {cal.fit['mfu']:.4f}, mbu {cal.fit['mbu']:.4f}, "
               f"h2d {cal.profile['h2d']['bandwidth_Bps'] / 1e9:.1f} GB/s, "
               f"{cal.seconds:.0f} s)")


def _parse_layouts(text: str) -> list[str]:
    from kernels.calibrate.layouts import parse_layouts

    return parse_layouts(text)


def _calibrate_onto(onto: Path, out: Path, host_layouts: str | None, model: str,
                    block_tokens: int, stream_priority: int | None, command: str,
                    json_out: Path | None, name: str | None) -> None:
    """`calibrate --onto`: the per-layout links only, written over a copy of ``onto``."""
    from kernels.calibrate.layouts import (
        calibrate_layouts,
        layout_link_comments,
        profile_onto,
    )
    from kvflow.profile import load_profile

    if host_layouts is None:
        fail("--onto measures only the --host-layouts links: give --host-layouts")
    with user_errors(KvflowError):
        layouts = _parse_layouts(host_layouts)
        load_profile(str(onto))  # a bad base fails before any measurement
        base_text = onto.read_text()
        cal = calibrate_layouts(model, block_tokens, layouts, stream_priority=stream_priority,
                                log=lambda m: typer.echo(m, err=True))
        text = profile_onto(base_text, cal.tables,
                            layout_link_comments(cal.measured, cal.model, command, cal.device,
                                                 cal.backend_options), name)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text)
        try:
            load_profile(str(tmp))
        except KvflowError:
            tmp.unlink()
            raise
        tmp.replace(out)
    if json_out is not None:
        json_out.write_text(json.dumps(cal.to_json(), indent=1, default=float))
    typer.echo(f"profile written to {out} ({len(cal.tables)} host layouts, "
               f"{cal.seconds:.0f} s)")


if __name__ == "__main__":
    app()
