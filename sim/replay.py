"""Replay a request trace through kvflow in the simulated world.

``mode="full"`` runs the reference engine on the virtual-time loop: arrivals at
their trace times, continuous batching, transfers over the link model and
compute from the cost model; the report has hit rates, latencies, link use.
``mode="cache"`` replays arrivals in order through the cache alone (every copy
lands at once, no time passes): hit rates only, for capacity studies.

Same inputs and seed give the same report, ``wall_s`` aside.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.engine import Engine, EngineConfig, EngineRequest, RequestState
from kvflow.errors import ConfigError
from kvflow.hashing import BlockHasher, ExtraKeys
from kvflow.layout import ModelSpec, preset
from kvflow.manager import CacheManager, Capacities, TransferOp
from kvflow.policy import PrefetchPolicy, WritePolicy
from kvflow.runtime import LINKS, Runtime
from sim.cost import CostModel, GpuProfile, load_profile
from sim.executor import SimExecutor
from sim.hierarchy import Hierarchy, SimBackend
from sim.loop import run_sim
from traces import Request, open_trace, sample_path

GiB = 1024**3
#: Share of GPU memory left for KV after weights, as serving engines reserve it.
GPU_MEMORY_UTILIZATION = 0.9
#: Tier sizes used when none is given.
DEFAULT_HOST_GB = 256.0
DEFAULT_STORAGE_GB = 2048.0
REPORT_VERSION = 1
MODES = ("full", "cache")
#: Worlds a full replay runs in: the simulator, or the engine on a real GPU (kernels.replay).
BACKENDS = ("sim", "cuda")


@dataclass
class ReplayConfig:
    """Everything a replay depends on; field names are ``kvflow sweep --param`` names."""

    trace: str | None = None
    model: str = "llama-3-8b"
    profile: str = "h100"
    device_blocks: int | None = None
    host_blocks: int | None = None
    storage_blocks: int | None = None
    device_gb: float | None = None
    host_gb: float | None = None
    storage_gb: float | None = None
    eviction: str = "lru"
    write_policy: str = "write_through"
    write_threshold: int = 1
    prefetch_policy: str = "best_effort"
    mode: str = "full"
    seed: int = 0
    limit: int | None = None
    max_batch_tokens: int = 8192
    max_running: int = 256
    sample_interval_s: float = 10.0
    skip_bad: bool = False
    backend: str = "sim"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; valid: {', '.join(MODES)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; valid: {', '.join(BACKENDS)}")
        if self.backend == "cuda" and self.mode != "full":
            raise ConfigError("backend 'cuda' replays in full mode only")
        for name in ("device_blocks", "host_blocks", "storage_blocks", "limit",
                     "device_gb", "host_gb", "storage_gb"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ConfigError(f"{name} must be >= 0, got {v}")
        for tier in ("device", "host", "storage"):
            if getattr(self, f"{tier}_blocks") is not None and getattr(
                    self, f"{tier}_gb") is not None:
                raise ConfigError(f"give {tier}_blocks or {tier}_gb, not both")
        if self.sample_interval_s <= 0:
            raise ConfigError("sample_interval_s must be positive")
        # Fail early, with the field named, rather than mid-replay.
        WritePolicy(self.write_policy, threshold=self.write_threshold)
        PrefetchPolicy(self.prefetch_policy)


@dataclass
class Setup:
    """What a config resolves to: the model, the GPU, the tiers, the requests."""

    spec: ModelSpec
    profile: GpuProfile
    capacities: Capacities
    requests: list[EngineRequest]
    trace_path: str
    skipped: int


def weight_bytes(spec: ModelSpec) -> float:
    """bf16 weights; for MoE models only what a device must hold is unknown here,
    so all active parameters count (a lower bound on memory)."""
    return spec.active_params * 2


def default_device_blocks(spec: ModelSpec, profile: GpuProfile) -> int:
    free = profile.memory_bytes * GPU_MEMORY_UTILIZATION - weight_bytes(spec)
    blocks = int(free // spec.bytes_per_block)
    if blocks <= 0:
        raise ConfigError(
            f"model {spec.name} does not fit on {profile.name} "
            f"({profile.memory_bytes / GiB:.0f} GiB): give --device-blocks explicitly")
    return blocks


def blocks_for_gb(gb: float, spec: ModelSpec) -> int:
    return int(gb * GiB // spec.bytes_per_block)


def request_keys(req: Request, hasher: BlockHasher | None) -> tuple[Hashable, ...]:
    """Block keys of a request: the trace's hash ids, or hashes of its tokens.

    A tenant gets its own key space, so tenants never share a block.
    """
    if req.block_hashes is not None:
        keys: tuple[Hashable, ...] = req.block_hashes
        if req.tenant is not None:
            keys = tuple((req.tenant, h) for h in keys)
        return keys
    if req.token_ids is not None and hasher is not None:
        extra = ExtraKeys(tenant_salt=req.tenant) if req.tenant is not None else None
        return tuple(hasher.hash_blocks(req.token_ids, extra=extra))
    return ()


def resolve(cfg: ReplayConfig) -> Setup:
    path = Path(cfg.trace) if cfg.trace else sample_path()
    trace = open_trace(path, skip_bad=cfg.skip_bad)
    spec = preset(cfg.model, block_tokens=trace.block_tokens)
    profile = load_profile(cfg.profile)
    hasher = BlockHasher(trace.block_tokens)
    requests = []
    for req in trace:
        if cfg.limit is not None and len(requests) >= cfg.limit:
            break
        requests.append(EngineRequest(req.index, req.arrival_s, request_keys(req, hasher),
                                      req.input_len, req.output_len))
    def size(blocks: int | None, gb: float | None, default: Callable[[], int]) -> int:
        if blocks is not None:
            return blocks
        return blocks_for_gb(gb, spec) if gb is not None else default()

    device = size(cfg.device_blocks, cfg.device_gb, lambda: default_device_blocks(spec, profile))
    host = size(cfg.host_blocks, cfg.host_gb, lambda: blocks_for_gb(DEFAULT_HOST_GB, spec))
    storage = size(cfg.storage_blocks, cfg.storage_gb,
                   lambda: blocks_for_gb(DEFAULT_STORAGE_GB, spec))
    return Setup(spec, profile, Capacities(device, host, storage), requests, str(path),
                 trace.skipped)


def make_manager(cfg: ReplayConfig, capacities: Capacities) -> CacheManager:
    return CacheManager(
        capacities, eviction=cfg.eviction,
        write_policy=WritePolicy(cfg.write_policy, threshold=cfg.write_threshold),
        prefetch_policy=PrefetchPolicy(cfg.prefetch_policy))


def run_replay(cfg: ReplayConfig,
               progress: Callable[[int, int], None] | None = None, *,
               configure_backend: Callable[[SimBackend], None] | None = None,
               inspect: Callable[[CacheManager, Runtime | None], None] | None = None,
               ) -> dict[str, Any]:
    """Run one replay and return its report (a JSON-ready dict).

    ``configure_backend`` sees the simulated backend before the first request
    (fault injection); ``inspect`` sees the manager and runtime after the last
    one (invariant checks). Both are for tests and experiments.
    """
    if cfg.backend == "cuda":
        if configure_backend is not None:
            raise ConfigError("configure_backend is for the simulated backend only")
        from kernels.replay import run_gpu_replay

        return run_gpu_replay(cfg, progress, inspect=inspect)
    t0 = time.perf_counter()
    setup = resolve(cfg)
    manager = make_manager(cfg, setup.capacities)
    if cfg.mode == "cache":
        body = _replay_cache(setup, manager, progress)
        if inspect is not None:
            inspect(manager, None)
    else:
        body = run_sim(_replay_full(cfg, setup, manager, progress, configure_backend, inspect))
    return assemble_report(cfg, setup, manager, body, t0)


def assemble_report(cfg: ReplayConfig, setup: Setup, manager: CacheManager,
                    body: dict[str, Any], t0: float) -> dict[str, Any]:
    """The report around a replay's body (shared by both worlds)."""
    report: dict[str, Any] = {
        "kvflow_report": REPORT_VERSION,
        "config": _config_dict(cfg, setup),
    }
    report.update(body)
    report["evictions"] = dict(zip(("device", "host", "storage"),
                                   manager.stats.evictions, strict=True))
    report["wall_s"] = round(time.perf_counter() - t0, 3)
    return report


def _config_dict(cfg: ReplayConfig, setup: Setup) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d.update(trace=setup.trace_path, device_blocks=setup.capacities.device,
             host_blocks=setup.capacities.host, storage_blocks=setup.capacities.storage,
             block_tokens=setup.spec.block_tokens, bytes_per_block=setup.spec.bytes_per_block,
             num_layers=setup.spec.num_layers, skipped_lines=setup.skipped)
    return d


# -- cache mode ---------------------------------------------------------------------------
def _replay_cache(setup: Setup, manager: CacheManager,
                  progress: Callable[[int, int], None] | None) -> dict[str, Any]:
    hits = [0, 0, 0]
    blocks = rejected = 0
    cap = setup.capacities.device
    total = len(setup.requests)
    for i, req in enumerate(setup.requests):
        keys = req.keys[:cap]  # what cannot fit on the device is recomputed, uncached
        plan = manager.plan(req.request_id, keys)
        _land(manager, plan.ops)
        manager.commit(plan)
        _land(manager, manager.finish(plan))
        for t in (0, 1, 2):
            hits[t] += plan.hits(t)
        blocks += len(req.keys)
        rejected += len(req.keys) > cap
        if progress is not None and (i % 256 == 0 or i + 1 == total):
            progress(i + 1, total)
    return {
        "requests": total, "rejected": 0, "truncated": rejected,
        "hit_rate": _hit_rates(hits, blocks),
        "ttft_s": None, "tpot_s": None, "e2e_s": None, "throughput": None,
        "bytes": None, "link_utilization": None,
        "prefetch": None, "errors": {"failed_transfers": 0, "recomputed_blocks": 0},
        "sim_time_s": None, "timeseries": {}, "samples": {},
    }


def _land(manager: CacheManager, ops: Iterable[TransferOp]) -> None:
    """Cache mode: every copy lands at once, follow-ups too."""
    queue = list(ops)
    while queue:
        queue += manager.complete(queue.pop(0), True)


def _hit_rates(hits: list[int], blocks: int) -> dict[str, float]:
    d = {name: (h / blocks if blocks else 0.0)
         for name, h in zip(("device", "host", "storage"), hits, strict=True)}
    d["total"] = sum(hits) / blocks if blocks else 0.0
    return d


# -- full mode ------------------------------------------------------------------------------
async def _replay_full(
    cfg: ReplayConfig, setup: Setup, manager: CacheManager,
    progress: Callable[[int, int], None] | None,
    configure_backend: Callable[[SimBackend], None] | None = None,
    inspect: Callable[[CacheManager, Runtime | None], None] | None = None,
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    spec = setup.spec
    backend = SimBackend(loop.env, spec, Hierarchy.from_profile(setup.profile))  # type: ignore[attr-defined]
    if configure_backend is not None:
        configure_backend(backend)
    log = TransferLog(backend, loop, sim_service_s)
    executor = SimExecutor(CostModel(spec, setup.profile), spec.num_layers)
    runtime, engine, sampler = wire_engine(cfg, setup, manager, log, executor, loop, progress)
    total = len(setup.requests)
    start = loop.time()
    arrivals = [start + r.arrival_s for r in setup.requests]
    cursor = 0  # index of the next request to arrive
    engine.next_arrival = lambda: arrivals[cursor] if cursor < total else None
    run = loop.create_task(engine.run(), name="engine")
    sample_task = loop.create_task(sampler.run(), name="sampler")
    for cursor, req in enumerate(setup.requests):  # cursor is read by next_arrival
        delay = arrivals[cursor] - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        engine.add(req)
    cursor = total
    engine.close()
    await run
    sample_task.cancel()
    sampler.sample()  # the last, partial interval
    end = loop.time()
    if inspect is not None:
        inspect(manager, runtime)
    return _full_report(setup, engine, runtime, log, sampler, end - start)


def wire_engine(cfg: ReplayConfig, setup: Setup, manager: CacheManager, log: TransferLog,
                executor: Any, loop: asyncio.AbstractEventLoop,
                progress: Callable[[int, int], None] | None
                ) -> tuple[Runtime, Engine, _Sampler]:
    """Runtime, engine and sampler over a world's logged backend and executor.

    Both worlds' replays build these alike, which is what makes their reports
    comparable.
    """
    spec = setup.spec
    runtime = Runtime(manager, log, spec.bytes_per_block, loop)
    engine = Engine(manager, runtime, executor,
                    EngineConfig(spec.block_tokens, cfg.max_batch_tokens, cfg.max_running))
    if progress is not None:
        total = len(setup.requests)
        engine.on_finish = lambda st: progress(len(engine.done), total)
    return runtime, engine, _Sampler(engine, log, executor, cfg.sample_interval_s)


class _Sampler:
    """Per-interval samples for the report's time series."""

    LINKS = ("h2d", "d2h", "storage_read", "storage_write")

    def __init__(self, engine: Engine, backend: Any, executor: Any,
                 interval: float) -> None:
        self.engine, self.backend, self.executor = engine, backend, executor
        self.interval = interval
        self.t: list[float] = []
        self.queue_len: list[int] = []
        self.running: list[int] = []
        self.util: dict[str, list[float]] = {k: [] for k in self.LINKS}
        self._last_busy = dict.fromkeys(self.LINKS, 0.0)
        self._last_t = engine.loop.time()
        self.next_sample = self._last_t + interval

    async def run(self) -> None:
        """Sample every interval while the engine makes progress.

        An interval in which the engine had work but took no step, with no
        transfer in flight, is a stall and ends the sampling: a sampler that
        kept ticking would keep the virtual clock running forever over it,
        hiding the loop's deadlock report. (An engine idle between arrivals
        is not stalled: the arrivals keep the clock going.)
        """
        engine = self.engine
        last_steps = -1
        while True:
            await asyncio.sleep(self.next_sample - engine.loop.time())
            self.sample()
            self.next_sample += self.interval
            steps = engine.stats.steps
            if (steps == last_steps and not engine.runtime.tasks
                    and (engine.waiting or engine.running)):
                return
            last_steps = steps

    def sample(self) -> None:
        now = self.engine.loop.time()
        span = now - self._last_t
        if span <= 0:
            return
        links = self.backend.metrics()
        for k in self.LINKS:
            busy = links[k]["busy_s"]
            self.util[k].append(round(min(1.0, (busy - self._last_busy[k]) / span), 6))
            self._last_busy[k] = busy
        self.t.append(round(now, 6))
        self.queue_len.append(self.engine.queue_len)
        self.running.append(len(self.engine.running))
        self._last_t = now


def _summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _full_report(setup: Setup, engine: Engine, runtime: Runtime, backend: Any,
                 sampler: _Sampler, sim_time: float) -> dict[str, Any]:
    """The full-mode body; ``backend`` has ``metrics()`` (per-link ``busy_s``) and, for a
    ``TransferLog``, ``summary()`` (per-transfer times)."""
    finished = [st for st in engine.done if st.finish_s is not None]
    ttft = [st.first_token_s - st.req.arrival_s for st in finished]  # type: ignore[operator]
    e2e = [st.finish_s - st.req.arrival_s for st in finished]  # type: ignore[operator]
    tpot = [(st.finish_s - st.first_token_s) / (st.generated - 1)  # type: ignore[operator]
            for st in finished if st.generated > 1]
    hits = [sum(st.hits[t] for st in finished) for t in (0, 1, 2)]
    blocks = sum(len(st.req.keys) for st in finished)
    links = backend.metrics()
    span = sim_time if sim_time > 0 else 1.0
    out_tokens = sum(st.generated for st in finished)
    in_tokens = sum(st.req.input_len for st in finished)
    m = runtime.metrics
    series: dict[str, Any] = {"interval_s": sampler.interval, "t": sampler.t}
    series.update(_hit_series(finished, sampler))
    series.update({f"link_util_{k}": v for k, v in sampler.util.items()})
    series.update(queue_len=sampler.queue_len, running=sampler.running)
    return {
        "requests": len(finished),
        "rejected": engine.stats.rejected,
        "hit_rate": _hit_rates(hits, blocks),
        "ttft_s": _summary(ttft), "tpot_s": _summary(tpot), "e2e_s": _summary(e2e),
        "throughput": {"requests_per_s": len(finished) / span,
                       "output_tokens_per_s": out_tokens / span,
                       "prompt_tokens_per_s": in_tokens / span},
        "bytes": dict(m.bytes),
        "link_utilization": {k: min(1.0, links[k]["busy_s"] / span) for k in _Sampler.LINKS},
        "prefetch": dict(m.prefetch),
        "errors": {"failed_transfers": m.failed + m.cancelled,
                   "recomputed_blocks": runtime.manager.stats.recomputed_blocks,
                   "recomputed_tokens": engine.stats.recomputed_tokens,
                   "replans": engine.stats.replans},
        "engine": {"steps": engine.stats.steps,
                   "compute_busy_s": getattr(engine.executor, "busy_s", None)},
        "transfers": backend.summary() if isinstance(backend, TransferLog) else None,
        "sim_time_s": sim_time,
        "timeseries": series,
        "samples": {"ttft_s": [round(x, 6) for x in ttft],
                    "tpot_s": [round(x, 6) for x in tpot]},
    }


def _hit_series(finished: list[RequestState],
                sampler: _Sampler) -> dict[str, list[float | None]]:
    """Hit rate per tier of the requests arriving in each sampling interval."""
    n = len(sampler.t)
    if n == 0:
        return {"hit_rate_device": [], "hit_rate_host": [], "hit_rate_storage": []}
    hits = np.zeros((3, n))
    blocks = np.zeros(n)
    for st in finished:
        b = min(n - 1, math.floor(st.req.arrival_s / sampler.interval))
        blocks[b] += len(st.req.keys)
        for t in (0, 1, 2):
            hits[t, b] += st.hits[t]
    rates = hits / np.maximum(blocks, 1)
    # An interval with no arrivals has no hit rate (null), not a rate of zero.
    return {f"hit_rate_{name}": [round(float(x), 6) if b else None
                                 for x, b in zip(rates[t], blocks, strict=True)]
            for t, name in enumerate(("device", "host", "storage"))}


# -- per-transfer times (both worlds) -----------------------------------------------------------
class _LoggedSink:
    """Forwards a backend's reports to the runtime's sink; notes when the op ended."""

    __slots__ = ("_log", "_rec", "_sink", "layer_done")

    def __init__(self, log: TransferLog, rec: list[Any], sink: Any) -> None:
        self._log, self._rec, self._sink = log, rec, sink
        self.layer_done = sink.layer_done  # per layer: no extra frame

    def done(self, error: BaseException | None = None) -> None:
        self._log._done(self._rec, error)
        self._sink.done(error)


class TransferLog:
    """A ``TransferBackend`` wrapper recording every op's kind, blocks and times.

    Both worlds wrap their backend in one, so their reports measure transfers
    the same way: ``latency`` from submit to the op's end in loop time
    (queueing and dependencies included) and ``service`` from the op's first
    layer starting on its link to its last layer landing, as the world's
    ``service(handle, token)`` reports it (simulated: from the link model's
    times; CUDA: from the task's own events around its copies). Handles are
    the inner backend's, so device-side waits (``wait_layer``) work unchanged.
    """

    def __init__(self, backend: Any, loop: asyncio.AbstractEventLoop,
                 service: Callable[[Any], float | None]) -> None:
        self.backend = backend
        self.num_layers = backend.num_layers
        self._loop = loop
        self._service = service
        #: [kind, link, blocks, submit time, done time, ok, handle, service_s]
        self.records: list[list[Any]] = []

    def submit(self, op: TransferOp, sink: Any, after: Any = ()) -> Any:
        rec = [op.kind.value, LINKS.get((op.src_tier, op.dst_tier), "?"), op.num_blocks,
               self._loop.time(), None, False, None, None]
        self.records.append(rec)
        rec[6] = handle = self.backend.submit(op, _LoggedSink(self, rec, sink), after)
        return handle

    def cancel(self, handle: Any) -> None:
        self.backend.cancel(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def _done(self, rec: list[Any], error: BaseException | None) -> None:
        rec[4] = self._loop.time()
        rec[5] = error is None
        if error is None:
            rec[7] = self._service(rec[6])
        rec[6] = None  # let handles and events go

    def metrics(self) -> dict[str, Any]:
        """The inner backend's, or per-link ``busy_s`` summed from service times."""
        inner = getattr(self.backend, "metrics", None)
        if inner is not None:
            return inner()
        busy = dict.fromkeys(_Sampler.LINKS, 0.0)
        for rec in self.records:
            if rec[7] is not None and rec[1] in busy:
                busy[rec[1]] += rec[7]
        return {k: {"busy_s": v} for k, v in busy.items()}

    def summary(self) -> dict[str, Any]:
        """Per op kind: ops, blocks, mean/p50 service and latency, service per block."""
        out: dict[str, Any] = {}
        kinds = sorted({r[0] for r in self.records})
        for kind in kinds:
            done = [r for r in self.records if r[0] == kind and r[5] and r[7] is not None]
            if not done:
                continue
            service = np.array([r[7] for r in done])
            latency = np.array([r[4] - r[3] for r in done])
            blocks = np.array([r[2] for r in done], dtype=float)
            out[kind] = {
                "ops": len(done), "blocks": int(blocks.sum()),
                "service_mean_s": float(service.mean()),
                "service_p50_s": float(np.percentile(service, 50)),
                "service_per_block_s": float(service.sum() / max(blocks.sum(), 1.0)),
                "latency_mean_s": float(latency.mean()),
                "latency_p50_s": float(np.percentile(latency, 50)),
            }
        return out


def sim_service_s(handle: Any) -> float | None:
    """A simulated op's service time: its first layer's start to its last layer's landing."""
    if not handle.land_times or handle.finished_at is None:
        return None
    return float(handle.finished_at - handle.land_times[0] + handle.first_unit)
