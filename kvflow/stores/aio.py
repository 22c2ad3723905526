"""Block store calls as asyncio awaitables, on a small bounded thread pool, with deadlines.

In the real world the scheduler runs on an event loop that must never block
on disk or network I/O, so ``AsyncStore`` runs a store's batched calls on a
``ThreadPoolExecutor`` of ``max_workers`` threads and resolves an asyncio future
on the loop when each finishes (``await astore.get_many(keys)``). The pool is
bounded on purpose: a slow store queues calls instead of spawning threads.

A call can carry a deadline (``timeout_s``, per call or a default for all).
When it passes, the awaiting caller gets :class:`StoreDeadlineError`, a
:class:`kvflow.errors.TransferError` — the same error as any failed load, so
the caller's answer is the same: recompute. The late result is discarded; a
call still queued is dropped without running; a put already running may still
land (harmless: it is a cache). Because a running call cannot be interrupted,
the error carries ``settled``, done once the worker has let go of the call's
arguments: a caller whose buffers a late call may still touch (pinned host
blocks) frees them only after it. A store that raises (stores are meant not
to, but a fault-injecting wrapper does) also becomes a ``TransferError``.
Either way the pool stays usable for the next call.

In the simulated world the same operations go over the storage link model of
``sim`` instead (virtual time has no threads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvflow.errors import ConfigError, TransferError
from kvflow.stores.base import BlockStore, StoreClosedError

T = TypeVar("T")


class StoreDeadlineError(TransferError):
    """A store call missed its deadline; the caller should recompute.

    ``settled`` is an asyncio future done once the abandoned call has really
    ended (at once if it was still queued and got dropped). Until then its
    worker may still read the call's arguments or write into its buffers: a
    caller that lent buffers (``get_many_into``, host blocks being written
    out) must not reuse them before ``await err.settled``.
    """

    def __init__(self, message: str, settled: asyncio.Future[None]) -> None:
        super().__init__(message)
        self.settled = settled


@dataclass
class AsyncStats:
    """Calls through the async wrapper: ``timeouts`` missed their deadline, ``failures`` raised."""

    calls: int = 0
    timeouts: int = 0
    failures: int = 0


class AsyncStore:
    """``store``'s calls as coroutines, on ``max_workers`` threads, with optional deadlines.

    ``timeout_s`` is the default deadline of every call (``None``: none); each
    call may pass its own. The deadline covers queueing plus the store call.
    ``close()`` stops the pool (queued calls fail with ``TransferError``); it
    does not close ``store``, which the caller owns.
    """

    def __init__(
        self, store: BlockStore, max_workers: int = 4, timeout_s: float | None = None
    ) -> None:
        if not isinstance(max_workers, int) or max_workers <= 0:
            raise ConfigError(f"max_workers must be a positive integer, got {max_workers!r}")
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive or None, got {timeout_s!r}")
        self.store = store
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self.stats = AsyncStats()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers, thread_name_prefix="kvflow-store"
        )
        self._closed = False
        self._inflight: set[asyncio.Future[None]] = set()

    async def _run(
        self, what: str, fn: Callable[..., T], *args: Any, timeout_s: float | None
    ) -> T:
        if self._closed:
            raise StoreClosedError(f"AsyncStore over {self.store!r} is closed")
        deadline = self.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        result: asyncio.Future[T] = loop.create_future()
        settled: asyncio.Future[None] = loop.create_future()  # the worker is done with args

        def deliver(cf: concurrent.futures.Future[T]) -> None:  # on the loop thread
            self._inflight.discard(settled)
            if not settled.done():
                settled.set_result(None)
            if result.done():
                return  # the caller gave up (deadline, cancellation): discard
            if cf.cancelled():
                result.set_exception(TransferError(
                    f"{what} on {self.store!r} did not run: the async store was closed"))
            elif (exc := cf.exception()) is not None:
                result.set_exception(exc)
            else:
                result.set_result(cf.result())

        def on_done(cf: concurrent.futures.Future[T]) -> None:  # on a worker thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(deliver, cf)

        self.stats.calls += 1
        try:
            cf = self._pool.submit(fn, *args)
        except RuntimeError:  # closed by another task since the check above
            raise StoreClosedError(f"AsyncStore over {self.store!r} is closed") from None
        self._inflight.add(settled)
        cf.add_done_callback(on_done)
        try:
            if deadline is None:
                return await result
            return await asyncio.wait_for(result, deadline)
        except asyncio.TimeoutError:
            self.stats.timeouts += 1
            raise StoreDeadlineError(
                f"{what} on {self.store!r} missed its deadline of {deadline:g} s", settled
            ) from None
        except (TransferError, StoreClosedError, asyncio.CancelledError):
            raise
        except Exception as exc:
            self.stats.failures += 1
            raise TransferError(f"{what} on {self.store!r} failed: {exc}") from exc
        finally:
            if not cf.done():
                cf.cancel()  # still queued: do not run it at all

    @property
    def in_flight(self) -> int:
        """Calls submitted whose worker has not finished (including abandoned late ones)."""
        return len(self._inflight)

    async def drain(self) -> None:
        """Wait until no worker is running or holding a call's arguments (buffers included)."""
        while self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)

    async def get_many(
        self, keys: Sequence[Hashable], timeout_s: float | None = None
    ) -> list[bytes | None]:
        """``store.get_many(keys)`` off the loop; ``TransferError`` past the deadline."""
        return await self._run(
            f"get_many of {len(keys)} blocks", self.store.get_many, list(keys),
            timeout_s=timeout_s,
        )

    async def get_many_into(
        self, keys: Sequence[Hashable], buffers: Sequence[object], timeout_s: float | None = None
    ) -> list[bool]:
        """``store.get_many_into(keys, buffers)`` off the loop.

        Past the deadline the caller gets :class:`StoreDeadlineError` while the
        late call may still be writing into ``buffers``: do not hand them to
        other data before the error's ``settled`` future is done (or
        :meth:`drain`), or a late read would overwrite it.
        """
        return await self._run(
            f"get_many_into of {len(keys)} blocks", self.store.get_many_into, list(keys),
            list(buffers), timeout_s=timeout_s,
        )

    async def put_many(
        self, items: Sequence[tuple[Hashable, bytes]], timeout_s: float | None = None
    ) -> list[bool]:
        """``store.put_many(items)`` off the loop; ``TransferError`` past the deadline."""
        return await self._run(
            f"put_many of {len(items)} blocks", self.store.put_many, list(items),
            timeout_s=timeout_s,
        )

    async def contains_many(
        self, keys: Sequence[Hashable], timeout_s: float | None = None
    ) -> list[bool]:
        return await self._run(
            f"contains_many of {len(keys)} blocks", self.store.contains_many, list(keys),
            timeout_s=timeout_s,
        )

    async def put_links(
        self, items: Sequence[tuple[Hashable, Hashable | None]], timeout_s: float | None = None
    ) -> bool:
        """``store.put_links(items)`` off the loop."""
        return await self._run(
            f"put_links of {len(items)} blocks", self.store.put_links, list(items),
            timeout_s=timeout_s,
        )

    async def delete(self, key: Hashable, timeout_s: float | None = None) -> bool:
        return await self._run("delete", self.store.delete, key, timeout_s=timeout_s)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, wait: bool = True) -> None:
        """Refuse new calls, drop queued ones; ``wait`` for running ones to finish."""
        self._closed = True
        self._pool.shutdown(wait=wait, cancel_futures=True)

    async def __aenter__(self) -> AsyncStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Do not block the loop on calls still running: they finish in the background.
        self.close(wait=False)

    def __repr__(self) -> str:
        return f"AsyncStore({self.store!r}, max_workers={self.max_workers})"
