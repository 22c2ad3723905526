"""``kvflow report | sweep | compare``: the views of replay results people look at.

Registered on the root app by :func:`register` (cli.py), so this module owns its
commands and cli.py stays a list of them. The conventions are the ones of every
``kvflow`` command: rich tables by default, ``--json`` for machines, a user's
mistake exits 2 with one ``error: ...`` line on stderr (no traceback), outputs
are never replaced without ``--force``, long runs show progress on stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvflow.errors import KvflowError
from kvflow.reports import page
from kvflow.reports import render as rep
from kvflow.reports.compare import compare_reports, print_comparison
from kvflow.reports.sweep import (
    PointResult,
    SweepError,
    expand_grid,
    parse_params,
    run_grid,
    value_word,
)
from kvflow.reports.sweep_plots import choose_x, csv_text, summary, sweep_plots
from traces.cli import OneLineCommand, fail, resolve_path, user_errors

SWEEP_CSV = "sweep.csv"
SWEEP_JSON = "sweep.json"
SWEEP_PLOTS = ("hit_rate", "ttft")


def _replay_api() -> tuple[type, Callable[[Any], dict[str, Any]]]:
    """The replay config class and run function (a seam for tests to put a fake in)."""
    try:
        from kvflow.replay import ReplayConfig, run_replay
    except ImportError as exc:
        fail(f"the replay engine is not available ({exc})")
    return ReplayConfig, run_replay


def _out(as_json: bool) -> Console:
    return Console(stderr=as_json, highlight=False)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


# -- report -----------------------------------------------------------------------------

_REPORT_EPILOG = """\
Examples:

  kvflow replay trace.jsonl --out run.json && kvflow report run.json

  kvflow report run.json --png plots/ --html run.html

  kvflow report run.json --html run.html --force      # replace run.html
"""


def report_cmd(
    report_file: Annotated[
        Path, typer.Argument(metavar="REPORT.json", help="A report from `kvflow replay --out`.")
    ],
    png: Annotated[
        Path | None,
        typer.Option("--png", metavar="DIR", help="Write the plots as PNG files into DIR."),
    ] = None,
    html_file: Annotated[
        Path | None,
        typer.Option(
            "--html", metavar="FILE", help="Write one self-contained HTML page (plots embedded)."
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace existing output files.")] = False,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print the report's metrics and written files as JSON."),
    ] = False,
) -> None:
    """Show a replay report as tables; optionally plots (PNG) and an HTML page.

    Plots: hit rate by tier; TTFT and TPOT CDFs; hit rate per tier, link
    utilisation and queue length over time (full mode; cache mode has no timing).
    """
    err = Console(stderr=True)
    with user_errors(KvflowError):
        report = rep.load_report(report_file)
        targets: dict[Path, bytes | str] = {}
        if html_file is not None:
            page.check_targets([html_file], force)
        if png is not None:
            page.check_dir(png)
        if png is not None or html_file is not None:
            spinner = err.status("rendering plots ...") if err.is_terminal else nullcontext()
            with spinner:
                plots = page.make_plots(report)
            if png is not None:
                paths = page.png_targets(png, list(plots))
                targets.update({paths[name]: data for name, data in plots.items()})
            if html_file is not None:
                title = f"kvflow report — {report_file.name}"
                targets[html_file] = page.render_html(report, plots, title, str(report_file))
        written = page.write_files(targets, force=force)
    if as_json:
        _print_json(
            {
                "report": str(report_file),
                "metrics": rep.flatten(report),
                "files": list(map(str, written)),
            }
        )
        return
    console = _out(False)
    rep.print_report(report, console, str(report_file))
    n_png = sum(p.suffix == ".png" for p in written)
    if n_png:
        console.print(f"wrote {n_png} plot(s) to {png}")
    if html_file is not None:
        console.print(f"wrote {html_file}")


# -- compare ----------------------------------------------------------------------------

_COMPARE_EPILOG = """\
Examples:

  kvflow compare lru.json s3fifo.json

  kvflow compare base.json bigger-host.json --json | jq '.metrics["ttft_s.p99"]'
"""


def compare_cmd(
    a: Annotated[Path, typer.Argument(metavar="A.json", help="The baseline report.")],
    b: Annotated[Path, typer.Argument(metavar="B.json", help="The report compared with A.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.")] = False,
) -> None:
    """Two replay reports side by side: values, B − A, and B / A.

    Deltas are green where B is better (higher hit rate and throughput, lower
    latency and errors) and red where it is worse; configuration differences
    are listed first.
    """
    with user_errors(KvflowError):
        ra, rb = rep.load_report(a), rep.load_report(b)
    cmp = compare_reports(ra, rb, str(a), str(b))
    if as_json:
        _print_json(cmp.to_dict())
        return
    print_comparison(cmp, _out(False))


# -- sweep ------------------------------------------------------------------------------

_SWEEP_EPILOG = """\
Every --param NAME is a replay setting (a field of kvflow.replay.ReplayConfig,
e.g. host_blocks, device_blocks, eviction, write_policy, prefetch_policy, mode,
limit, seed); several values make it an axis of the grid, one value fixes it.
Writes DIR/sweep.csv (one row per point), DIR/sweep.json and plots of hit rate
and TTFT p50/p99 against the numeric axis, one line per combination of the rest.

Examples:

  kvflow sweep sample:conversation_1k.jsonl -p host_blocks=0,1000,4000 -p eviction=lru,s3fifo

  kvflow sweep trace.jsonl -p host_blocks=0,2000,8000 -p write_policy=write_through,write_back \\
      -p mode=cache -o sweeps/host -j 2

  kvflow sweep trace.jsonl -p eviction=lru,lfu,s3fifo --scheduler tcp://10.0.0.5:8786

  kvflow sweep trace.jsonl -p host_blocks=0,1000 --dry-run         # list the points only
"""


def sweep_cmd(
    trace: Annotated[
        str, typer.Argument(metavar="TRACE", help="Trace file, or sample:NAME for a bundled one.")
    ],
    param: Annotated[
        list[str],
        typer.Option(
            "--param", "-p", metavar="NAME=V1,V2,...", help="A setting and its values; repeat."
        ),
    ],
    out_dir: Annotated[
        Path, typer.Option("--out", "-o", metavar="DIR", help="Where the CSV, JSON and plots go.")
    ] = Path("sweep"),
    x: Annotated[
        str | None,
        typer.Option("--x", metavar="NAME", help="x axis of the plots (default: a numeric axis)."),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers", "-j", min=1, help="Local processes (default: one per core, ≤ points)."
        ),
    ] = None,
    scheduler: Annotated[
        str | None,
        typer.Option(
            "--scheduler",
            metavar="ADDRESS",
            help="Run on this Dask scheduler (tcp://host:8786); workers need kvflow and the "
            "trace at the same path.",
        ),
    ] = None,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Write the PNG plots.")] = True,
    keep_reports: Annotated[
        bool,
        typer.Option("--keep-reports", help="Also write each point's report to DIR/reports/."),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="List the grid's points and exit.")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace existing output files.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the sweep summary as JSON.")
    ] = False,
) -> None:
    """Replay a trace over a grid of settings, in parallel; write a CSV and plots."""
    cfg_type, run = _replay_api()
    with user_errors(KvflowError):
        trace_path = _trace_file(trace)
        params = parse_params(cfg_type, param)
        params = [(n, [_trace_file(v) for v in vs] if n == "trace" else vs) for n, vs in params]
        try:
            base = cfg_type(trace=trace_path)
        except (ValueError, TypeError) as exc:
            raise SweepError(str(exc)) from None
        points = expand_grid(base, params)
        choose_x(params, x)
    names = [n for n, _ in params]

    if dry_run:
        if as_json:
            _print_json([{"point": p.index, "params": p.params} for p in points])
            return
        table = Table(title=f"{len(points)} point(s)", title_justify="left")
        table.add_column("point", justify="right")
        for n in names:
            table.add_column(n)
        for p in points:
            table.add_row(str(p.index), *(Text(value_word(p.params[n])) for n in names))
        _out(False).print(table)
        return

    targets = [out_dir / SWEEP_CSV, out_dir / SWEEP_JSON]
    if plots:
        targets += [out_dir / f"{n}.png" for n in SWEEP_PLOTS]
    if keep_reports:
        targets += [_report_path(out_dir, p.index) for p in points]
    with user_errors(KvflowError):
        page.check_dir(out_dir)
        page.check_targets(targets, force)  # before an hour of replays, not after

    err = Console(stderr=True, highlight=False)
    with user_errors(KvflowError), _progress(err, len(points)) as progress:
        try:
            results = run_grid(
                base, params, run, scheduler=scheduler, workers=workers, progress=progress
            )
        except KeyboardInterrupt:
            err.print("error: interrupted; nothing written")
            raise typer.Exit(130) from None

    files: dict[Path, bytes | str] = {out_dir / SWEEP_CSV: csv_text(results, names)}
    if plots:
        held = [f"{n}={value_word(vs[0])}" for n, vs in params if len(vs) == 1 and n != "trace"]
        traces = dict(params).get("trace", [trace_path])
        caption = " · ".join([", ".join(Path(t).name for t in traces), *held])
        made = sweep_plots(results, params, x, caption=caption)
        files.update({out_dir / f"{k}.png": v for k, v in made.items()})
    if keep_reports:
        for r in results:
            if r.report is not None:
                files[_report_path(out_dir, r.point.index)] = json.dumps(r.report, indent=1)
    listed = [str(p) for p in (*files, out_dir / SWEEP_JSON)]
    summ = summary(base, params, results, listed)
    files[out_dir / SWEEP_JSON] = json.dumps(summ, indent=2, default=str) + "\n"
    with user_errors(KvflowError):
        page.write_files(files, force=force)

    if as_json:
        _print_json(summ)
    else:
        _print_sweep(results, params, _out(False))
        _out(False).print(
            f"wrote {out_dir / SWEEP_CSV}, {out_dir / SWEEP_JSON}"
            + (f" and {sum(str(p).endswith('.png') for p in files)} plot(s)" if plots else "")
        )
    failed = [r for r in results if not r.ok]
    if failed:
        first = failed[0]
        sys.stderr.write(
            f"error: {len(failed)} of {len(results)} point(s) failed; first: "
            f"{first.point.label}: {first.error}\n"
        )
        raise typer.Exit(1)


def _report_path(out_dir: Path, index: int) -> Path:
    return out_dir / "reports" / f"point-{index:03d}.json"


def _trace_file(value: Any) -> str:
    """An existing trace file as an absolute path: workers may run elsewhere (cwd, host)."""
    p = resolve_path(str(value))
    if not p.is_file():
        raise SweepError(f"{value}: no such trace file")
    return str(p.resolve())


@contextmanager
def _progress(err: Console, total: int) -> Iterator[Callable[[int, int, PointResult], None]]:
    """A live bar on a terminal; one line per finished point otherwise (CI logs)."""
    if not err.is_terminal:

        def line(done: int, n: int, r: PointResult) -> None:
            what = r.error if r.error else _headline(r)
            msg = f"[{done}/{n}] {r.point.label}: {what} ({r.seconds:.1f} s)"
            err.print(msg, markup=False, soft_wrap=True)

        yield line
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("[bold]sweep"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("points"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task("", total=total)

        def update(done: int, n: int, r: PointResult) -> None:
            mark = "[red]failed[/red] " if r.error else ""
            bar.update(task, completed=done, description=f"{mark}{escape(r.point.label)}")

        yield update


def _headline(r: PointResult) -> str:
    flat = rep.flatten(r.report or {})
    s = f"hit {rep.fmt_pct(flat['hit_rate.total'])}"
    if flat["ttft_s.p50"] is not None:
        s += f", TTFT p50 {rep.fmt_secs(flat['ttft_s.p50'])}"
    return s


def _print_sweep(results: list[PointResult], params: list[Any], console: Console) -> None:
    """One row per point; settings fixed for the whole sweep go in the title, not in columns."""
    names = [n for n, vs in params if len(vs) > 1]
    fixed = ", ".join(f"{n}={value_word(vs[0])}" for n, vs in params if len(vs) == 1)
    title = escape(f"sweep: {len(results)} point(s)" + (f"; {fixed}" if fixed else ""))
    table = Table(title=title, title_justify="left")
    table.add_column("point", justify="right")
    for n in names:
        table.add_column(n)
    cols = [
        ("hit_rate.total", "hit rate"),
        ("ttft_s.p50", "TTFT p50"),
        ("ttft_s.p99", "TTFT p99"),
        ("throughput.requests_per_s", "throughput"),
    ]
    flats = [rep.flatten(r.report) if r.report else None for r in results]
    cols = [(k, lbl) for k, lbl in cols if any(f and f[k] is not None for f in flats)]
    for _, label in cols:
        table.add_column(label, justify="right")
    any_failed = any(not r.ok for r in results)
    if any_failed:
        table.add_column("error", style="red", no_wrap=True, overflow="ellipsis", max_width=50)
    for r, flat in zip(results, flats, strict=True):
        cells = [str(r.point.index), *(value_word(r.point.params[n]) for n in names)]
        for k, _ in cols:
            cells.append(rep.fmt_value(rep.METRIC_BY_KEY[k].kind, flat[k]) if flat else "-")
        if any_failed:
            cells.append(r.error or "")
        table.add_row(*(Text(c) for c in cells))
    console.print(table)


# -- registration -----------------------------------------------------------------------


def register(app: typer.Typer) -> None:
    """Add ``report``, ``sweep`` and ``compare`` to the root ``kvflow`` app."""
    app.command("report", cls=OneLineCommand, epilog=_REPORT_EPILOG)(report_cmd)
    app.command("sweep", cls=OneLineCommand, epilog=_SWEEP_EPILOG)(sweep_cmd)
    app.command("compare", cls=OneLineCommand, epilog=_COMPARE_EPILOG)(compare_cmd)
