"""The virtual-time loop: exact clock, simpy interplay, deadlocks, refusals."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import simpy

from sim.loop import (
    SimDeadlock,
    VirtualTimeLoop,
    VirtualTimeLoopPolicy,
    run_sim,
    schedule_at,
    simpy_to_future,
    wait_simpy,
)


def _loop() -> VirtualTimeLoop:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop), f"not on the virtual loop: {loop!r}"
    return loop


# --------------------------------------------------------------- the clock
@pytest.mark.asyncio
@pytest.mark.virtual_time
async def test_sleep_costs_exactly_its_virtual_time() -> None:
    loop = _loop()
    assert loop.time() == loop.env.now == 0
    await asyncio.sleep(0.25)
    assert loop.env.now == 0.25 and loop.time() == 0.25
    await asyncio.sleep(0)
    assert loop.env.now == 0.25
    for _ in range(3):
        await asyncio.sleep(0.1)
    assert loop.env.now == 0.25 + 0.1 + 0.1 + 0.1  # the same float additions, no drift


@pytest.mark.asyncio
@pytest.mark.virtual_time
async def test_long_sleep_takes_no_wall_time() -> None:
    # Behaviour, not a stopwatch: a year of virtual sleep is one jump of the clock, a
    # handful of loop iterations (a loop that really waited would never finish).
    loop = _loop()
    turns = 0
    run_once = loop._run_once  # type: ignore[attr-defined]

    def counted() -> None:
        nonlocal turns
        turns += 1
        run_once()

    loop._run_once = counted  # type: ignore[attr-defined]
    try:
        await asyncio.sleep(3600 * 24 * 365)
    finally:
        del loop._run_once  # type: ignore[attr-defined]
    assert loop.time() == 3600 * 24 * 365
    assert 0 < turns <= 4, turns


@pytest.mark.asyncio
@pytest.mark.virtual_time
async def test_sleepers_wake_in_time_order_at_their_times() -> None:
    loop = _loop()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, dt: float) -> None:
        await asyncio.sleep(dt)
        woke.append((name, loop.time()))

    await asyncio.gather(sleeper("c", 3.0), sleeper("a", 1.0), sleeper("b", 2.0),
                         sleeper("a2", 1.0))
    assert woke == [("a", 1.0), ("a2", 1.0), ("b", 2.0), ("c", 3.0)]


def test_timers_fire_at_large_virtual_times() -> None:
    """No clock-resolution fudge: at t=1e12 a float's spacing is 1.2e-4 s."""
    env = simpy.Environment(initial_time=1e12)

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        seen = []
        for dt in (1e-6, 1e-3, 1.0):
            await asyncio.sleep(dt)
            seen.append(loop.time())
        return seen

    t = 1e12
    expected = []
    for dt in (1e-6, 1e-3, 1.0):
        t = t + dt
        expected.append(t)
    assert run_sim(main(), env) == expected


@pytest.mark.asyncio
@pytest.mark.virtual_time
async def test_wait_for_times_out_in_virtual_time() -> None:
    loop = _loop()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.Event().wait(), timeout=5.0)
    assert loop.time() == 5.0


@pytest.mark.asyncio
@pytest.mark.virtual_time
async def test_cancelled_timer_does_not_move_the_clock() -> None:
    loop = _loop()
    handle = loop.call_later(100.0, lambda: None)
    await asyncio.sleep(1.0)
    handle.cancel()
    await asyncio.sleep(0.5)
    assert loop.time() == 1.5


# ---------------------------------------------------------------- simpy
@pytest.mark.asyncio
@pytest.mark.virtual_time
async def test_simpy_process_resolves_asyncio_future_directly() -> None:
    loop = _loop()
    env = loop.env
    fut = loop.create_future()

    def proc():  # a plain simpy process; runs on the loop's thread
        yield env.timeout(1.5)
        fut.set_result(("landed", env.now))

    env.process(proc())
    assert await fut == ("landed", 1.5)
    assert loop.time() == 1.5


@pytest.mark.asyncio
@pytest.mark.virtual_time
async def test_wait_simpy_value_failure_and_already_processed() -> None:
    loop = _loop()
    env = loop.env
    assert await wait_simpy(env.timeout(2.0, value="x")) == "x"
    assert env.now == 2.0

    failing = env.event()
    env.process(_fail_later(env, failing, 0.5))
    with pytest.raises(ValueError, match="disk on fire"):
        await wait_simpy(failing)
    assert env.now == 2.5  # defused: the environment did not crash

    done = env.timeout(0.0, value=7)
    await asyncio.sleep(1.0)
    assert done.processed
    assert await wait_simpy(done) == 7
    assert env.now == 3.5


def _fail_later(env: simpy.Environment, ev: simpy.Event, dt: float):
    yield env.timeout(dt)
    ev.fail(ValueError("disk on fire"))


@pytest.mark.asyncio
@pytest.mark.virtual_time
async def test_simpy_events_run_before_timers_at_equal_times() -> None:
    loop = _loop()
    env = loop.env
    order: list[str] = []
    loop.call_at(1.0, order.append, "timer")
    ev = env.timeout(1.0)
    ev.callbacks.append(lambda _e: order.append("simpy"))
    await asyncio.sleep(2.0)
    assert order == ["simpy", "timer"]


@pytest.mark.asyncio
@pytest.mark.virtual_time
async def test_schedule_at_is_exact_and_refuses_the_past() -> None:
    loop = _loop()
    env = loop.env
    await asyncio.sleep(0.2)
    when = 0.9  # 0.2 + (0.9 - 0.2) == 0.9000000000000001, not 0.9
    assert env.now + (when - env.now) != when
    ev = env.event()
    ev._ok, ev._value = True, None
    schedule_at(env, when, ev)
    await wait_simpy(ev)
    assert env.now == 0.9
    with pytest.raises(ValueError, match="before now"):
        schedule_at(env, 0.5, env.event())


def test_simpy_to_future_rejects_another_env() -> None:
    async def main() -> None:
        simpy_to_future(asyncio.get_running_loop(), simpy.Environment().event())

    with pytest.raises(ValueError, match="another environment"):
        run_sim(main())


def test_wait_simpy_needs_the_virtual_loop() -> None:
    async def main() -> None:
        await wait_simpy(simpy.Environment().event())

    with pytest.raises(RuntimeError, match="VirtualTimeLoop"):
        asyncio.run(main())


def test_simpy_model_crash_stops_the_run() -> None:
    env = simpy.Environment()

    def broken():
        yield env.timeout(1.0)
        raise ZeroDivisionError("model bug")

    async def main() -> None:
        env.process(broken())
        await asyncio.sleep(5.0)

    with pytest.raises(ZeroDivisionError, match="model bug"):
        run_sim(main(), env)


# ------------------------------------------------------------- deadlock
def test_deadlock_names_the_waiting_task() -> None:
    async def stuck() -> None:
        await asyncio.Event().wait()

    async def main() -> None:
        await asyncio.sleep(1.5)
        await asyncio.create_task(stuck(), name="stuck-waiter")

    with pytest.raises(SimDeadlock) as info:
        run_sim(main())
    msg = str(info.value)
    assert "t=1.5" in msg
    assert "'stuck-waiter'" in msg and "stuck" in msg and "test_sim_loop.py" in msg
    assert {t.get_name() for t in info.value.tasks} >= {"stuck-waiter"}


def test_deadlock_on_a_simpy_event_nobody_triggers() -> None:
    async def main() -> None:
        env = asyncio.get_running_loop().env  # type: ignore[attr-defined]
        await wait_simpy(env.event())

    with pytest.raises(SimDeadlock, match="1 task"):
        run_sim(main())


def test_no_deadlock_while_a_simpy_event_is_pending() -> None:
    env = simpy.Environment()

    async def main() -> float:
        fut = simpy_to_future(asyncio.get_running_loop(), env.timeout(1e6))
        await fut
        return env.now

    assert run_sim(main(), env) == 1e6


def test_run_sim_returns_and_cleans_up() -> None:
    cleaned: list[str] = []

    async def background() -> None:
        try:
            await asyncio.sleep(1e9)
        finally:
            cleaned.append("background")

    async def main() -> int:
        task = asyncio.create_task(background())
        await asyncio.sleep(2.0)
        assert not task.done()
        return 42

    assert run_sim(main()) == 42
    assert cleaned == ["background"]
    with pytest.raises(TypeError, match="coroutine"):
        run_sim(42)  # type: ignore[arg-type]


# ------------------------------------------------------------- refusals
@pytest.mark.asyncio
@pytest.mark.virtual_time
async def test_threads_executors_and_io_are_refused() -> None:
    loop = _loop()
    refused = "not allowed inside the simulation"
    with pytest.raises(RuntimeError, match=f"{refused}: run_in_executor"):
        await loop.run_in_executor(None, print)
    with pytest.raises(RuntimeError, match=f"{refused}: run_in_executor"):
        await asyncio.to_thread(print)
    with pytest.raises(RuntimeError, match=f"{refused}: create_connection"):
        await asyncio.open_connection("127.0.0.1", 9)
    with pytest.raises(RuntimeError, match=f"{refused}: getaddrinfo"):
        await loop.getaddrinfo("localhost", 80)
    with pytest.raises(RuntimeError, match=f"{refused}: subprocess_exec"):
        await asyncio.create_subprocess_exec("true")
    with pytest.raises(RuntimeError, match=f"{refused}: add_reader"):
        loop.add_reader(0, print)
    a, b = socket.socketpair()
    try:
        with pytest.raises(RuntimeError, match=f"{refused}: sock_recv"):
            await loop.sock_recv(a, 1)
    finally:
        a.close()
        b.close()


@pytest.mark.asyncio
@pytest.mark.virtual_time
async def test_call_soon_threadsafe_only_from_the_loop_thread() -> None:
    loop = _loop()
    got: list[str] = []
    loop.call_soon_threadsafe(got.append, "same thread")
    await asyncio.sleep(0)
    assert got == ["same thread"]
    errors: list[BaseException] = []

    def other() -> None:
        try:
            loop.call_soon_threadsafe(got.append, "other thread")
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and "another thread" in str(errors[0])
    assert got == ["same thread"]


# -------------------------------------------------------- pytest wiring
@pytest.mark.asyncio
async def test_unmarked_asyncio_tests_keep_the_default_loop() -> None:
    assert not isinstance(asyncio.get_running_loop(), VirtualTimeLoop)


def test_policy_makes_virtual_loops() -> None:
    loop = VirtualTimeLoopPolicy().new_event_loop()
    try:
        assert isinstance(loop, VirtualTimeLoop) and loop.time() == 0
    finally:
        loop.close()


def test_realtime_environment_is_refused() -> None:
    with pytest.raises(TypeError, match="RealtimeEnvironment"):
        VirtualTimeLoop(simpy.RealtimeEnvironment())
