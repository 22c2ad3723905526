"""The simulated world: the engine on a virtual-time loop, over the link model.

``SimWorld`` is what ``kvflow.replay`` runs a full replay in by default: the
loop is ``sim.loop.VirtualTimeLoop`` (simpy's clock; a sleep costs no wall
time), transfers go through ``sim.hierarchy.SimBackend`` (FIFO links with
bandwidth and latency from the GPU profile), and compute is the cost model's
time slept layer by layer (``sim.executor.SimExecutor``). Times in the report
are virtual seconds from the first arrival.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvflow.cost import CostModel
from kvflow.layout import ModelSpec
from kvflow.manager import Capacities
from kvflow.profile import GpuProfile
from kvflow.world import TierRequest, WorldSetup, default_capacities
from sim.executor import SimExecutor
from sim.hierarchy import Hierarchy, SimBackend
from sim.loop import run_sim

T = TypeVar("T")

__all__ = ["SimSite", "SimWorld", "sim_service_s"]


def sim_service_s(handle: Any) -> float | None:
    """A simulated op's service time: its first layer's start to its last layer's landing."""
    if not handle.land_times or handle.finished_at is None:
        return None
    return float(handle.finished_at - handle.land_times[0] + handle.first_unit)


class SimSite:
    """The simulated world, started on a ``VirtualTimeLoop``."""

    #: Its report reads no per-op records: the replay keeps only their columns.
    keep_transfer_records = False

    def __init__(self, loop: asyncio.AbstractEventLoop, setup: WorldSetup) -> None:
        self._loop = loop
        spec = setup.spec
        self.backend = SimBackend(loop.env, spec,  # type: ignore[attr-defined]
                                  Hierarchy.from_profile(setup.profile))
        self.backend.admit = setup.admit
        self.backend.set_host_layout(getattr(setup, "host_layout", "layer_major"))
        self.executor = SimExecutor(CostModel(spec, setup.profile, setup.tp), spec.num_layers)
        self.clock = loop.time
        self.service_s = sim_service_s

    async def sleep_until(self, when: float) -> None:
        delay = when - self._loop.time()
        if delay > 0:
            await asyncio.sleep(delay)

    def settle(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def report(self, log: Any) -> dict[str, Any] | None:
        return None


class SimWorld:
    """Virtual time, the link model and the cost model (``kvflow.world.World``).

    ``configure_backend`` sees the ``SimBackend`` before the first request
    (fault injection, for tests and experiments).
    """

    name = "sim"

    def __init__(self, configure_backend: Callable[[SimBackend], None] | None = None) -> None:
        self.configure_backend = configure_backend

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        return run_sim(main)

    def capacities(self, spec: ModelSpec, profile: GpuProfile, want: TierRequest) -> Capacities:
        return default_capacities(spec, profile, want)

    async def start(self, setup: WorldSetup) -> SimSite:
        site = SimSite(asyncio.get_running_loop(), setup)
        if self.configure_backend is not None:
            self.configure_backend(site.backend)
        return site
