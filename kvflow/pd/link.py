"""Links: how frames get from one instance to the other (the transports' one protocol).

A ``Link`` sends a ``Frame`` and returns once it has left (``await
link.send(frame)``); frames from the peer go to a ``FrameHandler``. Two kinds:

* ``InProcLink`` — two instances in one process (two engines' pools; on a GPU,
  two caches on one or two devices). A ``LAYER`` frame carries a reference to
  the source blocks, and the receiver copies them straight from the sender's
  memory (``BlockMemory.copy_from``: a numpy copy, a device-to-device or peer
  copy); ``send`` returns once that copy has landed.
* ``TcpLink`` (``kvflow.pd.tcp``) — two processes: frames in the
  ``kvflow.pd.wire`` format over a TCP connection, the payload staged through
  host memory. ``send`` returns once the kernel has taken the bytes.

Both start with a handshake that refuses a peer whose KV layout is not ours
(``LayoutMismatch``). A link that breaks (EOF, reset, a damaged header) closes,
and its handler's ``closed(error)`` fails everything in flight on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Protocol

from kvflow.errors import TransferError
from kvflow.layout import ModelSpec
from kvflow.pd.wire import (
    CorruptFrame,
    Frame,
    Kind,
    LayoutMismatch,
    ProtocolError,
    layout_descriptor,
    layout_difference,
    layout_fingerprint,
)

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
            # The receiver's copy runs to its end even if this sender is cancelled: the
            # receiver hands its blocks back only once no copy writes them any more.
            await asyncio.shield(asyncio.ensure_future(res))

    def close(self, error: BaseException | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        err = error or LinkClosed(f"link to {self.name} closed")
        if self.handler is not None:
            self.handler.closed(self, err)
        if self.peer is not None:
            self.peer.close(LinkClosed(f"peer {self.peer.name} closed the link"))
