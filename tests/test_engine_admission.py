"""Admission when the head of the queue does not fit and nothing runs.

Blocks that in-flight copies hold (a write_back copy-out filling a host block,
a backup, a prefetch) are not evictable until they land. A head request that
cannot fit *now* may well fit once they have: the engine must wait for them
and plan again, and refuse the request only once nothing is in flight, nothing
runs and it still cannot fit. Every run here is bounded by a deadline, so a
regression fails instead of hanging.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from kvflow.engine import Engine, EngineConfig, EngineRequest, StepBatch
from kvflow.errors import NotEnoughBlocks
from kvflow.manager import CacheManager, Capacities, OpKind, TransferOp
from kvflow.radix import Tier
from kvflow.runtime import Runtime, TransferTask

BT = 16
LAYERS = 2
DEADLINE_S = 5.0


class LaggingBackend:
    """Moves no bytes; every op lands ``delay_s`` after it is submitted (in order)."""

    num_layers = LAYERS

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.ops: list[TransferOp] = []

    def submit(self, op: TransferOp, sink: Any, after: Sequence[object] = ()) -> object:
        self.ops.append(op)

        def land() -> None:
            for layer in range(self.num_layers):
                sink.layer_done(layer)
            sink.done(None)

        asyncio.get_running_loop().call_later(self.delay_s, land)
        return op

    def cancel(self, handle: object) -> None:
        pass


class NullExecutor:
    """Computes nothing; a step waits for the loads it depends on, like a real one."""

    async def run_step(self, batch: StepBatch, waits: Sequence[TransferTask]) -> None:
        for t in waits:
            await t
        await asyncio.sleep(0)


def request(name: str, blocks: int, extra_tokens: int = 4) -> EngineRequest:
    """``blocks`` full prompt blocks, a partial one, and ``extra_tokens`` to generate."""
    keys = tuple(f"{name}{i}" for i in range(blocks))
    return EngineRequest(name, 0.0, keys, blocks * BT + BT - extra_tokens, extra_tokens)


async def serve(manager: CacheManager, backend: LaggingBackend,
                requests: Sequence[EngineRequest]) -> Engine:
    """Add ``requests`` at once and run the engine to completion, within ``DEADLINE_S``."""
    loop = asyncio.get_running_loop()
    runtime = Runtime(manager, backend, 1024, loop)
    engine = Engine(manager, runtime, NullExecutor(), EngineConfig(BT, max_running=4))
    run = asyncio.ensure_future(engine.run())
    for req in requests:
        engine.add(req)
    engine.close()
    try:
        await asyncio.wait_for(asyncio.shield(run), DEADLINE_S)
    except TimeoutError:
        run.cancel()
        pytest.fail(f"engine stalled: running={len(engine.running)} "
                    f"waiting={len(engine.waiting)} in flight={len(runtime.tasks)}")
    manager.check_invariants()
    assert not runtime.tasks and not manager.inflight
    return engine


@pytest.mark.asyncio
@pytest.mark.parametrize("delay_s", [0.0, 0.01])
async def test_head_waits_for_copy_outs_instead_of_being_rejected(delay_s: float) -> None:
    """Device 4, host 2, write_back: after "a" (3 blocks + 1) finishes, "b" needs all four
    device blocks. Its first plan copies a2 and a1 out to the two host blocks and is
    short one block: a0 is an inner node (its children live on host) with no host room
    left until those copy-outs land. Once they have, a0 can follow them down and "b" fits.
    """
    manager = CacheManager(Capacities(4, host=2), write_policy="write_back")
    backend = LaggingBackend(delay_s)
    engine = await serve(manager, backend, [request("a", 3), request("b", 3)])
    errors = {st.req.request_id: st.error for st in engine.done}
    assert errors == {"a": None, "b": None}
    assert engine.stats.rejected == 0 and engine.stats.finished == 2
    evicts = [op for op in backend.ops if op.kind is OpKind.EVICT]
    assert sum(op.num_blocks for op in evicts) == 3  # a2, a1, then a0
    assert manager.index.get("a0").state[Tier.HOST] != 0  # a0 followed them down


@pytest.mark.asyncio
async def test_a_request_that_never_fits_is_rejected_once_nothing_is_in_flight() -> None:
    """A plan that keeps failing ends in a clear error, not a stall, and only after the
    transfers in flight (here "a"'s backups to host) have landed."""
    manager = CacheManager(Capacities(4, host=2), write_policy="write_through")
    plan = manager.plan
    inflight_at_failure: list[int] = []

    def failing_plan(request_id: Any, *args: Any, **kwargs: Any) -> Any:
        if request_id == "b":
            inflight_at_failure.append(len(manager.inflight))
            raise NotEnoughBlocks(4, 0)
        return plan(request_id, *args, **kwargs)

    manager.plan = failing_plan  # type: ignore[method-assign]
    engine = await serve(manager, LaggingBackend(0.01), [request("a", 3), request("b", 3)])
    errors = {st.req.request_id: st.error for st in engine.done}
    assert errors["a"] is None and "does not fit" in (errors["b"] or "")
    assert engine.stats.rejected == 1
    assert max(inflight_at_failure) > 0 and inflight_at_failure[-1] == 0, inflight_at_failure
