"""One prefill/decode instance in the real-time CPU world: engine, cache and PD backend.

The pieces are the real-time world's (``HostCopyBackend`` for device <-> host,
``KeyedBlockExecutor`` writing and checking key-derived bytes, ``Engine``),
with ``PDBackend`` routed under ``(DEVICE, DEVICE)`` beside them. A decode
instance's executor checks every block it reads against the bytes its key
implies, so a received block with one wrong byte counts as a corrupt read.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from kvflow.backends import RoutedBackend
from kvflow.engine import Engine, EngineConfig
from kvflow.errors import ConfigError
from kvflow.host_memory import HostArrays
from kvflow.layout import ModelSpec
from kvflow.manager import CacheManager, Capacities
from kvflow.pd.backend import PDBackend
from kvflow.pd.memory import ArrayMemory
from kvflow.policy import PrefetchPolicy, WritePolicy
from kvflow.radix import Tier
from kvflow.realtime.cpu import HostCopyBackend, KeyedBlockExecutor
from kvflow.realtime.stack import tiny_spec
from kvflow.runtime import Runtime

__all__ = ["ROLES", "Instance", "InstanceConfig", "tiny_spec"]

ROLES = ("prefill", "decode")


@dataclass
class InstanceConfig:
    """Tiers, batching and compute pacing of one instance (wall seconds).

    ``device_blocks`` / ``host_blocks`` 0: sized from the workload by whoever runs
    the instance (``kvflow serve-pd``: four times the slice's largest request)."""

    device_blocks: int = 0
    host_blocks: int = 0
    eviction: str = "lru"
    write_policy: str = "write_through"
    max_batch_tokens: int = 2048
    max_running: int = 16
    #: Compute time of a step: ``step_s + token_s * tokens``.
    step_s: float = 0.002
    token_s: float = 2e-6
    verify_decode: bool = True
    copy_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.device_blocks < 0 or self.host_blocks < 0:
            raise ConfigError("device_blocks and host_blocks must be >= 0")
        WritePolicy(self.write_policy)


class Instance:
    """Manager + CPU device + host tier + PD backend, one runtime, one engine.

    Build inside a running loop.
    """

    def __init__(self, spec: ModelSpec, cfg: InstanceConfig, role: str) -> None:
        if role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        loop = asyncio.get_running_loop()
        self.spec, self.cfg, self.role = spec, cfg, role
        self.manager = CacheManager(Capacities(cfg.device_blocks, cfg.host_blocks),
                                    eviction=cfg.eviction, write_policy=cfg.write_policy,
                                    prefetch_policy=PrefetchPolicy("best_effort"))
        lay = spec.layout
        self.host = HostArrays.for_layout(lay, max(cfg.host_blocks, 1))
        self.copies = HostCopyBackend(self.host, cfg.device_blocks,
                                      bytes_per_s=cfg.copy_bytes_per_s)
        self.pd = PDBackend(lay.num_layers)
        self.backend = RoutedBackend({(Tier.HOST, Tier.DEVICE): self.copies,
                                      (Tier.DEVICE, Tier.HOST): self.copies,
                                      (Tier.DEVICE, Tier.DEVICE): self.pd}, loop)
        self.runtime = Runtime(self.manager, self.backend, spec.bytes_per_block, loop)
        self.memory = ArrayMemory(self.copies.device)
        self.executor = KeyedBlockExecutor(self.copies.device_layer, lay.num_layers,
                                           lay.bytes_per_layer_block, spec.block_tokens,
                                           step_s=cfg.step_s, token_s=cfg.token_s,
                                           verify_decode=cfg.verify_decode)
        self.executor.step_log = []
        self.engine = Engine(self.manager, self.runtime, self.executor,
                             EngineConfig(spec.block_tokens, cfg.max_batch_tokens,
                                          cfg.max_running))

    async def drain(self) -> None:
        await self.runtime.drain()

    def pools_free(self) -> dict[str, tuple[int, int]]:
        """Per tier (free, capacity) after dropping every unreferenced copy: with nothing
        running and nothing in flight, every pool is back to full."""
        self.manager.drop_all()
        return {p.name: (p.num_free, p.capacity) for p in self.manager.pools if p.capacity}

    def counters(self) -> dict[str, Any]:
        m = self.runtime.metrics
        return {"bytes": dict(m.bytes), "ops": dict(m.ops), "failed": m.failed,
                "cancelled": m.cancelled, "engine": dict(self.engine.stats.__dict__),
                "compute": self.executor.stats.as_dict(), "busy": self.copies.busy_s(),
                "steps": [(n, g, round(w, 7)) for n, g, w in self.executor.step_log or ()]}
