"""``StoreBackend``: the storage tier's ``TransferBackend`` in the real (threaded) world.

It runs the manager's storage ops through a block store:

* ``PREFETCH`` storage -> host: ``get_many_into`` straight into the host blocks;
* ``WRITE`` (host eviction, write_back) and ``BACKUP`` (write_through /
  write_through_selective) host -> storage: ``put_many`` from the host blocks.

Store calls run on ``AsyncStore``'s small bounded thread pool and complete
asyncio futures on the loop; the backend never blocks the loop. A store keeps
whole blocks, so an op moves all its layers at once and reports every layer
when the call returns.

Failure is the normal case for a cache tier, and every kind ends the same way:
a key the store does not have (absent, evicted by the store itself, lost in a
Redis restart), a blob that fails its checksum (the store answers ``None``), a
store error (disk full, connection refused), a missed deadline — the op
reports ``done(TransferError)`` and the manager's failure path makes the
request recompute. Nothing partial is ever reported as landed: an op with one
bad block fails whole.

Two rules the runtime relies on:

* ``done`` only once work has really stopped. A store call cannot be
  interrupted; past its deadline ``AsyncStore`` gives up waiting but the worker
  may still be writing into the host blocks (a read) or reading them (a
  write). The op therefore reports ``done`` only after ``StoreDeadlineError.settled``,
  so the manager never hands those blocks to other data while a late call
  still touches them. ``cancel`` works the same way: an op not started yet
  ends at once, one whose store call is running ends when the call does.
* ``after`` is honoured coarsely: an op starts once every op it must follow
  has finished (a store op is all layers at once anyway).

Already-stored blocks are not written again: before a put, ``contains_many``
asks the store which keys it already holds (the manager's residency only knows
what this process wrote; the store may hold blocks from an earlier run, or
from another engine sharing Redis) and skips them — counted in
``stats.write_skipped``, costing no write. After a write, each block's parent
is recorded in the store (``BlockStore.put_links``: a hint, whose failure is
counted and never fails the op), from which a new process rebuilds its index
(``kvflow.store_index.rediscover``).

Storage -> device (``SWAP_IN`` in a setup with no host tier) is not
supported: it needs device memory this backend does not own. Such an op is
refused with a ``TransferError`` naming it; give the cache a host tier.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np

from kvflow.backend import pending_after, submit_loop
from kvflow.errors import BlocksLost, ConfigError, TransferError
from kvflow.host_memory import HostMemory
from kvflow.manager import TransferOp
from kvflow.radix import Tier
from kvflow.stores.aio import AsyncStore, StoreDeadlineError
from kvflow.stores.base import BlockStore, StoreClosedError

_READ = (Tier.STORAGE, Tier.HOST)
_WRITE = (Tier.HOST, Tier.STORAGE)
_T = TypeVar("_T")


def store_key(key: Hashable) -> int | bytes | str:
    """The store key of a manager key.

    Stores take ints, bytes and str. A replay namespaces keys per tenant as
    ``(tenant, hash)`` tuples; those become a stable string (``repr`` of
    strings and ints does not change between runs or processes).
    """
    if isinstance(key, (int, bytes, str)) and not isinstance(key, bool):
        return key
    if isinstance(key, tuple):
        return "t" + repr(key)
    raise TypeError(f"cannot store a block under a key of type {type(key).__name__}: {key!r}")


class BusyClock:
    """Time during which at least one op was in flight (a link's busy time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._active = 0
        self._since = 0.0
        self._busy = 0.0

    def enter(self) -> None:
        if self._active == 0:
            self._since = self._loop.time()
        self._active += 1

    def exit(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._busy += self._loop.time() - self._since

    @property
    def busy_s(self) -> float:
        extra = self._loop.time() - self._since if self._active else 0.0
        return self._busy + extra


class StoreMissError(BlocksLost):
    """A storage read did not get some blocks (absent, evicted, corrupt, store down).

    ``missing``: the manager keys that missed. The op fails like any other
    (recompute). ``keys``: those known to be gone — all of them, unless the
    store reported errors during the read (a store that is down has lost
    nothing; its blocks may be back with it): the runtime has the manager drop
    its storage copies of those, so that a store restart or the store's own
    eviction does not leave entries that miss on every later read and are
    never written again.
    """

    def __init__(self, message: str, missing: list[Hashable], lost: bool) -> None:
        super().__init__(message, Tier.STORAGE, list(missing) if lost else [])
        self.missing = missing


@dataclass
class StoreBackendStats:
    """What the storage tier did, in ops and blocks.

    ``read_misses`` counts blocks a read did not get (absent, corrupt, store
    down); ``put_failed`` blocks a put did not store; ``write_skipped`` blocks
    not written because the store already held them. ``timeouts`` and
    ``errors`` count ops (a missed deadline; a store call that raised or a
    closed store); ``failed`` counts every op that ended in an error, those
    included, ``cancelled`` the ones stopped by ``cancel``.
    """

    read_ops: int = 0
    write_ops: int = 0
    blocks_read: int = 0
    blocks_written: int = 0
    write_skipped: int = 0
    links_written: int = 0
    links_failed: int = 0
    read_misses: int = 0
    put_failed: int = 0
    timeouts: int = 0
    errors: int = 0
    failed: int = 0
    cancelled: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class StoreOpHandle:
    """One storage op: the handle ``submit`` returns, for ``after`` and ``cancel``."""

    __slots__ = ("_waiters", "cancelled", "ended_at", "error", "finished", "op", "sink", "started",
                 "started_at", "task")

    def __init__(self, op: TransferOp, sink: Any) -> None:
        self.op = op
        self.sink = sink
        self.task: asyncio.Task[None] | None = None
        self.started = False      # a store call has been issued: cannot be called back
        self.cancelled = False
        self.finished = False
        self.error: BaseException | None = None
        #: Loop times of the first store call and of the end (service time = the difference).
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self._waiters: list[asyncio.Future[None]] = []

    def wait_finished(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A fresh future resolved when the op has finished (one per waiter, so that
        cancelling a waiter never cancels anyone else's)."""
        fut = loop.create_future()
        if self.finished:
            fut.set_result(None)
        else:
            self._waiters.append(fut)
        return fut

    def __repr__(self) -> str:
        op = self.op
        state = "finished" if self.finished else "running" if self.started else "waiting"
        return f"StoreOpHandle(op={op.op_id}, {op.kind.value}, blocks={op.num_blocks}, {state})"


class StoreBackend:
    """Host <-> storage transfers through a block store; implements ``TransferBackend``.

    ``store``: an ``AsyncStore`` (the caller owns it) or a ``BlockStore``
    (wrapped in an ``AsyncStore`` of ``max_workers`` threads, closed by
    :meth:`close`). ``host``: the host tier's memory. ``read_timeout_s`` /
    ``write_timeout_s``: each op's deadline from when it may start (its
    ``after`` ops done), queueing for a worker included; ``None`` leaves the
    ``AsyncStore``'s own default. ``key_fn`` maps manager keys to store keys.
    ``skip_stored`` asks the store before each write which blocks it holds.
    ``record_links`` records each written block's parent in the store
    (``BlockStore.put_links``) for ``kvflow.store_index.rediscover``.
    """

    def __init__(
        self,
        store: AsyncStore | BlockStore,
        host: HostMemory,
        num_layers: int,
        *,
        read_timeout_s: float | None = None,
        write_timeout_s: float | None = None,
        max_workers: int = 4,
        key_fn: Callable[[Hashable], int | bytes | str] = store_key,
        skip_stored: bool = True,
        record_links: bool = True,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if isinstance(store, BlockStore):
            self.store = AsyncStore(store, max_workers=max_workers)
            self._owns_store = True
        elif isinstance(store, AsyncStore):
            self.store = store
            self._owns_store = False
        else:
            raise TypeError(f"store must be an AsyncStore or a BlockStore, got {store!r}")
        if not isinstance(host, HostMemory):
            raise TypeError(f"host must implement kvflow.host_memory.HostMemory, got {host!r}")
        want = self.store.store.namespace.block_bytes
        if want is not None and want != host.bytes_per_block:
            raise ConfigError(
                f"the store's namespace holds blocks of {want} bytes, host blocks have "
                f"{host.bytes_per_block}: a store must be opened with the cache's layout")
        for name, t in (("read_timeout_s", read_timeout_s), ("write_timeout_s", write_timeout_s)):
            if t is not None and t <= 0:
                raise ConfigError(f"{name} must be positive or None, got {t!r}")
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ConfigError(f"num_layers must be a positive integer, got {num_layers!r}")
        self.host = host
        self.num_layers = num_layers
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self.key_fn = key_fn
        self.skip_stored = skip_stored
        self.record_links = record_links
        self.stats = StoreBackendStats()
        self._loop = loop
        self._slots: asyncio.Semaphore | None = None
        self._ops: set[StoreOpHandle] = set()
        self._busy: dict[str, BusyClock] = {}

    # ------------------------------------------------------------------ protocol
    def submit(self, op: TransferOp, sink: Any, after: Sequence[object] = ()) -> StoreOpHandle:
        """Start ``op`` once every op in ``after`` has finished; returns its handle at once."""
        pair = (Tier(op.src_tier), Tier(op.dst_tier))
        if pair not in (_READ, _WRITE):
            raise TransferError(
                f"StoreBackend moves blocks between host and storage only; op {op.op_id} "
                f"({op.kind.value}) goes {pair[0].name.lower()} -> {pair[1].name.lower()}"
                + (": storage <-> device needs a host tier to stage through (give the cache "
                   "host blocks)" if Tier.DEVICE in pair else ""))
        deps = pending_after(op, after, StoreOpHandle, "StoreBackend")
        loop = self._event_loop()
        h = StoreOpHandle(op, sink)
        self._ops.add(h)
        h.task = loop.create_task(self._run(h, deps), name=f"store-op-{op.op_id}")
        h.task.add_done_callback(lambda _t, h=h: self._task_ended(h))
        return h

    def cancel(self, handle: object) -> None:
        """Stop an op: at once if its store call has not been issued, else once it returns."""
        if not isinstance(handle, StoreOpHandle):
            raise TypeError(f"cancel: {handle!r} is not a StoreBackend handle")
        if handle.finished or handle.cancelled:
            return
        handle.cancelled = True
        if not handle.started and handle.task is not None:
            handle.task.cancel()  # waiting for a dependency or a worker: nothing to undo

    # ------------------------------------------------------------------ running
    async def _run(self, h: StoreOpHandle, deps: list[StoreOpHandle]) -> None:
        loop = asyncio.get_running_loop()
        op = h.op
        read = (op.src_tier, op.dst_tier) == _READ
        error: BaseException | None = None
        try:
            for d in deps:
                if not d.finished:
                    await d.wait_finished(loop)
            timeout = self.read_timeout_s if read else self.write_timeout_s
            deadline = None if timeout is None else loop.time() + timeout
            slots = self._semaphore()
            if deadline is None:
                await slots.acquire()
            else:
                try:
                    await asyncio.wait_for(slots.acquire(), max(deadline - loop.time(), 0.0))
                except asyncio.TimeoutError:
                    self.stats.timeouts += 1
                    raise TransferError(
                        f"{op.kind.value} op {op.op_id}: no store worker free within its "
                        f"deadline of {timeout:g} s") from None
            try:
                if h.cancelled:
                    raise asyncio.CancelledError
                h.started = True
                h.started_at = loop.time()
                link = "storage_read" if read else "storage_write"
                clock = self._busy_clock(link)
                clock.enter()
                try:
                    if read:
                        self.stats.read_ops += 1
                        error = await self._read(op, deadline)
                    else:
                        self.stats.write_ops += 1
                        error = await self._write(op, deadline)
                finally:
                    clock.exit()
            finally:
                slots.release()
        except asyncio.CancelledError:
            if not h.cancelled:  # the loop is shutting down: say so, do not hang the sink
                error = TransferError(f"{op.kind.value} op {op.op_id}: interrupted")
        except TransferError as exc:
            error = exc
        except Exception as exc:  # a bug in a host memory adapter or the like: fail the op
            error = TransferError(f"{op.kind.value} op {op.op_id} failed: {exc!r}")
            error.__cause__ = exc
        self._finish(h, error)

    async def _read(self, op: TransferOp, deadline: float | None) -> BaseException | None:
        keys = [self.key_fn(k) for k in op.keys]
        bufs: list[np.ndarray] = []
        staged: list[tuple[int, np.ndarray]] = []
        for b in op.dst_ids:
            view = self.host.block_view(b)
            if view is None:
                view = np.empty(self.host.bytes_per_block, dtype=np.uint8)
                staged.append((b, view))
            bufs.append(view)
        errors_before = self.store.store.stats.errors
        got = await self._store_call(
            op, self.store.get_many_into(keys, bufs, timeout_s=self._left(deadline)))
        if isinstance(got, BaseException):
            return got
        missing = [k for k, ok in zip(op.keys, got, strict=True) if not ok]
        if missing:
            self.stats.read_misses += len(missing)
            # Store errors meanwhile (any call: stats are per store) make the misses
            # inconclusive; then nothing is declared lost (only hits are at stake).
            lost = self.store.store.stats.errors == errors_before
            return StoreMissError(
                f"{op.kind.value} op {op.op_id}: {len(missing)} of {op.num_blocks} blocks not "
                f"read from the store (absent, evicted, corrupt or store down): "
                f"{_some(missing)}", missing, lost)
        for b, view in staged:
            self.host.scatter(b, view)
        self.stats.blocks_read += op.num_blocks
        return None

    async def _write(self, op: TransferOp, deadline: float | None) -> BaseException | None:
        keys = [self.key_fn(k) for k in op.keys]
        todo = list(range(op.num_blocks))
        if self.skip_stored:
            held = await self._store_call(
                op, self.store.contains_many(keys, timeout_s=self._left(deadline)),
                unknown=[False] * len(keys))  # write them all; the put will tell
            if isinstance(held, BaseException):
                return held
            todo = [i for i, h in enumerate(held) if not h]
            self.stats.write_skipped += op.num_blocks - len(todo)
        if not todo:
            return await self._link(op, keys, deadline)
        items: list[tuple[int | bytes | str, np.ndarray]] = []
        for i in todo:
            view = self.host.block_view(op.src_ids[i])
            if view is None:
                view = np.empty(self.host.bytes_per_block, dtype=np.uint8)
                self.host.gather(op.src_ids[i], view)
            items.append((keys[i], view))
        stored = await self._store_call(
            op, self.store.put_many(items, timeout_s=self._left(deadline)))
        if isinstance(stored, BaseException):
            return stored
        failed = [op.keys[i] for i, ok in zip(todo, stored, strict=True) if not ok]
        if failed:
            self.stats.put_failed += len(failed)
            last = getattr(self.store.store, "last_error", None)
            return TransferError(
                f"{op.kind.value} op {op.op_id}: {len(failed)} of {len(todo)} blocks not "
                f"stored ({last or 'no room or store down'}): {_some(failed)}")
        self.stats.blocks_written += len(todo)
        return await self._link(op, keys, deadline)

    async def _link(self, op: TransferOp, keys: list[int | bytes | str],
                    deadline: float | None) -> None:
        """Record the op's blocks' parents in the store (``BlockStore.put_links``), so that
        a later process can rebuild its index from the store (``kvflow.store_index``).
        A hint: failing to record one never fails the write (counted)."""
        if not self.record_links or len(op.nodes) != len(keys):
            return None
        links = []
        for key, node in zip(keys, op.nodes, strict=True):
            parent = node.parent
            links.append((key, None if parent is None else self.key_fn(parent.key)))
        try:
            ok = await self.store.put_links(links, timeout_s=self._left(deadline))
        except StoreDeadlineError as exc:
            await exc.settled
            ok = False
        except (TransferError, StoreClosedError):
            ok = False
        if ok:
            self.stats.links_written += len(links)
        else:
            self.stats.links_failed += len(links)
        return None

    async def _store_call(
        self, op: TransferOp, call: Awaitable[_T], unknown: _T | None = None
    ) -> _T | BaseException:
        """Await one store call of ``op``: its answer, or the error that ends the op.

        Past the deadline the late call may still be writing the host blocks (a
        read) or reading them (a write), so the op's error comes back only once
        the call has settled. A store error (raised, or a closed store) fails
        the op, counted in ``stats.errors`` — unless the call only asked a
        question: then ``unknown`` is the answer to go on with, uncounted.
        """
        try:
            return await call
        except StoreDeadlineError as exc:
            self.stats.timeouts += 1
            await exc.settled
            return exc
        except (TransferError, StoreClosedError) as exc:
            if unknown is not None:
                return unknown
            self.stats.errors += 1
            return self._wrap(op, exc)

    def _task_ended(self, h: StoreOpHandle) -> None:
        """A task cancelled before its first step never runs ``_run``: finish it here."""
        if not h.finished:
            self._finish(h, None if h.cancelled else TransferError(
                f"{h.op.kind.value} op {h.op.op_id}: interrupted"))

    def _finish(self, h: StoreOpHandle, error: BaseException | None) -> None:
        if h.cancelled and error is None:
            error = TransferError(f"op {h.op.op_id} ({h.op.kind.value}) was cancelled")
        h.finished = True
        h.ended_at = asyncio.get_running_loop().time()
        h.error = error
        self._ops.discard(h)
        if error is not None:
            if h.cancelled:
                self.stats.cancelled += 1
            else:
                self.stats.failed += 1
        try:
            if error is None:
                for layer in range(self.num_layers):
                    h.sink.layer_done(layer)
            h.sink.done(error)
        finally:  # ops waiting on this one must start even if the sink raised
            for fut in h._waiters:
                if not fut.done():
                    fut.set_result(None)
            h._waiters.clear()

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _left(deadline: float | None) -> float | None:
        if deadline is None:
            return None
        return max(deadline - asyncio.get_running_loop().time(), 1e-4)

    @staticmethod
    def _wrap(op: TransferOp, exc: BaseException) -> TransferError:
        err = TransferError(f"{op.kind.value} op {op.op_id}: {exc}")
        err.__cause__ = exc
        return err

    def _semaphore(self) -> asyncio.Semaphore:
        # One store call per worker: calls never queue inside the pool, where a
        # cancel could not reach them; they wait here, where it can.
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.store.max_workers)
        return self._slots

    def _busy_clock(self, link: str) -> BusyClock:
        clock = self._busy.get(link)
        if clock is None:
            clock = self._busy[link] = BusyClock(asyncio.get_running_loop())
        return clock

    def busy_s(self) -> dict[str, float]:
        """Seconds each link (``storage_read``, ``storage_write``) had a store call running."""
        return {k: self._busy[k].busy_s if k in self._busy else 0.0
                for k in ("storage_read", "storage_write")}

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        return submit_loop(self._loop, "StoreBackend.submit")

    @property
    def inflight(self) -> int:
        """Ops submitted and not finished."""
        return len(self._ops)

    async def drain(self) -> None:
        """Wait until every op has finished and no store worker holds a host buffer."""
        while self._ops:
            await asyncio.gather(*(h.task for h in list(self._ops) if h.task is not None),
                                 return_exceptions=True)
        await self.store.drain()

    def close(self) -> None:
        """Close the ``AsyncStore`` this backend made (not one it was given, not the store)."""
        if self._owns_store:
            with contextlib.suppress(Exception):
                self.store.close(wait=True)


def _some(keys: Sequence[Hashable], n: int = 4) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")
