"""AsyncStore: store calls on a bounded thread pool as awaitables, with deadlines.

``SlowStore`` and ``FaultyStore`` are test-only wrappers that add latency or
raise, standing in for "a store slower than the deadline" and a broken store.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Hashable, Sequence

import pytest

from kvflow.errors import ConfigError, TransferError
from kvflow.stores import (
    AsyncStore,
    BlockStore,
    MemoryStore,
    Namespace,
    StoreClosedError,
    StoreDeadlineError,
)

NS = Namespace("test-model", "raw")


class SlowStore(BlockStore):
    """Delegates to ``inner`` after sleeping ``delay_s`` (changeable while running)."""

    def __init__(self, inner: BlockStore, delay_s: float) -> None:
        super().__init__(inner.namespace)
        self.inner = inner
        self.delay_s = delay_s
        self.calls = 0
        self.finished = 0
        self.release = threading.Event()  # set: skip the rest of the delay

    def _slow(self) -> None:
        self.calls += 1
        self.release.wait(self.delay_s)

    def get_many(self, keys: Sequence[Hashable]) -> list[bytes | None]:
        self._slow()
        out = self.inner.get_many(keys)
        self.finished += 1
        return out

    def put_many(self, items: Sequence[tuple[Hashable, bytes]]) -> list[bool]:
        self._slow()
        out = self.inner.put_many(items)
        self.finished += 1
        return out

    def contains_many(self, keys: Sequence[Hashable]) -> list[bool]:
        self._slow()
        return self.inner.contains_many(keys)

    def delete(self, key: Hashable) -> bool:
        self._slow()
        return self.inner.delete(key)

    def __repr__(self) -> str:
        return f"SlowStore({self.delay_s})"


class FaultyStore(BlockStore):
    """Raises ``exc`` from every call while ``broken`` (a store that breaks its contract)."""

    def __init__(self, inner: BlockStore, exc: BaseException) -> None:
        super().__init__(inner.namespace)
        self.inner = inner
        self.exc = exc
        self.broken = True

    def _check(self) -> None:
        if self.broken:
            raise self.exc

    def get_many(self, keys: Sequence[Hashable]) -> list[bytes | None]:
        self._check()
        return self.inner.get_many(keys)

    def put_many(self, items: Sequence[tuple[Hashable, bytes]]) -> list[bool]:
        self._check()
        return self.inner.put_many(items)

    def contains_many(self, keys: Sequence[Hashable]) -> list[bool]:
        self._check()
        return self.inner.contains_many(keys)

    def delete(self, key: Hashable) -> bool:
        self._check()
        return self.inner.delete(key)


@pytest.mark.asyncio
async def test_round_trip_through_the_pool():
    inner = MemoryStore(NS)
    async with AsyncStore(inner, max_workers=2) as a:
        assert await a.put_many([(1, b"one"), (-2, b"two")]) == [True, True]
        assert await a.get_many([1, -2, 3]) == [b"one", b"two", None]
        assert await a.contains_many([1, 3]) == [True, False]
        assert await a.delete(1) is True
        assert a.stats.calls == 4 and a.stats.timeouts == 0
    assert inner.stats.hits == 2


@pytest.mark.asyncio
async def test_calls_run_off_the_event_loop_thread():
    seen = []

    class Probe(MemoryStore):
        def get_many(self, keys):
            seen.append(threading.current_thread().name)
            return super().get_many(keys)

    async with AsyncStore(Probe(NS)) as a:
        await a.get_many([1])
    assert seen and seen[0].startswith("kvflow-store")


@pytest.mark.asyncio
async def test_deadline_raises_transfer_error_and_pool_stays_usable():
    slow = SlowStore(MemoryStore(NS), delay_s=0.3)
    slow.inner.put(1, b"data")
    a = AsyncStore(slow, max_workers=2)
    try:
        with pytest.raises(TransferError, match=r"missed its deadline of 0\.05 s"):
            await a.get_many([1], timeout_s=0.05)
        assert slow.finished == 0  # the caller did not wait for the store call to end
        assert a.stats.timeouts == 1
        # the pool still serves (the late call holds one of two workers meanwhile)
        slow.delay_s = 0.0
        assert await a.get_many([1], timeout_s=1.0) == [b"data"]
        # the late call finishes in the background; its result goes nowhere
        await asyncio.sleep(0.35)
        assert slow.finished == 2
    finally:
        a.close()


@pytest.mark.asyncio
async def test_default_deadline_and_queued_call_past_deadline_never_runs():
    slow = SlowStore(MemoryStore(NS), delay_s=0.3)
    a = AsyncStore(slow, max_workers=1, timeout_s=0.05)
    try:
        first = asyncio.ensure_future(a.put_many([(1, b"x")]))
        second = asyncio.ensure_future(a.get_many([1]))  # queued behind the first
        for fut in (first, second):
            with pytest.raises(TransferError, match="deadline"):
                await fut
        slow.release.set()  # let the running call finish now
        await asyncio.sleep(0.05)
        assert slow.calls == 1  # the queued get was dropped, not run late
        slow.release.clear()
        slow.delay_s = 0.0
        assert await a.get_many([1]) == [b"x"]  # the late put landed: harmless
        assert a.stats.timeouts == 2
    finally:
        a.close()


@pytest.mark.asyncio
async def test_store_exceptions_become_transfer_errors():
    faulty = FaultyStore(MemoryStore(NS), OSError(5, "disk on fire"))
    async with AsyncStore(faulty) as a:
        with pytest.raises(TransferError, match="disk on fire") as info:
            await a.get_many([1])
        assert isinstance(info.value.__cause__, OSError)
        with pytest.raises(TransferError):
            await a.put_many([(1, b"x")])
        assert a.stats.failures == 2
        faulty.broken = False  # the store came back
        assert await a.put_many([(1, b"x")]) == [True]
        assert await a.get_many([1]) == [b"x"]


class CountingStore(SlowStore):
    """Counts the calls running at once (the most seen in ``peak``)."""

    def __init__(self, inner: BlockStore, delay_s: float) -> None:
        super().__init__(inner, delay_s)
        self.running = self.peak = 0
        self._lock = threading.Lock()

    def get_many(self, keys: Sequence[Hashable]) -> list[bytes | None]:
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            return super().get_many(keys)
        finally:
            with self._lock:
                self.running -= 1


@pytest.mark.asyncio
async def test_pool_is_bounded():
    # How many calls the store sees at once, not how long they took: the pool's bound
    # is the behaviour (timings on a loaded machine say little about it).
    for workers in (4, 1):
        store = CountingStore(MemoryStore(NS), delay_s=0.05)
        async with AsyncStore(store, max_workers=workers) as a:
            await asyncio.gather(*(a.get_many([i]) for i in range(8)))
        assert store.finished == 8 and store.peak <= workers, (workers, store.peak)
    # and with room for them all, calls do overlap: each waits until all 4 have started
    barrier = threading.Barrier(4, timeout=30)

    class Meeting(CountingStore):
        def get_many(self, keys: Sequence[Hashable]) -> list[bytes | None]:
            barrier.wait()
            return super().get_many(keys)

    store = Meeting(MemoryStore(NS), delay_s=0.0)
    async with AsyncStore(store, max_workers=4) as a:
        await asyncio.gather(*(a.get_many([i]) for i in range(4)))
    assert store.finished == 4 and not barrier.broken


@pytest.mark.asyncio
async def test_close_fails_queued_calls_and_refuses_new_ones():
    slow = SlowStore(MemoryStore(NS), delay_s=0.2)
    a = AsyncStore(slow, max_workers=1)
    running = asyncio.ensure_future(a.get_many([1]))
    queued = asyncio.ensure_future(a.get_many([2]))
    await asyncio.sleep(0.02)
    a.close(wait=False)
    with pytest.raises(TransferError, match="closed"):
        await queued
    assert await running == [None]  # a running call completes
    with pytest.raises(StoreClosedError):
        await a.get_many([1])


@pytest.mark.asyncio
async def test_cancelling_the_caller_drops_a_queued_call():
    slow = SlowStore(MemoryStore(NS), delay_s=0.2)
    async with AsyncStore(slow, max_workers=1) as a:
        busy = asyncio.ensure_future(a.get_many([1]))
        victim = asyncio.ensure_future(a.get_many([2]))
        await asyncio.sleep(0.02)
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        await busy
        await asyncio.sleep(0.02)
        assert slow.calls == 1


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ConfigError, match="max_workers"):
        AsyncStore(MemoryStore(NS), max_workers=0)
    with pytest.raises(ConfigError, match="timeout_s"):
        AsyncStore(MemoryStore(NS), timeout_s=0)


@pytest.mark.asyncio
async def test_late_read_into_buffers_is_fenced_by_settled():
    slow = SlowStore(MemoryStore(NS), delay_s=0.2)
    slow.inner.put(1, b"L" * 64)
    buf = bytearray(64)
    async with AsyncStore(slow, max_workers=2) as a:
        with pytest.raises(StoreDeadlineError) as info:
            await a.get_many_into([1], [buf], timeout_s=0.05)
        err = info.value
        assert isinstance(err, TransferError)
        assert not err.settled.done() and a.in_flight == 1
        # the abandoned call still owns the buffer: it writes into it late
        await err.settled
        assert bytes(buf) == b"L" * 64  # exactly why a caller must wait for ``settled``
        assert a.in_flight == 0
        # drain() waits for every abandoned call
        with pytest.raises(StoreDeadlineError):
            await a.get_many([1], timeout_s=0.01)
        assert a.in_flight == 1
        await a.drain()
        assert a.in_flight == 0


@pytest.mark.asyncio
async def test_queued_call_dropped_at_deadline_settles_at_once():
    slow = SlowStore(MemoryStore(NS), delay_s=0.3)
    async with AsyncStore(slow, max_workers=1) as a:
        busy = asyncio.ensure_future(a.get_many([1]))
        await asyncio.sleep(0.01)
        with pytest.raises(StoreDeadlineError) as info:
            await a.get_many([2], timeout_s=0.02)
        await asyncio.wait_for(info.value.settled, 0.1)  # never ran: nothing to wait for
        slow.release.set()
        await busy
