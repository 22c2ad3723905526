"""The PD verbs in engines: a prefill and a decode engine serving requests together.

The decode engine's executor checks every block it reads against the bytes its
key implies, so a request served from received KV proves the transfer bit-exact.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pd_helpers import TRANSPORTS, Pair, engine_requests, ports

from kvflow.engine import EngineRequest
from kvflow.manager import OpKind, TransferOp
from kvflow.pd.backend import ReceiveJob
from kvflow.pd.ports import prompt_digest
from kvflow.radix import Tier
from kvflow.realtime.pd_instance import Instance, InstanceConfig, tiny_spec

SPEC = tiny_spec()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_pair_serves_requests_from_received_kv(kind: str) -> None:
    reqs = engine_requests(12)
    pair = await Pair(SPEC, kind).run(reqs)
    pair.assert_clean()
    done = pair.finished()
    assert len(done) == len(reqs) and not [st.error for st in pair.D.engine.done if st.error]
    ds, ps = pair.ds.stats, pair.ps.stats
    assert ds.failed == ds.recomputed == 0 and ds.ok + ds.skipped == len(reqs) and ds.ok > 0
    assert ps.ok == len(reqs) and ps.failed == 0
    # the decode side computed one token per request (its first step), no prompt
    assert pair.D.executor.stats.prefill_tokens == len(reqs)
    assert pair.D.executor.stats.blocks_verified > sum(len(r.keys) for r in reqs)
    assert pair.D.engine.stats.recomputed_tokens == 0
    # what the decode side held already (a repeated prefix) was not sent again
    blocks = sum(len(r.keys) for r in reqs)
    assert pair.recv_port.stats.blocks == pair.send_port.stats.blocks < blocks * SPEC.num_layers
    assert all(st.generated == r.output_len - 1 for st, r in
               zip(sorted(done, key=lambda s: s.req.request_id), reqs, strict=True))


@pytest.mark.asyncio
async def test_layers_leave_while_prefill_still_computes() -> None:
    """A prompt prefilled in 4 chunks: its KV goes out chunk by chunk, layer by layer,
    and layer 0 has landed on the decode side before prefill produced its first token."""
    reqs = [EngineRequest(0, 0.0, tuple(("long", j) for j in range(8)), 8 * 16, 3)]
    pair = Pair(SPEC, "tcp", max_batch_tokens=32)
    landed: list[float] = []

    async def watch() -> None:
        while getattr(pair, "ds", None) is None or not pair.ds.stats.started:
            await asyncio.sleep(0.0005)
        task = next(t for t in pair.D.runtime.tasks.values() if t.kind is OpKind.RECEIVE)
        await task.layer(0)
        landed.append(asyncio.get_running_loop().time())

    watcher = asyncio.get_running_loop().create_task(watch())
    await pair.run(reqs)
    await asyncio.wait_for(watcher, 1)
    pair.assert_clean()
    first_token = pair.P.engine.done[0].first_token_s
    assert pair.P.executor.stats.steps == 4
    assert landed and landed[0] < first_token
    # four chunks of two blocks each, every layer: sent as written, not at the end
    assert pair.recv_port.stats.frames == 4 * SPEC.num_layers


@pytest.mark.asyncio
async def test_a_receive_waits_for_the_copy_out_still_reading_its_blocks() -> None:
    """A RECEIVE into a device block an eviction is still copying out starts only once
    that copy has read it: the host gets the old bytes, the device the new."""
    cfg = InstanceConfig(device_blocks=8, host_blocks=4, copy_bytes_per_s=2e4)
    P, D = Instance(SPEC, cfg, "prefill"), Instance(SPEC, cfg, "decode")
    rng = np.random.default_rng(1)
    P.copies.device[:] = rng.integers(1, 256, P.copies.device.shape, dtype=np.uint8)
    D.copies.device[:] = rng.integers(1, 256, D.copies.device.shape, dtype=np.uint8)
    old = D.copies.device[:, 3].copy()
    evict = TransferOp(10_000, OpKind.EVICT, Tier.DEVICE, Tier.HOST, [3], [0], ["old"])
    D.manager.inflight[evict.op_id] = evict  # a copy-out of what block 3 held before
    keys = (("k", 0), ("k", 1))
    d_plan = D.manager.plan("r", keys)
    async with ports("tcp", (SPEC, P.memory), (SPEC, D.memory)) as (send_port, recv_port):
        copy_out = D.runtime.submit(evict)
        recv_op = D.manager.remote_op(OpKind.RECEIVE, d_plan, [3, 5], [0, 1])
        D.pd.expect(recv_op, ReceiveJob("r", recv_port, 0, prompt_digest(keys, 0, 2)))
        recv = D.runtime.submit(recv_op)
        assert copy_out in recv.deps
        pulled = asyncio.get_running_loop().create_task(send_port.pull("r"))
        await asyncio.sleep(0.01)
        assert not copy_out.finished and not pulled.done()  # no pull before the copy read
        pull = await asyncio.wait_for(pulled, 5)
        assert copy_out.ok
        for layer in range(SPEC.num_layers):
            await send_port.put(pull, layer, 0, np.array([6, 7]))
        await asyncio.wait_for(recv.wait(), 5)
    assert np.array_equal(D.host.array[0], old)  # the copy-out read the old bytes
    assert np.array_equal(D.copies.device[:, [3, 5]], P.copies.device[:, [6, 7]])


@pytest.mark.asyncio
async def test_engine_hooks_hold_and_abort() -> None:
    """``on_admit`` runs once per admission, a ``held`` request is not scheduled, and
    ``abort`` gives its blocks back with the reason."""
    inst = Instance(SPEC, InstanceConfig(device_blocks=16, host_blocks=4), "decode")
    eng = inst.engine
    admitted: list[object] = []

    def on_admit(st: object) -> None:
        admitted.append(st)
        st.held = True  # type: ignore[attr-defined]

    eng.on_admit = on_admit
    run = asyncio.get_running_loop().create_task(eng.run())
    st = eng.add(EngineRequest("a", 0.0, (("x", 0), ("x", 1)), 30, 3))
    for _ in range(50):
        await asyncio.sleep(0.001)
    assert admitted == [st] and inst.executor.stats.steps == 0 and st in eng.running
    eng.abort(st, "its KV never came")
    eng.close()
    await asyncio.wait_for(run, 5)
    assert st.error == "its KV never came" and eng.stats.aborted == 1
    assert all(free == cap for free, cap in inst.pools_free().values())
    with pytest.raises(ValueError, match="not running"):
        eng.abort(st, "twice")


@pytest.mark.asyncio
async def test_a_side_keeps_its_newest_records_and_counts_them_all(monkeypatch) -> None:
    """A long-running pair must not grow with every request it served (issue 20, item 7's
    kind): each side keeps the newest ``RECORDS_KEPT`` records; the counts cover all."""
    import kvflow.pd.verbs as verbs
    monkeypatch.setattr(verbs, "RECORDS_KEPT", 4)
    reqs = engine_requests(12)
    pair = await Pair(SPEC, "inproc").run(reqs)
    pair.assert_clean()
    ds, ps = pair.ds.stats, pair.ps.stats
    assert ps.ok == len(reqs) and len(ps.records) == 4
    assert ds.ok + ds.skipped == len(reqs) and len(ds.records) == 4
