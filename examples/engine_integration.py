"""How an async serving engine uses kvflow: match -> plan -> submit -> compute -> commit -> finish.

Runs on the CPU with real bytes (numpy arrays stand in for GPU memory), so it
needs no GPU: ``python examples/engine_integration.py``. ``docs/integration.md``
walks through it; ``tests/test_examples.py`` runs it, so the page and the code
cannot drift apart.

Three requests: A computes three blocks, which the write policy backs up to
host; B needs the whole device, so A's blocks are evicted (they stay on host);
A again, with one more block, loads its prefix back from host layer by layer,
and computes layer i as soon as layer i has landed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence

import numpy as np

from kvflow.errors import TransferError
from kvflow.host_memory import HostArrays
from kvflow.manager import CacheManager, Capacities, Plan
from kvflow.radix import Tier
from kvflow.realtime.cpu import HostCopyBackend
from kvflow.runtime import Runtime

NUM_LAYERS = 4
LAYER_BYTES = 1024  # one block of one layer (K and V of its tokens)


def kv_bytes(key: Hashable, layer: int) -> np.ndarray:
    """What the model would write for block ``key`` in ``layer``: equal keys, equal KV."""
    seed = hash((key, layer)) & 0xFFFF_FFFF
    return np.random.default_rng(seed).integers(0, 256, LAYER_BYTES, dtype=np.uint8)


class TinyEngine:
    """The part of a serving engine that talks to kvflow (no batching, one request at a time)."""

    def __init__(self) -> None:
        self.manager = CacheManager(Capacities(device=4, host=8), eviction="lru",
                                    write_policy="write_through")
        self.host = HostArrays(8, NUM_LAYERS, LAYER_BYTES)
        self.copies = HostCopyBackend(self.host, 4)  # the TransferBackend: device <-> host
        self.runtime = Runtime(self.manager, self.copies, bytes_per_block=NUM_LAYERS * LAYER_BYTES)
        self.recomputed = 0  # requests that recomputed after a failed load

    async def serve(self, request_id: str, keys: Sequence[Hashable]) -> dict[str, int]:
        # 1. match + 2. plan: device blocks for the whole prompt; loads for what is cached
        #    below the device; evictions (and their copy-outs) if the device is short.
        plan = self.manager.plan(request_id, keys)
        # 3. submit: every op becomes a TransferTask at once; the runtime orders them
        #    (a block being copied out is not overwritten before the copy has read it).
        loads = self.runtime.submit_all(plan.ops)
        loads += [t for op in plan.shared if (t := self.runtime.task_of(op)) is not None]
        # 4. compute, layer by layer: layer i waits only for layer i of the loads.
        try:
            for layer in range(NUM_LAYERS):
                for task in loads:
                    await task.layer(layer)  # raises TransferError if that load failed
                self._compute_layer(plan, layer)
        except TransferError:
            # A failed or cancelled load never yields wrong data: the manager has
            # handed its blocks back to this request, which recomputes them.
            self.recomputed += 1
            for layer in range(NUM_LAYERS):
                self._compute_layer(plan, layer, recompute_all=True)
        # 5. commit: the new blocks become matchable (never before their KV is written) ...
        self.manager.commit(plan)
        # ... and finish: references drop, blocks become evictable, backups follow.
        self.runtime.submit_all(self.manager.finish(plan))
        return {t.name.lower(): plan.hits(t) for t in Tier}

    def _compute_layer(self, plan: Plan, layer: int, recompute_all: bool = False) -> None:
        device = self.copies.device_layer(layer)
        for i, (key, block) in enumerate(zip(plan.keys, plan.device_ids, strict=True)):
            if i < plan.num_cached and not recompute_all:
                # a cached block: attention reads it; check it holds the right bytes
                assert np.array_equal(device[block], kv_bytes(key, layer)), (key, layer)
            else:
                device[block] = kv_bytes(key, layer)  # the forward pass writes new KV

    async def drain(self) -> None:
        await self.runtime.drain()


async def main() -> list[dict[str, int]]:
    engine = TinyEngine()
    served = []
    for request_id, keys in (("A", [1, 2, 3]), ("B", [7, 8, 9, 10]), ("A2", [1, 2, 3, 4])):
        served.append(await engine.serve(request_id, keys))
        await engine.drain()  # let backups land before the next request (a real engine won't)
        print(f"request {request_id}: blocks served from {served[-1]}")
    engine.manager.check_invariants()
    return served


if __name__ == "__main__":
    asyncio.run(main())
