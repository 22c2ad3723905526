"""The engine's side of prefill/decode disaggregation: prefill-only mode, and requests
whose prefill ran on another engine.

A **prefill engine** (``Engine.handover`` set) runs a request up to its first
token, then takes it out of its batch and *holds* it: its blocks stay
referenced (the KV is still being sent from them) until the caller calls
``release``, and only then does the plan finish (backups per the write
policy, blocks unreferenced and cached for later requests).

A **decode engine** takes such a request with ``receive(req, origin)``
(``origin``: its state on the prefill engine). It is queued and admitted like
any request (first in, first out, as blocks allow; at once if the device has
room, which is when the caller may start moving the KV), except that its plan
takes from this engine's cache only what the device holds ready
(``CacheManager.plan(device_only=True)``: it loads nothing, so nothing of its
own can fail under it); its other blocks are ``COMPUTING`` (never matchable)
until its KV has arrived. ``missing_blocks`` says how many blocks must come
over. ``landed`` says they have: once the copies still reading what those
blocks held before are done, the blocks are committed (matchable from then
on) and the request decodes from the next step, its first token, admission
time and prefix hits those of ``origin`` — so TTFT is the prefill engine's
and TPOT, measured here, includes whatever it waited for its KV.

Why a hold and not an early finish on the prefill side: the blocks being sent
must not be evicted and overwritten while the network reads them, so they
count against the prefill engine's memory until the last layer has left.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.engine import Engine, EngineRequest, RequestState


class HandoverMixin:
    """Prefill-only mode and received requests (see the module docstring); part of
    ``Engine``, kept apart because a colocated engine never uses it."""

    # -- prefill side --------------------------------------------------------------------
    def _hand_over(self: Engine, st: RequestState) -> None:
        """``st`` has its first token: out of the batch, held until ``release``."""
        ends = getattr(self.executor, "layer_ends", None)
        st.layer_ends = ends() if ends is not None else None
        del self.running[st]
        self.holding.append(st)
        self.stats.handed_over += 1
        self.handover(st)  # type: ignore[misc]

    def release(self: Engine, st: RequestState) -> None:
        """A handed-over request's KV has left: finish its plan here (its blocks stay
        cached, backed up as the write policy says)."""
        self.holding.remove(st)
        self.runtime.submit_all(self.manager.finish(st.plan))  # type: ignore[arg-type]
        if self._keep_done:
            self.done.append(st)
        self._wake.set()

    # -- decode side ---------------------------------------------------------------------
    def receive(self: Engine, req: EngineRequest, origin: RequestState) -> RequestState:
        """Queue ``req``, prefilled on another engine (its state there: ``origin``), to be
        decoded here once ``landed``. Admitted at once where the device has room
        (``on_admit`` then fires before this returns)."""
        st = type(origin)(req, origin=origin, held=True)  # a RequestState (no import cycle)
        blocks = self._blocks_needed(req)
        if blocks > self._max_blocks:
            st.error = f"needs {blocks} device blocks, the device has {self._max_blocks}"
            self.stats.rejected += 1
            self._left(st)
            return st
        self.waiting.append(st)
        self._admit()
        self._wake.set()
        return st

    def _admit_received(self: Engine, st: RequestState) -> None:
        """``_admit``'s part for a received request, its plan made (``device_only``)."""
        plan = st.plan
        assert plan is not None
        st.admit_s = self.clock()
        st.prefilled = st.req.input_len  # once landed; held until then
        # Copy-outs of what its new blocks held before (evictions) must read first.
        st.tasks = self.runtime.submit_all(plan.ops)
        self._enter_running(st, plan)
        if self.on_admit is not None:
            self.on_admit(st)

    def missing_blocks(self: Engine, st: RequestState) -> int:
        """Prompt blocks of an admitted received request that this device did not hold:
        what must come from the prefill engine."""
        prompt = math.ceil(st.req.input_len / self.config.block_tokens)
        return max(0, prompt - st.plan.num_cached)  # type: ignore[union-attr]

    def landed(self: Engine, st: RequestState) -> None:
        """The KV of received request ``st`` has arrived (see the module docstring)."""
        pending = [t.wait() for t in st.tasks if not t.finished]
        if pending:
            self.loop.create_task(self._decode_when_settled(st, pending))
        else:
            self._start_decoding(st)

    async def _decode_when_settled(self: Engine, st: RequestState,
                                   pending: list[asyncio.Future[None]]) -> None:
        await asyncio.wait(pending)
        self._start_decoding(st)

    def _start_decoding(self: Engine, st: RequestState) -> None:
        origin = st.origin
        assert origin is not None and st.plan is not None
        self.manager.commit(st.plan)
        st.held = False
        st.waited = True
        st.decode_from_s = self.clock()
        st.first_token_s = origin.first_token_s
        st.admit_s, st.hits = origin.admit_s, origin.hits
        st.generated = 1
        self._joining.append(st)  # decodes from the next step (Engine._join_decoders)
        if self._fast_forwarding:  # join the batch at the next step boundary
            self.executor.cut_decode_steps(self.loop.time())  # type: ignore[attr-defined]
        self._wake.set()

    @property
    def waits_on_peer(self: Engine) -> bool:
        """Whether this engine waits for another: KV still to be sent from here, or a
        received request's still to arrive (an engine that takes no step then is not
        stalled)."""
        return bool(self.holding) or any(st.held and st.origin is not None
                                         for st in self.running)
