"""A step's layers chained as timers (``sim.executor._Layers``) change nothing a replay sees.

The executor sleeps a step's layers one timer each; where the loads have landed it
chains them (the timer that ends a layer pushes the next, ``VirtualTimeLoop.chain``)
and, where nothing else is due, runs the next iteration's push, clock move and pop in
place. Timers due at the same instant fire in the order the heap's
layout gives, so the chained run must leave the heap exactly as the plain loop of
``asyncio.sleep`` calls does. Here other tasks sleep to instants on a coarse grid
(ties with each other and with layer ends are common), simpy events fall on the same
grid, and the order in which everything happens must be the same, event for event.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sim.executor import _Layers
from sim.loop import run_sim

_LANDED = SimpleNamespace(layers_done=10**9)  # a load whose every layer has landed


async def _plain(log: list[Any], layers: int, per_layer: float, overhead: float) -> None:
    loop = asyncio.get_running_loop()
    for _ in range(layers):
        await asyncio.sleep(per_layer)
        log.append(("layer", loop.time()))
    if overhead > 0:
        await asyncio.sleep(overhead)
    log.append(("step end", loop.time()))


async def _chained(log: list[Any], layers: int, per_layer: float, overhead: float) -> None:
    loop = asyncio.get_running_loop()
    ex = SimpleNamespace(num_layers=layers, busy_s=0.0)
    ends: list[float] = []
    i = 0
    while i < layers:
        i = await _Layers(ex, loop, i, per_layer, overhead, [_LANDED], ends).run()
    if i == layers and overhead > 0:
        await asyncio.sleep(overhead)
    log.extend(("layer", t) for t in ends)
    log.append(("step end", loop.time()))


def _run(chain: bool, steps: list[tuple[int, float, float]], sleepers: list[list[float]],
         events: list[float]) -> list[Any]:
    log: list[Any] = []

    async def sleeper(k: int, gaps: list[float]) -> None:
        loop = asyncio.get_running_loop()
        for g in gaps:
            await asyncio.sleep(g)
            log.append((f"sleeper {k}", loop.time()))

    async def engine() -> None:
        # A step's layers are logged as they end (plain) or at its end (chained): the
        # engine's own order against other tasks is what the log compares.
        step_log: list[Any] = []
        for layers, per_layer, overhead in steps:
            await (_chained if chain else _plain)(step_log, layers, per_layer, overhead)
            log.append(("engine", asyncio.get_running_loop().time()))
        log.append(("layers", step_log))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        env = loop.env  # type: ignore[attr-defined]

        def proc() -> Any:
            last = 0.0
            for t in events:
                yield env.timeout(t - last)
                last = t
                log.append(("simpy", env.now))

        env.process(proc())
        await asyncio.gather(engine(), *(sleeper(k, g) for k, g in enumerate(sleepers)))

    run_sim(main())
    return log


_GRID = st.integers(1, 12).map(lambda k: k * 0.25)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(1, 6), _GRID, st.sampled_from([0.0, 0.25, 0.5])),
                      min_size=1, max_size=6),
       sleepers=st.lists(st.lists(_GRID, max_size=8), max_size=5),
       events=st.lists(_GRID, max_size=6).map(lambda g: sorted(set(
           sum(g[:i + 1]) for i in range(len(g))))))
def test_chained_layers_keep_the_order_of_everything(
        steps: list[tuple[int, float, float]], sleepers: list[list[float]],
        events: list[float]) -> None:
    assert _run(True, steps, sleepers, events) == _run(False, steps, sleepers, events)


def test_the_check_sees_an_order_change() -> None:
    """Two sleepers due at one instant: which fires first follows the heap, and a
    run of layers that pushed and popped differently would swap them."""
    plain = _run(False, [(4, 0.25, 0.0)], [[1.0], [0.5, 0.5]], [])
    sleepers = [e for e in plain if str(e[0]).startswith("sleeper")]
    assert [t for _, t in sleepers] == [0.5, 1.0, 1.0]
    assert _run(True, [(4, 0.25, 0.0)], [[1.0], [0.5, 0.5]], []) == plain
