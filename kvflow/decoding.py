"""Progress after a step: prefills that complete start decoding, decoders that have
all their tokens finish; and a run of pure decode steps taken in one go.

Part of ``Engine`` (``kvflow.engine``). Decoding requests all gain a token per
step, so their counts are one shared step counter plus a base each and the
ones that finish come off a heap: a step costs O(what changes).
"""

from __future__ import annotations

from heapq import heappop, heappush

from kvflow.executor import StepBatch
from kvflow.request_state import RequestState


class DecodingMixin:
    """Decode bookkeeping and fast-forward, of ``Engine``."""

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
