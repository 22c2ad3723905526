"""PD faults over TCP, each ending as documented, with every pool full after drain:

* the prefill peer dies mid-transfer (a real process, killed): the receive fails
  ("closed the connection mid-transfer") and the request recomputes its prefill on
  the decode side (``on_failure="recompute"``) or ends with that reason ("fail");
  later requests find the peer unreachable and do the same;
* a frame's body is damaged on the way: that request's receive fails, the prefill
  side is told (its send fails) and the request recomputes; the connection stays up
  and every other request's KV still arrives;
* a frame's header is damaged: the stream is out of step, so the link closes, what
  was in flight on it recomputes, and the next receive reconnects;
* the peers' layouts differ: the handshake refuses the link, no byte of KV moves,
  every request recomputes (or fails, naming both layouts);
* the peer is slower than the deadline: the receive is cancelled at its deadline,
  the prefill side told, and the request recomputes.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from pd_helpers import FrameFlipper, Pair, engine_requests

from kvflow.engine import EngineRequest
from kvflow.pd.transports import tcp_receive_port
from kvflow.pd.verbs import DecodeSide
from kvflow.realtime.pd_instance import Instance, InstanceConfig, tiny_spec

SPEC = tiny_spec()
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.asyncio
@pytest.mark.parametrize("on_failure", ["recompute", "fail"])
async def test_the_prefill_peer_dies_mid_transfer(on_failure: str) -> None:
    peer = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "tests" / "pd_peer_process.py"),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        port = int(await asyncio.wait_for(peer.stdout.readline(), 30))  # type: ignore[union-attr]
        D = Instance(SPEC, InstanceConfig(device_blocks=32, host_blocks=8, step_s=0.001),
                     "decode")
        side = DecodeSide(D.engine, D.pd, tcp_receive_port(SPEC, D.memory, "127.0.0.1", port),
                          deadline_s=10, on_failure=on_failure).attach()
        run = asyncio.get_running_loop().create_task(D.engine.run())
        keys = tuple(("dies", j) for j in range(6))
        st = D.engine.add(EngineRequest("r0", 0.0, keys, 6 * 16 - 3, 3))
        peer.stdin.write(b"r0\n")  # type: ignore[union-attr]
        assert await asyncio.wait_for(peer.stdout.readline(), 10) == b"sent\n"  # type: ignore[union-attr]
        for _ in range(1000):
            if side.port.stats.frames:
                break
            await asyncio.sleep(0.002)
        assert side.port.stats.frames == 1 and st.held  # layer 0 landed, the rest never will
        peer.kill()
        await peer.wait()
        for _ in range(1000):
            if not st.held:
                break
            await asyncio.sleep(0.002)
        late = D.engine.add(EngineRequest("r1", 0.0, tuple(("late", j) for j in range(3)), 40, 2))
        D.engine.close()
        await asyncio.wait_for(run, 10)
    finally:
        if peer.returncode is None:
            peer.kill()
            await peer.wait()
    await D.drain()
    errors = [r.error for r in side.stats.records]
    assert "closed the connection mid-transfer" in errors[0]
    assert "cannot reach PD peer" in errors[1]  # the peer is gone for later requests too
    assert side.stats.failed == 2 and side.stats.ok == 0
    if on_failure == "recompute":
        assert st.error is None and st.finish_s is not None and late.finish_s is not None
        assert side.stats.recomputed == 2
        assert D.engine.stats.recomputed_tokens == st.req.input_len + late.req.input_len
        assert D.executor.stats.blocks_written >= len(keys) + 2
    else:
        assert "KV transfer from the prefill instance failed" in st.error  # type: ignore[operator]
        assert "mid-transfer" in st.error and st.finish_s is None  # type: ignore[operator]
        assert side.stats.aborted == 2 and D.engine.stats.aborted == 2
    assert D.executor.stats.corrupt_reads == 0
    D.manager.check_invariants()
    assert all(free == cap for free, cap in D.pools_free().values())


@pytest.mark.asyncio
async def test_a_damaged_frame_body_fails_only_its_request() -> None:
    flip = FrameFlipper(nth=0, where="body")
    reqs = engine_requests(6, shared=6)  # no shared prefixes: every request pulls
    pair = await Pair(SPEC, proxy={"mangle": flip}).run(reqs)
    pair.assert_clean()
    assert flip.flipped and pair.proxy.connections == 1  # type: ignore[union-attr]
    ds = pair.ds.stats
    assert ds.failed == 1 and ds.recomputed == 1 and ds.ok == len(reqs) - 1
    bad = next(r for r in ds.records if not r.ok)
    assert "checksum mismatch" in bad.error  # type: ignore[operator]
    assert pair.recv_port.stats.corrupt_frames == 1
    sent = next(r for r in pair.ps.stats.records if r.request == bad.request)
    assert not sent.ok and "cancelled" in sent.error  # type: ignore[operator]
    assert len(pair.finished()) == len(reqs)


@pytest.mark.asyncio
async def test_a_damaged_frame_header_closes_the_link_and_the_next_receive_reconnects() -> None:
    flip = FrameFlipper(nth=1, where="header")
    reqs = engine_requests(6, shared=6, gap_s=0.03)
    pair = await Pair(SPEC, proxy={"mangle": flip}).run(reqs)
    pair.assert_clean()
    ds = pair.ds.stats
    assert flip.flipped and ds.failed >= 1 and ds.recomputed == ds.failed
    assert any("header checksum" in (r.error or "") for r in ds.records)
    assert ds.ok >= 1 and pair.proxy.connections == 2  # type: ignore[union-attr]
    assert len(pair.finished()) == len(reqs)


@pytest.mark.asyncio
@pytest.mark.parametrize("on_failure", ["recompute", "fail"])
async def test_a_peer_of_another_layout_is_refused_and_nothing_moves(on_failure: str) -> None:
    reqs = engine_requests(4, shared=4)
    pair = await Pair(SPEC, d_spec=SPEC.replace(num_layers=2), p_deadline_s=0.3,
                      on_failure=on_failure).run(reqs)
    pair.assert_clean()
    assert pair.server.refused and "num_layers differs" in pair.server.refused[0]
    assert pair.recv_port.stats.bytes == pair.send_port.stats.bytes == 0
    ds, ps = pair.ds.stats, pair.ps.stats
    assert ds.failed == len(reqs) and ps.failed == len(reqs)  # sends: never pulled
    assert all("num_layers differs: 4 at 'prefill', 2 at 'decode'" in r.error  # type: ignore[operator]
               for r in ds.records)
    if on_failure == "recompute":
        assert len(pair.finished()) == len(reqs) and ds.recomputed == len(reqs)
    else:
        assert not pair.finished() and ds.aborted == len(reqs)
        assert all("layouts" in st.error for st in pair.D.engine.done)  # type: ignore[operator]


@pytest.mark.asyncio
@pytest.mark.parametrize("slow_from", ["handshake", "first-layer"])
async def test_a_peer_slower_than_the_deadline_is_cancelled_and_told(slow_from: str) -> None:
    """Slow from its first byte (the receive gives up while still connecting) or from
    its first KV frame: either way the receive ends at its deadline and the prefill
    side hears of it (its sends stop then, not at their own, later deadline)."""
    reqs = engine_requests(3, shared=3, gap_s=0.0)
    hello = 1 if slow_from == "first-layer" else 0  # the HELLO passes at once, or not
    pair = await Pair(SPEC, d_deadline_s=0.15, p_deadline_s=20, proxy={
        "mangle": lambda o, c: c, "delay_s": 0.4, "delay_from": hello}).run(reqs)
    pair.assert_clean()
    ds, ps = pair.ds.stats, pair.ps.stats
    assert ds.failed == len(reqs) and ds.recomputed == len(reqs)
    assert all(r.error == "deadline passed" for r in ds.records), ds.records
    assert ps.failed == len(reqs)
    assert all("decode peer" in r.error  # type: ignore[operator]
               and ("cancelled request" in r.error or "refused request" in r.error)
               for r in ps.records), ps.records
    assert len(pair.finished()) == len(reqs)
