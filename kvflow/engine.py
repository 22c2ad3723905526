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
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import Protocol

from kvflow.errors import ConfigError, NotEnoughBlocks, TransferError
from kvflow.handover import HandoverMixin
from kvflow.manager import CacheManager, OpKind, Plan, Reservation
from kvflow.policy import PrefetchPolicy
from kvflow.radix import Tier
from kvflow.runtime import Runtime, TransferTask


@dataclass(frozen=True)
class EngineRequest:
    """What the engine needs of a request: its block keys and its lengths."""

    request_id: Hashable
    arrival_s: float
    keys: tuple[Hashable, ...]
    input_len: int
    output_len: int


@dataclass(frozen=True)
class EngineConfig:
    block_tokens: int
    max_batch_tokens: int = 8192
    max_running: int = 256

    def __post_init__(self) -> None:
        for name in ("block_tokens", "max_batch_tokens", "max_running"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"EngineConfig.{name} must be positive")


@dataclass
class StepBatch:
    """One step's work: prefill chunks and decode tokens.

    ``prefill`` items are ``(new_tokens, context_tokens_before)``; ``decode``
    items are the context lengths of the decoding requests. ``decode_count`` and
    ``decode_context_sum`` are their number and sum (from ``decode`` when not
    given); an executor with ``per_request = False`` gets only these, not the list.
    """

    prefill: list[tuple[int, int]] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    #: The request of each item: decodes first, then prefills, in the order of
    #: ``decode`` and ``prefill``. An executor that computes real data (the GPU
    #: one) reads block tables and tokens from these; the simulated one ignores them.
    requests: list[RequestState] = field(default_factory=list)
    decode_count: int = -1
    decode_context_sum: int = 0

    def __post_init__(self) -> None:
        if self.decode_count < 0:
            self.decode_count = len(self.decode)
            self.decode_context_sum = sum(self.decode)

    @property
    def tokens(self) -> int:
        return sum(n for n, _ in self.prefill) + self.decode_count


class ComputeExecutor(Protocol):
    """Runs one step's compute; the world-specific half of the engine."""

    async def run_step(self, batch: StepBatch, waits: Sequence[TransferTask]) -> None:
        """Compute ``batch``; layer i may start only once layer i of each wait landed.

        Raises ``TransferError`` if a wait failed; the engine then redoes the
        step for the affected requests.
        """
        ...


class MultiStepExecutor(ComputeExecutor, Protocol):
    """An executor that can run several pure-decode steps as one (the simulator)."""

    async def run_decode_steps(self, count: int, context_sum: int, max_steps: int,
                               until: float | None) -> int:
        """Run up to ``max_steps`` decode steps of ``count`` sequences whose contexts sum
        to ``context_sum`` in the first (and grow by one each a step).

        Stops after the step that ends at or past ``until`` (loop time), always
        running at least one; returns how many ran.
        """
        ...

    def cut_decode_steps(self, until: float) -> None:
        """End the run in progress after the step that ends at or past ``until``."""
        ...


@dataclass(eq=False)
class RequestState:
    req: EngineRequest
    plan: Plan | None = None
    tasks: list[TransferTask] = field(default_factory=list)     # everything a step waits on
    shared: list[TransferTask] = field(default_factory=list)    # other requests' loads
    prefetch: list[TransferTask] = field(default_factory=list)
    prefetched: frozenset = frozenset()  # keys brought up from storage at arrival
    reservation: Reservation | None = None
    ready: bool = False             # prefetch settled, may be scheduled
    held: bool = False              # held back from outside (kvflow.pd: its KV is on its way)
    waited: bool = False            # its loads have been waited for by a step
    prefilled: int = 0              # prompt tokens whose KV exists
    #: Output tokens so far; while decoding, brought up to date when the request
    #: finishes or a per-request batch lists it (the engine counts steps instead).
    generated: int = 0
    admit_s: float = 0.0
    first_token_s: float | None = None
    finish_s: float | None = None
    hits: tuple[int, int, int] = (0, 0, 0)
    error: str | None = None
    # Prefill/decode disaggregation (kvflow.handover): the request's state on the engine
    # that prefilled it; when each layer of its last prefill step ended (prefill side);
    # when its KV was in place to decode (decode side).
    origin: RequestState | None = None
    layer_ends: list[float] | None = None
    decode_from_s: float | None = None
    seq: int = field(default=0, repr=False)       # admission order (running order)
    computing0: int = field(default=0, repr=False)  # len(plan.computing) when planned
    dstep0: int = field(default=0, repr=False)    # decode step count at its first token


@dataclass
class EngineStats:
    admitted: int = 0
    finished: int = 0
    rejected: int = 0
    replans: int = 0
    aborted: int = 0
    handed_over: int = 0
    steps: int = 0
    recomputed_tokens: int = 0


class Engine(HandoverMixin):
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

    def _can_fast_forward(self) -> bool:
        """Several decode steps in one go give exactly what one by one would when
        nothing can change in between: every running request is decoding
        (none waits for a prefetch) and arrivals are known in advance."""
        return (self.next_arrival is not None
                and hasattr(self.executor, "run_decode_steps")
                # A received request waiting for its KV cuts the run short as it lands
                # (it is neither prefilling nor decoding until then).
                and not self._prefilling)

    async def _decode_steps(self, batch: StepBatch) -> None:
        """Run decode steps up to the next finish or arrival, whichever is first."""
        max_steps = self._finishing[0][0] - self._dstep
        until = self.next_arrival() if self.next_arrival is not None else None
        self._fast_forwarding = True
        try:
            ran = await self.executor.run_decode_steps(  # type: ignore[attr-defined]
                batch.decode_count, batch.decode_context_sum, max_steps, until)
        finally:
            self._fast_forwarding = False
        self.stats.steps += ran
        self._dstep += ran
        self._finish_decoders(self.clock())

    # -- admission -----------------------------------------------------------------------
    def _admit(self) -> None:
        manager = self.manager
        while self.waiting and len(self.running) < self.config.max_running:
            st = self.waiting[0]
            req = st.req
            extra = self._blocks_needed(req) - len(req.keys)
            # best_effort: what has not reached host by now is recomputed. With no host
            # tier nothing is ever prefetched, so storage hits are read at admission,
            # layer by layer under the compute, as wait_complete reads them.
            best_effort = (self.prefetch_policy.name == "best_effort"
                           and manager.has_tier(Tier.HOST))
            if best_effort:
                for t in st.prefetch:
                    if not t.finished:
                        t.cancel("prefetch: request scheduled")
            try:
                plan = manager.plan(req.request_id, req.keys, extra,
                                    use_storage=not best_effort,
                                    device_only=st.origin is not None)
            except NotEnoughBlocks:
                self.runtime.submit_all(self._take_detached())
                if self.running or self.holding:
                    return  # head of line waits for blocks to come free
                if self._drop_reservations():
                    continue  # they pinned blocks through closure: try again
                if self._retry_when_a_transfer_lands():
                    return  # copies in flight hold blocks that are evictable once landed
                # Nothing runs, nothing is in flight, nothing is held for anyone else:
                # it never fits.
                self.waiting.popleft()
                st.error = "does not fit on the device even with every other block evicted"
                self.stats.rejected += 1
                self._left(st)
                continue
            self.runtime.submit_all(self._take_detached())
            self.waiting.popleft()
            if st.reservation is not None:  # the plan holds what it needs now
                manager.release(st.reservation)
                st.reservation = None
            st.plan = plan
            if st.origin is not None:
                self._admit_received(st)
                continue
            st.computing0 = len(plan.computing)
            st.admit_s = self.clock()
            st.hits = self._served_from(st, plan.num_cached)
            st.prefilled = min(req.input_len, plan.num_cached * self.config.block_tokens)
            st.tasks = []
            for op in plan.ops:
                task = self.runtime.submit(op)
                if op.kind is OpKind.PREFETCH:
                    st.prefetch.append(task)
                else:
                    st.tasks.append(task)
            # Loads of other requests this one reads. A prefetch started at
            # arrival (owned by nobody) is not one of them: our swap-in reads
            # after it, and fails into a recompute if it does not land.
            st.shared = [t for t in map(self.runtime.task_of, plan.shared)
                         if t is not None and t.op.plan is not None]
            st.tasks += st.shared
            new_ids = plan.device_ids[plan.num_cached:] + plan.extra_ids
            st.tasks += self.runtime.pending_readers(Tier.DEVICE, new_ids)
            self.stats.admitted += 1
            self._seq += 1
            st.seq = self._seq
            self.running[st] = None
            self._prefilling[st] = None
            if self.prefetch_policy.name == "timeout" and any(
                    not t.finished for t in st.prefetch):
                self.loop.create_task(self._settle_prefetch(st))
            else:
                # wait_complete needs no holding back: the swap-ins read after
                # the prefetch, and each layer's compute after its swap-in.
                st.ready = True
            if self.on_admit is not None:
                self.on_admit(st)

    def _drop_reservations(self) -> bool:
        """Release what waiting requests hold for their prefetch; True if any was held.

        Reservations are hints: a queue of waiting requests holding host
        blocks can, through prefix closure, pin device blocks too (a device
        parent of a held host child cannot be dropped). When nothing runs and
        the head of the queue cannot fit, they go.
        """
        held = False
        for st in self.waiting:
            if st.reservation is not None:
                held = held or bool(st.reservation.nodes)
                self.manager.release(st.reservation)
                st.reservation = None
        return held

    def _retry_when_a_transfer_lands(self) -> bool:
        """Plan the head of the queue again once some transfer in flight has ended;
        False if none is in flight.

        A block whose copy is still being filled (a write_back copy-out to host,
        a backup, a prefetch) cannot be evicted until it lands, and through prefix
        closure it can pin more: a device parent whose only child lives on host
        stays until that child's host copy is ready to be dropped or there is
        host room to copy the parent down too. So with nothing running, a head
        that does not fit *now* may fit once those copies land — including the
        copy-outs its own failed plan just started. Each retry either fits or
        moves more blocks down, so waiting ends; refusing it at once would turn
        a transient shortage into a spurious "does not fit" error.
        """
        waiter = self._room_waiter
        if waiter is not None and not waiter.done():
            return True
        pending = [t.wait() for t in self.runtime.tasks.values() if not t.finished]
        if not pending:
            return False
        self._room_waiter = self.loop.create_task(self._wake_on_first(pending))
        return True

    async def _wake_on_first(self, pending: list[asyncio.Future[None]]) -> None:
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        self._wake.set()

    def _take_detached(self) -> list:
        ops = self.manager.detached_ops[:]
        self.manager.detached_ops.clear()
        return ops

    async def _settle_prefetch(self, st: RequestState) -> None:
        """Timeout policy: hold the request back until its prefetch lands or the
        deadline passes; what has not landed by then is recomputed."""
        pending = [t.wait() for t in st.prefetch if not t.finished]
        if pending:  # all may have landed between admission and this task's first step
            await asyncio.wait(pending, timeout=self.prefetch_policy.deadline_s(st.req.input_len))
        for t in st.prefetch:
            if not t.finished:
                t.cancel("prefetch deadline")
        st.ready = True
        self._wake.set()

    # -- scheduling -----------------------------------------------------------------------
    def _schedule(self) -> tuple[StepBatch, list[tuple[RequestState, int]], list[TransferTask]]:
        """Decodes first (one token each), then prefill chunks within the budget.

        Every decoding request is in every step: a prefill chunk is at least one
        token, so a step adds at most as many decoders as the budget has left
        after the decodes, and there are never more decoders than tokens.
        Returns the batch, the prefill members and the loads to wait for.
        """
        batch = StepBatch()
        members: list[tuple[RequestState, int]] = []
        waits: list[TransferTask] = []
        budget = self.config.max_batch_tokens
        self._join_decoders()
        n_dec = len(self._decoding)
        assert n_dec <= budget, (n_dec, budget)
        batch.decode_count = n_dec
        batch.decode_context_sum = self._dec_base + n_dec * self._dstep
        budget -= n_dec
        for st in [st for st in self._prefilling if st.ready and not st.held]:
            if budget <= 0:
                break
            if not st.waited:
                if self._replan_if_lost(st):
                    continue
                self._rewind_to_failed(st)
                waits.extend(t for t in st.tasks if not t.finished)
            todo = max(st.req.input_len - st.prefilled, 1 if st.prefilled == st.req.input_len
                       else 0)
            n = min(todo, budget)
            if n == todo and self.on_last_chunk is not None:
                self.on_last_chunk(st)
            context = min(st.prefilled, st.req.input_len - n)
            batch.prefill.append((n, context))
            members.append((st, n))
            budget -= n
        if self._per_request:
            decoders = [st for st in self.running if st in self._decoding]
            for st in decoders:
                st.generated = self._generated(st)
            batch.decode = [st.req.input_len + st.generated for st in decoders]
            batch.requests = decoders + [st for st, _ in members]
        return batch, members, waits

    def _replan_if_lost(self, st: RequestState) -> bool:
        """A load this request shared (someone else's) failed: plan it again.

        The blocks it expected are now another request's to recompute; waiting
        for that would convoy, so it goes back to the head of the queue.
        """
        plan = st.plan
        assert plan is not None
        if not any(t.finished and not t.ok for t in st.shared):
            return False
        self.stats.replans += 1
        self.runtime.submit_all(self.manager.finish(plan))
        del self.running[st], self._prefilling[st]
        st.plan, st.tasks, st.shared, st.prefetch, st.ready = None, [], [], [], False
        self.waiting.appendleft(st)
        return True

    def _rewind_to_failed(self, st: RequestState) -> None:
        """Move the prefill start back to the first block whose load failed."""
        plan = st.plan
        assert plan is not None
        if len(plan.computing) == st.computing0:
            # No load of its failed since it was planned: its computing blocks are the
            # ones it was given, from the end of its cached prefix (as admission set it).
            return
        position = {id(n): i for i, n in enumerate(plan.nodes)}
        redo = [position[id(n)] for n in plan.computing if id(n) in position]
        # A failed load was ordered after copies still reading its device block
        # (a copy-out of what the block held before); one that failed before it
        # ran no longer holds them back, so the recompute waits for them itself.
        # The plan's own readers (a PD send of what it computes) read the new KV.
        for t in self.runtime.pending_readers(Tier.DEVICE, [plan.device_ids[i] for i in redo]):
            if t not in st.tasks and t.op.plan is not plan:
                st.tasks.append(t)
        first = min(redo, default=None)
        if first is None:
            return
        start = min(st.prefilled, first * self.config.block_tokens)
        if start < st.prefilled:
            self.stats.recomputed_tokens += st.prefilled - start
            st.prefilled = start
        st.hits = self._served_from(st, first)  # what was served, not what was planned

    @staticmethod
    def _served_from(st: RequestState, blocks: int) -> tuple[int, int, int]:
        """Blocks per tier among the first ``blocks`` cached ones; blocks the
        arrival prefetch brought up to host count as storage hits."""
        counts = [0, 0, 0]
        tiers = st.plan.source_tiers  # type: ignore[union-attr]
        keys = st.req.keys
        for i in range(min(blocks, len(tiers))):
            t = tiers[i]
            if t == Tier.HOST and keys[i] in st.prefetched:
                t = Tier.STORAGE
            counts[t] += 1
        return counts[0], counts[1], counts[2]

    def _after_failed_loads(self, members: list[tuple[RequestState, int]]) -> None:
        """A step's wait failed: nothing of it counts; affected requests rewind."""
        for st, _ in members:
            if st.first_token_s is None and not st.waited:
                if self._replan_if_lost(st):
                    continue
                self._rewind_to_failed(st)

    # -- progress ------------------------------------------------------------------------
    def _advance(self, members: list[tuple[RequestState, int]]) -> None:
        now = self.clock()
        manager = self.manager
        self._dstep += 1  # every decoding request was in the step
        self._finish_decoders(now)
        for st, n in members:
            st.waited = True
            st.prefilled = min(st.req.input_len, st.prefilled + n)
            if st.prefilled < st.req.input_len:
                continue
            manager.commit(st.plan)  # type: ignore[arg-type]
            st.first_token_s = now
            st.generated = 1
            del self._prefilling[st]
            if self.on_first_token is not None:
                self.on_first_token(st)
            if st.req.output_len <= 1:
                self._finish(st, now)
                continue
            if self.handover is not None:
                self._hand_over(st)
                continue
            self._start_decode(st)

    def _start_decode(self, st: RequestState) -> None:
        """``st`` (its first token out, ``generated`` = 1) decodes from the next step."""
        st.dstep0 = self._dstep
        self._decoding[st] = None
        self._dec_base += st.req.input_len + 1 - st.dstep0
        heappush(self._finishing, (st.dstep0 + st.req.output_len - 1, st.seq, st))

    def _join_decoders(self) -> None:
        """Received requests whose KV landed join the decoding set here, between steps
        (one landing during a step or a run of decode steps must not count it)."""
        joining = self._joining
        while joining:
            st = joining.pop(0)
            if st in self.running:
                self._start_decode(st)

    def _generated(self, st: RequestState) -> int:
        """A decoding request's output tokens so far."""
        return 1 + self._dstep - st.dstep0

    def _finish_decoders(self, now: float) -> None:
        """Finish the decoding requests that have all their tokens, in running order."""
        finishing = self._finishing
        while finishing and finishing[0][0] <= self._dstep:
            st = heappop(finishing)[2]
            del self._decoding[st]
            st.generated = self._generated(st)
            self._dec_base -= st.req.input_len + 1 - st.dstep0
            self._finish(st, now)

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
