"""Shared pieces of the PD tests: specs covering every cache role, transports, checks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from kvflow.layout import ModelSpec
from kvflow.pd.memory import ArrayMemory, BlockMemory
from kvflow.pd.ports import ReceivePort, SendPort
from kvflow.pd.transports import inproc_ports, tcp_receive_port, tcp_send_port

#: One spec per set of roles: K/V; K/V + fp8 scales; MLA latent; MLA fp8 + scale + DSA indexer.
ROLE_SPECS = {
    "mha-bf16": ModelSpec("mha-bf16", num_layers=3, num_kv_heads=2, head_dim=16),
    "mha-fp8": ModelSpec("mha-fp8", num_layers=3, num_kv_heads=2, head_dim=16, dtype="fp8"),
    "mla-bf16": ModelSpec("mla-bf16", num_layers=2, num_kv_heads=1, head_dim=40,
                          attention="mla", kv_lora_rank=32, qk_rope_head_dim=8),
    "mla-fp8-dsa": ModelSpec("mla-fp8-dsa", num_layers=2, num_kv_heads=1, head_dim=40,
                             attention="mla", kv_lora_rank=32, qk_rope_head_dim=8,
                             indexer_head_dim=16, dtype="fp8"),
}
TRANSPORTS = ("inproc", "tcp")
POISON = 0xA5


def random_memory(spec: ModelSpec, blocks: int, seed: int) -> ArrayMemory:
    """Random bytes, never all zero (zeros hide blocks nobody wrote)."""
    lay = spec.layout
    rng = np.random.default_rng(seed)
    return ArrayMemory(rng.integers(1, 256, (lay.num_layers, blocks, lay.bytes_per_layer_block),
                                    dtype=np.uint8))


def poisoned_memory(spec: ModelSpec, blocks: int) -> ArrayMemory:
    lay = spec.layout
    return ArrayMemory(np.full((lay.num_layers, blocks, lay.bytes_per_layer_block), POISON,
                               np.uint8))


def role_slices(spec: ModelSpec) -> dict[str, slice]:
    """Each role's bytes within a block's layer row (the wire order)."""
    out, off = {}, 0
    for r in spec.layout.roles:
        out[r.name] = slice(off, off + r.bytes_per_block)
        off += r.bytes_per_block
    return out


def assert_moved(spec: ModelSpec, src: np.ndarray, src_ids: Any, dst: np.ndarray,
                 dst_ids: Any) -> None:
    """Every role of every layer landed bit-exact; no other destination block changed."""
    for name, sl in role_slices(spec).items():
        for layer in range(spec.num_layers):
            a = src[layer][np.asarray(src_ids)][:, sl]
            b = dst[layer][np.asarray(dst_ids)][:, sl]
            assert np.array_equal(a, b), f"role {name}, layer {layer} differs"
    others = np.setdiff1d(np.arange(dst.shape[1]), np.asarray(dst_ids))
    assert (dst[:, others] == POISON).all(), "a block that was not pulled was written"


@contextlib.asynccontextmanager
async def ports(kind: str, p: tuple[ModelSpec, BlockMemory],
                d: tuple[ModelSpec, BlockMemory]) -> AsyncIterator[tuple[SendPort, ReceivePort]]:
    """A prefill and a decode port over ``kind`` (in-process, or TCP on loopback)."""
    if kind == "inproc":
        send, recv = inproc_ports(p, d)
        yield send, recv
        return
    send, server = await tcp_send_port(*p)
    recv = tcp_receive_port(*d, "127.0.0.1", server.port)
    try:
        yield send, recv
    finally:
        await recv.close()
        await server.close()
        await asyncio.sleep(0)


# --------------------------------------------------------------------------- engine pairs
class Proxy:
    """A real TCP hop between a decode and a prefill port that can damage or slow the
    prefill -> decode bytes: ``mangle(offset, chunk) -> chunk`` sees every chunk with its
    stream offset; ``delay_s`` sleeps before forwarding each chunk reaching past stream
    offset ``delay_from``. Each connection through it is its own stream (offsets start
    at 0)."""

    def __init__(self, target_port: int, mangle: Any = None, delay_s: float = 0.0,
                 delay_from: int = 0) -> None:
        self.target_port = target_port
        self.mangle = mangle
        self.delay_s = delay_s
        self.delay_from = delay_from  # stream offset from which chunks are delayed
        self.port = 0
        self.connections = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        tr, tw = await asyncio.open_connection("127.0.0.1", self.target_port)
        for coro in (self._pipe(r, tw, None), self._pipe(tr, w, self.mangle)):
            t = asyncio.get_running_loop().create_task(coro)
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, mangle: Any) -> None:
        offset = 0
        try:
            while chunk := await r.read(1 << 16):
                if mangle is not None:
                    chunk = mangle(offset, chunk)
                    if self.delay_s and offset + len(chunk) > self.delay_from:
                        await asyncio.sleep(self.delay_s)
                offset += len(chunk)
                w.write(chunk)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.sleep(0)


def engine_requests(n: int, blocks: tuple[int, ...] = (5, 8, 3, 11), shared: int = 3,
                    output_len: int = 4, gap_s: float = 0.01, block_tokens: int = 16) -> list[Any]:
    """``n`` requests over ``shared`` prompt families (so prefixes repeat), each a few
    tokens short of whole blocks (a partial last block)."""
    from kvflow.engine import EngineRequest

    out = []
    for i in range(n):
        nb = blocks[i % len(blocks)]
        keys = tuple((f"fam{i % shared}", j) for j in range(nb))
        out.append(EngineRequest(i, gap_s * i, keys, nb * block_tokens - 3, output_len))
    return out


class Pair:
    """A prefill and a decode engine in one loop, over a transport; see ``run``."""

    def __init__(self, spec: ModelSpec, kind: str = "tcp", *, d_spec: ModelSpec | None = None,
                 p_blocks: int = 64, d_blocks: int = 64, max_batch_tokens: int = 64,
                 p_deadline_s: float = 5.0, d_deadline_s: float = 5.0,
                 on_failure: str = "recompute", proxy: dict[str, Any] | None = None) -> None:
        self.spec, self.d_spec, self.kind = spec, d_spec or spec, kind
        self.p_blocks, self.d_blocks, self.mbt = p_blocks, d_blocks, max_batch_tokens
        self.p_deadline_s, self.d_deadline_s = p_deadline_s, d_deadline_s
        self.on_failure = on_failure
        self.proxy_args = proxy
        self.proxy: Proxy | None = None

    async def run(self, reqs: list[Any]) -> Pair:
        from kvflow.engine import EngineRequest
        from kvflow.pd.verbs import DecodeSide, PrefillSide
        from kvflow.realtime.pd_instance import Instance, InstanceConfig

        self.P = P = Instance(self.spec, InstanceConfig(
            device_blocks=self.p_blocks, host_blocks=16, max_batch_tokens=self.mbt,
            step_s=0.001, token_s=0.0), "prefill")
        self.D = D = Instance(self.d_spec, InstanceConfig(
            device_blocks=self.d_blocks, host_blocks=16, step_s=0.001, token_s=0.0), "decode")
        server = None
        if self.kind == "inproc":
            send_port, recv_port = inproc_ports((self.spec, P.memory), (self.d_spec, D.memory))
        else:
            send_port, server = await tcp_send_port(self.spec, P.memory)
            port = server.port
            if self.proxy_args is not None:
                self.proxy = await Proxy(port, **self.proxy_args).start()
                port = self.proxy.port
            recv_port = tcp_receive_port(self.d_spec, D.memory, "127.0.0.1", port)
        self.send_port, self.recv_port, self.server = send_port, recv_port, server
        self.ps = PrefillSide(P.engine, P.pd, send_port, self.p_deadline_s).attach()
        self.ds = DecodeSide(D.engine, D.pd, recv_port, self.d_deadline_s,
                             self.on_failure).attach()
        loop = asyncio.get_running_loop()
        runs = [loop.create_task(P.engine.run()), loop.create_task(D.engine.run())]
        t0 = loop.time()
        try:
            for r in reqs:
                await asyncio.sleep(max(0.0, t0 + r.arrival_s - loop.time()))
                P.engine.add(EngineRequest(r.request_id, r.arrival_s, r.keys, r.input_len, 1))
                D.engine.add(EngineRequest(r.request_id, r.arrival_s, r.keys, r.input_len,
                                           r.output_len - 1))
            P.engine.close()
            D.engine.close()
            await asyncio.wait_for(asyncio.gather(*runs), 30)
        finally:
            for t in runs:
                t.cancel()
            await P.drain()
            await D.drain()
            await recv_port.close()
            if server is not None:
                await server.close()
            if self.proxy is not None:
                await self.proxy.close()
        return self

    def assert_clean(self) -> None:
        """No wrong byte read anywhere, every pool full, every invariant held."""
        for inst in (self.P, self.D):
            assert inst.executor.stats.corrupt_reads == 0, inst.executor.stats.examples
            inst.manager.check_invariants()
            assert not inst.runtime.tasks and not inst.pd.inflight
            pools = inst.pools_free()
            assert all(free == cap for free, cap in pools.values()), (inst.role, pools)

    def finished(self) -> list[Any]:
        return [st for st in self.D.engine.done if st.finish_s is not None]


class FrameFlipper:
    """A ``Proxy.mangle`` that walks the frames of a PD stream and flips one bit of the
    ``nth`` LAYER frame (0-based): in its payload (``where="body"``: the stream stays in
    step) or in its header (``where="header"``: the stream cannot be trusted any more)."""

    def __init__(self, nth: int = 0, where: str = "body") -> None:
        self.nth, self.where = nth, where
        self.head = bytearray()
        self.left = 0        # body bytes of the current frame still to pass
        self.body_len = 0
        self.layers = 0
        self.flipped = False
        self._target = False

    def __call__(self, offset: int, chunk: bytes) -> bytes:
        import struct

        from kvflow.pd.wire import HEADER_SIZE, Kind

        out = bytearray(chunk)
        i = 0
        while i < len(out):
            if self.left == 0:  # in a header
                take = min(HEADER_SIZE - len(self.head), len(out) - i)
                start = len(self.head)
                self.head += out[i:i + take]
                if len(self.head) == HEADER_SIZE:
                    kind, meta, payload = struct.unpack_from("<HIQ", self.head, 6)
                    self._target = (kind == Kind.LAYER and self.layers == self.nth
                                    and not self.flipped)
                    if self._target and self.where == "header":
                        j = 8 - start  # meta_len's first byte
                        if 0 <= j < take:
                            out[i + j] ^= 0x04
                            self.flipped = True
                    self.layers += kind == Kind.LAYER
                    self.left = self.body_len = meta + payload
                    self.head.clear()
                i += take
                continue
            take = min(self.left, len(out) - i)
            if self._target and self.where == "body" and not self.flipped:
                mid = self.body_len - self.body_len // 3  # inside the payload
                j = mid - (self.body_len - self.left)
                if 0 <= j < take:
                    out[i + j] ^= 0x01
                    self.flipped = True
            self.left -= take
            i += take
        return bytes(out)
