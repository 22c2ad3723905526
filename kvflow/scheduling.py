"""Scheduling: one step's batch (decodes first, then prefill chunks within the token
budget), and what a request does when a load it waited on failed.

Part of ``Engine`` (``kvflow.engine``). A load that fails never yields wrong
data: the request rewinds its prefill to the first such block, or is planned
again when the load was another request's.
"""

from __future__ import annotations

from kvflow.executor import StepBatch
from kvflow.radix import Tier
from kvflow.request_state import RequestState
from kvflow.runtime import TransferTask


class SchedulingMixin:
    """``_schedule`` and the rewinds after failed loads, of ``Engine``."""

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
