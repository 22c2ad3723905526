"""Compute in virtual time: the cost model's step time as a sleep, layer-aware.

When a step depends on loads still in flight, it is computed layer by layer —
each layer starts once that layer of every load has landed — which is how
layer-wise overlap shows up in simulated TTFT. Otherwise the whole step is one
sleep, so a replay pays one loop wake-up per step, not one per layer; and a run
of layers whose loads have landed is a chain of timers (``_Layers``), not a
wake-up of the step's task per layer.

Prefill/decode disaggregation reads two more things off it: when each layer of
the last step ended (``layer_ends``: a prefill instance streams a layer's KV
once it is computed), and a run of decode steps may be cut short
(``cut_decode_steps``) when a request whose KV just arrived is to join the
batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvflow.cost import CostModel
from kvflow.engine import StepBatch
from kvflow.runtime import TransferTask
from sim.loop import VirtualTimeLoop


class _DecodeRun:
    """A run of decode steps in progress: enough to recompute where it may stop."""

    __slots__ = ("batch", "context_sum", "handle", "max_steps", "ran", "start", "total",
                 "wake")

    def __init__(self, start: float, batch: int, context_sum: int, max_steps: int) -> None:
        self.start, self.batch, self.context_sum, self.max_steps = (
            start, batch, context_sum, max_steps)
        self.ran = 0
        self.total = 0.0
        self.wake: asyncio.Future[None] | None = None
        self.handle: asyncio.TimerHandle | None = None


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
        #: Host time per load a step waits on, spent before it starts (profile key).
        self._load_submit_s = cost.profile.load_submit_s
        # The last step: its start, its batch, and its layers' ends where it was run
        # layer by layer (else they follow from the cost model).
        self._last_start = 0.0
        self._last_batch: StepBatch | None = None
        self._last_ends: list[float] | None = None
        self._decoding: _DecodeRun | None = None

    async def run_step(self, batch: StepBatch, waits: Sequence[TransferTask]) -> None:
        loop = asyncio.get_running_loop()
        if waits and self._load_submit_s:  # the host submits the loads, then the step
            submit = self._load_submit_s * len(waits)
            self.busy_s += submit
            await asyncio.sleep(submit)
        self._last_start = loop.time()
        self._last_batch = batch
        self._last_ends = None
        pending = [t for t in waits if not t.finished or not t.ok]
        n, ctx = batch.decode_count, batch.decode_context_sum
        if not pending:
            dt = self.cost.step_time_sums(batch.prefill, n, ctx)
            self.busy_s += dt
            await asyncio.sleep(dt)
            return
        per_layer = self.cost.layer_time_sums(batch.prefill, n, ctx)
        overhead = self.cost.step_time_sums(batch.prefill, n, ctx) - self.num_layers * per_layer
        ends: list[float] = []
        self._last_ends = ends
        num_layers = self.num_layers
        if per_layer <= 0 or not isinstance(loop, VirtualTimeLoop):
            for i in range(num_layers):
                for t in pending:
                    if t.layers_done <= i:
                        await t.layer(i)  # raises TransferError if that load failed
                self.busy_s += per_layer
                await asyncio.sleep(per_layer)
                ends.append(loop.time())
            if overhead > 0:
                self.busy_s += overhead
                await asyncio.sleep(overhead)
            return
        # The same, with runs of layers whose loads have landed slept as a chain of
        # timers (``_Layers``): the same times, one wake-up of this task per run.
        i = 0
        while i < num_layers:
            for t in pending:
                if t.layers_done <= i:
                    await t.layer(i)  # raises TransferError if that load failed
            self.busy_s += per_layer
            i = await _Layers(self, loop, i, per_layer, overhead, pending, ends).run()
        if i == num_layers and overhead > 0:
            self.busy_s += overhead
            await asyncio.sleep(overhead)

    def layer_ends(self) -> list[float]:
        """Loop time at which each layer of the last step ended.

        A step computes its layers first and spends its host overhead after
        them; one run as a single sleep has layer ``i`` end at ``start + (i + 1)
        * layer_time``, one run layer by layer (behind loads) when it did.
        """
        if self._last_ends is not None:
            return list(self._last_ends)
        batch = self._last_batch
        if batch is None:
            return []
        per_layer = self.cost.layer_time_sums(batch.prefill, batch.decode_count,
                                              batch.decode_context_sum)
        start = self._last_start
        return [start + (i + 1) * per_layer for i in range(self.num_layers)]

    def _span(self, run: _DecodeRun, until: float | None) -> tuple[int, float]:
        """Steps (and their total time) of ``run`` up to the one that ends at or past
        ``until``: one rule for the first plan and any cut, so a cut run stops exactly
        where a run told the earlier ``until`` from the start would have."""
        budget = None if until is None else until - run.start
        return self.cost.decode_run(run.batch, run.context_sum, run.max_steps, budget)

    async def run_decode_steps(self, count: int, context_sum: int, max_steps: int,
                               until: float | None) -> int:
        """Several pure-decode steps as one sleep: the sum of their step times."""
        loop = asyncio.get_running_loop()
        run = _DecodeRun(loop.time(), count, context_sum, max_steps)
        run.ran, run.total = self._span(run, until)
        run.wake = loop.create_future()
        run.handle = loop.call_at(run.start + run.total, _wake, run.wake)
        self._decoding = run
        try:
            await run.wake
        finally:
            self._decoding = None
            run.handle.cancel()
        self.busy_s += run.total
        return run.ran

    def cut_decode_steps(self, until: float) -> None:
        """End the run of decode steps in progress after the step that ends at or past
        ``until`` (no run, or one that ends before: nothing changes)."""
        run = self._decoding
        if run is None or run.wake is None or run.wake.done():
            return
        ran, total = self._span(run, until)
        if ran >= run.ran:
            return
        run.ran, run.total = ran, total
        assert run.handle is not None
        run.handle.cancel()
        run.handle = asyncio.get_running_loop().call_at(run.start + total, _wake, run.wake)


class _Layers:
    """A step's layers slept one after another, as the plain loop sleeps them, but
    chained: the timer that ends a layer starts the next layer's (and after the last,
    the step's overhead) itself, instead of waking the step's task to do it, when

    * every load the step waits on has landed that layer, so the task would not
      wait for one but go straight to its sleep, and
    * the loop says the push is indistinguishable from the task's own one
      iteration later (``VirtualTimeLoop.chain``).

    Otherwise it wakes the task, exactly where the plain loop's sleep would have
    (and the task goes on as the plain loop does). Each layer's end is its own
    timer at ``now + per_layer``, as ``asyncio.sleep`` puts it, so every time,
    every sum and the order of timers due at the same instant are the plain
    loop's; what goes is a task wake-up, a future and a sleep call per layer.
    Where the loop's next iteration would do nothing but fire that timer, the
    loop does that iteration's heap push and pop and clock move in place
    (``VirtualTimeLoop.chain``) and the next layer goes on in this call:
    a run of layers with nothing else due between them costs no loop iteration.
    ``run`` returns the number of layers slept so far, plus one once the overhead
    was slept too.

    (Merging such a run into one timer would be cheaper still, but it changes
    the heap's layout, and with it which of two timers due at the same instant,
    such as a sampler tick and an arrival, fires first: reports would move.)
    """

    __slots__ = ("ends", "ex", "fut", "handle", "i", "loop", "overhead", "pending",
                 "per_layer")

    def __init__(self, ex: SimExecutor, loop: VirtualTimeLoop, i: int, per_layer: float,
                 overhead: float, pending: list[TransferTask], ends: list[float]) -> None:
        self.ex, self.loop, self.i = ex, loop, i
        self.per_layer, self.overhead = per_layer, overhead
        self.pending, self.ends = pending, ends
        self.fut: asyncio.Future[int] = loop.create_future()
        self.handle = loop.call_at(loop.time() + per_layer, self._end)

    async def run(self) -> int:
        try:
            return await self.fut
        finally:
            self.handle.cancel()  # as asyncio.sleep does (nothing, once it fired)

    def _end(self) -> None:
        loop = self.loop
        env = loop.env
        ex = self.ex
        num_layers = ex.num_layers
        ends, pending, h = self.ends, self.pending, self.handle
        i = self.i
        while i < num_layers:  # (else: the overhead ended)
            now = env._now
            ends.append(now)
            i += 1
            if i < num_layers:
                for t in pending:
                    if t.layers_done <= i:
                        break  # the task waits for that layer's load
                else:
                    chained = loop.chain(h, now + self.per_layer)
                    if chained is not None:
                        ex.busy_s += self.per_layer
                        if chained:
                            continue
                        self.i = i
                        return
            elif self.overhead > 0:
                chained = loop.chain(h, now + self.overhead)
                if chained is not None:
                    ex.busy_s += self.overhead
                    i += 1
                    if chained:
                        break
                    self.i = i
                    return
            break
        self.i = i
        if not self.fut.cancelled():
            self.fut.set_result(i)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
