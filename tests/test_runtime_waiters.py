"""Several awaiters of one ``TransferTask``: a waiter that gives up (``asyncio.wait_for``
timing out, its task cancelled) must never cancel the transfer or the future others
await (issue 20, item 5)."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.layout import ModelSpec
from kvflow.manager import CacheManager, Capacities
from kvflow.profile import Link
from kvflow.runtime import Runtime, TaskState, TransferTask
from sim.hierarchy import Hierarchy, SimBackend

pytestmark = pytest.mark.virtual_time

GiB = 2**30
SPEC = ModelSpec("t", num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=256)
PCIE = Link(GiB, 10e-6)
HIER = Hierarchy(PCIE, PCIE, Link(1e9, 1e-4, True), Link(1e9, 1e-4, True))
UNIT = PCIE.unit_time(2 * SPEC.bytes_per_layer_block)


def backup_task() -> tuple[Runtime, TransferTask]:
    loop = asyncio.get_running_loop()
    manager = CacheManager(Capacities(device=4, host=8))
    backend = SimBackend(loop.env, SPEC, HIER)  # type: ignore[attr-defined]
    rt = Runtime(manager, backend, SPEC.bytes_per_block, loop)
    plan = manager.plan("r1", ["a", "b"])
    manager.commit(plan)
    (task,) = rt.submit_all(manager.finish(plan))
    return rt, task


@pytest.mark.asyncio
async def test_a_layer_waiter_timing_out_does_not_cancel_the_others() -> None:
    rt, task = backup_task()
    patient = asyncio.ensure_future(task.layer(2))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(task.layer(2), UNIT / 2)  # gives up during layer 0
    await patient  # raised CancelledError before the fix
    assert asyncio.get_running_loop().time() == pytest.approx(3 * UNIT)
    await task
    assert task.state is TaskState.DONE and rt.metrics.cancelled == 0


@pytest.mark.asyncio
async def test_a_whole_task_waiter_timing_out_leaves_the_task_awaitable() -> None:
    rt, task = backup_task()
    other = asyncio.ensure_future(task.wait())
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(task.wait(), UNIT / 2)
    await other
    assert task.ok
    await task  # after it landed, too: a fresh awaiter is not handed a cancelled future
    await asyncio.wait_for(task.wait(), 1.0)
    assert rt.metrics.cancelled == 0


@pytest.mark.asyncio
async def test_a_waiting_task_cancelled_leaves_the_layer_future_to_the_others() -> None:
    _, task = backup_task()
    loop = asyncio.get_running_loop()

    async def wait_layer(i: int) -> float:
        await task.layer(i)
        return loop.time()

    quitter = asyncio.ensure_future(wait_layer(1))
    stayer = asyncio.ensure_future(wait_layer(1))
    await asyncio.sleep(UNIT / 2)
    quitter.cancel()
    assert await stayer == pytest.approx(2 * UNIT)
    assert quitter.cancelled()
    assert await wait_layer(1) == pytest.approx(2 * UNIT)  # landed: resolved at once
