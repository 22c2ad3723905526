"""One prefill/decode instance on a GPU: the CUDA world's half of ``kvflow serve-pd``.

The same pieces as the real-time CPU world's instance
(``kvflow.realtime.pd_instance.Instance``) with the GPU's parts in their place:
``CudaBackend`` moves device <-> host (pinned), an executor of ``kernels.fast``
(``exact`` by default: batch-invariant, so a request's tokens are the same
whoever batched it, which is what lets a PD run be compared token for token
with a colocated one) computes real tokens from real KV, and the PD transfers
read and write the device KV through ``CudaBlockMemory`` (per frame one kernel
gathers a layer's blocks straight into pinned host memory, or scatters a frame
from pinned memory into the blocks; then the TCP link).

``PDExecutor`` adapts the GPU executor to a PD instance, in two ways:

* a step's waits may be ops of another backend (a PD send still reading a block
  the step overwrites) or routed ops (``RoutedBackend`` wraps every handle):
  the CUDA ones are waited for on the GPU (``CudaBackend.wait_layer`` on the
  inner handle), the others on the host before the step is enqueued;
* ``layer_written(batch, layer)`` (the prefill side's cue to send a layer) is
  called for every layer once the step's last kernel has run (the executor
  resolves its future from a host callback after the step's end event), so a
  send never reads KV the GPU has not written yet. That sends at step
  granularity, not layer by layer inside a step: the transfer overlaps the
  prefill steps that follow, not the layers of the step that wrote it.

The instance is built by ``CudaWorld.pd_instance`` (``kvflow.world`` loads the
world by name; the core never imports this module).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kernels.backend import CudaBackend, CudaTask, LoopThreadGC
from kernels.fast import make_executor
from kernels.pd_peer import CudaBlockMemory
from kvflow.backends import RoutedBackend
from kvflow.engine import Engine, EngineConfig
from kvflow.errors import ConfigError
from kvflow.layout import ModelSpec
from kvflow.manager import CacheManager, Capacities
from kvflow.pd.backend import PDBackend
from kvflow.policy import PrefetchPolicy
from kvflow.radix import Tier
from kvflow.runtime import Runtime

#: What an instance does: one half of a PD pair, or both (the colocated reference run).
ROLES = ("prefill", "decode", "colocated")


class _CudaWait:
    """A runtime task seen through its CUDA handle (what ``GpuExecutor`` waits on)."""

    __slots__ = ("handle", "task")

    def __init__(self, task: Any, handle: CudaTask) -> None:
        self.task, self.handle = task, handle

    @property
    def finished(self) -> bool:
        return bool(self.task.finished)

    @property
    def ok(self) -> bool:
        return bool(self.task.ok)

    def wait(self) -> Any:
        return self.task.wait()


class PDExecutor:
    """A GPU executor for a PD instance (see the module docstring); everything else is
    the wrapped executor's."""

    def __init__(self, inner: Any, num_layers: int) -> None:
        self.inner = inner
        self.num_layers = num_layers
        #: Set by ``kvflow.pd.verbs.PrefillSide.attach``.
        self.layer_written: Any = None

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    async def run_step(self, batch: Any, waits: Sequence[Any]) -> None:
        on_gpu: list[Any] = []
        for t in waits:
            handle = t.handle
            inner = getattr(handle, "inner", handle)
            if isinstance(inner, CudaTask):
                on_gpu.append(_CudaWait(t, inner))
            elif not t.finished or not t.ok:
                await t.wait()  # a peer transfer, or an op not submitted yet; raises if failed
        await self.inner.run_step(batch, on_gpu)
        written = self.layer_written
        if written is not None:
            for layer in range(self.num_layers):
                written(batch, layer)


class CudaInstance:
    """Manager + ``CudaBackend`` (device and pinned host tiers) + PD backend, one
    runtime, one engine over a ``PDExecutor``. Build with ``await CudaInstance.build``."""

    def __init__(self) -> None:
        raise TypeError("use: await CudaInstance.build(spec, cfg, role)")

    @classmethod
    async def build(cls, spec: ModelSpec, cfg: Any, role: str, *, executor: str = "exact",
                    seed: int = 0, backend_options: dict[str, Any] | None = None,
                    warm_up_links: Callable[[CudaBackend], Awaitable[None]] | None = None
                    ) -> CudaInstance:
        """``cfg``: a ``kvflow.realtime.pd_instance.InstanceConfig`` (its pacing fields
        do not apply: the GPU computes). ``warm_up_links``: one copy each way before the
        first arrival (``kernels.world.warm_up_links``, passed in by the world)."""
        if role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if cfg.device_blocks <= 0:
            raise ConfigError("a GPU PD instance needs device_blocks > 0")
        self = object.__new__(cls)
        loop = asyncio.get_running_loop()
        self.spec, self.cfg, self.role = spec, cfg, role
        self.manager = CacheManager(Capacities(cfg.device_blocks, cfg.host_blocks),
                                    eviction=cfg.eviction, write_policy=cfg.write_policy,
                                    prefetch_policy=PrefetchPolicy("best_effort"))
        self.gpu = CudaBackend(spec, cfg.device_blocks, max(cfg.host_blocks, 1),
                               **(backend_options or {}))
        inner = make_executor(executor, self.gpu, seed=seed, max_tokens=cfg.max_batch_tokens)
        await inner.warm_up(block=0)
        if warm_up_links is not None:
            await warm_up_links(self.gpu)
        self.gpu.synchronize()
        #: (tokens, GPU s, wall s) per step: what a simulator's compute model is fitted to.
        inner.step_log = self.step_log = []
        self.executor = PDExecutor(inner, spec.num_layers)
        self.pd = PDBackend(spec.num_layers)
        self.backend = RoutedBackend({(Tier.HOST, Tier.DEVICE): self.gpu,
                                      (Tier.DEVICE, Tier.HOST): self.gpu,
                                      (Tier.DEVICE, Tier.DEVICE): self.pd}, loop)
        self.runtime = Runtime(self.manager, self.backend, spec.bytes_per_block, loop)
        self.memory = CudaBlockMemory.for_backend(self.gpu)
        self.engine = Engine(self.manager, self.runtime, self.executor,
                             EngineConfig(spec.block_tokens, cfg.max_batch_tokens,
                                          cfg.max_running))
        self._gc = LoopThreadGC(loop)
        return self

    async def drain(self) -> None:
        await self.runtime.drain()
        self.gpu.synchronize()
        self._gc.stop()

    def pools_free(self) -> dict[str, tuple[int, int]]:
        """Per tier (free, capacity) after dropping every unreferenced copy."""
        self.manager.drop_all()
        return {p.name: (p.num_free, p.capacity) for p in self.manager.pools if p.capacity}

    def outputs(self) -> dict[Any, list[int]]:
        """Sampled tokens per request id, in order."""
        return {rid: [t for t, _ in v] for rid, v in self.executor.inner.outputs.items()}

    def counters(self) -> dict[str, Any]:
        m = self.runtime.metrics
        ex = self.executor.inner
        return {"bytes": dict(m.bytes), "ops": dict(m.ops), "failed": m.failed,
                "cancelled": m.cancelled, "engine": dict(self.engine.stats.__dict__),
                # No keyed bytes on a GPU: the check is the tokens (report's "tokens").
                "compute": {"corrupt_reads": 0, "blocks_verified": 0,
                            "executor": getattr(ex, "kind", None), "steps": ex.steps,
                            "gpu_s": ex.busy_s},
                "steps": [(sum(n for n, _ in pre) + len(dec), round(gpu, 7), round(wall, 7))
                          for pre, dec, gpu, wall, _ in self.step_log]}
