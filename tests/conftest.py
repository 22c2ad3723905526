"""Shared pytest configuration.

Virtual time for async tests (``sim.loop.VirtualTimeLoop``)
------------------------------------------------------------
A test marked with both ``asyncio`` and ``virtual_time`` runs on a fresh
``VirtualTimeLoop`` (its own simpy environment, starting at t=0)::

    @pytest.mark.asyncio
    @pytest.mark.virtual_time
    async def test_something() -> None:
        loop = asyncio.get_running_loop()      # a VirtualTimeLoop
        env = loop.env                         # its simpy environment
        await asyncio.sleep(0.25)              # no wall time passes
        assert loop.time() == env.now == 0.25

or, for a whole module, ``pytestmark = pytest.mark.virtual_time`` plus
``@pytest.mark.asyncio`` on each async test (the ``virtual_time`` mark on a
plain, synchronous test does nothing). Every other asyncio test keeps the
default loop (the event loop policy's), so GPU tests on real loops are untouched.

How: pytest-asyncio (>= 1.4) asks the ``pytest_asyncio_loop_factories`` hook
for the loop factories of each asyncio test; we answer one factory per test,
so test ids do not change (pytest >= 8.4). This replaces overriding the
``event_loop_policy`` fixture, which pytest-asyncio 1.x deprecates and which
is session-wide. With an older pytest-asyncio the hook is never called, and
``virtual_time`` tests are skipped with that reason rather than run on a real
loop where their virtual timings would be meaningless.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest

from sim.loop import VirtualTimeLoop


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "virtual_time: run this asyncio test on sim.loop.VirtualTimeLoop (simpy virtual time)",
    )


@pytest.hookimpl(optionalhook=True)
def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.get_closest_marker("virtual_time") is not None:
        return {"virtual_time": VirtualTimeLoop}
    return {"asyncio": asyncio.new_event_loop}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config.hook, "pytest_asyncio_loop_factories"):
        return
    skip = pytest.mark.skip(reason="virtual_time tests need pytest-asyncio >= 1.4 "
                                   "(the pytest_asyncio_loop_factories hook)")
    for item in items:
        if item.get_closest_marker("virtual_time") and item.get_closest_marker("asyncio"):
            item.add_marker(skip)


@pytest.fixture(params=["python", "native"])
def core(request: pytest.FixtureRequest) -> str:
    """Each index core in turn (``PrefixIndex(core=...)``): the native one where it was
    built (``pip install`` compiles it; ``test_index_core.py`` checks it was, for an
    installed kvflow), the Python reference always."""
    from kvflow.radix import NATIVE_CORE

    if request.param == "native" and NATIVE_CORE is None:
        pytest.skip("kvflow._index_core is not built (kvflow run from a source tree "
                    "without pip install)")
    return request.param
