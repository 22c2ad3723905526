"""The GPU replay's pieces that need no GPU: options from the environment, its clock."""

from __future__ import annotations

import asyncio
import time

import pytest

from kernels.replay import env_backend_options, fine_clock, sleep_until
from kvflow.errors import ConfigError


def test_env_backend_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFLOW_STREAM_PRIORITY", raising=False)
    monkeypatch.delenv("KVFLOW_COPY_ENGINE", raising=False)
    assert env_backend_options() == {}
    monkeypatch.setenv("KVFLOW_STREAM_PRIORITY", "-3")
    monkeypatch.setenv("KVFLOW_COPY_ENGINE", "never")
    assert env_backend_options() == {"stream_priority": -3, "dma": "never"}
    monkeypatch.setenv("KVFLOW_COPY_ENGINE", "sometimes")
    with pytest.raises(ConfigError, match="KVFLOW_COPY_ENGINE must be"):
        env_backend_options()
    monkeypatch.setenv("KVFLOW_COPY_ENGINE", "auto")
    monkeypatch.setenv("KVFLOW_STREAM_PRIORITY", "high")
    with pytest.raises(ConfigError, match="KVFLOW_STREAM_PRIORITY must be"):
        env_backend_options()


def test_sleep_until_is_never_early_and_lets_the_loop_run() -> None:
    """Arrivals are injected at their time on a fine clock, not the loop's ms timers,
    and waiting for one never stops the engine's work on the same loop."""

    async def main() -> tuple[list[float], int]:
        loop = asyncio.get_running_loop()
        clock = fine_clock(loop)
        assert abs(clock() - loop.time()) < 5e-3  # the same scale as the loop's clock
        ticks = 0

        async def other_work() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        worker = loop.create_task(other_work())
        late = []
        for gap in (0.0005, 0.003, 0.0):
            due = clock() + gap
            await sleep_until(clock, due)
            late.append(clock() - due)
        worker.cancel()
        return late, ticks

    t0 = time.perf_counter()
    late, ticks = asyncio.run(main())
    assert all(x >= 0 for x in late), late
    assert ticks > 0
    assert time.perf_counter() - t0 < 5  # no runaway spin
