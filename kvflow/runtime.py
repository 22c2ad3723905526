"""The asyncio runtime: every planned copy becomes an awaitable ``TransferTask``.

A task is returned the moment its op is submitted; the backend (simulated or
CUDA) moves the bytes and reports each layer as it lands. Callers await the
whole task or just ``task.layer(i)``, which is what lets compute of layer i
start while layers i+1.. are still in flight.

Ordering is enforced here, not by callers. For every block an op reads or
writes, the runtime remembers the in-flight op that writes it and the ones
that read it; a new op is started *after* (layer by layer) any in-flight op it
would race with:

* read after write — a swap-in reading a host block that a prefetch or an
  eviction is still filling;
* write after read — a swap-in or eviction overwriting a device block whose
  previous content another copy-out is still reading (the write_back case);
* write after write.

A read-after-write dependency that fails makes its readers fail too (they
would read bytes that never arrived). Every failure or cancellation is
reported to the manager, which marks the blocks not resident and hands them to
a request to recompute: a failed load degrades to recompute, never to wrong
data.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvflow.backend import TransferBackend
from kvflow.errors import BlocksLost, TransferError
from kvflow.manager import REMOTE_KINDS, CacheManager, OpKind, TransferOp
from kvflow.radix import Tier

#: Link name per (src tier, dst tier), as reports and backends name them.
LINKS: dict[tuple[int, int], str] = {
    (Tier.HOST, Tier.DEVICE): "h2d",
    (Tier.DEVICE, Tier.HOST): "d2h",
    (Tier.STORAGE, Tier.HOST): "storage_read",
    (Tier.STORAGE, Tier.DEVICE): "storage_read",
    (Tier.HOST, Tier.STORAGE): "storage_write",
    (Tier.DEVICE, Tier.STORAGE): "storage_write",
}


class TaskState(str, Enum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class TransferTask:
    """One op in flight. ``await task`` for all of it, ``await task.layer(i)`` for layer i.

    Awaiting raises ``TransferError`` if the transfer failed or was cancelled
    before the awaited part landed. The task is also the backend's
    ``LayerSink``: the backend reports progress straight into it.
    """

    __slots__ = ("_clock", "_done", "_layer_futs", "_layers_done", "_poison", "_raw_dependents",
                 "_runtime", "deps", "error", "handle", "num_layers", "op", "state")

    #: The sink protocol's opt-in (``kvflow.backend.LayerSink``): a backend whose handles
    #: know their layers' landing times (the simulator's) may report a layer only when
    #: ``layer(i)`` waits for it; ``layers_done`` then reads the handle.
    lazy_layers = True

    def __init__(self, runtime: Runtime, op: TransferOp, num_layers: int) -> None:
        self._runtime = runtime
        self.op = op
        self.num_layers = num_layers
        self.state = TaskState.RUNNING
        self._layers_done = 0
        # The backend handle, where it reports layers lazily (see ``lazy_layers``).
        self._clock: Any = None
        self.error: BaseException | None = None
        self.handle: object = None
        self.deps: list[TransferTask] = []
        # Awaiters' futures, one per call: per layer, and of the whole transfer.
        self._layer_futs: dict[int, list[asyncio.Future[None]]] | None = None
        self._done: list[asyncio.Future[None]] | None = None
        self._raw_dependents: list[TransferTask] = []
        # Set when a source this task reads from failed: whatever the backend
        # reports at the end, the bytes written are not valid.
        self._poison: BaseException | None = None

    # -- what it is -------------------------------------------------------------
    @property
    def kind(self) -> OpKind:
        return self.op.kind

    @property
    def blocks(self) -> tuple[list[int], list[int]]:
        """(source ids, destination ids)."""
        return self.op.src_ids, self.op.dst_ids

    @property
    def layers_done(self) -> int:
        """Layers landed (and valid) so far."""
        clock = self._clock
        if clock is not None and self.state is TaskState.RUNNING and self._poison is None:
            return clock.layers_reported()
        return self._layers_done

    @property
    def finished(self) -> bool:
        return self.state is not TaskState.RUNNING

    @property
    def ok(self) -> bool:
        return self.state is TaskState.DONE

    def __repr__(self) -> str:
        op = self.op
        return (f"TransferTask(op={op.op_id}, {op.kind.value}, {op.src_tier.name.lower()}->"
                f"{op.dst_tier.name.lower()}, blocks={op.num_blocks}, {self.state.value}, "
                f"layers={self.layers_done}/{self.num_layers})")

    # -- awaiting ------------------------------------------------------------------
    def layer(self, i: int) -> asyncio.Future[None]:
        """A future resolved when layer ``i`` has landed (or failed).

        Each call gets a future of its own: an awaiter that gives up (its
        ``asyncio.wait_for`` timing out, its task cancelled) cancels only its
        own, never the transfer or what other awaiters wait on.
        """
        loop = self._runtime.loop
        fut = loop.create_future()
        if i < self.layers_done:
            fut.set_result(None)
            return fut
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range [0, {self.num_layers})")
        if self.finished:
            fut.set_exception(self._failure())
            return fut
        futs = self._layer_futs
        if futs is None:
            futs = self._layer_futs = {}
        waiters = futs.get(i)
        if waiters is None:
            futs[i] = [fut]
            if self._clock is not None and self._poison is None:
                self._clock.watch(i)
        else:
            _append_pruned(waiters, fut)
        return fut

    def wait(self) -> asyncio.Future[None]:
        """A future resolved when the whole transfer has landed (or failed); one per
        call, like ``layer``."""
        fut = self._runtime.loop.create_future()
        if self.state is TaskState.DONE:
            fut.set_result(None)
        elif self.finished:
            fut.set_exception(self._failure())
        elif self._done is None:
            self._done = [fut]
        else:
            _append_pruned(self._done, fut)
        return fut

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the transfer; its blocks become not resident (recompute)."""
        self._runtime.cancel(self, reason)

    def _set_poison(self, error: BaseException) -> None:
        """From now on nothing it writes is valid: its layer count stops where it is."""
        self._layers_done = self.layers_done
        self._poison = error

    def _failure(self) -> TransferError:
        err = self.error
        if isinstance(err, TransferError):
            return err
        what = "cancelled" if self.state is TaskState.CANCELLED else "failed"
        e = TransferError(f"{self.op.kind.value} op {self.op.op_id} {what}: {err!r}")
        e.__cause__ = err
        return e

    # -- LayerSink (called by the backend, on the loop thread) ---------------------
    def layer_done(self, layer: int) -> None:
        if self.finished or self._poison is not None:
            return
        self._layers_done = layer + 1
        futs = self._layer_futs
        if futs:
            for i in [i for i in futs if i <= layer]:
                for fut in futs.pop(i):
                    if not fut.done():
                        fut.set_result(None)

    def done(self, error: BaseException | None = None) -> None:
        if self.finished:
            return
        if self._poison is not None:
            error = self._poison
        elif self._clock is not None:
            self._layers_done = self._clock.layers_reported()
        if error is None:
            self._layers_done = self.num_layers
            self.state = TaskState.DONE
        else:
            self.error = error
            self.state = (TaskState.CANCELLED if isinstance(error, asyncio.CancelledError)
                          else TaskState.FAILED)
        exc = None if error is None else self._failure()
        futs = self._layer_futs
        if futs:
            for waiters in futs.values():
                _settle(waiters, exc)  # a layer nobody awaits any more is not an error
            self._layer_futs = None
        if self._done is not None:
            _settle(self._done, exc)
            self._done = None
        self._runtime._finished(self)


def _append_pruned(waiters: list[asyncio.Future[None]], fut: asyncio.Future[None]) -> None:
    """Add an awaiter's future; drop those whose awaiters gave up, once there are many
    (a caller polling with short timeouts must not grow the list without bound)."""
    if len(waiters) >= 16:
        waiters[:] = [f for f in waiters if not f.done()]
    waiters.append(fut)


def _settle(waiters: list[asyncio.Future[None]], exc: BaseException | None) -> None:
    for fut in waiters:
        if fut.done():
            continue  # its awaiter gave up
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
            fut.exception()  # retrieved: an awaiter that gave up is not an error


@dataclass
class RuntimeMetrics:
    """What the runtime moved and what went wrong, for the report."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("h2d", "d2h", "storage_read", "storage_write"), 0))
    ops: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in OpKind})
    blocks: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in OpKind})
    failed: int = 0
    cancelled: int = 0
    dependency_failures: int = 0
    prefetch: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("issued", "completed", "cancelled", "failed"), 0))


class Runtime:
    """Turns ops into tasks on a backend, in a safe order, and reports back to the manager."""

    def __init__(self, manager: CacheManager, backend: TransferBackend,
                 bytes_per_block: int, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.manager = manager
        self.backend = backend
        self.bytes_per_block = bytes_per_block
        self.loop = loop or asyncio.get_running_loop()
        self.metrics = RuntimeMetrics()
        self.tasks: dict[int, TransferTask] = {}  # op id -> task, while in flight
        # Per tier: block id -> the in-flight task writing it / the task (or, where
        # several, the list of tasks) reading it.
        self._writer: list[dict[int, TransferTask]] = [{}, {}, {}]
        self._readers: list[dict[int, TransferTask | list[TransferTask]]] = [{}, {}, {}]
        self._idle: asyncio.Event | None = None

    # -- submission -------------------------------------------------------------
    def submit(self, op: TransferOp, deadline: float | None = None) -> TransferTask:
        """Start ``op`` now (after whatever it must follow); returns its task at once.

        ``deadline`` (loop time): cancel the transfer if it has not landed by then.
        """
        task = TransferTask(self, op, self.backend.num_layers)
        deps: dict[int, TransferTask] = {}
        raw: list[TransferTask] = []
        src, dst = op.src_tier, op.dst_tier
        # (a remote side's blocks are not this runtime's: they order nothing here)
        src_ids = op.src_ids if op.reads_local else ()
        dst_ids = op.dst_ids if op.writes_local else ()
        writer_s, writer_d = self._writer[src], self._writer[dst]
        readers_s, readers_d = self._readers[src], self._readers[dst]
        # Most ops touch no block another op in flight touches: then the maps are
        # updated in bulk; block by block only where they meet (same order as ever).
        if not writer_s.keys().isdisjoint(src_ids):
            for b in src_ids:
                w = writer_s.get(b)
                if w is not None and id(w) not in deps:
                    deps[id(w)] = w
                    raw.append(w)
        if readers_s.keys().isdisjoint(src_ids):
            readers_s.update(dict.fromkeys(src_ids, task))
        else:
            for b in src_ids:
                r = readers_s.get(b)
                if r is None:
                    readers_s[b] = task
                elif type(r) is list:
                    r.append(task)
                else:
                    readers_s[b] = [r, task]
        if not (writer_d.keys().isdisjoint(dst_ids) and readers_d.keys().isdisjoint(dst_ids)):
            for b in dst_ids:
                w = writer_d.get(b)
                if w is not None:
                    deps[id(w)] = w
                r = readers_d.get(b)
                if r is not None:
                    for x in (r if type(r) is list else (r,)):
                        deps[id(x)] = x
        writer_d.update(dict.fromkeys(dst_ids, task))
        task.deps = list(deps.values())
        for w in raw:
            w._raw_dependents.append(task)
        self.tasks[op.op_id] = task
        m = self.metrics
        m.ops[op.kind.value] += 1
        m.blocks[op.kind.value] += op.num_blocks
        if op.kind is OpKind.PREFETCH:
            m.prefetch["issued"] += 1
        if self._idle is not None:
            self._idle.clear()
        task.handle = handle = self.backend.submit(op, task, [d.handle for d in task.deps])
        if getattr(handle, "lazy_layers", False) is True:
            task._clock = handle
        if deadline is not None and not task.finished:
            self.loop.call_at(deadline, self._expire, task)
        return task

    def submit_all(self, ops: Iterable[TransferOp]) -> list[TransferTask]:
        return [self.submit(op) for op in ops]

    def task_of(self, op: TransferOp) -> TransferTask | None:
        """The in-flight task of ``op`` (None once it has finished)."""
        return self.tasks.get(op.op_id)

    def pending_readers(self, tier: int, block_ids: Iterable[int]) -> list[TransferTask]:
        """In-flight tasks still reading any of these blocks.

        Compute that writes new KV into recycled device blocks waits for these,
        layer by layer, exactly as a transfer would.
        """
        readers = self._readers[tier]
        ids = block_ids if isinstance(block_ids, (list, tuple)) else list(block_ids)
        if readers.keys().isdisjoint(ids):
            return []
        out: dict[int, TransferTask] = {}
        for b in ids:
            r = readers.get(b)
            if r is not None:
                for x in (r if type(r) is list else (r,)):
                    out[id(x)] = x
        return list(out.values())

    # -- cancellation ---------------------------------------------------------------
    def cancel(self, task: TransferTask, reason: str = "cancelled") -> None:
        """Ask the backend to stop ``task``.

        The task settles (as cancelled) when the backend reports it done — for
        a GPU, once work already queued has drained; a store read, when the
        call returns — so its blocks are never handed out while a copy may
        still be writing them. Its readers (a swap-in after a prefetch) are
        failed now, not then: whatever the backend reports, the bytes they
        would read will never be valid, and a request that gave up on a slow
        read must not wait for it anyway (its deadline bounds its wait).
        """
        if task.finished:
            return
        if task._poison is None:
            task._set_poison(asyncio.CancelledError(reason))
        self._fail_readers(task)
        self.backend.cancel(task.handle)

    def _fail_readers(self, task: TransferTask) -> None:
        """Fail the unfinished tasks that read what ``task`` writes (read after write)."""
        op = task.op
        for dep in task._raw_dependents:
            if not dep.finished and dep._poison is None:
                self.metrics.dependency_failures += 1
                dep._set_poison(TransferError(
                    f"{dep.op.kind.value} op {dep.op.op_id}: its source "
                    f"(op {op.op_id}) did not land"))
                self._fail_readers(dep)
                self.backend.cancel(dep.handle)

    def _expire(self, task: TransferTask) -> None:
        if not task.finished:
            self.cancel(task, "deadline passed")

    # -- completion ------------------------------------------------------------------
    def _finished(self, task: TransferTask) -> None:
        op = task.op
        self.tasks.pop(op.op_id, None)
        writer_d = self._writer[op.dst_tier]
        get = writer_d.get
        for b in op.dst_ids if op.writes_local else ():
            if get(b) is task:
                del writer_d[b]
        readers_s = self._readers[op.src_tier]
        get = readers_s.get
        for b in op.src_ids if op.reads_local else ():
            r = get(b)  # registered in submit, once per source block
            if r is task:
                del readers_s[b]
            elif type(r) is list:
                r.remove(task)
                if len(r) == 1:
                    readers_s[b] = r[0]
        m = self.metrics
        ok = task.state is TaskState.DONE
        # A peer transfer's bytes are what the peer asked for: kvflow.pd counts them.
        if ok and op.kind not in REMOTE_KINDS:
            m.bytes[LINKS[(op.src_tier, op.dst_tier)]] += op.num_blocks * self.bytes_per_block
        elif task.state is TaskState.CANCELLED:
            m.cancelled += 1
        else:
            m.failed += 1
        if op.kind is OpKind.PREFETCH:
            key = {TaskState.DONE: "completed", TaskState.CANCELLED: "cancelled"}.get(
                task.state, "failed")
            m.prefetch[key] += 1
        if not ok:
            self._fail_readers(task)
        task._raw_dependents = []
        follow = self.manager.complete(op, ok)
        if isinstance(task.error, BlocksLost) and task.error.keys:
            self.manager.lost(task.error.tier, task.error.keys)
        for f in follow:
            self.submit(f)
        if not self.tasks and self._idle is not None:
            self._idle.set()

    async def drain(self) -> None:
        """Wait until no transfer is in flight (follow-ups included)."""
        while self.tasks:
            if self._idle is None:
                self._idle = asyncio.Event()
            self._idle.clear()
            await self._idle.wait()
