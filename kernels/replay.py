"""Replay a request trace with the engine on a real GPU (``kvflow replay --backend cuda``).

The same scheduler, runtime and engine as the simulated replay (``sim.replay``),
on a real event loop (uvloop): arrivals at their trace times in wall-clock time,
``CudaBackend`` moving real KV between device and pinned host memory, and
``GpuExecutor`` computing each step on the GPU behind per-layer device-side
waits. The report is the simulator's (``sim.replay._full_report``), built from
the same objects; times are wall-clock seconds where the simulator's are
virtual, and per-transfer times come from CUDA events around each op on its
stream (``TransferLog``), where the simulator takes them from its link model.

The device has no storage tier here (``CudaBackend`` moves device <-> host
only), so the storage tier must be 0. Pools default to what fits: device
blocks in the GPU memory left after weights and workspace, host blocks in a
quarter of the machine's memory (pinned), both capped by the simulator's
defaults. Before the first arrival every kernel runs once (NVRTC compiles,
first launches), so no request pays for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from kernels._cuda import cupy_module, gpu_unavailable_reason
from kvflow.errors import ConfigError
from kvflow.manager import CacheManager, Capacities, OpKind, TransferOp
from kvflow.radix import Tier
from kvflow.runtime import Runtime
from sim.realtime import new_loop
from sim.replay import (
    DEFAULT_HOST_GB,
    ReplayConfig,
    Setup,
    TransferLog,
    _full_report,
    _summary,
    assemble_report,
    blocks_for_gb,
    default_device_blocks,
    make_manager,
    resolve,
    wire_engine,
)

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


def gpu_capacities(cfg: ReplayConfig, setup: Setup) -> Capacities:
    """Pools for the GPU world: as configured, else what fits (see the module docstring)."""
    spec = setup.spec
    if cfg.storage_blocks or cfg.storage_gb:
        raise ConfigError("--backend cuda has no storage tier: give --storage-blocks 0")
    cp = cupy_module()
    free, _ = cp.cuda.runtime.memGetInfo()
    if cfg.device_blocks is not None:
        device = cfg.device_blocks
    elif cfg.device_gb is not None:
        device = blocks_for_gb(cfg.device_gb, spec)
    else:
        weights = spec.active_params * 2
        room = free * DEVICE_SHARE - weights - _workspace_bytes(
            spec, cfg.max_batch_tokens + cfg.max_running)
        device = min(int(room // spec.bytes_per_block),
                     default_device_blocks(spec, setup.profile))
    if cfg.host_blocks is not None:
        host = cfg.host_blocks
    elif cfg.host_gb is not None:
        host = blocks_for_gb(cfg.host_gb, spec)
    else:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        host = min(int(ram * HOST_SHARE // spec.bytes_per_block),
                   blocks_for_gb(DEFAULT_HOST_GB, spec))
    if device <= 0:
        raise ConfigError(f"model {spec.name} leaves no GPU memory for KV blocks "
                          f"({free / GiB:.1f} GiB free): give --device-blocks")
    return Capacities(device, host, 0)


def env_backend_options() -> dict[str, Any]:
    """``CudaBackend`` options from the environment, for calibrate and replay alike.

    ``KVFLOW_STREAM_PRIORITY`` (``default``, ``highest`` or an int): how the copy
    streams compete with compute for SMs (``benchmarks/bench_overlap.py``).
    ``KVFLOW_COPY_ENGINE`` (``auto``, ``never``, ``always``): whether ops go to
    the copy engine as batched memcpys or to the swap kernel. Both change what
    a transfer costs, so a profile is only valid for the settings it was
    calibrated with: hence variables that both commands read.
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


def cuda_transfer_log(backend: Any, loop: asyncio.AbstractEventLoop) -> TransferLog:
    """A ``TransferLog`` timing each op with its task's CUDA events.

    The start event is recorded after the waits for the ops it depends on and
    right before its first layer's copy (it completes when the op starts on
    its link, as the simulator's service time starts); the end event right
    after its last layer's copy, whenever that layer is enqueued.
    """
    cp = cupy_module()
    backend.record_starts = True

    def service(handle: Any) -> float | None:
        start = getattr(handle, "start_event", None)
        end = getattr(handle, "end_event", None)
        if start is None or end is None:
            return None
        end.synchronize()  # at done time the GPU is past it (or a few us from it)
        return cp.cuda.get_elapsed_time(start, end) / 1e3

    return TransferLog(backend, loop, service)


def run_gpu_replay(cfg: ReplayConfig, progress: Callable[[int, int], None] | None = None, *,
                   inspect: Callable[[CacheManager, Runtime | None], None] | None = None,
                   timeout_s: float | None = None,
                   backend_options: dict[str, Any] | None = None,
                   step_log: list[Any] | None = None,
                   op_log: list[Any] | None = None) -> dict[str, Any]:
    """Run one replay on the GPU; returns the simulator's report format (plus ``device``).

    ``backend_options`` go to ``CudaBackend`` (CTAs, stream priority, ...);
    ``timeout_s`` bounds the replay's wall time (``ConfigError`` past it);
    ``step_log``, a list, receives the executor's per-step records, and
    ``op_log`` one ``(kind, link, blocks, service_s)`` per completed transfer
    (calibration fits to both).
    """
    reason = gpu_unavailable_reason()
    if reason is not None:
        raise ConfigError(f"--backend cuda needs a CUDA GPU and CuPy: {reason}")
    if cfg.backend != "cuda":
        cfg = dataclasses.replace(cfg, backend="cuda")
    t0 = time.perf_counter()
    setup = resolve(cfg)
    setup = dataclasses.replace(setup, capacities=gpu_capacities(cfg, setup))
    manager = make_manager(cfg, setup.capacities)
    options = env_backend_options() if backend_options is None else backend_options
    body = _run_loop(_replay_gpu(cfg, setup, manager, progress, inspect, timeout_s, options,
                                 step_log, op_log))
    return assemble_report(cfg, setup, manager, body, t0)


def _run_loop(coro: Any) -> Any:
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(coro)


async def warm_up_links(backend: Any) -> None:
    """One copy each way (host block 0 <-> device block 0): compiles and loads the swap kernel."""
    from kernels.backend import FutureSink

    for i, (src, dst) in enumerate(((Tier.DEVICE, Tier.HOST), (Tier.HOST, Tier.DEVICE))):
        sink = FutureSink(backend.num_layers)
        backend.submit(TransferOp(-1 - i, OpKind.EVICT, src, dst, [0], [0], []), sink)
        await sink.wait()


async def _replay_gpu(cfg: ReplayConfig, setup: Setup, manager: CacheManager,
                      progress: Callable[[int, int], None] | None,
                      inspect: Callable[[CacheManager, Runtime | None], None] | None,
                      timeout_s: float | None, options: dict[str, Any],
                      step_log: list[Any] | None = None,
                      op_log: list[Any] | None = None) -> dict[str, Any]:
    from kernels.backend import CudaBackend, LoopThreadGC
    from kernels.compute import GpuExecutor

    cp = cupy_module()
    loop = asyncio.get_running_loop()
    spec, caps = setup.spec, setup.capacities
    backend = CudaBackend(spec, caps.device, max(caps.host, 1), **options)
    executor = GpuExecutor(backend, seed=cfg.seed,
                           max_tokens=cfg.max_batch_tokens + cfg.max_running)
    await executor.warm_up(block=0)
    await warm_up_links(backend)
    backend.synchronize()
    executor.step_log = step_log  # (calibration reads the engine's steps)
    log = cuda_transfer_log(backend, loop)
    runtime, engine, sampler = wire_engine(cfg, setup, manager, log, executor, loop, progress)
    total = len(setup.requests)
    # Timestamps and arrivals on a fine clock aligned with the loop's: uvloop's
    # timers and loop.time() count whole milliseconds, which would add up to a
    # millisecond or two of harness lateness to every TTFT.
    clock = fine_clock(loop)
    engine.clock = clock
    start = clock()
    lags: list[float] = []

    async def feed() -> None:
        for req in setup.requests:
            due = start + req.arrival_s
            await sleep_until(clock, due)
            lags.append(clock() - due)
            engine.add(req)
        engine.close()

    run = loop.create_task(engine.run(), name="engine")
    sample_task = loop.create_task(sampler.run(), name="sampler")
    collector = LoopThreadGC(loop)
    try:
        await asyncio.wait_for(asyncio.gather(feed(), run), timeout_s)
    except TimeoutError:
        raise ConfigError(f"the GPU replay did not finish within {timeout_s:.0f} s "
                          f"({len(engine.done)} of {total} requests done)") from None
    finally:
        sample_task.cancel()
        backend.synchronize()
        collector.stop()
    sampler.sample()
    end = clock()
    if op_log is not None:
        op_log.extend((r[0], r[1], r[2], r[7]) for r in log.records if r[5] and r[7] is not None)
    backend.synchronize()
    if inspect is not None:
        inspect(manager, runtime)
    # The report counts from the first arrival at 0, as the simulator's loop does.
    for st in engine.done:
        for name in ("admit_s", "first_token_s", "finish_s"):
            v = getattr(st, name)
            if v is not None:
                setattr(st, name, v - start)
    sampler.t = [round(t - start, 6) for t in sampler.t]
    body = _full_report(setup, engine, runtime, log, sampler, end - start)
    props = cp.cuda.runtime.getDeviceProperties(backend.device)
    name = props["name"]
    body["device"] = {
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "backend_options": {k: v for k, v in options.items() if isinstance(v, (int, float))},
        "executor_steps": executor.steps,
        "executor_gpu_s": executor.busy_s,
        "outputs": sum(len(v) for v in executor.outputs.values()),
        # How late each request reached the engine (timer wake-ups; uvloop's clock
        # counts whole ms): part of every GPU TTFT that the simulator does not see.
        "arrival_lag_s": _summary(lags) if lags else None,
    }
    return body
