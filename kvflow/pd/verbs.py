"""The PD verbs: ``send`` a request's prompt KV from a prefill instance, ``receive`` it
on a decode instance, each a ``TransferTask`` with per-layer futures.

``PrefillSide.send(st, dest)`` starts once the prefill engine has admitted the
request (``Engine.on_admit``): its layer futures resolve as each layer has left,
and each layer leaves as soon as prefill wrote it (the executor's
``layer_written``), so sending overlaps the rest of prefill.

``DecodeSide.receive(st, src)`` starts once the decode engine has admitted the
request: the device blocks are the plan's (allocated through the manager, the
locally cached prefix matched and loaded as for any request); it pulls the
positions past that prefix and holds the request back (``held``) until the
transfer has settled. The received blocks stay ``COMPUTING`` (not matchable)
until the request's first step commits them, so no one reads partial KV.
If the transfer fails or is cancelled (deadline, peer gone, damaged frame,
layout refused), the request recomputes its prefill from the first received
position (``on_failure="recompute"``) or ends with the reason
(``on_failure="fail"``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvflow.engine import Engine, RequestState
from kvflow.errors import ConfigError
from kvflow.manager import OpKind, Plan
from kvflow.pd.backend import PDBackend, ReceiveJob, SendJob
from kvflow.pd.ports import ReceivePort, SendPort, prompt_digest
from kvflow.pd.wire import wire_id
from kvflow.runtime import TransferTask

ON_FAILURE = ("recompute", "fail")


def prompt_blocks(plan: Plan, input_len: int, block_tokens: int) -> list[int]:
    """Device blocks holding the prompt's KV, by position: the keyed blocks, then a
    partial last block (the plan's first extra block) where the prompt has one."""
    n = math.ceil(input_len / block_tokens)
    ids = plan.device_ids + plan.extra_ids
    if n > len(ids):
        raise ConfigError(f"request {plan.request_id!r}: {n} prompt blocks, the plan holds "
                          f"{len(ids)}")
    return ids[:n]


@dataclass
class TransferRecord:
    """One request's transfer, for the report (loop times of its instance)."""

    request: str
    started_s: float
    blocks: int
    bytes: int
    settled_s: float | None = None
    ok: bool | None = None
    error: str | None = None


#: How many transfers' records a side keeps (the newest): a long-running PD pair must
#: not grow with every request it ever served; the counts below cover them all.
RECORDS_KEPT = 4096


def _records() -> deque[TransferRecord]:
    return deque(maxlen=RECORDS_KEPT)


@dataclass
class SideStats:
    started: int = 0
    ok: int = 0
    failed: int = 0
    skipped: int = 0       # nothing to move (the decode side held the whole prompt)
    recomputed: int = 0    # decode: requests that recomputed after a failed receive
    aborted: int = 0       # decode: requests ended by on_failure="fail"
    records: deque[TransferRecord] = field(default_factory=_records)

    def as_dict(self) -> dict[str, Any]:
        """The counts (not the records)."""
        return {k: v for k, v in self.__dict__.items() if k != "records"}


class PrefillSide:
    """A prefill engine's half of PD: every admitted request is sent to ``port``'s peer.

    ``attach`` wires it into the engine (``on_admit``) and the executor
    (``layer_written``). ``deadline_s``: a send not finished by then (its peer
    never pulled, or is too slow) is cancelled, and the peer told.
    """

    def __init__(self, engine: Engine, backend: PDBackend, port: SendPort,
                 deadline_s: float | None = 30.0) -> None:
        self.engine = engine
        self.backend = backend
        self.port = port
        self.deadline_s = deadline_s
        self.stats = SideStats()
        self.jobs: dict[str, tuple[SendJob, TransferTask]] = {}

    def attach(self) -> PrefillSide:
        ex = self.engine.executor
        if not hasattr(ex, "layer_written"):
            raise ConfigError(f"{type(ex).__name__} cannot report layers as it writes them "
                              "(a prefill instance needs an executor with layer_written)")
        ex.layer_written = self.layer_written  # type: ignore[attr-defined]
        self.engine.on_admit = self.send  # type: ignore[assignment]
        return self

    def send(self, st: RequestState, dest: SendPort | None = None) -> TransferTask | None:
        """Start sending ``st``'s prompt KV to whoever pulls it at ``dest``.

        A request admitted a second time (replanned after a shared load failed) is
        not sent again: its first send stops and the peer recomputes.
        """
        port = dest or self.port
        rid = wire_id(st.req.request_id)
        old = self.jobs.get(rid)
        if old is not None:
            if not old[1].finished:
                old[1].cancel("the prefill instance replanned the request")
            return None
        plan = st.plan
        assert plan is not None
        eng = self.engine
        ids = prompt_blocks(plan, st.req.input_len, eng.config.block_tokens)
        ready = min(len(ids), st.prefilled // eng.config.block_tokens)
        job = SendJob(rid, port, plan.keys, len(ids), [ready] * self.backend.num_layers)
        op = eng.manager.remote_op(OpKind.SEND, plan, ids, range(len(ids)))
        self.backend.expect(op, job)
        task = eng.runtime.submit(op, self._deadline())
        self.jobs[rid] = (job, task)
        rec = TransferRecord(rid, eng.loop.time(), len(ids), 0)
        self.stats.started += 1
        self.stats.records.append(rec)
        task.wait().add_done_callback(lambda f, t=task, r=rec: self._settled(t, r, job))
        return task

    def _settled(self, task: TransferTask, rec: TransferRecord, job: SendJob) -> None:
        rec.settled_s = self.engine.loop.time()
        rec.ok = task.ok
        pull = job.pull
        rec.blocks = 0 if pull is None else len(pull.ids)
        rec.bytes = rec.blocks * self.port.memory.layer_bytes * self.backend.num_layers
        if task.ok:
            self.stats.ok += 1
        else:
            self.stats.failed += 1
            rec.error = str(task.error)

    def layer_written(self, batch: Any, layer: int) -> None:
        """The executor wrote ``layer`` of this step: prefill chunks extend what may go."""
        bt = self.engine.config.block_tokens
        nd = len(batch.decode)
        for st, (n, ctx) in zip(batch.requests[nd:], batch.prefill, strict=True):
            entry = self.jobs.get(wire_id(st.req.request_id))
            if entry is None or entry[1].finished:
                continue
            end = ctx + n
            upto = math.ceil(end / bt) if end >= st.req.input_len else end // bt
            entry[0].wrote(layer, upto)

    def abandon(self, request_id: object, reason: str) -> None:
        """This instance will not prefill ``request_id`` (rejected): tell the peer now."""
        self.port.give_up(wire_id(request_id), reason)

    def _deadline(self) -> float | None:
        return None if self.deadline_s is None else self.engine.loop.time() + self.deadline_s


class DecodeSide:
    """A decode engine's half of PD: every admitted request's prompt KV is received
    from ``port``'s peer before it decodes (see the module docstring)."""

    def __init__(self, engine: Engine, backend: PDBackend, port: ReceivePort,
                 deadline_s: float | None = 30.0, on_failure: str = "recompute") -> None:
        if on_failure not in ON_FAILURE:
            raise ConfigError(f"on_failure must be one of {', '.join(ON_FAILURE)}, "
                              f"got {on_failure!r}")
        self.engine = engine
        self.backend = backend
        self.port = port
        self.deadline_s = deadline_s
        self.on_failure = on_failure
        self.stats = SideStats()
        #: Called with (request state, record) as each transfer settles.
        self.on_settled: Callable[[RequestState, TransferRecord], None] | None = None

    def attach(self) -> DecodeSide:
        self.engine.on_admit = self.receive  # type: ignore[assignment]
        return self

    def receive(self, st: RequestState, src: ReceivePort | None = None) -> TransferTask | None:
        """Pull ``st``'s prompt KV past its locally cached prefix into its plan's blocks;
        None if there is nothing to pull (the request then runs as a full local hit)."""
        port = src or self.port
        plan = st.plan
        assert plan is not None
        eng = self.engine
        bt = eng.config.block_tokens
        ids = prompt_blocks(plan, st.req.input_len, bt)
        first = min(plan.num_cached, len(ids))
        rid = wire_id(st.req.request_id)
        rec = TransferRecord(rid, eng.loop.time(), len(ids) - first,
                             (len(ids) - first) * port.memory.layer_bytes
                             * self.backend.num_layers)
        self.stats.records.append(rec)
        digest = prompt_digest(plan.keys, first, len(ids))
        if first == len(ids):
            self.stats.skipped += 1
            rec.settled_s, rec.ok = rec.started_s, True
            port.decline(rid, first, digest)
            return None
        job = ReceiveJob(rid, port, first, digest)
        op = eng.manager.remote_op(OpKind.RECEIVE, plan, ids[first:], range(first, len(ids)))
        self.backend.expect(op, job)
        task = eng.runtime.submit(op, self._deadline())
        self.stats.started += 1
        before = st.prefilled
        st.prefilled = st.req.input_len  # its KV is on its way: no prefill once it lands
        st.held = True
        task.wait().add_done_callback(
            lambda f, t=task: self._settled(st, t, rec, first, min(before, first * bt)))
        return task

    def _settled(self, st: RequestState, task: TransferTask, rec: TransferRecord,
                 first: int, rewind_to: int) -> None:
        eng = self.engine
        rec.settled_s = eng.loop.time()
        rec.ok = task.ok
        st.held = False
        if task.ok:
            self.stats.ok += 1
            # Landed whole: matchable from now on (another request may read them).
            eng.manager.commit_received(st.plan, first)  # type: ignore[arg-type]
        else:
            self.stats.failed += 1
            rec.error = str(task.error)
            if self.on_failure == "fail":
                self.stats.aborted += 1
                eng.abort(st, f"KV transfer from the prefill instance failed: {rec.error}")
            else:
                self.stats.recomputed += 1
                eng.stats.recomputed_tokens += st.prefilled - rewind_to
                st.prefilled = rewind_to
        if self.on_settled is not None:
            self.on_settled(st, rec)
        eng.wake()

    def _deadline(self) -> float | None:
        return None if self.deadline_s is None else self.engine.loop.time() + self.deadline_s

