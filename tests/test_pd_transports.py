"""PD transports with real bytes: every cache role bit-exact over each transport, the
layout handshake, and SEND / RECEIVE as runtime ``TransferTask``s layer by layer."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pd_helpers import (
    ROLE_SPECS,
    TRANSPORTS,
    assert_moved,
    poisoned_memory,
    ports,
    random_memory,
)

from kvflow.engine import EngineRequest
from kvflow.layout import ModelSpec
from kvflow.manager import OpKind
from kvflow.pd.backend import ReceiveJob, SendJob
from kvflow.pd.ports import prompt_digest
from kvflow.pd.transports import inproc_ports, tcp_receive_port, tcp_send_port
from kvflow.pd.wire import LayoutMismatch
from kvflow.radix import COMPUTING, READY
from kvflow.realtime.pd_instance import Instance, InstanceConfig


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("name", sorted(ROLE_SPECS))
async def test_every_role_round_trips_bit_exact(kind: str, name: str) -> None:
    spec = ROLE_SPECS[name]
    src, dst = random_memory(spec, 24, seed=len(name)), poisoned_memory(spec, 40)
    src_ids = np.array([7, 3, 19, 20, 21, 0, 11, 23, 5])        # runs and singletons
    dst_ids = np.array([39, 2, 3, 4, 17, 30, 31, 8, 1])
    keys = [("k", i) for i in range(len(src_ids))]
    first = 2  # the decode side holds positions 0-1 already
    ends: list[BaseException | None] = []
    landed: list[int] = []
    done = asyncio.Event()
    async with ports(kind, (spec, src), (spec, dst)) as (send, recv):
        await recv.expect("r", first, dst_ids[first:], prompt_digest(keys, first, len(keys)),
                          landed.append, lambda e: (ends.append(e), done.set()))
        pull = await send.pull("r")
        assert (pull.first, pull.ids.tolist()) == (first, dst_ids[first:].tolist())
        for layer in range(spec.num_layers):  # two runs per layer, as two prefill chunks
            await send.put(pull, layer, first, src_ids[first:5])
            await send.put(pull, layer, 5, src_ids[5:])
        await asyncio.wait_for(done.wait(), 5)
    assert ends == [None] and landed == list(range(spec.num_layers))
    assert_moved(spec, src.array, src_ids[first:], dst.array, dst_ids[first:])
    assert recv.stats.bytes == send.stats.bytes == (
        (len(src_ids) - first) * spec.num_layers * spec.layout.bytes_per_layer_block)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_peer_of_another_layout_is_refused_at_the_handshake(kind: str) -> None:
    a = ROLE_SPECS["mha-bf16"]
    b = a.replace(dtype="fp8")
    if kind == "inproc":
        with pytest.raises(LayoutMismatch, match="dtype differs"):
            inproc_ports((a, random_memory(a, 4, 0)), (b, poisoned_memory(b, 4)))
        return
    send, server = await tcp_send_port(a, random_memory(a, 4, 0))
    recv = tcp_receive_port(b, poisoned_memory(b, 4), "127.0.0.1", server.port)
    ended: list[BaseException | None] = []
    try:
        with pytest.raises(LayoutMismatch, match="dtype differs: 'bf16' at 'prefill', 'fp8' at"):
            await recv.expect("r", 0, np.array([1]), 0, lambda layer: None, ended.append)
        for _ in range(100):
            if server.refused:
                break
            await asyncio.sleep(0.01)
        assert server.refused and "dtype differs" in server.refused[0]
        assert not send.links and not ended  # nothing connected, nothing was received
    finally:
        await server.close()


def _instances(spec: ModelSpec) -> tuple[Instance, Instance]:
    cfg = InstanceConfig(device_blocks=16, host_blocks=8)
    return Instance(spec, cfg, "prefill"), Instance(spec, cfg, "decode")


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_send_and_receive_are_transfer_tasks_layer_by_layer(kind: str) -> None:
    """Layer l leaves and lands only once prefill wrote it; the received blocks are not
    matchable before the whole transfer landed; both pools are full after drain."""
    spec = ROLE_SPECS["mha-fp8"]
    P, D = _instances(spec)
    keys = tuple(("p", i) for i in range(5))
    req = EngineRequest("r1", 0.0, keys, 5 * spec.block_tokens, 2)
    p_plan = P.manager.plan("r1", keys, 1)
    d_plan = D.manager.plan("r1", keys, 1)
    rng = np.random.default_rng(3)
    P.copies.device[:] = rng.integers(1, 256, P.copies.device.shape, dtype=np.uint8)
    D.copies.device[:] = 0xA5
    async with ports(kind, (spec, P.memory), (spec, D.memory)) as (send_port, recv_port):
        job = SendJob("r1", send_port, keys, 5, [0] * spec.num_layers)
        send_op = P.manager.remote_op(OpKind.SEND, p_plan, p_plan.device_ids, range(5))
        P.pd.expect(send_op, job)
        send = P.runtime.submit(send_op)
        recv_op = D.manager.remote_op(OpKind.RECEIVE, d_plan, d_plan.device_ids, range(5))
        D.pd.expect(recv_op, ReceiveJob("r1", recv_port, 0, prompt_digest(keys, 0, 5)))
        recv = D.runtime.submit(recv_op)
        for _ in range(20):
            await asyncio.sleep(0)
        assert send.layers_done == recv.layers_done == 0  # nothing written, nothing sent
        for layer in range(spec.num_layers):
            job.wrote(layer, 5)
            await asyncio.wait_for(recv.layer(layer), 5)
            assert recv.layers_done == layer + 1 and send.layers_done >= layer + 1
            assert all(n.state[0] == COMPUTING for n in d_plan.computing)
            assert len(D.manager.match(keys)) == 0  # still not matchable
        await asyncio.wait_for(asyncio.gather(send.wait(), recv.wait()), 5)
    assert send.ok and recv.ok
    assert_moved(spec, P.copies.device, p_plan.device_ids, D.copies.device, d_plan.device_ids)
    assert D.manager.commit_received(d_plan, 0) == 5
    assert [n.state[0] for n in D.manager.match(keys)] == [READY] * 5
    for inst, plan in ((P, p_plan), (D, d_plan)):
        inst.manager.commit(plan)
        inst.runtime.submit_all(inst.manager.finish(plan))
        await inst.drain()
        inst.manager.check_invariants()
        assert all(free == cap for free, cap in inst.pools_free().values())
    assert req.input_len == 5 * spec.block_tokens


@pytest.mark.asyncio
async def test_a_pull_right_behind_the_handshake_is_kept() -> None:
    """A decode peer may pull the moment it has the prefill side's HELLO, before that
    side has started its link: the frame waits for it (it closed the link once)."""
    from kvflow.pd.link import Local
    from kvflow.pd.wire import Frame, Kind, encode

    spec = ROLE_SPECS["mha-bf16"]
    send, server = await tcp_send_port(spec, random_memory(spec, 4, 0))
    local = Local(spec, "decode", "decode")
    pull = Frame(Kind.PULL, "r", meta={"first": 0, "ids": [1, 2], "digest": 7})
    wire = b"".join(bytes(p) for f in (local.hello(), pull)
                    for p in encode(f, local.fingerprint))
    _reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(wire)  # HELLO and PULL in one segment
        await writer.drain()
        got = await asyncio.wait_for(send.pull("r"), 5)
        assert got.ids.tolist() == [1, 2] and got.digest == 7
        assert not got.link.closed and send.stats.protocol_errors == 0
    finally:
        writer.close()
        await server.close()


class _ThreadedMemory:
    """Device memory whose copies run on a worker thread and land later (as a GPU's
    do), each waiting for ``gate``: a copy still in flight can be held there."""

    def __init__(self, spec: ModelSpec, blocks: int) -> None:
        import threading

        from kvflow.pd.memory import ArrayMemory

        self.inner = poisoned_memory(spec, blocks)
        self.num_layers, self.num_blocks, self.layer_bytes = self.inner.array.shape
        self.gate = threading.Event()
        self._copy = ArrayMemory.copy_from

    def read(self, layer: int, ids: np.ndarray) -> np.ndarray:
        return self.inner.read(layer, ids)

    def write(self, layer: int, ids: np.ndarray, data: np.ndarray) -> None:
        self.inner.write(layer, ids, data)

    def copy_from(self, src: object, layer: int, s: np.ndarray, d: np.ndarray) -> object:
        def copy() -> None:
            self.gate.wait(10)
            self._copy(self.inner, src, layer, s, d)

        return asyncio.get_running_loop().run_in_executor(None, copy)


@pytest.mark.asyncio
async def test_a_receive_ends_only_once_no_copy_writes_its_blocks() -> None:
    """The sender gives up while a copy into the receiver's blocks is in flight: the
    receive fails, but only after that copy has finished (its blocks are handed back
    then, never while a copy may still write them)."""
    spec = ROLE_SPECS["mha-bf16"]
    src, dst = random_memory(spec, 8, 1), _ThreadedMemory(spec, 8)
    send, recv = inproc_ports((spec, src), (spec, dst))  # type: ignore[arg-type]
    ended: list[BaseException | None] = []
    await recv.expect("r", 0, np.array([3, 4]), prompt_digest([1, 2], 0, 2), lambda _: None,
                      ended.append)
    pull = await send.pull("r")
    put = asyncio.get_running_loop().create_task(send.put(pull, 0, 0, np.array([6, 7])))
    await asyncio.sleep(0.02)
    put.cancel()  # the sending side stops mid-frame ...
    send.give_up("r", "the prefill instance stopped", pull)  # ... and says so
    for _ in range(20):
        await asyncio.sleep(0.005)
    assert ended == []  # the copy still runs: the receive has not ended
    dst.gate.set()
    for _ in range(400):
        if ended:
            break
        await asyncio.sleep(0.005)
    assert len(ended) == 1 and "gave up" in str(ended[0])
    assert np.array_equal(dst.inner.array[0][[3, 4]], src.array[0][[6, 7]])  # it finished
