"""The CUDA world: the engine on a real GPU (``kvflow replay --backend cuda``).

The same scheduler, runtime, engine and replay driver (``kvflow.replay``) as
the simulated world, on a real event loop (uvloop): arrivals at their trace
times in wall-clock time, ``CudaBackend`` moving real KV between device and
pinned host memory, and an executor (``kernels.fast.make_executor``: fast by
default, or the exact one) computing each step on the GPU behind per-layer
device-side waits. Times are wall-clock seconds where the
simulator's are virtual, and per-transfer times come from CUDA events around
each op on its stream, where the simulator takes them from its link model.

A storage tier needs a real block store (``store``: ``dir:PATH`` or a
redis:// URL, ``kvflow.stores.spec``): host <-> storage runs through
``kvflow.store_backend.StoreBackend`` over the pinned host pool
(``kernels.host_blocks.CudaHostBlocks``), beside ``CudaBackend`` behind a
``RoutedBackend`` — the very path the real-time CPU world tests. Storage ->
device stages through the host tier (storage -> host -> device: the prefetch
at arrival, then the swap-in), so a store needs host blocks; without a store
the storage tier must be 0. At start the manager's index is rebuilt from what
the store already holds (``kvflow.store_index``). Pools default to what fits: device
blocks in the GPU memory left after weights and workspace, host blocks in a
quarter of the machine's memory (pinned), both capped by the simulator's
defaults. Before the first arrival every kernel runs once (NVRTC compiles,
first launches), so no request pays for it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kernels._cuda import cupy_module, gpu_unavailable_reason
from kvflow.errors import ConfigError
from kvflow.layout import ModelSpec
from kvflow.manager import Capacities, OpKind, TransferOp
from kvflow.profile import GpuProfile
from kvflow.radix import Tier
from kvflow.world import (
    DEFAULT_HOST_GB,
    DEFAULT_STORAGE_GB,
    TierRequest,
    WorldSetup,
    blocks_for_gb,
    default_device_blocks,
    new_loop,
    run_realtime_loop,
)

T = TypeVar("T")

GiB = 1024**3
#: Share of free GPU memory the device pool may take once weights and workspace are out.
DEVICE_SHARE = 0.85
#: Share of the machine's memory the pinned host pool may take by default.
HOST_SHARE = 0.25


def _workspace_bytes(spec: Any, tokens: int) -> int:
    from kernels.model import ModelShape

    s = ModelShape.from_spec(spec)
    per_token = (s.hidden * 6 + s.qkv_dim * 2 + s.q_dim * 2 + s.intermediate * 6)
    return tokens * per_token + (64 << 20)


def gpu_capacities(spec: ModelSpec, profile: GpuProfile, want: TierRequest,
                   store: str | None = None) -> Capacities:
    """Pools for the GPU world: as asked, else what fits (see the module docstring)."""
    storage = 0
    if store is None:
        if want.storage_blocks or want.storage_gb:
            raise ConfigError("--backend cuda keeps a storage tier in a real block store: "
                              "give --store dir:PATH or --store redis://..., or "
                              "--storage-blocks 0")
    else:
        storage = storage_capacity(spec, want, store)
    cp = cupy_module()
    free, _ = cp.cuda.runtime.memGetInfo()
    if want.device_blocks is not None:
        device = want.device_blocks
    elif want.device_gb is not None:
        device = blocks_for_gb(want.device_gb, spec)
    else:
        weights = spec.active_params * 2
        room = free * DEVICE_SHARE - weights - _workspace_bytes(spec, want.max_step_tokens)
        device = min(int(room // spec.bytes_per_block), default_device_blocks(spec, profile))
    if want.host_blocks is not None:
        host = want.host_blocks
    elif want.host_gb is not None:
        host = blocks_for_gb(want.host_gb, spec)
    else:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        host = min(int(ram * HOST_SHARE // spec.bytes_per_block),
                   blocks_for_gb(DEFAULT_HOST_GB, spec))
    if device <= 0:
        raise ConfigError(f"model {spec.name} leaves no GPU memory for KV blocks "
                          f"({free / GiB:.1f} GiB free): give --device-blocks")
    if storage and host <= 0:
        raise ConfigError("--store: storage -> device goes through the host tier in the cuda "
                          "world; give --host-blocks > 0")
    return Capacities(device, host, storage)


def storage_capacity(spec: ModelSpec, want: TierRequest, store: str) -> int:
    """The storage tier over ``store``: as asked, else half a directory's free space."""
    from kvflow.stores.spec import default_storage_bytes

    if want.storage_blocks is not None:
        blocks = want.storage_blocks
    elif want.storage_gb is not None:
        blocks = blocks_for_gb(want.storage_gb, spec)
    else:
        room = default_storage_bytes(store)
        if room is None:
            raise ConfigError(f"--store {store.split('@')[-1]}: give --storage-blocks or "
                              "--storage-gb (the Redis server's memory bounds the tier)")
        blocks = min(room // spec.bytes_per_block, blocks_for_gb(DEFAULT_STORAGE_GB, spec))
    if blocks <= 0:
        raise ConfigError(f"--store {store.split('@')[-1]}: the storage tier holds no block")
    return int(blocks)


def env_backend_options() -> dict[str, Any]:
    """``CudaBackend`` options from the environment, for calibrate and replay alike.

    ``KVFLOW_STREAM_PRIORITY`` (``default``, ``highest`` or an int): how the copy
    streams compete with compute for SMs (``benchmarks/bench_overlap.py``).
    ``KVFLOW_COPY_ENGINE`` (``auto``, ``never``, ``always``): whether ops go to
    the copy engine as batched memcpys or to the swap kernel.
    ``KVFLOW_EAGER_LAYERS`` (an integer >= 1, or ``all``): layers of an op
    enqueued at submit, the rest paced by the host (``CudaBackend``'s
    ``eager_layers``; default 4); ``all`` takes the host's pacing out of the
    ops' times, which the simulator does not model. Each changes what a transfer
    costs, so a profile is only valid for the settings it was calibrated with:
    hence variables that both commands read.
    """
    out: dict[str, Any] = {}
    value = os.environ.get("KVFLOW_STREAM_PRIORITY", "").strip()
    if value == "highest":
        from kernels.backend import HIGHEST_PRIORITY

        out["stream_priority"] = HIGHEST_PRIORITY
    elif value and value != "default":
        try:
            out["stream_priority"] = int(value)
        except ValueError:
            raise ConfigError(f"KVFLOW_STREAM_PRIORITY must be 'default', 'highest' or an "
                              f"integer, got {value!r}") from None
    engine = os.environ.get("KVFLOW_COPY_ENGINE", "").strip()
    if engine:
        if engine not in ("auto", "never", "always"):
            raise ConfigError(f"KVFLOW_COPY_ENGINE must be 'auto', 'never' or 'always', "
                              f"got {engine!r}")
        out["dma"] = engine
    eager = os.environ.get("KVFLOW_EAGER_LAYERS", "").strip()
    if eager == "all":
        out["eager_layers"] = None
    elif eager:
        if not eager.isdigit() or int(eager) < 1:
            raise ConfigError(f"KVFLOW_EAGER_LAYERS must be an integer >= 1 or 'all', "
                              f"got {eager!r}")
        out["eager_layers"] = int(eager)
    return out


def fine_clock(loop: asyncio.AbstractEventLoop) -> Callable[[], float]:
    """``time.perf_counter`` shifted onto ``loop.time()``'s scale (sub-microsecond steps)."""
    offset = loop.time() - time.perf_counter()
    return lambda: time.perf_counter() + offset


#: How long before an arrival ``sleep_until`` stops trusting the loop's timers.
_TIMER_SLACK_S = 2e-3


async def sleep_until(clock: Callable[[], float], due: float) -> None:
    """Return at ``due`` on ``clock`` to within a few microseconds.

    The loop's timer takes it to within ``_TIMER_SLACK_S``; then it yields to
    the loop until the moment comes, so the engine keeps running meanwhile
    (the spin costs CPU, never the engine's progress).
    """
    ahead = due - clock() - _TIMER_SLACK_S
    if ahead > 0:
        await asyncio.sleep(ahead)
    while clock() < due:
        await asyncio.sleep(0)


def cuda_service_s(handle: Any) -> float | None:
    """An op's service time from its task's CUDA events.

    The start event is recorded after the waits for the ops it depends on and
    right before its first layer's copy (it completes when the op starts on
    its link, as the simulator's service time starts); the end event right
    after its last layer's copy, whenever that layer is enqueued.
    """
    start = getattr(handle, "start_event", None)
    end = getattr(handle, "end_event", None)
    if start is None or end is None:
        return None
    end.synchronize()  # at done time the GPU is past it (or a few us from it)
    return cupy_module().cuda.get_elapsed_time(start, end) / 1e3


def routed_service_s(handle: Any) -> float | None:
    """An op's service time behind a ``RoutedBackend``: CUDA events for device <-> host
    ops, the store call's loop times (first call to end) for host <-> storage ones."""
    inner = getattr(handle, "inner", None)
    if inner is None:
        return None
    if hasattr(inner, "start_event"):
        return cuda_service_s(inner)
    start, end = getattr(inner, "started_at", None), getattr(inner, "ended_at", None)
    return None if start is None or end is None else end - start


class CudaSite:
    """The CUDA world, started on a real loop: backend, executor, fine clock, GC guard.

    ``storage``: the storage tier's ``StoreBackend`` and the store under it, when the
    world has one; ``backend`` is then a ``RoutedBackend`` over both, ``gpu`` the
    ``CudaBackend`` either way.
    """

    def __init__(self, backend: Any, executor: Any, loop: asyncio.AbstractEventLoop,
                 options: dict[str, Any], op_log: list[Any] | None,
                 storage: Any = None, store: Any = None, store_name: str | None = None) -> None:
        from kernels.backend import LoopThreadGC

        self.gpu = backend
        self.executor = executor
        self.options = options
        self.op_log = op_log
        backend.record_starts = True  # start events for cuda_service_s
        self.service_s = cuda_service_s
        self.storage = storage
        self.store = store
        self.store_name = store_name
        self.rediscovered: Any = None
        self.backend = backend
        if storage is not None:
            from kvflow.backends import RoutedBackend

            self.backend = RoutedBackend({
                (Tier.HOST, Tier.DEVICE): backend, (Tier.DEVICE, Tier.HOST): backend,
                (Tier.STORAGE, Tier.HOST): storage, (Tier.HOST, Tier.STORAGE): storage})
            self.service_s = routed_service_s
        # Timestamps and arrivals on a fine clock aligned with the loop's: uvloop's
        # timers and loop.time() count whole milliseconds, which would add up to a
        # millisecond or two of harness lateness to every TTFT.
        self.clock = fine_clock(loop)
        self.lags: list[float] = []
        self._collector = LoopThreadGC(loop)

    async def sleep_until(self, when: float) -> None:
        await sleep_until(self.clock, when)
        self.lags.append(self.clock() - when)

    def rediscover(self, manager: Any) -> None:
        """Index what the store already holds (before the first arrival)."""
        if self.store is not None:
            from kvflow.store_index import rediscover

            self.rediscovered = rediscover(manager, self.store)

    async def drain(self) -> None:
        """Wait for the store's writes in flight (backups the last requests started)."""
        if self.storage is not None:
            await self.storage.drain()

    def settle(self) -> None:
        self.gpu.synchronize()

    async def stop(self) -> None:
        self.gpu.synchronize()
        try:
            if self.storage is not None:
                await self.storage.drain()
                self.storage.close()
        finally:
            if self.store is not None:
                self.store.close()
            self._collector.stop()

    def report(self, log: Any) -> dict[str, Any]:
        from kvflow.replay.report import summary

        if self.op_log is not None:
            self.op_log.extend((r[0], r[1], r[2], r[7]) for r in log.records
                               if r[5] and r[7] is not None)
        cp = cupy_module()
        props = cp.cuda.runtime.getDeviceProperties(self.gpu.device)
        name = props["name"]
        ex = self.executor
        out: dict[str, Any] = {}
        if self.storage is not None:
            out["store"] = {
                "store": self.store_name, "stats": self.store.stats.as_dict(),
                "backend": self.storage.stats.as_dict(),
                "rediscovered": (None if self.rediscovered is None
                                 else self.rediscovered.as_dict())}
        return {**out, "device": {
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "backend_options": {k: v for k, v in self.options.items()
                                if isinstance(v, (int, float))},
            "executor_steps": ex.steps,
            "executor_gpu_s": ex.busy_s,
            "executor": getattr(ex, "kind", None),
            "outputs": sum(len(v) for v in ex.outputs.values()),
            # Every request's sampled tokens and checksums, hashed: equal digests, equal
            # outputs (the exact executor's are bit-identical whatever the tiers).
            "outputs_digest": outputs_digest(ex.outputs),
            # How late each request reached the engine (timer wake-ups; uvloop's clock
            # counts whole ms): part of every GPU TTFT that the simulator does not see.
            "arrival_lag_s": summary(self.lags) if self.lags else None,
        }}


def outputs_digest(outputs: dict[Any, list[tuple[int, int]]]) -> str:
    """xxh3_64 over every request's ``(token, checksum)`` list, in request order."""
    import xxhash

    h = xxhash.xxh3_64()
    for rid, toks in sorted(outputs.items(), key=lambda kv: repr(kv[0])):
        h.update(repr((rid, toks)).encode())
    return h.hexdigest()


class CudaWorld:
    """The engine on a real GPU (``kvflow.world.World``).

    ``backend_options`` go to ``CudaBackend`` (CTAs, stream priority, ...;
    default: ``env_backend_options()``); ``step_log``, a list, receives the
    executor's per-step records, and ``op_log`` one ``(kind, link, blocks,
    service_s)`` per completed transfer (calibration fits to both). ``executor``:
    ``kernels.fast.EXECUTORS`` (default fast). ``store``: the storage tier's block
    store, ``dir:PATH`` or a redis:// URL (``kvflow.stores.spec``; None: no storage).
    """

    name = "cuda"

    def __init__(self, backend_options: dict[str, Any] | None = None,
                 step_log: list[Any] | None = None, op_log: list[Any] | None = None,
                 executor: str | None = None, store: str | None = None) -> None:
        from kernels.fast import DEFAULT_EXECUTOR, EXECUTORS

        reason = gpu_unavailable_reason()
        if reason is not None:
            raise ConfigError(f"--backend cuda needs a CUDA GPU and CuPy: {reason}")
        self.executor = executor or DEFAULT_EXECUTOR
        if self.executor not in EXECUTORS:
            raise ConfigError(f"unknown executor {executor!r}; valid: {', '.join(EXECUTORS)}")
        self.options = env_backend_options() if backend_options is None else backend_options
        self.step_log = step_log
        self.op_log = op_log
        if store is not None:
            from kvflow.stores.spec import parse_store

            parse_store(store)
        self.store = store

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        return run_realtime_loop(main, new_loop)

    def capacities(self, spec: ModelSpec, profile: GpuProfile, want: TierRequest) -> Capacities:
        return gpu_capacities(spec, profile, want, self.store)

    async def start(self, setup: WorldSetup) -> CudaSite:
        from kernels.backend import CudaBackend
        from kernels.fast import make_executor

        loop = asyncio.get_running_loop()
        caps = setup.capacities
        options = dict(self.options)
        options.setdefault("host_layout", getattr(setup, "host_layout", "layer_major"))
        backend = CudaBackend(setup.spec, caps.device, max(caps.host, 1), **options)
        executor = make_executor(self.executor, backend, seed=setup.seed,
                                 max_tokens=setup.max_step_tokens)
        await executor.warm_up(block=0)
        await warm_up_links(backend)
        backend.synchronize()
        executor.step_log = self.step_log  # (calibration reads the engine's steps)
        if not caps.storage or self.store is None:
            return CudaSite(backend, executor, loop, self.options, self.op_log)
        from kernels.host_blocks import CudaHostBlocks
        from kvflow.store_backend import StoreBackend
        from kvflow.stores import Namespace
        from kvflow.stores.spec import describe_store, open_store

        store = open_store(self.store, Namespace.for_model(setup.spec), caps.storage)
        try:
            storage = StoreBackend(store, CudaHostBlocks(backend), setup.spec.num_layers)
        except BaseException:
            store.close()
            raise
        return CudaSite(backend, executor, loop, self.options, self.op_log, storage, store,
                        describe_store(self.store))

    async def pd_instance(self, spec: ModelSpec, cfg: Any, role: str, seed: int = 0) -> Any:
        """One prefill, decode or colocated instance of ``kvflow serve-pd --backend cuda``
        (``kernels.pd_instance.CudaInstance``), warmed up, on the running loop."""
        from kernels.pd_instance import CudaInstance

        return await CudaInstance.build(spec, cfg, role, executor=self.executor, seed=seed,
                                        backend_options=self.options,
                                        warm_up_links=warm_up_links)


async def warm_up_links(backend: Any) -> None:
    """One copy each way (host block 0 <-> device block 0): compiles and loads the swap kernel."""
    from kernels.backend import FutureSink

    for i, (src, dst) in enumerate(((Tier.DEVICE, Tier.HOST), (Tier.HOST, Tier.DEVICE))):
        sink = FutureSink(backend.num_layers)
        backend.submit(TransferOp(-1 - i, OpKind.EVICT, src, dst, [0], [0], []), sink)
        await sink.wait()


def run_gpu_replay(cfg: Any, progress: Callable[[int, int], None] | None = None, *,
                   inspect: Callable[..., None] | None = None,
                   timeout_s: float | None = None,
                   backend_options: dict[str, Any] | None = None,
                   step_log: list[Any] | None = None,
                   op_log: list[Any] | None = None) -> dict[str, Any]:
    """``kvflow.replay.run_replay`` in a ``CudaWorld`` built with these options.

    ``cfg`` is a ``kvflow.replay.ReplayConfig`` (its backend is taken as
    ``cuda``); the report is the simulator's format plus ``device``.
    """
    import dataclasses

    from kvflow.replay import run_replay

    if cfg.backend != "cuda" or cfg.executor is None:  # the report names what ran
        cfg = dataclasses.replace(cfg, backend="cuda", executor=cfg.executor or "fast")
    world = CudaWorld(backend_options, step_log, op_log, executor=cfg.executor,
                      store=cfg.store)
    return run_replay(cfg, progress, world=world, inspect=inspect, timeout_s=timeout_s)
