"""The shared runtime (``kvflow.runtime``) on the simulated world: exact virtual timings
of per-layer futures, layer-wise ordering, injected faults, deadlines, deadlocks."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.errors import TransferError
from kvflow.layout import ModelSpec
from kvflow.manager import CacheManager, Capacities, OpKind
from kvflow.runtime import Runtime
from sim.hierarchy import Hierarchy, Link, SimBackend
from sim.loop import SimDeadlock, VirtualTimeLoop, run_sim

pytestmark = pytest.mark.virtual_time

MiB, GiB = 2**20, 2**30
SPEC = ModelSpec("t", num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=256)
PCIE = Link(GiB, 10e-6)
HIER = Hierarchy(PCIE, PCIE, Link(1e9, 1e-4, True), Link(1e9, 1e-4, True))


def unit(blocks: int) -> float:
    return PCIE.unit_time(blocks * SPEC.bytes_per_layer_block)


def sums(start: float, step: float, n: int) -> list[float]:
    out, t = [], start
    for _ in range(n):
        t = t + step
        out.append(t)
    return out


def world(device: int = 4, host: int = 8, **kw: object) -> tuple[
        VirtualTimeLoop, CacheManager, SimBackend, Runtime]:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop)
    manager = CacheManager(Capacities(device=device, host=host))
    backend = SimBackend(loop.env, SPEC, HIER, **kw)  # type: ignore[arg-type]
    return loop, manager, backend, Runtime(manager, backend, SPEC.bytes_per_block, loop)


@pytest.mark.asyncio
async def test_backup_layers_resolve_in_order_at_exact_times() -> None:
    loop, m, _, rt = world()
    plan = m.plan("r1", ["a", "b"])
    m.commit(plan)
    (backup,) = rt.submit_all(m.finish(plan))
    assert backup.kind is OpKind.BACKUP
    seen = []
    for i in range(4):
        await backup.layer(i)
        seen.append(loop.time())
    assert seen == sums(0.0, unit(2), 4)
    await backup
    assert backup.ok and rt.metrics.bytes["d2h"] == 2 * SPEC.bytes_per_block


@pytest.mark.asyncio
async def test_swap_in_into_blocks_being_copied_out_waits_layer_by_layer() -> None:
    loop, m, _, rt = world()
    p1 = m.plan("r1", ["a", "b"])
    m.commit(p1)
    rt.submit_all(m.finish(p1))
    await rt.drain()
    t0 = loop.time()
    p2 = m.plan("r2", ["c", "d", "e", "f"])  # fills the device; a, b stay on host
    m.commit(p2)
    (backup,) = rt.submit_all(m.finish(p2))  # reads device blocks 0..3
    p3 = m.plan("r3", ["a", "b"])  # host hits, into device blocks the backup still reads
    (swap,) = rt.submit_all(p3.ops)
    assert swap.kind is OpKind.SWAP_IN and swap.deps == [backup]
    landed = []
    for i in range(4):
        await swap.layer(i)
        landed.append(loop.time())
        assert backup.layers_done == i + 1  # never ahead of what it overwrites
    backup_layers = sums(t0, unit(4), 4)
    assert landed == [b + unit(2) for b in backup_layers]


@pytest.mark.asyncio
async def test_injected_storage_fault_fails_the_task_at_its_time() -> None:
    loop, m, be, rt = world()
    be.inject_failure(lambda op: op.kind is OpKind.BACKUP)
    plan = m.plan("r1", ["a"])
    m.commit(plan)
    (backup,) = rt.submit_all(m.finish(plan))
    await backup.layer(0)
    with pytest.raises(TransferError, match="injected failure"):
        await backup
    assert loop.time() == unit(1)
    assert rt.metrics.failed == 1 and m.stats.failed_ops == 1


@pytest.mark.asyncio
async def test_deadline_cancels_the_transfer() -> None:
    loop, m, _, rt = world()
    plan = m.plan("r1", ["a", "b"])
    m.commit(plan)
    (op,) = m.finish(plan)
    task = rt.submit(op, deadline=unit(2) * 2.5)  # during layer 2
    with pytest.raises(TransferError):
        await task
    # the unit on the wire completes (unreported), then the task ends
    assert loop.time() == sums(0.0, unit(2), 3)[-1]
    assert task.layers_done == 2 and rt.metrics.cancelled == 1


def test_deadlock_names_the_task_waiting_on_a_transfer_nobody_reports() -> None:
    class BlackHole:
        num_layers = 4

        def submit(self, op: object, sink: object, after: object) -> object:
            return object()

        def cancel(self, handle: object) -> None:
            pass

    async def engine_step() -> None:
        loop = asyncio.get_running_loop()
        m = CacheManager(Capacities(device=4, host=8))
        rt = Runtime(m, BlackHole(), SPEC.bytes_per_block, loop)  # type: ignore[arg-type]
        plan = m.plan("r1", ["a"])
        m.commit(plan)
        (task,) = rt.submit_all(m.finish(plan))
        await task.layer(0)

    async def main() -> None:
        await asyncio.create_task(engine_step(), name="engine-step")

    with pytest.raises(SimDeadlock, match=r"'engine-step'.*engine_step"):
        run_sim(main())
