"""The replay driver: a trace through the manager, runtime and engine, in any world.

``mode="full"`` runs the reference engine in a ``World`` (``kvflow.world``): the
simulated one (virtual time: arrivals at their trace times, transfers over the
link model, compute from the cost model) or a real one (wall-clock time, real
copies and kernels). The driver is the same for every world: it reads the
trace, builds the manager, runtime and engine, feeds arrivals, and builds the
report (``kvflow.replay.report``); the world supplies the loop, the backend,
the executor and the clocks. Worlds are loaded by name, lazily, so importing
this module imports neither simpy nor CuPy.

``mode="cache"`` replays arrivals in order through the cache alone (every copy
lands at once, no time passes, no world): hit rates only, for capacity studies.

Same inputs and seed give the same report, ``wall_s`` aside.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from kvflow.cluster.instances import Cluster
from kvflow.engine import Engine, EngineConfig
from kvflow.errors import ConfigError
from kvflow.headroom import AccessLog, new_access_log
from kvflow.manager import CacheManager, TransferOp
from kvflow.replay.aggregate import Finished, RequestsCsv
from kvflow.replay.config import (
    ReplayConfig,
    Setup,
    instance_capacities,
    make_manager,
    make_pool,
    resolve,
)
from kvflow.replay.load import load_section
from kvflow.replay.report import (
    IdleSkip,
    Part,
    Sampler,
    assemble_report,
    full_report,
    hit_rates,
    instance_rows,
    summary,
)
from kvflow.replay.requests import numbers
from kvflow.replay.transfer_log import TransferLog
from kvflow.runtime import Runtime
from kvflow.world import Site, World, WorldSetup, load_world

Inspect = Callable[[CacheManager, "Runtime | None"], None]


def run_replay(cfg: ReplayConfig,
               progress: Callable[[int, int], None] | None = None, *,
               world: World | None = None,
               configure_backend: Callable[[Any], None] | None = None,
               inspect: Inspect | None = None,
               timeout_s: float | None = None,
               requests_csv: str | Path | None = None,
               ) -> dict[str, Any]:
    """Run one replay and return its report (a JSON-ready dict).

    ``world``: where a full replay runs; default ``load_world(cfg.backend)``.
    ``configure_backend`` sees the simulated backend before the first request
    (fault injection); ``inspect`` sees the manager and runtime after the last
    one (invariant checks); ``timeout_s`` bounds a full replay's run (a
    ``ConfigError`` past it). All are for tests, experiments and calibration.
    ``requests_csv``: a full replay writes one row per request there as it
    finishes (``kvflow.replay.aggregate.CSV_COLUMNS``); the report itself keeps
    only aggregates.
    """
    if configure_backend is not None:
        if cfg.backend != "sim":
            raise ConfigError("configure_backend is for the simulated backend only")
        if world is None:
            world = load_world("sim", configure_backend=configure_backend)
    t0 = time.perf_counter()
    if requests_csv is not None and cfg.mode != "full":
        raise ConfigError("requests_csv: per-request rows come from a full replay only "
                          f"(mode is {cfg.mode!r})")
    if cfg.mode == "cache":
        if cfg.instances == "auto":
            cfg = dataclasses.replace(cfg, instances=1)
        setup = resolve(cfg, count=False)  # counted by the replay's own pass
        manager = make_manager(cfg, setup.capacities, setup)
        accesses = _headroom_log(cfg, setup)
        with _few_full_collections():
            body = _replay_cache(setup, manager, progress, accesses)
        if inspect is not None:
            inspect(manager, None)
        return assemble_report(cfg, setup, manager, body, t0, accesses)
    if world is None:
        options = {k: v for k, v in (("executor", cfg.executor), ("store", cfg.store)) if v}
        world = load_world(cfg.backend, **options)
    setup = resolve(cfg, world)
    auto = cfg.instances == "auto"
    if auto:
        cfg = dataclasses.replace(cfg, instances=auto_instances(cfg, setup))
    manager = make_manager(cfg, setup.capacities, setup)
    csv_out = None if requests_csv is None else RequestsCsv(requests_csv)
    accesses = _headroom_log(cfg, setup)
    try:
        with _few_full_collections():
            body = world.run(replay_in_world(cfg, setup, manager, world, progress, inspect,
                                             timeout_s, csv_out, accesses))
    finally:
        if csv_out is not None:
            csv_out.close()
    if accesses is not None:
        accesses.finish()
    report = assemble_report(cfg, setup, manager, body, t0, accesses)
    report["load"]["instances_auto"] = auto
    return report


#: The cycle collector's youngest-generation threshold during a replay (the default
#: is 700): see ``_few_full_collections``.
YOUNG_COLLECTION_THRESHOLD = 20_000


def _headroom_log(cfg: ReplayConfig, setup: Setup) -> AccessLog | None:
    """The headroom section's accesses, logged as the replay reads the trace rather
    than read again for the report; one instance only (a cluster's report has no
    single-cache optimum)."""
    if cfg.headroom and cfg.instances == 1 and cfg.pd is None:
        return new_access_log(setup.capacities.device)
    return None


@contextlib.contextmanager
def _few_full_collections() -> Iterator[None]:
    """Run with the cycle collector's full (oldest-generation) passes 100x rarer,
    and its young ones ~30x rarer.

    A replay keeps a large, long-lived heap (the prefix index, the queue of an
    overloaded trace) and frees what a request used by reference counting (its
    objects form no cycles), so a full pass finds nearly nothing and costs a walk
    over the whole heap: at the default threshold they took 5-7% of a replay.
    The young passes find nearly nothing too (the 12k conversation trace: ~300
    objects in ~230 passes), but each walks what survived since the last, so their
    cost is the heap's growth, walked twice (generations 0 and 1), plus ~0.3 ms a
    pass: ~3.5% of a full replay at the default, ~2% at 20,000
    (``benchmarks/results/replay_speed.md``, "Failed retries skipped").
    The previous thresholds come back afterwards.
    """
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], YOUNG_COLLECTION_THRESHOLD), before[1],
                     max(before[2], 1000))
    try:
        yield
    finally:
        gc.set_threshold(*before)


def auto_instances(cfg: ReplayConfig, setup: Setup) -> int:
    """``instances="auto"``: the fewest instances for a predicted utilisation of 0.7
    (one where the world runs a single engine: the GPU)."""
    if cfg.backend != "sim":
        return 1
    load = load_section(setup.requests, setup.spec, setup.profile, setup.capacities,
                        cfg.max_batch_tokens, cfg.max_running, 1, **setup.load_kwargs())
    return int(load["instances_suggested"])


def _replay_cache(setup: Setup, manager: CacheManager,
                  progress: Callable[[int, int], None] | None,
                  accesses: AccessLog | None = None) -> dict[str, Any]:
    blocks = rejected = 0
    cap = setup.capacities.device
    # (a progress bar needs the count up front: a pass of its own)
    total = len(setup.requests) if progress is not None else 0
    before = list(manager.stats.hits)  # every plan's hits, per tier (a plan counts its own)
    plan_of, commit, finish = manager.plan, manager.commit, manager.finish
    for i, req in enumerate(setup.requests):
        keys = req.keys
        plan = plan_of(req.request_id, keys[:cap])  # what cannot fit is recomputed, uncached
        if plan.ops:
            _land(manager, plan.ops)
        commit(plan)
        ops = finish(plan)
        if ops:
            _land(manager, ops)
        blocks += len(keys)
        rejected += len(keys) > cap
        if accesses is not None:
            accesses.add(keys)
        if progress is not None and (i % 256 == 0 or i + 1 == total):
            progress(i + 1, total)
    if accesses is not None:
        accesses.finish()
    hits = [h - b for h, b in zip(manager.stats.hits, before, strict=True)]
    total = len(setup.requests)
    return {
        "requests": total, "rejected": 0, "truncated": rejected,
        "hit_rate": hit_rates(hits, blocks),
        "ttft_s": None, "tpot_s": None, "e2e_s": None, "throughput": None,
        "bytes": None, "link_utilization": None,
        "prefetch": None, "errors": {"failed_transfers": 0, "recomputed_blocks": 0},
        "sim_time_s": None, "timeseries": {}, "samples": {},
    }


def _land(manager: CacheManager, ops: Iterable[TransferOp]) -> None:
    """Cache mode: every copy lands at once, follow-ups too."""
    queue = list(ops)
    complete = manager.complete
    while queue:
        queue += complete(queue.pop(0), True)


# -- full mode ------------------------------------------------------------------------------
async def replay_in_world(cfg: ReplayConfig, setup: Setup, manager: CacheManager, world: World,
                          progress: Callable[[int, int], None] | None = None,
                          inspect: Inspect | None = None,
                          timeout_s: float | None = None,
                          csv_out: RequestsCsv | None = None,
                          accesses: AccessLog | None = None) -> dict[str, Any]:
    """The full-mode body: ``cfg.instances`` engines in ``world``, fed the trace's arrivals
    through the router (one instance: ``manager`` is its manager), each on its own
    hardware (``Setup.instance_specs``), sharing a pool where the config has one.
    ``accesses``: an ``AccessLog`` to add every request's keys to as it arrives (one
    instance only)."""
    specs = setup.instance_specs(cfg.instances)
    managers = [manager] + [make_manager(cfg, instance_capacities(cfg, s.capacities, i),
                                         setup)
                            for i, s in enumerate(specs) if i > 0]
    pool = make_pool(cfg, setup)
    sites: list[Site] = []
    try:
        for s in specs:
            gate = None if pool is None or pool.gate is None or s.nic is None else \
                pool.gate.for_instance(s.nic[0])
            sites.append(await world.start(WorldSetup(
                setup.spec, s.profile, s.capacities, cfg.seed,
                cfg.max_batch_tokens + cfg.max_running, s.tp, gate,
                host_layout=cfg.host_layout)))
            # A world over a persistent store indexes what it holds before the first arrival.
            rediscover = getattr(sites[-1], "rediscover", None)
            if rediscover is not None:
                rediscover(managers[len(sites) - 1])
        if pool is not None:
            pool.attach(managers)
        body = await _drive(cfg, setup, managers, sites, progress, inspect, timeout_s,
                            None if pool is None else pool.tier_hits, csv_out, accesses)
        if pool is not None:
            body["pool"] = pool.report()
        if "instances" in body:
            for row, s in zip(body["instances"], specs, strict=True):
                row.update(tp=s.tp, group=s.group)
        return body
    finally:
        for site in sites:
            await site.stop()


async def _drive(cfg: ReplayConfig, setup: Setup, managers: list[CacheManager],
                 sites: list[Site], progress: Callable[[int, int], None] | None,
                 inspect: Inspect | None, timeout_s: float | None,
                 lookup: Callable[..., tuple[int, int, int]] | None = None,
                 csv_out: RequestsCsv | None = None,
                 accesses: AccessLog | None = None) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    site = sites[0]  # the clock and the arrivals' sleeps (all instances share the loop)
    parts: list[Part] = []
    total = len(setup.requests)
    finished = 0
    start = site.clock()  # the report counts from the first arrival at 0

    for i, (mgr, s) in enumerate(zip(managers, sites, strict=True)):
        # Requests are folded into the report as they leave, then let go; per-op
        # records only where the world reads them (Site.keep_transfer_records).
        log = TransferLog(s.backend, loop, s.service_s,
                          keep_records=getattr(s, "keep_transfer_records", True))
        runtime, engine, sampler = wire_engine(cfg, setup, mgr, log, s.executor, loop, None)
        engine.clock = s.clock
        fin = Finished(start, cfg.sample_interval_s)
        row = None if csv_out is None else csv_out.writer(i, start)

        def on_finish(st: Any, fin: Finished = fin, row: Any = row) -> None:
            nonlocal finished
            fin.add(st)
            if row is not None:
                row(st)
            finished += 1
            if progress is not None:
                progress(finished, total)

        engine.on_finish = on_finish
        parts.append(Part(engine, runtime, log, sampler, fin))
    cluster = Cluster(cfg, setup, parts, lookup) if len(parts) > 1 else None
    engines = [p.engine for p in parts]
    arrivals = array("d", [start + a for a in numbers(setup.requests)[0]])
    cursor = 0  # index of the next request to arrive

    def next_arrival() -> float | None:
        return arrivals[cursor] if cursor < total else None

    for engine in engines:
        engine.next_arrival = next_arrival
    skip = IdleSkip(engines, next_arrival)  # an idle stretch is one sample, not one a tick
    for p in parts:
        p.sampler.skip = skip

    async def feed_and_run() -> None:
        nonlocal cursor
        for cursor, req in enumerate(setup.requests):  # cursor is read by next_arrival
            await site.sleep_until(arrivals[cursor])
            if accesses is not None:
                add(req)
            elif cluster is None:
                engines[0].add(req)
            else:
                cluster.add(req, site.clock())
        cursor = total
        if cluster is None:
            engines[0].close()
        else:
            cluster.close()  # under PD, decode instances close once prefill is done
        for run in runs:
            await run

    if accesses is not None:
        if cluster is not None:
            raise ValueError("accesses are logged for a replay of one instance only")
        log_keys = accesses.add
        arrive = engines[0].add

        def add(req: Any) -> None:
            log_keys(req.keys)
            arrive(req)

    runs, samplers = [], []
    for p in parts:
        runs.append(loop.create_task(p.engine.run(), name="engine"))
        samplers.append(loop.create_task(p.sampler.run(), name="sampler"))
    try:
        if timeout_s is None:
            await feed_and_run()
        else:
            await asyncio.wait_for(feed_and_run(), timeout_s)
    except TimeoutError:
        raise ConfigError(f"the replay did not finish within {timeout_s:.0f} s "
                          f"({finished} of {total} requests done)") from None
    finally:
        for task in samplers:
            task.cancel()
        for run in runs:
            if not run.done():
                run.cancel()
    for s in sites:
        drain = getattr(s, "drain", None)  # a world's own queues (a store's writes)
        if drain is not None:
            await drain()
        s.settle()
    for p in parts:
        p.sampler.sample()  # the last, partial interval
    end = site.clock()
    if inspect is not None:
        for p in parts:
            inspect(p.runtime.manager, p.runtime)
    if start != 0.0:  # the report counts from the first arrival at 0
        for p in parts:
            p.sampler.t = array("d", [round(t - start, 6) for t in p.sampler.t])
    body = full_report(setup, parts, end - start, (cfg.slo_ttft_s, cfg.slo_tpot_s))
    if cluster is not None:
        body["cluster"] = cluster.report(end - start)
        body["instances"] = instance_rows(parts, end - start)
        if cluster.pd is not None:
            body["pd"] = cluster.pd.report(end - start, summary)
            cluster.pd.rows(body["instances"], summary, hit_rates)
    for s in sites:
        extra = s.report(parts[sites.index(s)].log)
        if extra:
            body.update(extra)
    return body


def wire_engine(cfg: ReplayConfig, setup: Setup, manager: CacheManager, log: TransferLog,
                executor: Any, loop: asyncio.AbstractEventLoop,
                progress: Callable[[int, int], None] | None
                ) -> tuple[Runtime, Engine, Sampler]:
    """Runtime, engine and sampler over a world's logged backend and executor.

    Every world's replay builds these alike, which is what makes their reports
    comparable.
    """
    spec = setup.spec
    runtime = Runtime(manager, log, spec.bytes_per_block, loop)
    engine = Engine(manager, runtime, executor,
                    EngineConfig(spec.block_tokens, cfg.max_batch_tokens, cfg.max_running),
                    # (PD's per-instance rows fold them as they leave: kvflow.cluster.pd)
                    keep_done=False)
    if progress is not None:
        total = len(setup.requests)
        count = 0

        def on_finish(_st: Any) -> None:
            nonlocal count
            count += 1
            progress(count, total)

        engine.on_finish = on_finish
    return runtime, engine, Sampler(engine, log, executor, cfg.sample_interval_s)
