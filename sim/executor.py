"""Compute in virtual time: the cost model's step time as a sleep, layer-aware.

When a step depends on loads still in flight, it is computed layer by layer —
each layer starts once that layer of every load has landed — which is how
layer-wise overlap shows up in simulated TTFT. Otherwise the whole step is one
sleep, so a replay pays one loop wake-up per step, not one per layer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvflow.cost import CostModel
from kvflow.engine import StepBatch
from kvflow.runtime import TransferTask


class SimExecutor:
    """``ComputeExecutor`` of the simulated world.

    It needs the decoding sequences' number and context sum only (``per_request``
    false: the engine keeps those as running sums rather than listing them).
    """

    per_request = False

    def __init__(self, cost: CostModel, num_layers: int) -> None:
        self.cost = cost
        self.num_layers = num_layers
        self.busy_s = 0.0

    async def run_step(self, batch: StepBatch, waits: Sequence[TransferTask]) -> None:
        pending = [t for t in waits if not t.finished or not t.ok]
        n, ctx = batch.decode_count, batch.decode_context_sum
        if not pending:
            dt = self.cost.step_time_sums(batch.prefill, n, ctx)
            self.busy_s += dt
            await asyncio.sleep(dt)
            return
        per_layer = self.cost.layer_time_sums(batch.prefill, n, ctx)
        overhead = self.cost.step_time_sums(batch.prefill, n, ctx) - self.num_layers * per_layer
        for i in range(self.num_layers):
            for t in pending:
                if t.layers_done <= i:
                    await t.layer(i)  # raises TransferError if that load failed
            self.busy_s += per_layer
            await asyncio.sleep(per_layer)
        if overhead > 0:
            self.busy_s += overhead
            await asyncio.sleep(overhead)

    async def run_decode_steps(self, count: int, context_sum: int, max_steps: int,
                               until: float | None) -> int:
        """Several pure-decode steps as one sleep: the sum of their step times."""
        loop = asyncio.get_running_loop()
        budget = None if until is None else until - loop.time()
        step_time = self.cost.decode_step_time
        total = 0.0
        ran = 0
        while ran < max_steps:
            total += step_time(count, context_sum)
            ran += 1
            if budget is not None and total >= budget:
                break
            context_sum += count  # every context grows by the token just decoded
        self.busy_s += total
        await asyncio.sleep(total)
        return ran
