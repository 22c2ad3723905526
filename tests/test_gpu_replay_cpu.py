"""The GPU replay's pieces that need no GPU: options from the environment, its clock."""

from __future__ import annotations

import asyncio

import pytest

from kernels.world import env_backend_options, fine_clock, sleep_until
from kvflow.errors import ConfigError


def test_env_backend_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFLOW_STREAM_PRIORITY", raising=False)
    monkeypatch.delenv("KVFLOW_COPY_ENGINE", raising=False)
    monkeypatch.delenv("KVFLOW_EAGER_LAYERS", raising=False)
    assert env_backend_options() == {}
    monkeypatch.setenv("KVFLOW_EAGER_LAYERS", "all")
    assert env_backend_options() == {"eager_layers": None}
    monkeypatch.setenv("KVFLOW_EAGER_LAYERS", "8")
    assert env_backend_options() == {"eager_layers": 8}
    for bad in ("0", "some"):
        monkeypatch.setenv("KVFLOW_EAGER_LAYERS", bad)
        with pytest.raises(ConfigError, match="KVFLOW_EAGER_LAYERS must be"):
            env_backend_options()
    monkeypatch.delenv("KVFLOW_EAGER_LAYERS")
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
        before = loop.time()
        now = clock()
        after = loop.time()
        # the same scale as the loop's clock (to its 1 ms resolution), however long a
        # loaded machine took between the reads
        assert before - 2e-3 <= now <= after + 2e-3
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

    late, ticks = asyncio.run(main())  # returning at all: the spin ends at each due time
    assert all(x >= 0 for x in late), late
    assert ticks > 0


def test_loop_thread_gc_collects_only_on_the_loop_while_active() -> None:
    """A CUDA host callback allocates on a driver thread; a collection started there
    would destroy CUDA objects where CUDA refuses (cudaErrorNotPermitted)."""
    import gc
    import threading

    from kernels.backend import LoopThreadGC

    threads: set[str] = set()

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            threads.add(threading.current_thread().name)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        collector = LoopThreadGC(loop, interval_s=0.01)
        assert not gc.isenabled()

        def allocate_cycles() -> None:  # what a host callback thread does, much more of
            for _ in range(50_000):
                a: list = []
                a.append(a)

        worker = threading.Thread(target=allocate_cycles, name="driver")
        worker.start()
        await asyncio.sleep(0.05)  # the loop's own collections run meanwhile
        worker.join()
        collector.stop()
        assert gc.isenabled()

    gc.callbacks.append(note)
    try:
        was = gc.isenabled()
        asyncio.run(main())
        assert gc.isenabled() == was
    finally:
        gc.callbacks.remove(note)
    assert "driver" not in threads
    assert threading.main_thread().name in threads  # it did collect, on the loop's thread
