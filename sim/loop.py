"""A virtual-time asyncio event loop whose clock is a simpy environment.

The scheduler, the runtime and the engine are written once against asyncio.
In the simulated world they run on ``VirtualTimeLoop``: ``loop.time()`` is
``env.now``, and whenever no callback is ready the loop, instead of blocking
in a selector, *jumps* the clock to the next thing that can happen — the next
simpy event or the next asyncio timer, whichever comes first. ``await
asyncio.sleep(dt)`` therefore costs ``dt`` of virtual time and no wall time,
and a simpy process (a link moving bytes, say) runs on the same thread as the
coroutines, so it may resolve asyncio futures directly.

Why ``_run_once`` is overridden rather than plugging a fake selector into
``BaseEventLoop``: the stock iteration recomputes the wait as ``when - now``,
asks the selector to wait that long, and then fires every timer with ``when <
now + clock_resolution``. On a virtual clock that costs exactness (``now +
(when - now)`` need not equal ``when``) and needs a resolution fudge that either
fires timers early or, at large virtual times where a float's spacing exceeds
the resolution, never fires them. Our iteration jumps to a timer's ``when``
itself and fires timers with ``when <= now``: ``await asyncio.sleep(0.25)`` at
``t=0`` resumes at exactly ``env.now == 0.25``. It is also cheaper (no system
call per iteration). ``run_forever``, ``run_until_complete``, timers, tasks,
futures and exception handling are ``BaseEventLoop``'s own.

Ordering: at equal times simpy events run before asyncio timers; simpy events
are only processed when no asyncio callback is ready, so everything triggered
at one instant settles before the clock moves on.

Deadlock: nothing ready, no timer, no simpy event, yet the loop was asked to
keep running (``run_until_complete`` of an unfinished future). A real loop
would block forever; this one raises ``SimDeadlock`` naming every waiting task.

Refused (``RuntimeError: not allowed inside the simulation: ...``): executors
and ``asyncio.to_thread`` (a thread runs in real time; the virtual clock cannot
wait for it), sockets, pipes, subprocesses, name resolution, signal handlers
and file-descriptor callbacks (real I/O), and ``call_soon_threadsafe`` from any
thread other than the loop's.

The loop reads and writes three simpy internals (``Environment._now``,
``_queue`` and ``_eid``; stable since simpy 3): the clock is moved to a timer's
time directly, and ``schedule_at`` queues an event at an absolute time so
that completion times are exactly what the model computed, not ``now +
(t - now)``.

Tests: ``tests/conftest.py`` runs any ``@pytest.mark.asyncio`` test that also
carries ``@pytest.mark.virtual_time`` on this loop (see the comments there).
"""

from __future__ import annotations

import asyncio
import asyncio.base_events as _base_events
import threading
from collections.abc import Callable, Coroutine
from heapq import heapify, heappop, heappush
from typing import Any, NoReturn, TypeVar

import simpy
from simpy.core import NORMAL

__all__ = [
    "SimDeadlock",
    "VirtualTimeLoop",
    "VirtualTimeLoopPolicy",
    "run_sim",
    "schedule_at",
    "simpy_to_future",
    "wait_simpy",
]

T = TypeVar("T")

_MIN_SCHEDULED = _base_events._MIN_SCHEDULED_TIMER_HANDLES
_MIN_CANCELLED_FRACTION = _base_events._MIN_CANCELLED_TIMER_HANDLES_FRACTION


class SimDeadlock(RuntimeError):
    """The simulation can make no progress but tasks are still waiting.

    ``tasks`` holds the waiting tasks; the message names each one (name,
    coroutine and where it is suspended, and what it waits on).
    """

    def __init__(self, now: float, tasks: list[asyncio.Task[Any]]) -> None:
        self.now = now
        self.tasks = tasks
        if tasks:
            lines = "\n".join(f"  - {_describe(t)}" for t in tasks)
            detail = f"{len(tasks)} task(s) still waiting:\n{lines}"
        else:
            detail = "no task is waiting, yet the loop was asked to go on (an unresolved future?)"
        super().__init__(
            f"simulation deadlock at t={now!r}: nothing is ready to run and no timer or "
            f"simpy event is scheduled; {detail}"
        )


def _describe(task: asyncio.Task[Any]) -> str:
    """``Task 'name' <coroutine ...> at file:line, waiting on <Future ...>``."""
    where = ""
    try:
        stack = task.get_stack(limit=1)
    except Exception:  # pragma: no cover - introspection must never hide the deadlock
        stack = []
    if stack:
        frame = stack[-1]
        where = f" suspended at {frame.f_code.co_filename}:{frame.f_lineno}"
    waiter = getattr(task, "_fut_waiter", None)
    waiting = f", waiting on {waiter!r}" if waiter is not None else ""
    return f"Task {task.get_name()!r} {task.get_coro()!r}{where}{waiting}"


def _refuse(what: str, why: str) -> Callable[..., NoReturn]:
    def refused(self: VirtualTimeLoop, *args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(f"not allowed inside the simulation: {what} ({why})")

    refused.__name__ = what
    refused.__doc__ = f"Refused: {why}."
    return refused


_THREADS = "threads run in real time and the virtual clock cannot wait for them; " \
    "model the work's duration with `await asyncio.sleep(cost)`"
_IO = "real I/O has no place on a virtual clock; model it with sim.hierarchy links"


class VirtualTimeLoop(asyncio.BaseEventLoop):
    """An asyncio loop on a simpy clock: time jumps; it never waits.

    ``env`` is the simpy environment whose ``now`` is this loop's ``time()``;
    simpy events are processed by this loop (never call ``env.run`` while it
    runs). A fresh environment is made when none is given.
    """

    def __init__(self, env: simpy.Environment | None = None) -> None:
        super().__init__()
        if env is None:
            env = simpy.Environment()
        if isinstance(env, simpy.RealtimeEnvironment):
            raise TypeError("VirtualTimeLoop needs a simpy.Environment, not a RealtimeEnvironment")
        if not all(hasattr(env, a) for a in ("_now", "_queue", "_eid")):
            raise TypeError(
                f"{type(env).__name__} lacks simpy.Environment's _now/_queue/_eid, "
                "which VirtualTimeLoop drives directly"
            )
        self.env = env
        #: True while the callback running is its iteration's only one (see ``chain``).
        self.solo = False

    # ------------------------------------------------------------------ clock
    def time(self) -> float:
        """Virtual time: ``env.now``."""
        return self.env._now

    def _run_once(self) -> None:
        """One iteration: settle cancelled timers, jump the clock if idle, run what is due."""
        sched = self._scheduled
        n = len(sched)
        if n > _MIN_SCHEDULED and self._timer_cancelled_count / n > _MIN_CANCELLED_FRACTION:
            kept = []
            for h in sched:
                if h._cancelled:
                    h._scheduled = False
                else:
                    kept.append(h)
            heapify(kept)
            self._scheduled = sched = kept
            self._timer_cancelled_count = 0
        else:
            while sched and sched[0]._cancelled:
                self._timer_cancelled_count -= 1
                heappop(sched)._scheduled = False

        ready = self._ready
        if not ready and not self._stopping:
            self._advance()
            sched = self._scheduled
        now = self.env._now
        while sched and sched[0]._when <= now:
            h = heappop(sched)
            h._scheduled = False
            ready.append(h)
        n = len(ready)
        # A callback that runs alone in its iteration may chain work that would have
        # run in the next one (``sim.executor``'s layer timers): see ``chain``.
        self.solo = n == 1
        for _ in range(n):
            h = ready.popleft()
            if not h._cancelled:
                h._run()

    def chain(self, h: asyncio.TimerHandle, when: float) -> bool | None:
        """From the callback of timer ``h`` (fired, so off the heap), put ``h`` back at
        ``when`` where that is what a task the callback would wake (``call_soon``) is
        to do first thing next iteration; None where it may not, and nothing is done.

        It may when the callback runs alone in its iteration and the next
        iteration's start would leave the timer heap as it is (no purge of
        cancelled timers, no cancelled timer at its head): then nothing else runs,
        and nothing else touches the heap, between the two moments, so the heap,
        and with it the order of timers due at the same instant, comes out the
        same; the iteration saved is one in which only that task would have run.

        Returns True where, moreover, the loop's next iteration would do nothing
        but fire ``h``: nothing ready, no simpy event and no other timer due at or
        before ``when``, no purge due. Then that iteration's work on the heap and
        the clock is done here (push ``h``, move the clock to ``when``, pop ``h``:
        the push and pop keep the heap's layout what it would be) and the caller
        runs ``h``'s callback's work itself, alone, as that iteration would.
        False: ``h`` is on the heap, due at ``when``.
        """
        if not self.solo:
            return None
        sched = self._scheduled
        n = len(sched)
        cancelled = self._timer_cancelled_count
        if n > _MIN_SCHEDULED and cancelled / n > _MIN_CANCELLED_FRACTION:
            return None
        if sched and sched[0]._cancelled:
            return None
        h._when = when
        heappush(sched, h)
        queue = self.env._queue
        n += 1
        if (self._ready or self._stopping or sched[0] is not h or (n > 1 and (
                sched[1]._when <= when or (n > 2 and sched[2]._when <= when)))
                or (queue and queue[0][0] <= when)
                or (n > _MIN_SCHEDULED and cancelled / n > _MIN_CANCELLED_FRACTION)):
            h._scheduled = True
            return False
        heappop(sched)
        if when > self.env._now:
            self.env._now = when
        return True

    def _advance(self) -> None:
        """Process simpy events until a callback is ready, or jump to the next timer.

        Exceptions from simpy (a crashed process, a raising callback) propagate
        out of the loop: a broken model must stop the run, not be logged past.
        """
        env = self.env
        queue = env._queue
        sched = self._scheduled
        ready = self._ready
        step = env.step
        while True:
            while sched and sched[0]._cancelled:
                self._timer_cancelled_count -= 1
                heappop(sched)._scheduled = False
            if queue and (not sched or queue[0][0] <= sched[0]._when):
                step()
                if ready or self._stopping:
                    return
                continue
            if sched:
                when = sched[0]._when
                if when > env._now:
                    env._now = when
                return
            waiting = [t for t in asyncio.all_tasks(self) if not t.done()]
            raise SimDeadlock(env._now, sorted(waiting, key=lambda t: t.get_name()))

    # ---------------------------------------------------------------- threads
    def call_soon_threadsafe(
        self, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.Handle:
        """``call_soon``, from the loop's own thread only (a CUDA-style backend hop)."""
        tid = self._thread_id
        if tid is not None and tid != threading.get_ident():
            raise RuntimeError(
                "not allowed inside the simulation: call_soon_threadsafe from another thread "
                f"({threading.current_thread().name}); {_THREADS}"
            )
        return self.call_soon(callback, *args, context=context)

    def _write_to_self(self) -> None:
        """Nothing to wake: the loop never sleeps."""

    def _process_events(self, event_list: object) -> None:
        """No selector, no events."""

    run_in_executor = _refuse("run_in_executor", _THREADS)
    set_default_executor = _refuse("set_default_executor", _THREADS)
    getaddrinfo = _refuse("getaddrinfo", _IO)
    getnameinfo = _refuse("getnameinfo", _IO)
    create_connection = _refuse("create_connection", _IO)
    create_server = _refuse("create_server", _IO)
    create_unix_connection = _refuse("create_unix_connection", _IO)
    create_unix_server = _refuse("create_unix_server", _IO)
    create_datagram_endpoint = _refuse("create_datagram_endpoint", _IO)
    connect_accepted_socket = _refuse("connect_accepted_socket", _IO)
    connect_read_pipe = _refuse("connect_read_pipe", _IO)
    connect_write_pipe = _refuse("connect_write_pipe", _IO)
    start_tls = _refuse("start_tls", _IO)
    sendfile = _refuse("sendfile", _IO)
    subprocess_exec = _refuse("subprocess_exec", _IO)
    subprocess_shell = _refuse("subprocess_shell", _IO)
    add_reader = _refuse("add_reader", _IO)
    add_writer = _refuse("add_writer", _IO)
    remove_reader = _refuse("remove_reader", _IO)
    remove_writer = _refuse("remove_writer", _IO)
    sock_recv = _refuse("sock_recv", _IO)
    sock_recv_into = _refuse("sock_recv_into", _IO)
    sock_recvfrom = _refuse("sock_recvfrom", _IO)
    sock_recvfrom_into = _refuse("sock_recvfrom_into", _IO)
    sock_sendall = _refuse("sock_sendall", _IO)
    sock_sendto = _refuse("sock_sendto", _IO)
    sock_connect = _refuse("sock_connect", _IO)
    sock_accept = _refuse("sock_accept", _IO)
    sock_sendfile = _refuse("sock_sendfile", _IO)
    add_signal_handler = _refuse("add_signal_handler", _IO)
    remove_signal_handler = _refuse("remove_signal_handler", _IO)


class VirtualTimeLoopPolicy(asyncio.DefaultEventLoopPolicy):
    """An event loop policy whose new loops are ``VirtualTimeLoop`` s (each on a fresh env)."""

    def new_event_loop(self) -> VirtualTimeLoop:
        return VirtualTimeLoop()


# ---------------------------------------------------------------------- simpy
def schedule_at(env: simpy.Environment, when: float, event: simpy.Event) -> None:
    """Queue a *triggered* ``event`` at absolute time ``when`` (>= ``env.now``).

    ``env.schedule`` takes a delay, and ``now + (when - now)`` may miss
    ``when`` by a rounding step; a model that computed ``when`` wants exactly it.
    """
    if when < env._now:
        raise ValueError(f"cannot schedule at t={when!r}, before now (t={env._now!r})")
    heappush(env._queue, (when, NORMAL, next(env._eid), event))


def simpy_to_future(loop: asyncio.AbstractEventLoop, event: simpy.Event) -> asyncio.Future[Any]:
    """A future resolved with ``event``'s value (or its exception) when simpy processes it.

    A failed event is defused (handled here, so it does not crash the
    environment). The future is resolved from within the loop's simpy step, on
    the loop's thread.
    """
    if isinstance(loop, VirtualTimeLoop) and event.env is not loop.env:
        raise ValueError("the simpy event belongs to another environment than the loop's")
    fut = loop.create_future()

    def resolve(ev: simpy.Event) -> None:
        if not ev.ok:
            ev.defused = True
        if fut.done():  # cancelled by the waiter
            return
        if ev.ok:
            fut.set_result(ev.value)
        else:
            fut.set_exception(ev.value)

    if event.callbacks is None:  # already processed
        resolve(event)
    else:
        event.callbacks.append(resolve)
    return fut


async def wait_simpy(event: simpy.Event) -> Any:
    """Await a simpy event from a coroutine on a ``VirtualTimeLoop``; returns its value."""
    loop = asyncio.get_running_loop()
    if not isinstance(loop, VirtualTimeLoop):
        raise RuntimeError(
            f"wait_simpy needs a running VirtualTimeLoop, not {type(loop).__name__}: "
            "on any other loop the simpy clock never advances"
        )
    return await simpy_to_future(loop, event)


# ------------------------------------------------------------------------ run
def run_sim(main: Coroutine[Any, Any, T], env: simpy.Environment | None = None) -> T:
    """Run ``main`` to completion on a fresh ``VirtualTimeLoop`` (on ``env``) and close it.

    Like ``asyncio.run``: tasks still pending at the end (after a deadlock,
    say) are cancelled and given the chance to unwind before the loop closes.
    """
    if not asyncio.iscoroutine(main):
        raise TypeError(f"run_sim needs a coroutine, got {type(main).__name__}")
    loop = VirtualTimeLoop(env)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_all_tasks(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_all_tasks(loop: VirtualTimeLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not tasks:
        return
    for t in tasks:
        t.cancel()
    try:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    except SimDeadlock:
        return  # a task that swallows its cancellation and waits forever: give up on it
    for t in tasks:
        if t.cancelled():
            continue
        if t.exception() is not None:
            loop.call_exception_handler({
                "message": "unhandled exception during run_sim() shutdown",
                "exception": t.exception(),
                "task": t,
            })


# ------------------------------------------------------------------ benchmark
def _bench(n: int = 200_000, repeat: int = 3) -> None:
    """Iterations/s (best of ``repeat``): ``sleep(0)`` (vs stock asyncio), timer wakeups
    (8 tasks sleeping in turn), and simpy timeouts of a process inside the loop."""
    import time as _time

    async def spin(k: int) -> None:
        for _ in range(k):
            await asyncio.sleep(0)

    async def timers(k: int, tasks: int = 8) -> None:
        async def one(dt: float) -> None:
            for _ in range(k // tasks):
                await asyncio.sleep(dt)

        await asyncio.gather(*(one(1e-3 * (i + 1)) for i in range(tasks)))

    async def simpy_events(k: int) -> None:
        env = asyncio.get_running_loop().env

        def proc() -> Any:
            for _ in range(k):
                yield env.timeout(1e-3)

        await wait_simpy(env.process(proc()))

    for label, make in (
        ("sleep(0)", spin),
        ("timer wakeups", timers),
        ("simpy timeouts", simpy_events),
    ):
        for kind in ("virtual", "asyncio") if make is spin else ("virtual",):
            best = float("inf")
            for _ in range(repeat):
                t0 = _time.perf_counter()
                if kind == "virtual":
                    run_sim(make(n))
                else:
                    asyncio.run(make(n))
                best = min(best, _time.perf_counter() - t0)
            print(f"{label:>14} {kind:>8}: {n / best:>12,.0f} /s")


if __name__ == "__main__":
    _bench()
