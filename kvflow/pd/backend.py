"""``PDBackend``: the ``TransferBackend`` that runs SEND and RECEIVE ops over ports.

The runtime sees a peer transfer as one more op (``OpKind.SEND`` reads this
device's blocks, ``OpKind.RECEIVE`` writes them), routed here by
``RoutedBackend`` under ``(DEVICE, DEVICE)``. So a send is ordered after the
loads that fill its blocks and a receive after the copy-outs still reading the
blocks it overwrites, by the same rules as every copy, and compute that reuses
a block a send still reads waits for it (``Runtime.pending_readers``).

A SEND waits for its peer's pull, then sends each layer of the positions asked
for as soon as prefill has written them (``SendJob.wrote``), reporting layer
``l`` once all of it has left. A RECEIVE pulls and reports layer ``l`` once all
of it has landed. Before ``submit`` the verbs register what the op needs
(``expect``); an op submitted without it fails, naming it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvflow.backend import pending_after
from kvflow.errors import TransferError
from kvflow.manager import OpKind, TransferOp
from kvflow.pd.ports import Pull, ReceivePort, SendPort, prompt_digest
from kvflow.pd.wire import ProtocolError


@dataclass(eq=False)
class SendJob:
    """A SEND's request, port and prefill progress: positions ``[0, written[l])`` of
    layer ``l`` hold their KV (the cached prefix at first, then what prefill wrote)."""

    request: str
    port: SendPort
    keys: Sequence[Hashable]
    num_positions: int
    written: list[int]
    pull: Pull | None = None
    _changed: asyncio.Event | None = field(default=None, repr=False)

    def wrote(self, layer: int, upto: int) -> None:
        if upto > self.written[layer]:
            self.written[layer] = min(upto, self.num_positions)
            if self._changed is not None:
                self._changed.set()

    async def changed(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()
        self._changed.clear()


@dataclass(eq=False)
class ReceiveJob:
    """A RECEIVE's request and port; ``first`` is the first position it pulls."""

    request: str
    port: ReceivePort
    first: int
    digest: int


@dataclass(eq=False)
class PDHandle:
    op: TransferOp
    sink: Any
    job: SendJob | ReceiveJob
    deps: list[PDHandle]
    task: asyncio.Task[None] | None = None
    finished: bool = False
    reason: str | None = None
    error: BaseException | None = None
    ended: asyncio.Future[None] | None = None
    #: Loop times: submitted, the pull (sent or received), the last layer's end.
    started_at: float = 0.0
    pulled_at: float | None = None
    ended_at: float | None = None


class PDBackend:
    """Runs SEND / RECEIVE ops; see the module docstring."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._jobs: dict[int, SendJob | ReceiveJob] = {}
        self.inflight: set[PDHandle] = set()

    def expect(self, op: TransferOp, job: SendJob | ReceiveJob) -> None:
        """Register what ``op`` needs; call before the runtime submits it."""
        want = SendJob if op.kind is OpKind.SEND else ReceiveJob
        if op.kind not in (OpKind.SEND, OpKind.RECEIVE) or not isinstance(job, want):
            raise TypeError(f"op {op.op_id} ({op.kind.value}) cannot run a {type(job).__name__}")
        self._jobs[op.op_id] = job

    # ------------------------------------------------------------------ protocol
    def submit(self, op: TransferOp, sink: Any, after: Sequence[object] = ()) -> PDHandle:
        loop = asyncio.get_running_loop()
        deps = pending_after(op, after, PDHandle, "PDBackend")
        job = self._jobs.pop(op.op_id, None)
        h = PDHandle(op, sink, job, deps)  # type: ignore[arg-type]
        h.started_at = loop.time()
        h.ended = loop.create_future()
        self.inflight.add(h)
        if job is None:
            err = TransferError(f"op {op.op_id} ({op.kind.value}) reached PDBackend without "
                                "a job (PDBackend.expect before Runtime.submit)")
            loop.call_soon(self._finish, h, err)
            return h
        run = self._send if op.kind is OpKind.SEND else self._receive
        h.task = loop.create_task(run(h), name=f"pd-{op.kind.value}-{job.request}")
        h.task.add_done_callback(lambda t, h=h: self._task_ended(h, t))
        return h

    def cancel(self, handle: object) -> None:
        if not isinstance(handle, PDHandle):
            raise TypeError(f"cancel: {handle!r} is not a PDBackend handle")
        self._stop(handle, "cancelled")

    def _stop(self, h: PDHandle, reason: str, error: BaseException | None = None) -> None:
        if h.finished or h.reason is not None:
            return
        h.reason = reason
        h.error = error
        if h.task is not None:
            h.task.cancel()

    def _task_ended(self, h: PDHandle, task: asyncio.Task[None]) -> None:
        if h.finished:
            return
        exc = None if task.cancelled() else task.exception()
        err = TransferError(f"{h.op.kind.value} op {h.op.op_id} stopped: {exc!r}")
        err.__cause__ = exc
        self._finish(h, h.error or err)

    def _finish(self, h: PDHandle, error: BaseException | None) -> None:
        if h.finished:
            return
        h.finished = True
        h.ended_at = asyncio.get_running_loop().time()
        self.inflight.discard(h)
        try:
            h.sink.done(error)
        finally:
            if h.ended is not None and not h.ended.done():
                h.ended.set_result(None)

    async def _deps(self, h: PDHandle) -> None:
        for d in h.deps:
            if not d.finished and d.ended is not None:
                await asyncio.shield(d.ended)

    # ------------------------------------------------------------------ send
    async def _send(self, h: PDHandle) -> None:
        job: SendJob = h.job  # type: ignore[assignment]
        port = job.port
        pull: Pull | None = None
        error: BaseException | None = None
        try:
            await self._deps(h)
            pull = job.pull = await port.pull(job.request)
            h.pulled_at = asyncio.get_running_loop().time()
            if not 0 <= pull.first <= pull.end <= job.num_positions:
                raise ProtocolError(f"request {job.request}: the peer pulled positions "
                                    f"[{pull.first}, {pull.end}) of {job.num_positions}")
            if pull.digest != prompt_digest(job.keys, pull.first, pull.end):
                raise ProtocolError(f"request {job.request}: the peer's prompt is not ours "
                                    "(block keys differ)")
            port.watch(pull, lambda err: self._stop(h, str(err), err))
            await self._stream(h, job, pull)
        except asyncio.CancelledError:
            error = h.error or TransferError(
                f"send of request {job.request} stopped: {h.reason or 'cancelled'}")
        except TransferError as exc:
            error = exc
        if error is None:
            port.unwatch(job.request)
        else:
            port.give_up(job.request, str(error), pull)
        self._finish(h, error)

    async def _stream(self, h: PDHandle, job: SendJob, pull: Pull) -> None:
        src = np.asarray(h.op.src_ids, dtype=np.int64)
        L = self.num_layers
        sent = [pull.first] * L
        reported = 0
        sink = h.sink
        while True:
            progressed = False
            for layer in range(L):
                hi = min(job.written[layer], pull.end)
                if sent[layer] < hi:
                    await job.port.put(pull, layer, sent[layer], src[sent[layer]:hi])
                    sent[layer] = hi
                    progressed = True
                while reported < L and sent[reported] >= pull.end:
                    sink.layer_done(reported)
                    reported += 1
            if reported == L:
                return
            if not progressed:
                await job.changed()

    # ------------------------------------------------------------------ receive
    async def _receive(self, h: PDHandle) -> None:
        job: ReceiveJob = h.job  # type: ignore[assignment]
        loop = asyncio.get_running_loop()
        result: asyncio.Future[BaseException | None] = loop.create_future()

        def on_layer(layer: int) -> None:
            if not h.finished:
                h.sink.layer_done(layer)

        def on_end(err: BaseException | None) -> None:
            if not result.done():
                result.set_result(err)

        error: BaseException | None
        try:
            await self._deps(h)
            h.pulled_at = loop.time()
            await job.port.expect(job.request, job.first,
                                  np.asarray(h.op.dst_ids, dtype=np.int64), job.digest,
                                  on_layer, on_end)
            error = await asyncio.shield(result)
        except asyncio.CancelledError:
            reason = h.reason or "cancelled"
            settle = job.port.cancel(job.request, reason)
            if settle is not None:
                await settle  # copies into our blocks still in flight: they are ours after
            error = h.error or TransferError(f"receive of request {job.request} stopped: {reason}")
        except TransferError as exc:
            error = exc
        self._finish(h, error)
