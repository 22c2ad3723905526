"""Grids of replays: every combination of a few settings, run in parallel, one row each.

Sizing a cluster or picking a policy means running the same trace under many
configurations (host tier size x eviction policy x write policy, say) and
reading the curves. This module does the three parts of that:

* **expansion** — :func:`parse_params` turns ``NAME=V1,V2,...`` strings into typed
  values, checked against the fields of the replay config dataclass (so the sweep
  knows every setting ``ReplayConfig`` has, with no list to keep in step), and
  :func:`expand_grid` takes their cartesian product over a base config;
* **running** — :func:`run_grid` runs one replay per point, on a local process
  pool (one process per core: a replay is CPU-bound Python) or, given a
  scheduler address, on an existing Dask distributed cluster. A point that fails
  is recorded with its error and the sweep goes on: an hour of results is not
  thrown away for one bad corner of the grid;
* **output** — :func:`csv_text` (one row per point: the swept values, then every
  metric of :data:`kvflow.reports.render.METRICS`) and :func:`sweep_plots` (hit rate and
  TTFT p50/p99 against a numeric setting, one line per combination of the rest).

The run function is injectable (``run=``) so the machinery can be tested without
the simulator; whatever is passed must be a picklable top-level function taking
the config and returning a report dict, because it crosses process boundaries.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import multiprocessing
import os
import socket
import time
import types
import typing
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from kvflow.errors import KvflowError

Param = tuple[str, list[Any]]
RunFn = Callable[[Any], dict[str, Any]]
ProgressFn = Callable[[int, int, "PointResult"], None]

MODES = ("full", "cache")
NONE_WORDS = ("none", "null")
TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")


class SweepError(KvflowError, ValueError):
    """A sweep specification or setting is unusable; the message names the parameter."""


def _choices() -> dict[str, tuple[str, ...]]:
    """Valid words for the string settings, from the registries that define them."""
    from kvflow.cluster.router import ROUTERS, VIEWS
    from kvflow.policy import EVICTION_POLICIES, PREFETCH_POLICIES, WRITE_POLICIES

    return {
        "eviction": tuple(EVICTION_POLICIES),
        "write_policy": tuple(WRITE_POLICIES),
        "prefetch_policy": tuple(PREFETCH_POLICIES),
        "mode": MODES,
        "router": ROUTERS,
        "router_view": VIEWS,
        "instances": ("auto",),
    }


# -- expansion --------------------------------------------------------------------------


def parse_param_spec(spec: str) -> tuple[str, list[str]]:
    """``"host_blocks=0,1000"`` -> ``("host_blocks", ["0", "1000"])``, or a :class:`SweepError`."""
    name, eq, values = spec.partition("=")
    name = name.strip()
    if not eq or not name:
        raise SweepError(f"--param {spec!r}: expected NAME=V1,V2,...")
    raw = [v.strip() for v in values.split(",")]
    if not values.strip() or any(v == "" for v in raw):
        raise SweepError(f"--param {spec!r}: empty value (expected NAME=V1,V2,...)")
    return name, raw


def config_fields(cfg_type: type) -> dict[str, Any]:
    """The sweepable fields of a config dataclass, name -> resolved type hint."""
    if not dataclasses.is_dataclass(cfg_type):
        raise TypeError(f"{cfg_type!r} is not a dataclass")
    hints = typing.get_type_hints(cfg_type)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cfg_type) if f.init}


def _union_args(hint: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return None


def coerce_value(name: str, hint: Any, raw: str) -> Any:
    """Parse one command-line word to the field's type (int, float, bool, str, or ``X | None``).

    Checks what can be checked without running: the policy and mode names, and
    that block counts and limits are not negative. The replay config checks the
    rest when it is built.
    """
    args = _union_args(hint)
    if args is not None:
        if raw.lower() in NONE_WORDS and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) > 1:  # e.g. ``int | str`` (instances=4 or auto): the first that parses
            for alt in sorted(rest, key=lambda a: a is str):
                try:
                    return coerce_value(name, alt, raw)
                except SweepError:
                    continue
            raise SweepError(f"{name}={raw}: not a valid value (a {hint})")
        hint = rest[0]
    if hint is bool:
        low = raw.lower()
        if low in TRUE_WORDS or low in FALSE_WORDS:
            return low in TRUE_WORDS
        raise SweepError(f"{name}={raw}: expected true or false")
    if hint is int:
        try:
            value: Any = int(raw)
        except ValueError:
            try:
                f = float(raw)
            except ValueError:
                f = math.nan
            if not f.is_integer():
                raise SweepError(f"{name}={raw}: expected an integer") from None
            value = int(f)
        if value < 0 and (name.endswith("_blocks") or name == "limit"):
            raise SweepError(f"{name}={raw}: must be >= 0")
        return value
    if hint is float:
        try:
            value = float(raw)
        except ValueError:
            raise SweepError(f"{name}={raw}: expected a number") from None
        if not math.isfinite(value):
            raise SweepError(f"{name}={raw}: expected a finite number")
        if name.endswith("_s") and value <= 0:
            raise SweepError(f"{name}={raw}: must be > 0")
        return value
    if hint is str:
        valid = _choices().get(name)
        if valid is not None and raw not in valid:
            raise SweepError(f"{name}={raw}: unknown value; valid: {', '.join(valid)}")
        return raw
    raise SweepError(f"{name}: cannot sweep a setting of type {hint}")


def parse_params(cfg_type: type, specs: Sequence[str]) -> list[Param]:
    """Parse and type every ``--param``; unknown or repeated names are user errors.

    A single value fixes a setting for the whole sweep (``--param mode=cache``);
    several make it an axis of the grid.
    """
    fields = config_fields(cfg_type)
    out: list[Param] = []
    seen: set[str] = set()
    for spec in specs:
        name, raw = parse_param_spec(spec)
        if name not in fields:
            raise SweepError(f"unknown parameter {name!r}; valid: {', '.join(fields)}")
        if name in seen:
            raise SweepError(f"parameter {name!r} given twice; list all its values in one --param")
        seen.add(name)
        values = [coerce_value(name, fields[name], r) for r in raw]
        dup = next((v for i, v in enumerate(values) if v in values[:i]), _MISSING)
        if dup is not _MISSING:
            raise SweepError(f"{name}: value {dup!r} given twice")
        out.append((name, values))
    return out


_MISSING = object()


@dataclass(frozen=True)
class Point:
    """One configuration of the grid: its position, the swept values, the full config."""

    index: int
    params: dict[str, Any]
    config: Any

    @property
    def label(self) -> str:
        return point_label(self.params)


@dataclass(frozen=True)
class PointResult:
    """What one point gave: a report, or the error that stopped it (one line)."""

    point: Point
    report: dict[str, Any] | None
    error: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None


def point_label(params: Mapping[str, Any]) -> str:
    """``host_blocks=1000, eviction=lru``: how a point is named in messages and legends."""
    return ", ".join(f"{k}={value_word(v)}" for k, v in params.items())


def value_word(v: Any) -> str:
    """A setting's value as typed on the command line: ``none``, ``true``, ``4000``."""
    if v is None:
        return "none"
    return str(v).lower() if isinstance(v, bool) else str(v)


def expand_grid(base: Any, params: Sequence[Param]) -> list[Point]:
    """The cartesian product of the values over ``base``, first parameter varying slowest.

    Every config is built here, before anything runs, so a combination the
    config rejects is reported at once rather than after the other points ran.
    """
    names = [n for n, _ in params]
    points = []
    for i, combo in enumerate(itertools.product(*(vs for _, vs in params))):
        over = dict(zip(names, combo, strict=True))
        try:
            cfg = dataclasses.replace(base, **over)
        except (ValueError, TypeError) as exc:
            raise SweepError(f"point {point_label(over)}: {exc}") from None
        points.append(Point(i, over, cfg))
    return points


# -- running ----------------------------------------------------------------------------


def available_cpus() -> int:
    """Cores this process may use (the affinity mask, not the machine's total)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, KvflowError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _run_point(run: RunFn, cfg: Any) -> tuple[dict[str, Any] | None, str | None, float]:
    """Runs in the worker: never raises, so one point's failure cannot break the pool."""
    t0 = time.perf_counter()
    try:
        rep = run(cfg)
        if not isinstance(rep, dict):
            raise TypeError(f"run function returned {type(rep).__name__}, not a report dict")
    except Exception as exc:
        return None, _describe(exc), time.perf_counter() - t0
    return rep, None, time.perf_counter() - t0


def _default_run() -> RunFn:
    try:
        from kvflow.replay import run_replay
    except ImportError as exc:
        raise SweepError(f"the replay engine is not available ({exc})") from None
    return run_replay


def run_grid(
    base: Any,
    params: Sequence[Param],
    run: RunFn | None = None,
    *,
    scheduler: str | None = None,
    workers: int | None = None,
    progress: ProgressFn | None = None,
    connect_timeout_s: float = 10.0,
) -> list[PointResult]:
    """Run every point of the grid; results in grid order, failures recorded, not raised.

    ``scheduler`` (a Dask scheduler address such as ``tcp://10.0.0.5:8786``) sends
    the points to that cluster; its workers must be able to import kvflow and
    read the trace at the same path. Otherwise the points run on ``workers``
    local processes (default: one per available core, at most one per point;
    ``1`` runs them in this process). ``progress(done, total, result)`` is called
    as each point finishes.
    """
    points = expand_grid(base, params)
    fn = run if run is not None else _default_run()
    if workers is not None and workers < 1:
        raise SweepError(f"workers must be >= 1, got {workers}")
    if scheduler is not None:
        if workers is not None:
            raise SweepError("--workers is for local runs; on a Dask cluster its workers decide")
        return _run_dask(scheduler, fn, points, progress, connect_timeout_s)
    n_workers = min(len(points), workers or available_cpus())
    if n_workers <= 1:
        return _run_serial(fn, points, progress)
    return _run_pool(fn, points, n_workers, progress)


def _record(
    results: list[PointResult | None],
    point: Point,
    outcome: tuple[dict[str, Any] | None, str | None, float],
    progress: ProgressFn | None,
) -> None:
    rep, err, secs = outcome
    res = PointResult(point, rep, err, secs)
    results[point.index] = res
    if progress is not None:
        progress(sum(r is not None for r in results), len(results), res)


def _finish(results: list[PointResult | None]) -> list[PointResult]:
    assert all(r is not None for r in results)
    return typing.cast(list[PointResult], results)


def _run_serial(fn: RunFn, points: list[Point], progress: ProgressFn | None) -> list[PointResult]:
    results: list[PointResult | None] = [None] * len(points)
    for p in points:
        _record(results, p, _run_point(fn, p.config), progress)
    return _finish(results)


def _run_pool(
    fn: RunFn, points: list[Point], n_workers: int, progress: ProgressFn | None
) -> list[PointResult]:
    # spawn, not fork: the parent may hold threads (the progress display, a Dask
    # client) whose locks a forked child would inherit mid-flight.
    ctx = multiprocessing.get_context("spawn")
    results: list[PointResult | None] = [None] * len(points)
    ex = ProcessPoolExecutor(max_workers=n_workers, mp_context=ctx)
    try:
        futs = {ex.submit(_run_point, fn, p.config): p for p in points}
        for fut in as_completed(futs):
            try:
                outcome = fut.result()
            except BrokenProcessPool:
                outcome = (None, "worker process died (out of memory, or killed)", 0.0)
            except Exception as exc:  # e.g. the run function could not be pickled
                outcome = (None, _describe(exc), 0.0)
            _record(results, futs[fut], outcome, progress)
    except BaseException:
        ex.shutdown(wait=False, cancel_futures=True)
        raise
    ex.shutdown(wait=True)
    return _finish(results)


def _precheck_address(address: str, timeout_s: float) -> None:
    """Fail fast, and in one line, where nothing listens: a dask Client would retry
    until its timeout and then print a traceback from its finaliser."""
    from distributed.comm import parse_address
    from distributed.comm.addressing import parse_host_port

    try:
        scheme, loc = parse_address(address)
        if scheme not in ("tcp", "tls"):
            return
        host, port = parse_host_port(loc)
    except ValueError as exc:
        raise SweepError(f"bad Dask scheduler address {address!r}: {exc}") from None
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise SweepError(f"cannot reach the Dask scheduler at {address}: {reason}") from None


def _run_dask(
    address: str,
    fn: RunFn,
    points: list[Point],
    progress: ProgressFn | None,
    timeout_s: float,
) -> list[PointResult]:
    try:
        from distributed import Client
        from distributed import as_completed as dask_as_completed
    except ImportError:
        raise SweepError("--scheduler needs dask.distributed: pip install 'kvflow[dask]'") from None
    _precheck_address(address, timeout_s)
    try:
        client = Client(address, timeout=timeout_s, set_as_default=False)
    except (OSError, TimeoutError, ValueError) as exc:
        raise SweepError(f"cannot connect to the Dask scheduler at {address}: {exc}") from None
    results: list[PointResult | None] = [None] * len(points)
    tag = uuid.uuid4().hex[:8]
    futs: list[Any] = []
    try:
        futs = client.map(
            _run_point,
            [fn] * len(points),
            [p.config for p in points],
            key=[f"kvflow-sweep-{tag}-{p.index}" for p in points],
            pure=False,
        )
        by_key = {f.key: p for f, p in zip(futs, points, strict=True)}
        for fut in dask_as_completed(futs, loop=client.loop):
            try:
                outcome = fut.result()
            except Exception as exc:  # KilledWorker, a lost connection, ...
                outcome = (None, f"dask: {_describe(exc)}", 0.0)
            _record(results, by_key[fut.key], outcome, progress)
    finally:
        pending = [f for f in futs if not f.done()]
        if pending:
            client.cancel(pending)
        client.close()
    return _finish(results)
