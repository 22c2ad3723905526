"""A reference serving loop with continuous batching, written once for both worlds.

Requests arrive, are matched and planned (device blocks for the whole request
are reserved at admission, so a running request is never preempted), wait for
their storage prefetch as the prefetch policy says, are prefilled in chunks
under a per-step token budget, then decoded one token per step. Each step's
compute is handed to a ``ComputeExecutor`` together with the transfers it
depends on: the simulated executor sleeps for the cost model's time, layer by
layer, after each layer's loads; the GPU executor enqueues real kernels behind
device-side waits. The engine itself never blocks on a layer.

A load that fails or is cut short never yields wrong data: the manager hands
the blocks to the request to recompute, and the engine moves the request's
prefill start back to the first such block.

A step costs O(what changes), not O(running requests): requests are kept by
state (waiting, prefilling, decoding); decoding requests all gain a token per
step, so their token counts are one shared step counter plus a base each, the
batch's decode size and context sum are running sums, and the ones that finish
come off a heap ordered by the step they finish in. A run of pure decode steps
(``MultiStepExecutor``) is one sleep up to the next finish or arrival. An
executor that computes real data (``per_request`` true, the default) still gets
each request's context and state in the batch.

``Engine`` is one class over several modules: this one (the outside and the
loop), ``kvflow.admission``, ``kvflow.scheduling``, ``kvflow.decoding`` and
``kvflow.handover``; the request's types live in ``kvflow.request_state``, a
step's batch and the executor protocols in ``kvflow.executor``, and are
re-exported here.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable

from kvflow.admission import AdmissionMixin
from kvflow.decoding import DecodingMixin
from kvflow.errors import TransferError
from kvflow.executor import (  # noqa: F401 (re-exported)
    ComputeExecutor,
    MultiStepExecutor,
    StepBatch,
)
from kvflow.handover import HandoverMixin
from kvflow.manager import CacheManager, OpKind
from kvflow.policy import PrefetchPolicy
from kvflow.request_state import (
    EngineConfig,
    EngineRequest,
    EngineStats,
    RequestState,
)
from kvflow.runtime import Runtime
from kvflow.scheduling import SchedulingMixin


class Engine(HandoverMixin, AdmissionMixin, SchedulingMixin, DecodingMixin):
    """Continuous batching over a ``CacheManager`` and a ``Runtime``.

    Prefill/decode disaggregation adds a prefill-only mode and requests
    prefilled elsewhere (``kvflow.handover``).
    """

    def __init__(self, manager: CacheManager, runtime: Runtime, executor: ComputeExecutor,
                 config: EngineConfig, keep_done: bool = True) -> None:
        """``keep_done``: keep every request that left in ``done`` (a replay folds them
        into its report through ``on_finish`` instead, and keeps nothing)."""
        self.manager = manager
        self.runtime = runtime
        self.executor = executor
        self.config = config
        self.prefetch_policy: PrefetchPolicy = manager.prefetch_policy
        self.loop = runtime.loop
        #: Where request timestamps (admit, first token, finish) come from: the loop's
        #: clock by default; a real-time replay may give a finer one on the same scale
        #: (uvloop's counts whole milliseconds).
        self.clock: Callable[[], float] = self.loop.time
        self.waiting: deque[RequestState] = deque()
        #: Admitted requests in admission order (a dict used as an ordered set).
        self.running: dict[RequestState, None] = {}
        self.done: list[RequestState] = []
        self._keep_done = keep_done
        self.stats = EngineStats()
        # Running requests by state: prefilling (in running order) and decoding. Every
        # decoding request gains one token per step (when the batch holds them all), so
        # its count is 1 + _dstep - st.dstep0; _dec_base keeps the context sum's part
        # that does not move: sum(input_len + 1 - dstep0).
        self._prefilling: dict[RequestState, None] = {}
        self._decoding: dict[RequestState, None] = {}
        self._dstep = 0
        self._dec_base = 0
        self._finishing: list[tuple[int, int, RequestState]] = []  # (step it ends, seq, st)
        self._seq = 0
        self._per_request = getattr(executor, "per_request", True) is not False
        self._wake = asyncio.Event()
        self._closed = False
        # Wakes the loop when a transfer lands while the head of the queue waits for one.
        self._room_waiter: asyncio.Task[None] | None = None
        #: Called once per request as it leaves: finished, or rejected (``st.error`` set).
        self.on_finish: Callable[[RequestState], None] | None = None
        #: Called as a request's prefill completes (its first token); a router's exact view.
        self.on_first_token: Callable[[RequestState], None] | None = None
        #: Called once a request is admitted and its plan's loads are submitted, before
        #: any step: prefill/decode disaggregation (``kvflow.pd``) starts a request's
        #: send there, or its receive (holding it back with ``held`` until the KV landed).
        self.on_admit: Callable[[RequestState], None] | None = None
        #: Prefill-only mode (``kvflow.handover``): called with each request that has its
        #: first token and more to generate; it leaves the batch, blocks held, until
        #: ``release``. ``holding``: those not yet released.
        self.handover: Callable[[RequestState], None] | None = None
        #: Called as the step that is to complete a request's prefill is scheduled (a
        #: decode instance allocates its blocks then, to take its layers as they come).
        self.on_last_chunk: Callable[[RequestState], None] | None = None
        self.holding: list[RequestState] = []
        self._fast_forwarding = False
        self._in_step = False
        self._joining: list[RequestState] = []  # received requests to decode from next step
        # Loop time of the next arrival, if the caller knows it (a trace replay
        # does): lets a multi-step executor run decode steps in one go, exactly.
        self.next_arrival: Callable[[], float | None] | None = None
        self._max_blocks = manager.capacities.device

    # -- the outside -----------------------------------------------------------------
    def add(self, req: EngineRequest) -> RequestState:
        """Queue a request (at its arrival)."""
        st = RequestState(req)
        blocks = self._blocks_needed(req)
        if blocks > self._max_blocks:
            st.error = f"needs {blocks} device blocks, the device has {self._max_blocks}"
            self.stats.rejected += 1
            self._left(st)
            return st
        self.waiting.append(st)
        # Storage reads start now, not at admission: they overlap the queueing.
        st.reservation = self.manager.prefetch(req.keys)
        for task in self.runtime.submit_all(st.reservation.ops):
            if task.kind is OpKind.PREFETCH:
                st.prefetch.append(task)
        if st.prefetch:
            st.prefetched = frozenset(k for t in st.prefetch for k in t.op.keys)
        self._wake.set()
        return st

    def close(self) -> None:
        """No more requests will come: ``run`` returns once everything is done."""
        self._closed = True
        self._wake.set()

    def wake(self) -> None:
        """Schedule again now (a request ``held`` back from outside was let go)."""
        self._wake.set()

    def abort(self, st: RequestState, reason: str) -> None:
        """End a running request that has not produced a token, with ``reason``: its
        plan is finished uncommitted (its own blocks go back, nothing half-written
        stays indexed). For a request whose KV was to come from elsewhere and did not."""
        if st not in self.running or st.first_token_s is not None:
            raise ValueError(f"request {st.req.request_id!r} is not running before its first token")
        del self.running[st]
        self._prefilling.pop(st, None)
        if st.plan is not None:
            self.runtime.submit_all(self.manager.finish(st.plan))
        st.error = reason
        self.stats.aborted += 1
        self._left(st)
        self._wake.set()

    @property
    def computing(self) -> bool:
        """Inside the executor: a step, or decode steps taken in one go, which the step
        counter shows only as they start or end (a sampler must not read a long one as
        a stall)."""
        return self._in_step or self._fast_forwarding

    @property
    def queue_len(self) -> int:
        return len(self.waiting)

    def _blocks_needed(self, req: EngineRequest) -> int:
        total = math.ceil((req.input_len + req.output_len) / self.config.block_tokens)
        return max(total, len(req.keys))

    # -- the loop ----------------------------------------------------------------------
    async def run(self) -> None:
        """Step until closed and every request has finished."""
        while True:
            self._admit()
            batch, members, waits = self._schedule()
            if not members and not batch.decode_count:
                if self._closed and not self.waiting and not self.running and not self.holding:
                    break
                self._wake.clear()
                await self._wake.wait()
                continue
            if not batch.prefill and not waits and self._can_fast_forward():
                await self._decode_steps(batch)
                continue
            self.stats.steps += 1
            self._in_step = True
            try:
                await self.executor.run_step(batch, waits)
            except TransferError:
                self._after_failed_loads(members)
                continue
            finally:
                self._in_step = False
            self._advance(members)
        await self.runtime.drain()

    def _finish(self, st: RequestState, now: float) -> None:
        st.finish_s = now
        self.runtime.submit_all(self.manager.finish(st.plan))  # type: ignore[arg-type]
        del self.running[st]
        self.stats.finished += 1
        self._left(st)

    def _left(self, st: RequestState) -> None:
        """A request is done (finished, or rejected with ``st.error``)."""
        if self._keep_done:
            self.done.append(st)
        if self.on_finish is not None:
            self.on_finish(st)
