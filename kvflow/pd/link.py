"""Links: how frames get from one instance to the other (the transports' one protocol).

A ``Link`` sends a ``Frame`` and returns once it has left (``await
link.send(frame)``); frames from the peer go to a ``FrameHandler``. Two kinds:

* ``InProcLink`` — two instances in one process (two engines' pools; on a GPU,
  two caches on one or two devices). A ``LAYER`` frame carries a reference to
  the source blocks, and the receiver copies them straight from the sender's
  memory (``BlockMemory.copy_from``: a numpy copy, a device-to-device or peer
  copy); ``send`` returns once that copy has landed.
* ``TcpLink`` — two processes: frames in the ``kvflow.pd.wire`` format over an
  asyncio stream, the payload staged through host memory. ``send`` returns once
  the kernel has taken the bytes (``drain``).

Both start with a handshake that refuses a peer whose KV layout is not ours
(``LayoutMismatch``). A link that breaks (EOF, reset, a damaged header) closes,
and its handler's ``closed(error)`` fails everything in flight on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable
from typing import Any, Protocol

from kvflow.errors import TransferError
from kvflow.layout import ModelSpec
from kvflow.pd.wire import (
    HEADER_SIZE,
    CorruptFrame,
    DamagedBody,
    Frame,
    Kind,
    LayoutMismatch,
    ProtocolError,
    decode_body,
    decode_header,
    encode,
    layout_descriptor,
    layout_difference,
    layout_fingerprint,
)

#: Stream buffer of a TCP link (bytes buffered before the transport pauses reading).
STREAM_LIMIT = 8 << 20
HANDSHAKE_TIMEOUT_S = 5.0


class FrameHandler(Protocol):
    """What a link delivers to: the frames of its peer, then its end."""

    def frame(self, link: Link, frame: Frame) -> Awaitable[None] | None: ...

    def bad_frame(self, link: Link, error: CorruptFrame) -> None:
        """A frame whose body failed its checksum (the stream is still in step)."""
        ...

    def closed(self, link: Link, error: BaseException) -> None: ...


class Link(Protocol):
    name: str
    #: True where ``LAYER`` frames carry ``source`` references (no payload bytes).
    by_reference: bool

    @property
    def closed(self) -> bool: ...

    async def send(self, frame: Frame) -> None: ...

    def close(self, error: BaseException | None = None) -> None: ...


class LinkClosed(TransferError):
    """The link to the peer is gone (closed, reset, or the peer died)."""


class Local:
    """One end's identity: its name, role and layout (what the handshake sends)."""

    def __init__(self, spec: ModelSpec, name: str, role: str) -> None:
        self.spec = spec
        self.name = name
        self.role = role
        self.layout = layout_descriptor(spec)
        self.fingerprint = layout_fingerprint(self.layout)
        self.layer_bytes = spec.layout.bytes_per_layer_block

    def hello(self) -> Frame:
        return Frame(Kind.HELLO, meta={"name": self.name, "role": self.role,
                                       "layout": self.layout})


def check_hello(local: Local, frame: Frame) -> None:
    """``LayoutMismatch`` unless ``frame`` is a HELLO with our layout."""
    if frame.kind is Kind.REFUSE:
        raise LayoutMismatch(f"the PD peer refused {local.name!r}: "
                             f"{frame.meta.get('reason', '?')}")
    if frame.kind is not Kind.HELLO:
        raise ProtocolError(f"expected HELLO from the peer, got {frame.kind.name}")
    peer = str(frame.meta.get("name", "?"))
    diff = layout_difference(local.layout, frame.meta.get("layout"), repr(local.name), repr(peer))
    if diff is not None:
        raise LayoutMismatch(f"KV layouts of {local.name!r} and {peer!r} differ, {diff}")


# --------------------------------------------------------------------------- in-process
class InProcLink:
    """One end of an in-process pair; ``send`` runs the peer's handler and awaits it."""

    by_reference = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.peer: InProcLink | None = None
        self.handler: FrameHandler | None = None
        self._closed = False

    @classmethod
    def pair(cls, a: Local, b: Local) -> tuple[InProcLink, InProcLink]:
        """Two connected ends (a's, b's) after the layout check (``LayoutMismatch``)."""
        check_hello(a, b.hello())
        check_hello(b, a.hello())
        x, y = cls(b.name), cls(a.name)  # each end is named after its peer
        x.peer, y.peer = y, x
        return x, y

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, frame: Frame) -> None:
        peer = self.peer
        if self._closed or peer is None or peer._closed or peer.handler is None:
            raise LinkClosed(f"link to {self.name} is closed")
        res = peer.handler.frame(peer, frame)
        if res is not None:
            await res

    def close(self, error: BaseException | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        err = error or LinkClosed(f"link to {self.name} closed")
        if self.handler is not None:
            self.handler.closed(self, err)
        if self.peer is not None:
            self.peer.close(LinkClosed(f"peer {self.peer.name} closed the link"))


# --------------------------------------------------------------------------- TCP
class TcpLink:
    """A stream to the peer after a successful handshake; ``start`` reads its frames."""

    by_reference = False

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 local: Local, peer_hello: Frame) -> None:
        self.reader = reader
        self.writer = writer
        self.local = local
        self.peer_name = str(peer_hello.meta.get("name", "?"))
        self.name = f"{self.peer_name}@{_peer_address(writer)}"
        self.handler: FrameHandler | None = None
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self.stats = {"frames_out": 0, "frames_in": 0, "bytes_out": 0, "bytes_in": 0,
                      "corrupt_frames": 0}

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self, handler: FrameHandler) -> None:
        self.handler = handler
        self._task = asyncio.get_running_loop().create_task(self._read(), name=f"pd-{self.name}")

    async def send(self, frame: Frame) -> None:
        if self._closed:
            raise LinkClosed(f"link to {self.name} is closed")
        pieces = encode(frame, self.local.fingerprint)
        self.writer.writelines(pieces)
        self.stats["frames_out"] += 1
        self.stats["bytes_out"] += sum(len(p) for p in pieces)
        try:
            await self.writer.drain()
        except (ConnectionError, OSError) as exc:
            err = LinkClosed(f"link to {self.name} broke while sending: {exc!r}")
            self.close(err)
            raise err from exc

    async def _read(self) -> None:
        error: BaseException
        try:
            while True:
                try:
                    frame = await read_frame(self.reader, self.local, self.stats)
                except DamagedBody as exc:
                    self.handler.bad_frame(self, exc)  # type: ignore[union-attr]
                    continue
                res = self.handler.frame(self, frame)  # type: ignore[union-attr]
                if inspect.isawaitable(res):
                    await res
        except asyncio.IncompleteReadError:
            error = LinkClosed(f"peer {self.name} closed the connection mid-transfer")
        except (ConnectionError, OSError) as exc:
            error = LinkClosed(f"connection to {self.name} lost: {exc!r}")
        except ProtocolError as exc:
            error = exc
        except asyncio.CancelledError:
            error = LinkClosed(f"link to {self.name} closed")
        self._task = None
        self.close(error)

    def close(self, error: BaseException | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.writer.close()
        if self._task is not None and self._task is not _current_task():
            self._task.cancel()
        if self.handler is not None:
            self.handler.closed(self, error or LinkClosed(f"link to {self.name} closed"))

    async def wait_closed(self) -> None:
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


def _peer_address(writer: asyncio.StreamWriter) -> str:
    addr = writer.get_extra_info("peername")
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)


async def read_frame(reader: asyncio.StreamReader, local: Local,
                     stats: dict[str, int] | None = None) -> Frame:
    """The next frame.

    Raises ``asyncio.IncompleteReadError`` at EOF, ``DamagedBody`` for a LAYER frame
    whose body failed its checksum (the stream is still in step), and
    ``ProtocolError`` when the stream cannot be trusted any more (a bad header, a
    damaged control frame, a frame of another layout).
    """
    raw = await reader.readexactly(HEADER_SIZE)
    header = decode_header(raw)
    meta = await reader.readexactly(header.meta_len) if header.meta_len else b""
    payload = await reader.readexactly(header.payload_len) if header.payload_len else b""
    if stats is not None:
        stats["frames_in"] += 1
        stats["bytes_in"] += HEADER_SIZE + header.meta_len + header.payload_len
    if header.layout_fp != local.fingerprint and header.kind not in (Kind.HELLO, Kind.REFUSE):
        raise ProtocolError(f"{header.kind.name} frame of another KV layout "
                            f"({header.layout_fp:#x}, ours {local.fingerprint:#x})")
    try:
        return decode_body(header, meta, payload, local.layer_bytes)
    except DamagedBody as exc:
        if header.kind is not Kind.LAYER:  # a control frame we cannot read: state unknown
            raise ProtocolError(f"damaged {header.kind.name} frame: {exc}") from exc
        if stats is not None:
            stats["corrupt_frames"] += 1
        raise


async def _handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, local: Local,
                     client: bool) -> Frame:
    """Exchange HELLOs; the side that finds the layouts differ sends REFUSE first."""
    async def send(frame: Frame) -> None:
        writer.writelines(encode(frame, local.fingerprint))
        await writer.drain()

    if client:
        await send(local.hello())
    peer = await read_frame(reader, local)
    try:
        check_hello(local, peer)
    except LayoutMismatch as exc:
        if peer.kind is not Kind.REFUSE:
            with contextlib.suppress(Exception):
                await send(Frame(Kind.REFUSE, meta={"reason": str(exc)}))
        raise
    if not client:
        await send(local.hello())
    return peer


async def connect(host: str, port: int, local: Local,
                  timeout_s: float = HANDSHAKE_TIMEOUT_S) -> TcpLink:
    """Connect to a peer's ``TcpServer`` and shake hands (``LayoutMismatch`` if refused)."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=STREAM_LIMIT), timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        raise LinkClosed(f"cannot reach PD peer at {host}:{port}: {exc!r}") from exc
    try:
        peer = await asyncio.wait_for(_handshake(reader, writer, local, client=True), timeout_s)
    except BaseException as exc:
        writer.close()
        if isinstance(exc, (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError)):
            raise LinkClosed(f"handshake with {host}:{port} failed: {exc!r}") from exc
        raise
    _nodelay(writer)
    return TcpLink(reader, writer, local, peer)


class TcpServer:
    """Accepts peers on ``host:port`` (0: any free port; see ``port``) and hands each
    link that passes the handshake to ``on_link``. Refused peers are counted."""

    def __init__(self, local: Local, on_link: Any, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.local = local
        self.on_link = on_link
        self.host = host
        self.port = port
        self.refused: list[str] = []
        self._server: asyncio.base_events.Server | None = None
        self.links: list[TcpLink] = []

    async def start(self) -> TcpServer:
        self._server = await asyncio.start_server(self._accept, self.host, self.port,
                                                  limit=STREAM_LIMIT)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer = await asyncio.wait_for(_handshake(reader, writer, self.local, client=False),
                                          HANDSHAKE_TIMEOUT_S)
        except (ProtocolError, asyncio.IncompleteReadError, ConnectionError,
                asyncio.TimeoutError, OSError) as exc:
            self.refused.append(str(exc))
            writer.close()
            return
        _nodelay(writer)
        link = TcpLink(reader, writer, self.local, peer)
        self.links.append(link)
        self.on_link(link)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for link in self.links:
                link.close()
            await self._server.wait_closed()
            self._server = None


def _nodelay(writer: asyncio.StreamWriter) -> None:
    import socket

    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
