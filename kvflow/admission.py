"""Admission: from the queue to a plan, and what a head that does not fit waits for.

Part of ``Engine`` (``kvflow.engine``). Device blocks for the whole request are
reserved here, so a running request is never preempted; a request that cannot
fit now waits for blocks to come free, for reservations to go, or for copies in
flight to land, and is refused only when none of those can help.
"""

from __future__ import annotations

import asyncio

from kvflow.errors import NotEnoughBlocks
from kvflow.plans import OpKind, Plan
from kvflow.radix import Tier
from kvflow.request_state import RequestState


class AdmissionMixin:
    """``_admit`` and what it waits on, of ``Engine``."""

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
            self._enter_running(st, plan)
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

    def _enter_running(self, st: RequestState, plan: Plan) -> None:
        """An admitted request joins the running set (in admission order), its new
        device blocks read only after the copies still reading them (evictions)."""
        new_ids = plan.device_ids[plan.num_cached:] + plan.extra_ids
        st.tasks += self.runtime.pending_readers(Tier.DEVICE, new_ids)
        self.stats.admitted += 1
        self._seq += 1
        st.seq = self._seq
        self.running[st] = None

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
