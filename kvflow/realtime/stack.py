"""Replay requests in real time through real block stores: the real-time CPU world.

The simulator (``kvflow.replay`` in ``sim``'s world) answers "what would
happen" in virtual time, moving sizes only. This world answers "does it
work": the same engine, manager and runtime run on an ordinary asyncio loop
(uvloop where available), device <-> host copies move real bytes between
numpy arrays (``kvflow.realtime.cpu.HostCopyBackend``), host <-> storage goes
through a real ``BlockStore`` on a thread pool (``kvflow.store_backend.
StoreBackend``; local directory, Redis, memory), and the compute writes and
verifies key-derived bytes (``kvflow.realtime.cpu.KeyedBlockExecutor``), so a
single wrong byte read from any tier is counted. It is the bench the storage
fault tests run on: a store killed, corrupted, full or slow mid-replay must
cost recomputes, never wrong data, never a leaked block.

Its report has the replay report's keys (``kvflow.replay.report``), so
``kvflow report`` renders both; fields that only the simulator knows —
``sim_time_s``, the time series — are ``None`` or empty, and ``run_time_s``,
``store`` and ``compute`` are added. It needs no GPU and neither world's
package; the GPU world (``kernels``) plugs the same ``StoreBackend`` behind a
``RoutedBackend`` next to its ``CudaBackend``.

A ``RealtimeStack`` keeps its manager, tiers and store across ``replay``
calls, so a test can run a trace, break the store, repair it and run again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.backends import RoutedBackend
from kvflow.engine import Engine, EngineConfig, EngineRequest
from kvflow.errors import ConfigError
from kvflow.host_memory import HostArrays
from kvflow.layout import ModelSpec
from kvflow.manager import CacheManager, Capacities
from kvflow.policy import PrefetchPolicy, WritePolicy
from kvflow.radix import Tier
from kvflow.realtime.cpu import HostCopyBackend, KeyedBlockExecutor
from kvflow.replay.config import request_keys
from kvflow.replay.report import REPORT_VERSION, hit_rates, summary
from kvflow.replay.transfer_log import TransferLog
from kvflow.runtime import Runtime
from kvflow.store_backend import StoreBackend
from kvflow.store_index import Rediscovered, rediscover
from kvflow.stores import AsyncStore, BlockStore
from kvflow.world import new_loop
from traces import Request

#: Called before each arrival with (index, request); may be a coroutine (fault injection).
ArrivalHook = Callable[[int, EngineRequest], "Awaitable[None] | None"]


def tiny_spec(block_tokens: int = 16, num_layers: int = 4, num_kv_heads: int = 2,
              head_dim: int = 16) -> ModelSpec:
    """A model small enough that a block is a few KB: the bytes are real, not the sizes."""
    return ModelSpec("kvflow-tiny", num_layers=num_layers, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, dtype="bf16", block_tokens=block_tokens,
                     hidden_size=num_kv_heads * head_dim * 4, num_attention_heads=num_kv_heads * 4,
                     intermediate_size=num_kv_heads * head_dim * 8, active_params=1e6)


def service_s(handle: Any) -> float | None:
    """An op's service time in this world: its first copy or store call starting to its end."""
    inner = getattr(handle, "inner", None) or handle  # a RoutedHandle's sub-backend handle
    start, end = getattr(inner, "started_at", None), getattr(inner, "ended_at", None)
    return None if start is None or end is None else end - start


def engine_requests(requests: Iterable[Request], time_scale: float = 1.0) -> list[EngineRequest]:
    """A trace's requests as the engine's, arrivals multiplied by ``time_scale``."""
    return [EngineRequest(r.index, r.arrival_s * time_scale, request_keys(r, None),
                          r.input_len, r.output_len) for r in requests]


@dataclass
class RealtimeConfig:
    """Tiers, policies, pacing and store deadlines of a real-time replay."""

    device_blocks: int = 32
    host_blocks: int = 16
    storage_blocks: int = 1024
    eviction: str = "lru"
    write_policy: str = "write_through"
    write_threshold: int = 1
    prefetch_policy: str = "best_effort"
    max_batch_tokens: int = 256
    max_running: int = 8
    #: Compute time of a step: ``step_s + token_s * tokens`` (wall seconds).
    step_s: float = 0.0005
    token_s: float = 2e-6
    #: Check every prompt block at every decode step too (prefills always check).
    verify_decode: bool = True
    #: Pace of device <-> host copies (bytes/s per direction); None: at once.
    copy_bytes_per_s: float | None = None
    #: Deadline of each storage op (queueing for a worker included); None: none.
    read_timeout_s: float | None = 1.0
    write_timeout_s: float | None = 2.0
    store_workers: int = 4
    #: Index what the store already holds at start (``kvflow.store_index.rediscover``).
    rediscover: bool = True

    def __post_init__(self) -> None:
        for name in ("device_blocks", "host_blocks", "storage_blocks"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        WritePolicy(self.write_policy, threshold=self.write_threshold)
        PrefetchPolicy(self.prefetch_policy)


class RealtimeStack:
    """Manager + CPU device + host arrays + (optional) store, wired through one runtime.

    Build it inside a running loop. ``store`` is borrowed (the caller closes
    it); without one, or with ``storage_blocks=0``, there is no storage tier.
    """

    def __init__(self, spec: ModelSpec, cfg: RealtimeConfig,
                 store: BlockStore | None = None) -> None:
        loop = asyncio.get_running_loop()
        storage = cfg.storage_blocks if store is not None else 0
        if storage and not cfg.host_blocks:
            raise ConfigError("a storage tier needs a host tier to stage through "
                              "(StoreBackend moves host <-> storage only)")
        self.spec = spec
        self.cfg = cfg
        self.caps = Capacities(cfg.device_blocks, cfg.host_blocks, storage)
        self.manager = CacheManager(
            self.caps, eviction=cfg.eviction,
            write_policy=WritePolicy(cfg.write_policy, threshold=cfg.write_threshold),
            prefetch_policy=PrefetchPolicy(cfg.prefetch_policy))
        layout = spec.layout
        self.host = HostArrays.for_layout(layout, max(cfg.host_blocks, 1))
        self.copies = HostCopyBackend(self.host, cfg.device_blocks,
                                      bytes_per_s=cfg.copy_bytes_per_s)
        routes: dict[tuple[int, int], Any] = {(Tier.HOST, Tier.DEVICE): self.copies,
                                              (Tier.DEVICE, Tier.HOST): self.copies}
        self.store = store if storage else None
        self.astore: AsyncStore | None = None
        self.storage: StoreBackend | None = None
        if self.store is not None:
            self.astore = AsyncStore(self.store, max_workers=cfg.store_workers)
            self.storage = StoreBackend(self.astore, self.host, layout.num_layers,
                                        read_timeout_s=cfg.read_timeout_s,
                                        write_timeout_s=cfg.write_timeout_s)
            routes[(Tier.STORAGE, Tier.HOST)] = self.storage
            routes[(Tier.HOST, Tier.STORAGE)] = self.storage
        #: What the index took from the store at start (None: not asked, or no store).
        self.rediscovered: Rediscovered | None = None
        if self.store is not None and cfg.rediscover:
            self.rediscovered = rediscover(self.manager, self.store)
        self.backend = RoutedBackend(routes)
        # Recorded like the simulator's, so both reports measure transfers the same way:
        # as columns of numbers (no per-op records), restarted at each pass.
        self.log = TransferLog(self.backend, loop, service_s, keep_records=False)
        self.runtime = Runtime(self.manager, self.log, spec.bytes_per_block, loop)
        self.executor = KeyedBlockExecutor(self.copies.device_layer, layout.num_layers,
                                           layout.bytes_per_layer_block, spec.block_tokens,
                                           step_s=cfg.step_s, token_s=cfg.token_s,
                                           verify_decode=cfg.verify_decode)
        self.passes = 0
        self._log_from = 0  # first TransferLog record of the current pass

    # ------------------------------------------------------------------ running
    async def replay(self, requests: Sequence[EngineRequest],
                     on_arrival: ArrivalHook | None = None) -> dict[str, Any]:
        """Run ``requests`` (arrivals relative to now) to completion; returns the report
        of this pass (counters are this pass's, not cumulative)."""
        loop = asyncio.get_running_loop()
        t_wall = time.perf_counter()
        before = self._counters()
        if self.log.open_ops:  # (something ran between passes and is still moving)
            self._log_from = len(self.log)
        else:  # the last pass was summarised: keep this pass's ops only
            self.log.restart()
            self._log_from = 0
        engine = Engine(self.manager, self.runtime, self.executor,
                        EngineConfig(self.spec.block_tokens, self.cfg.max_batch_tokens,
                                     self.cfg.max_running))
        run = loop.create_task(engine.run(), name="engine")
        start = loop.time()
        try:
            for i, req in enumerate(requests):
                delay = start + req.arrival_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if on_arrival is not None:
                    res = on_arrival(i, req)
                    if inspect.isawaitable(res):
                        await res
                if run.done():
                    run.result()  # the engine died: raise what killed it
                engine.add(req)
            engine.close()
            await run
        finally:
            if not run.done():
                run.cancel()
        await self.drain()
        end = loop.time()
        report = self._report(engine, start, end, before, requests)
        self.passes += 1
        report["wall_s"] = round(time.perf_counter() - t_wall, 3)
        return report

    async def drain(self) -> None:
        """Wait for every transfer (follow-ups included) and every store worker."""
        await self.runtime.drain()
        if self.storage is not None:
            await self.storage.drain()
            await self.runtime.drain()

    def close(self) -> None:
        """Stop the store's thread pool (the store itself is the caller's)."""
        if self.astore is not None:
            self.astore.close(wait=True)

    # ------------------------------------------------------------------ report
    def _counters(self) -> dict[str, Any]:
        m = self.runtime.metrics
        d: dict[str, Any] = {
            "bytes": dict(m.bytes), "prefetch": dict(m.prefetch),
            "failed": m.failed, "cancelled": m.cancelled,
            "dependency_failures": m.dependency_failures,
            "ops": dict(m.ops), "blocks": dict(m.blocks),
            "recomputed_blocks": self.manager.stats.recomputed_blocks,
            "failed_ops": self.manager.stats.failed_ops,
            "lost_copies": self.manager.stats.lost_copies,
            "evictions": list(self.manager.stats.evictions),
            "compute": dataclasses.replace(self.executor.stats, examples=[]).as_dict(),
            "busy": {**self.copies.busy_s(),
                     **(self.storage.busy_s() if self.storage is not None else {})},
        }
        if self.store is not None:
            assert self.storage is not None and self.astore is not None
            d["store"] = self.store.stats.as_dict()
            d["store_backend"] = self.storage.stats.as_dict()
            d["store_async"] = dataclasses.asdict(self.astore.stats)
        return d

    def _report(self, engine: Engine, start: float, end: float, before: dict[str, Any],
                requests: Sequence[EngineRequest]) -> dict[str, Any]:
        now = _delta(self._counters(), before)
        finished = [st for st in engine.done if st.finish_s is not None]
        ttft = [st.first_token_s - start - st.req.arrival_s for st in finished]  # type: ignore[operator]
        e2e = [st.finish_s - start - st.req.arrival_s for st in finished]  # type: ignore[operator]
        tpot = [(st.finish_s - st.first_token_s) / (st.generated - 1)  # type: ignore[operator]
                for st in finished if st.generated > 1]
        hits = [sum(st.hits[t] for st in finished) for t in (0, 1, 2)]
        blocks = sum(len(st.req.keys) for st in finished)
        span = end - start if end > start else 1.0
        compute = now["compute"]
        compute["examples"] = [repr(e) for e in self.executor.stats.examples]
        store = now.get("store", {})
        backend = now.get("store_backend", {})
        cfg = dataclasses.asdict(self.cfg)
        cfg.update(world="cpu-realtime", model=self.spec.name,
                   block_tokens=self.spec.block_tokens,
                   bytes_per_block=self.spec.bytes_per_block, num_layers=self.spec.num_layers,
                   storage_blocks=self.caps.storage,
                   store=None if self.store is None else repr(self.store), pass_index=self.passes,
                   trace_requests=len(requests))
        return {
            "kvflow_report": REPORT_VERSION,
            "config": cfg,
            "requests": len(finished),
            "rejected": engine.stats.rejected,
            "hit_rate": hit_rates(hits, blocks),
            "ttft_s": summary(ttft), "tpot_s": summary(tpot), "e2e_s": summary(e2e),
            "queue_s": summary([st.admit_s - start - st.req.arrival_s for st in finished]),
            "slo": None, "load": None,  # (no cost model for the CPU world's compute)
            "headroom": None,  # (passes share one warm cache: no cold-start optimum applies)
            "throughput": {
                "requests_per_s": len(finished) / span,
                "output_tokens_per_s": sum(st.generated for st in finished) / span,
                "prompt_tokens_per_s": sum(st.req.input_len for st in finished) / span},
            "bytes": now["bytes"],
            "link_utilization": {k: min(1.0, v / span) for k, v in now["busy"].items()},
            "prefetch": now["prefetch"],
            "transfers": self._transfer_summary(),
            "errors": {
                "failed_transfers": now["failed"] + now["cancelled"],
                "recomputed_blocks": now["recomputed_blocks"],
                "recomputed_tokens": engine.stats.recomputed_tokens,
                "replans": engine.stats.replans,
                "store_errors": store.get("errors", 0),
                "store_corrupt": store.get("corrupt", 0),
                "store_timeouts": backend.get("timeouts", 0),
                "store_read_misses": backend.get("read_misses", 0),
                "store_put_failed": backend.get("put_failed", 0),
                "store_lost_entries": now["lost_copies"],
                "corrupt_reads": compute["corrupt_reads"],
            },
            "store": None if self.store is None else {
                "stats": store, "backend": backend, "async": now["store_async"],
                "rediscovered": (None if self.rediscovered is None
                                 else self.rediscovered.as_dict())},
            "compute": compute,
            "engine": {"steps": engine.stats.steps, "compute_busy_s": compute["busy_s"]},
            "evictions": dict(zip(("device", "host", "storage"), now["evictions"],
                                  strict=True)),
            "sim_time_s": None,
            "run_time_s": end - start,
            "timeseries": {},
            "samples": {"ttft_s": [round(x, 6) for x in ttft],
                        "tpot_s": [round(x, 6) for x in tpot]},
        }


    def _transfer_summary(self) -> dict[str, Any]:
        """``TransferLog.summary`` of this pass's ops only."""
        return self.log.summary(self._log_from)


def _delta(now: Any, before: Any) -> Any:
    """``now - before`` for counters: numbers, lists and dicts of them (others: ``now``)."""
    if isinstance(now, dict):
        return {k: _delta(v, before.get(k) if isinstance(before, dict) else None)
                for k, v in now.items()}
    if isinstance(now, list) and isinstance(before, list) and len(now) == len(before):
        return [_delta(a, b) for a, b in zip(now, before, strict=True)]
    if isinstance(now, (int, float)) and not isinstance(now, bool) and isinstance(
            before, (int, float)):
        return now - before
    return now


def run_realtime(requests: Sequence[EngineRequest], cfg: RealtimeConfig | None = None,
                 store: BlockStore | None = None, spec: ModelSpec | None = None, *,
                 passes: int = 1, use_uvloop: bool = True) -> list[dict[str, Any]]:
    """Replay ``requests`` ``passes`` times on one stack; one report per pass.

    ``store`` is borrowed (closed by the caller). Runs its own event loop.
    """
    cfg = cfg or RealtimeConfig()
    spec = spec or tiny_spec()

    async def main() -> list[dict[str, Any]]:
        stack = RealtimeStack(spec, cfg, store)
        try:
            return [await stack.replay(requests) for _ in range(passes)]
        finally:
            await stack.drain()
            stack.close()

    loop = new_loop(use_uvloop)
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()
