"""The TCP link: PD frames between two processes, on an asyncio buffered protocol.

Why not ``asyncio`` streams: a ``StreamReader`` copies every byte twice on the way
in (into its buffer, then out of it for ``readexactly``) and Python 3.11's
``writelines`` joins the pieces of a frame into one new bytes object. Here the
kernel writes each frame's parts straight into their final buffers
(``BufferedProtocol.get_buffer``: the header, the meta, then one payload buffer
reused from frame to frame), and the payload is written from the sender's
staging array without being joined to its header. The receiver checks the
header before it trusts a length in it, and the body's checksum before the
frame is delivered (``kvflow.pd.wire``).

A frame is delivered to the handler on the loop, one at a time: a handler that
returns an awaitable pauses reading until it resolves (back-pressure; the
payload buffer is not reused before). Writes wait for the transport's flow
control (``drain``) so a slow peer holds back its sender, not memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from kvflow.pd.link import (
    HANDSHAKE_TIMEOUT_S,
    FrameHandler,
    LinkClosed,
    Local,
    check_hello,
)
from kvflow.pd.wire import (
    HEADER_SIZE,
    DamagedBody,
    Frame,
    Header,
    Kind,
    LayoutMismatch,
    ProtocolError,
    decode_body,
    decode_header,
    encode,
)


class _FrameProtocol(asyncio.BufferedProtocol):
    """Reads frames into their buffers; hands each to ``deliver``; tracks write flow."""

    def __init__(self, local: Local) -> None:
        self.local = local
        self.transport: asyncio.Transport | None = None
        self.deliver: Callable[[Frame], Awaitable[None] | None] | None = None
        self.damaged: Callable[[DamagedBody], None] | None = None
        self.lost: Callable[[BaseException], None] | None = None
        self.first: asyncio.Future[Frame] | None = None   # the handshake's HELLO
        #: Frames that came after the handshake, before the link was started.
        self.early: list[Frame] = []
        self.made: asyncio.Future[None] | None = None
        self._head = bytearray(HEADER_SIZE)
        self._part = 0                                  # 0 header, 1 meta, 2 payload
        self._pos = 0
        self._header: Header | None = None
        self._meta = bytearray()
        self._payload = np.empty(0, np.uint8)
        self._view = memoryview(self._head)
        self._paused = False
        self._drain: list[asyncio.Future[None]] = []
        self._gone: BaseException | None = None
        self.stats = {"frames_out": 0, "frames_in": 0, "bytes_out": 0, "bytes_in": 0,
                      "corrupt_frames": 0}

    # -- connection --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.made is not None and not self.made.done():
            self.made.set_result(None)

    def connection_lost(self, exc: BaseException | None) -> None:
        mid = self._part != 0 or self._pos != 0
        err = self._gone or LinkClosed(
            "the peer closed the connection mid-transfer" + (" (inside a frame)" if mid else "")
            if exc is None else f"connection lost: {exc!r}")
        self._gone = err
        for fut in self._drain:
            if not fut.done():
                fut.set_exception(err)
                fut.exception()
        self._drain.clear()
        if self.first is not None and not self.first.done():
            self.first.set_exception(err)
            self.first.exception()
        if self.lost is not None:
            self.lost(err)

    def eof_received(self) -> bool:
        return False  # close our side too

    def fail(self, err: BaseException) -> None:
        """The stream cannot be trusted: drop it (``connection_lost`` reports ``err``)."""
        if self._gone is None:
            self._gone = err
        if self.transport is not None:
            self.transport.abort()

    # -- reading -----------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view[self._pos:]

    def buffer_updated(self, nbytes: int) -> None:
        self._pos += nbytes
        if self._pos < len(self._view):
            return
        try:
            self._advance()
        except ProtocolError as exc:
            self.fail(exc)

    def _advance(self) -> None:
        while True:
            if self._part == 0:
                h = self._header = decode_header(bytes(self._head))
                if h.layout_fp != self.local.fingerprint and h.kind not in (Kind.HELLO,
                                                                            Kind.REFUSE):
                    raise ProtocolError(f"{h.kind.name} frame of another KV layout")
                if len(self._meta) != h.meta_len:
                    self._meta = bytearray(h.meta_len)
                self._part, self._pos, self._view = 1, 0, memoryview(self._meta)
            elif self._part == 1:
                n = self._header.payload_len  # type: ignore[union-attr]
                if len(self._payload) < n:
                    self._payload = np.empty(max(n, 2 * len(self._payload)), np.uint8)
                self._part, self._pos = 2, 0
                self._view = memoryview(self._payload)[:n]
            else:
                self._frame_done()
                self._part, self._pos, self._view = 0, 0, memoryview(self._head)
                return
            if len(self._view):
                return  # wait for these bytes

    def _frame_done(self) -> None:
        h = self._header
        assert h is not None
        st = self.stats
        st["frames_in"] += 1
        st["bytes_in"] += HEADER_SIZE + h.meta_len + h.payload_len
        try:
            frame = decode_body(h, self._meta, self._payload[:h.payload_len],
                                self.local.layer_bytes)
        except DamagedBody as exc:
            if h.kind is not Kind.LAYER:
                raise ProtocolError(f"damaged {h.kind.name} frame: {exc}") from exc
            st["corrupt_frames"] += 1
            if self.damaged is not None:
                self.damaged(exc)
            return
        if self.first is not None and not self.first.done():
            self.first.set_result(frame)
            return
        if self.deliver is None:  # the handshake ended, its link is not started yet
            self.early.append(frame)
            return
        self._hand(frame)

    def _hand(self, frame: Frame) -> None:
        res = self.deliver(frame)  # type: ignore[misc]
        if inspect.isawaitable(res):  # hold the stream (and the payload buffer) till done
            assert self.transport is not None
            self.transport.pause_reading()
            asyncio.ensure_future(res).add_done_callback(self._resume)

    def _resume(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            self.fail(ProtocolError(f"a frame's handler failed: {fut!r}"))
        elif self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    # -- writing -----------------------------------------------------------------------
    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        for fut in self._drain:
            if not fut.done():
                fut.set_result(None)
        self._drain.clear()

    async def send(self, frame: Frame) -> None:
        if self._gone is not None or self.transport is None or self.transport.is_closing():
            raise self._gone or LinkClosed("the connection is closed")
        head, meta, payload = encode(frame, self.local.fingerprint)
        self.transport.write(bytes(head) + bytes(meta))
        if len(payload):
            self.transport.write(payload)
        self.stats["frames_out"] += 1
        self.stats["bytes_out"] += len(head) + len(meta) + len(payload)
        if self._paused:
            fut = asyncio.get_running_loop().create_future()
            self._drain.append(fut)
            await fut


class TcpLink:
    """One connection to a peer, after a successful handshake; ``start`` delivers its
    frames to a handler."""

    by_reference = False

    def __init__(self, proto: _FrameProtocol, peer_hello: Frame) -> None:
        self.proto = proto
        self.stats = proto.stats
        self.peer_name = str(peer_hello.meta.get("name", "?"))
        addr = proto.transport.get_extra_info("peername") if proto.transport else None
        where = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        self.name = f"{self.peer_name}@{where}"
        self.handler: FrameHandler | None = None
        self._closed = False
        proto.lost = self._lost

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self, handler: FrameHandler) -> None:
        self.handler = handler
        self.proto.deliver = lambda frame: handler.frame(self, frame)
        self.proto.damaged = lambda exc: handler.bad_frame(self, exc)
        early, self.proto.early = self.proto.early, []
        for frame in early:
            self.proto._hand(frame)

    async def send(self, frame: Frame) -> None:
        if self._closed:
            raise LinkClosed(f"link to {self.name} is closed")
        try:
            await self.proto.send(frame)
        except LinkClosed as exc:
            raise LinkClosed(f"link to {self.name}: {exc}") from exc

    def _lost(self, error: BaseException) -> None:
        if self._closed:
            return
        self._closed = True
        if isinstance(error, LinkClosed):
            error = LinkClosed(f"{self.name}: {error}")
        if self.handler is not None:
            self.handler.closed(self, error)

    def close(self, error: BaseException | None = None) -> None:
        if self._closed:
            return
        self.proto.fail(error or LinkClosed(f"link to {self.name} closed"))
        self._lost(error or LinkClosed(f"link to {self.name} closed"))


async def _handshake(proto: _FrameProtocol, local: Local, client: bool) -> Frame:
    """Exchange HELLOs; the side that finds the layouts differ sends REFUSE first."""
    loop = asyncio.get_running_loop()
    if client:
        await proto.send(local.hello())
    try:
        peer = await proto.first  # type: ignore[misc]
        check_hello(local, peer)
    except LayoutMismatch as exc:
        if "refused" not in str(exc):
            with contextlib.suppress(Exception):
                await proto.send(Frame(Kind.REFUSE, meta={"reason": str(exc)}))
                await asyncio.sleep(0)
        proto.fail(exc)
        raise
    except BaseException as exc:
        proto.fail(exc if isinstance(exc, Exception) else LinkClosed("handshake stopped"))
        raise
    proto.first = None
    if not client:
        await proto.send(local.hello())
    del loop
    return peer


async def connect(host: str, port: int, local: Local,
                  timeout_s: float = HANDSHAKE_TIMEOUT_S) -> TcpLink:
    """Connect to a peer's ``TcpServer`` and shake hands (``LayoutMismatch`` if refused)."""
    loop = asyncio.get_running_loop()
    proto = _FrameProtocol(local)
    proto.first = loop.create_future()
    try:
        await asyncio.wait_for(loop.create_connection(lambda: proto, host, port), timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        raise LinkClosed(f"cannot reach PD peer at {host}:{port}: {exc!r}") from exc
    try:
        peer = await asyncio.wait_for(_handshake(proto, local, client=True), timeout_s)
    except asyncio.TimeoutError as exc:
        proto.fail(LinkClosed("handshake timed out"))
        raise LinkClosed(f"handshake with {host}:{port} timed out") from exc
    except LinkClosed as exc:
        raise LinkClosed(f"handshake with {host}:{port} failed: {exc}") from exc
    return TcpLink(proto, peer)


class TcpServer:
    """Accepts peers on ``host:port`` (0: any free port; see ``port``) and hands each
    link that passes the handshake to ``on_link``. Refused peers are counted."""

    def __init__(self, local: Local, on_link: Callable[[TcpLink], None],
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.local = local
        self.on_link = on_link
        self.host = host
        self.port = port
        self.refused: list[str] = []
        self.links: list[TcpLink] = []
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> TcpServer:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def _protocol(self) -> _FrameProtocol:
        loop = asyncio.get_running_loop()
        proto = _FrameProtocol(self.local)
        proto.first = loop.create_future()
        task = loop.create_task(self._accept(proto))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return proto

    async def _accept(self, proto: _FrameProtocol) -> None:
        try:
            peer = await asyncio.wait_for(_handshake(proto, self.local, client=False),
                                          HANDSHAKE_TIMEOUT_S)
        except (ProtocolError, LinkClosed, asyncio.TimeoutError, OSError) as exc:
            self.refused.append(str(exc))
            proto.fail(exc if isinstance(exc, Exception) else LinkClosed("refused"))
            return
        link = TcpLink(proto, peer)
        self.links.append(link)
        self.on_link(link)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for link in self.links:
                link.close()
            for t in list(self._tasks):
                t.cancel()
            await self._server.wait_closed()
            self._server = None
