"""The examples the docs point to run, and do what the docs say they do."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_engine_integration_example_loads_a_prefix_back_from_host() -> None:
    example = _load("engine_integration")
    served = asyncio.run(example.main())
    assert served == [
        {"device": 0, "host": 0, "storage": 0},  # A computes everything
        {"device": 0, "host": 0, "storage": 0},  # B evicts A from the device
        {"device": 0, "host": 3, "storage": 0},  # A again: its prefix comes back from host
    ]


def test_engine_integration_example_recomputes_after_a_failed_load() -> None:
    """The doc's promise: a failed load costs a recompute, never wrong bytes."""
    example = _load("engine_integration")

    async def run() -> dict[str, int]:
        engine = example.TinyEngine()
        await engine.serve("A", [1, 2, 3])
        await engine.drain()
        await engine.serve("B", [7, 8, 9, 10])
        await engine.drain()
        original = engine.copies.submit

        def failing_submit(op, sink, after=()):
            handle = original(op, sink, after)
            engine.copies.cancel(handle)  # every load is cut short
            return handle

        engine.copies.submit = failing_submit
        hits = await engine.serve("A2", [1, 2, 3, 4])
        await engine.drain()
        engine.manager.check_invariants()
        assert engine.recomputed == 1
        return hits

    assert asyncio.run(run())["host"] == 3  # planned from host, then recomputed
