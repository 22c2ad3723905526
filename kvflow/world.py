"""A world: where the engine runs. The seam between the scheduler and its surroundings.

The manager, runtime and engine are the same objects everywhere; what differs
is what they run on. A ``World`` supplies exactly that, and nothing else:

* an **event loop** (``run``): the simulator's virtual-time loop, or a real
  one (uvloop, ``new_loop``) where time is the wall clock;
* **tier sizes** (``capacities``): what fits where it runs (a GPU world asks
  the GPU for its free memory; the simulator takes the profile's);
* once started on its loop (``start``), a ``Site``: the ``TransferBackend``
  that moves blocks, the ``ComputeExecutor`` that computes steps, a clock
  for the report's times, how to wait for an arrival, and how long a
  transfer was in service (so both worlds' reports time transfers alike).

Worlds are looked up by name (``WORLDS``) and imported only when asked for,
so the core never imports simpy or CuPy: ``sim.world.SimWorld`` is the
simulated world, ``kernels.world.CudaWorld`` the GPU one. The replay driver
(``kvflow.replay``) runs the engine in whichever it is given.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from kvflow.errors import ConfigError
from kvflow.manager import Capacities

if TYPE_CHECKING:
    from kvflow.backend import TransferBackend
    from kvflow.engine import ComputeExecutor
    from kvflow.layout import ModelSpec
    from kvflow.profile import GpuProfile
    from kvflow.replay.transfer_log import TransferLog

T = TypeVar("T")

#: World name -> "module:class"; imported on first use only.
WORLDS: dict[str, str] = {
    "sim": "sim.world:SimWorld",
    "cuda": "kernels.world:CudaWorld",
}

GiB = 1024**3
#: Share of GPU memory left for KV after weights, as serving engines reserve it.
GPU_MEMORY_UTILIZATION = 0.9
#: Tier sizes used when none is given.
DEFAULT_HOST_GB = 256.0
DEFAULT_STORAGE_GB = 2048.0


@dataclass(frozen=True)
class TierRequest:
    """The tier sizes a user asked for (None: the world's default) and the step size."""

    device_blocks: int | None = None
    host_blocks: int | None = None
    storage_blocks: int | None = None
    device_gb: float | None = None
    host_gb: float | None = None
    storage_gb: float | None = None
    #: Most tokens one engine step computes (workspace a GPU world must leave free).
    max_step_tokens: int = 8192
    #: GPUs one instance spans (tensor parallelism): KV and weights split that many ways.
    tp: int = 1


@dataclass(frozen=True)
class WorldSetup:
    """What a world is started with: the model, the GPU profile, the tiers, the seed.

    ``tp``: GPUs the instance spans (tensor parallelism; ``profile``'s links are the
    instance's already, ``kvflow.profile.tensor_parallel_links``), for the cost model.
    ``admit``: a gate on storage transfers, ``admit(op, nbytes, now) -> earliest start``,
    shared by the instances of a cluster whose storage is one pool with an aggregate
    bandwidth (``kvflow.cluster.pool.PoolGate``); a world that cannot honour it is
    never given one (the replay's config allows a pool in the simulated world only).
    """

    spec: ModelSpec
    profile: GpuProfile
    capacities: Capacities
    seed: int = 0
    max_step_tokens: int = 8192
    tp: int = 1
    admit: Callable[[Any, float, float], float] | None = None
    #: The host pool's layout (``kvflow.host_layout``): pieces per copy, layer-future groups.
    host_layout: str = "layer_major"


@runtime_checkable
class Site(Protocol):
    """A started world: what the engine and the driver use while a replay runs."""

    backend: TransferBackend
    executor: ComputeExecutor

    def clock(self) -> float:
        """Now, on the scale the report's times use (the loop's, or finer)."""
        ...

    async def sleep_until(self, when: float) -> None:
        """Return at ``when`` on ``clock`` (an arrival's time)."""
        ...

    def service_s(self, handle: Any) -> float | None:
        """How long a finished op was in service on its link (None: unknown)."""
        ...

    def settle(self) -> None:
        """Wait for the world's own work in flight (a GPU's queues) once the engine is done,
        before the run's end time is read."""
        ...

    async def stop(self) -> None:
        """Release what ``start`` took (streams, threads); called once, also on error."""
        ...

    def report(self, log: TransferLog) -> dict[str, Any] | None:
        """The world's own sections of the report (None: none); ``log`` holds the run's ops."""
        ...


@runtime_checkable
class World(Protocol):
    """Where an engine runs: its loop, its tier sizes, and a ``Site`` once started."""

    name: str

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        """Run ``main`` to completion on a fresh loop of this world (its loop factory)."""
        ...

    def capacities(self, spec: ModelSpec, profile: GpuProfile, want: TierRequest) -> Capacities:
        """Tier sizes in blocks: ``want`` where given, else what this world holds."""
        ...

    async def start(self, setup: WorldSetup) -> Site:
        """Build backend and executor on the running loop (warmed up, ready for arrivals)."""
        ...


def load_world(name: str, **options: Any) -> World:
    """The world called ``name``, imported now and built with ``options``.

    An unknown name, or a world whose module cannot be imported (simpy or
    CuPy missing), is a ``ConfigError`` that says which.
    """
    target = WORLDS.get(name)
    if target is None:
        raise ConfigError(f"unknown world {name!r}; valid: {', '.join(WORLDS)}")
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"world {name!r} is not available: {exc}") from None
    world: World = getattr(module, cls_name)(**options)
    return world


def new_loop(use_uvloop: bool = True) -> asyncio.AbstractEventLoop:
    """A fresh real-time event loop: uvloop's where installed and asked for, else asyncio's."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run_realtime_loop(main: Coroutine[Any, Any, T],
                      loop_factory: Callable[[], asyncio.AbstractEventLoop] = new_loop) -> T:
    """Run ``main`` on a fresh real-time loop and close it (``asyncio.run`` on ``new_loop``)."""
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main)


# -- tier sizes ---------------------------------------------------------------------------------
def weight_bytes(spec: ModelSpec) -> float:
    """bf16 weights; for MoE models only what a device must hold is unknown here,
    so all active parameters count (a lower bound on memory)."""
    return spec.active_params * 2


def default_device_blocks(spec: ModelSpec, profile: GpuProfile, tp: int = 1) -> int:
    """KV blocks in the profile's GPU memory once weights are in, as engines reserve it.

    ``tp`` GPUs (tensor parallelism) hold the weights once between them and each
    holds 1/tp of every block (its share of the KV heads), so a block stays the
    model's whole block and the tier counts ``(tp * memory * 0.9 - weights) /
    bytes_per_block`` of them.
    """
    memory = profile.memory_bytes * tp if tp > 1 else profile.memory_bytes
    free = memory * GPU_MEMORY_UTILIZATION - weight_bytes(spec)
    blocks = int(free // spec.bytes_per_block)
    if blocks <= 0:
        gpus = f"{tp} x " if tp > 1 else ""
        raise ConfigError(
            f"model {spec.name} does not fit on {gpus}{profile.name} "
            f"({profile.memory_bytes / GiB:.0f} GiB): give --device-blocks explicitly")
    return blocks


def blocks_for_gb(gb: float, spec: ModelSpec) -> int:
    return int(gb * GiB // spec.bytes_per_block)


def sized(blocks: int | None, gb: float | None, spec: ModelSpec,
          default: Callable[[], int]) -> int:
    """A tier's size: ``blocks`` if given, else ``gb`` in blocks, else ``default()``."""
    if blocks is not None:
        return blocks
    return blocks_for_gb(gb, spec) if gb is not None else default()


def default_capacities(spec: ModelSpec, profile: GpuProfile, want: TierRequest) -> Capacities:
    """Tiers as asked, else: the profile's GPU memory left after weights, 256 GB of host
    memory and 2 TB of storage (the simulated world's sizes, and cache mode's)."""
    return Capacities(
        sized(want.device_blocks, want.device_gb, spec,
              lambda: default_device_blocks(spec, profile, want.tp)),
        sized(want.host_blocks, want.host_gb, spec,
              lambda: blocks_for_gb(DEFAULT_HOST_GB, spec)),
        sized(want.storage_blocks, want.storage_gb, spec,
              lambda: blocks_for_gb(DEFAULT_STORAGE_GB, spec)))
