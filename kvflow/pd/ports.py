"""The two ends of PD transfers over links: ``SendPort`` (prefill) and ``ReceivePort`` (decode).

The decode side pulls: once it has device blocks for a request it sends
``PULL(request, first, ids, digest)`` — "positions [first, first + len(ids)) of
the prompt, into these blocks of mine" — and the prefill side answers with
``LAYER`` frames as its prefill writes each layer. Either side may give up: the
decode side with ``CANCEL`` (deadline, cancellation, a damaged frame), the
prefill side with ``ABORT`` (its send failed, or it will never prefill the
request). ``digest`` names the prompt (its block keys), so two instances that
number requests alike but hold different prompts never exchange KV.

Everything a port knows about a request is dropped when the request ends, ok or
not; a frame for a request that has ended is counted and ignored, never written.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvflow.errors import TransferError
from kvflow.pd.link import Link, LinkClosed
from kvflow.pd.memory import BlockMemory, check_ids
from kvflow.pd.wire import DamagedBody, Frame, Kind, ProtocolError


def prompt_digest(keys: Sequence[Hashable], first: int, end: int) -> int:
    """Names positions [first, end) of a prompt by its block keys (positions past
    the keys, a partial last block, count by number)."""
    return xxhash.xxh3_64_intdigest(repr((first, end, tuple(keys[first:end]))).encode())


@dataclass(frozen=True)
class Pull:
    """A decode instance's ask for one request: positions ``first ..`` into ``ids``."""

    request: str
    first: int
    ids: np.ndarray
    digest: int
    link: Link

    @property
    def end(self) -> int:
        return self.first + len(self.ids)


@dataclass
class PortStats:
    pulls: int = 0
    frames: int = 0
    blocks: int = 0
    bytes: int = 0
    cancels: int = 0
    aborts: int = 0
    stale_frames: int = 0
    corrupt_frames: int = 0
    protocol_errors: int = 0
    links_lost: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _spawn(coro: Awaitable[Any]) -> None:
    """Send a control frame without waiting (its failure is the link's, reported there)."""
    async def run() -> None:
        with contextlib.suppress(TransferError, ConnectionError, OSError):
            await coro

    asyncio.get_running_loop().create_task(run())


# --------------------------------------------------------------------------- prefill
class SendPort:
    """The prefill instance's end: pulls from any number of decode peers' links."""

    def __init__(self, memory: BlockMemory) -> None:
        self.memory = memory
        self.stats = PortStats()
        self.links: list[Link] = []
        self._pulls: dict[str, Pull] = {}
        self._waiting: dict[str, asyncio.Future[Pull]] = {}
        #: Running sends by request: told when their peer cancels or goes away.
        self._watchers: dict[str, tuple[Link, Callable[[BaseException], None]]] = {}
        #: Requests this side gave up before a pull came: answered with ABORT.
        self._given_up: dict[str, str] = {}
        #: Requests a peer refused (cancelled) before this side started sending them.
        self._refused: dict[str, str] = {}

    def attach(self, link: Link) -> None:
        link.handler = self  # type: ignore[attr-defined]
        self.links.append(link)
        start = getattr(link, "start", None)
        if start is not None:
            start(self)

    # -- the send side's calls ----------------------------------------------------------
    async def pull(self, request: str) -> Pull:
        """Wait for a decode peer to ask for ``request`` (``TransferError`` if it refused)."""
        reason = self._refused.pop(request, None)
        if reason is not None:
            raise TransferError(f"the decode peer refused request {request}: {reason}")
        pull = self._pulls.pop(request, None)
        if pull is not None:
            return pull
        fut = self._waiting.get(request)
        if fut is None or fut.done():
            fut = self._waiting[request] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.shield(fut)
        finally:
            if self._waiting.get(request) is fut and not fut.done():
                del self._waiting[request]

    def watch(self, pull: Pull, on_peer_gone: Callable[[BaseException], None]) -> None:
        """Call ``on_peer_gone(error)`` if the peer cancels ``pull`` or its link breaks."""
        self._watchers[pull.request] = (pull.link, on_peer_gone)

    def unwatch(self, request: str) -> None:
        self._watchers.pop(request, None)

    async def put(self, pull: Pull, layer: int, first: int, src_ids: np.ndarray) -> int:
        """Send layer ``layer`` of positions ``[first, first + len(src_ids))`` (our
        blocks ``src_ids``) of ``pull``'s request; returns once it has left. Bytes sent."""
        off = first - pull.first
        dst = pull.ids[off:off + len(src_ids)]
        frame = Frame(Kind.LAYER, pull.request, layer, first, dst)
        if pull.link.by_reference:
            frame.source = (self.memory, src_ids)
        else:
            frame.payload = self.memory.read(layer, src_ids)
        await pull.link.send(frame)
        n = len(src_ids) * self.memory.layer_bytes
        st = self.stats
        st.frames += 1
        st.blocks += len(src_ids)
        st.bytes += n
        return n

    def give_up(self, request: str, reason: str, pull: Pull | None = None) -> None:
        """This side will not (finish) sending ``request``: tell the peer (``ABORT``),
        now if it asked already, else when it asks."""
        self._watchers.pop(request, None)
        pending = self._pulls.pop(request, None)
        pull = pull or pending
        self.stats.aborts += 1
        if pull is not None and not pull.link.closed:
            _spawn(pull.link.send(Frame(Kind.ABORT, request, meta={"reason": reason})))
        elif pull is None:
            self._given_up[request] = reason

    # -- what the links deliver ----------------------------------------------------------
    def frame(self, link: Link, frame: Frame) -> None:
        if frame.kind is Kind.PULL:
            try:
                ids = np.asarray(frame.meta["ids"], dtype=np.int64)
                pull = Pull(frame.request, int(frame.meta["first"]), ids,
                            int(frame.meta["digest"]), link)
            except (KeyError, TypeError, ValueError) as exc:
                self.stats.protocol_errors += 1
                link.close(ProtocolError(f"malformed PULL from {link.name}: {exc!r}"))
                return
            self.stats.pulls += 1
            reason = self._given_up.pop(pull.request, None)
            if reason is not None:
                _spawn(link.send(Frame(Kind.ABORT, pull.request, meta={"reason": reason})))
                return
            fut = self._waiting.pop(pull.request, None)
            if fut is not None and not fut.done():
                fut.set_result(pull)
            else:
                self._pulls[pull.request] = pull
        elif frame.kind is Kind.CANCEL:
            self.stats.cancels += 1
            self._pulls.pop(frame.request, None)
            reason = str(frame.meta.get("reason", "?"))
            watcher = self._watchers.pop(frame.request, None)
            fut = self._waiting.pop(frame.request, None)
            if watcher is not None:
                watcher[1](TransferError(f"decode peer {link.name} cancelled request "
                                         f"{frame.request}: {reason}"))
            elif fut is not None and not fut.done():
                fut.set_exception(TransferError(
                    f"the decode peer refused request {frame.request}: {reason}"))
            else:
                self._refused[frame.request] = reason
        else:
            self.stats.protocol_errors += 1
            link.close(ProtocolError(f"unexpected {frame.kind.name} frame from decode peer "
                                     f"{link.name}"))

    def bad_frame(self, link: Link, error: DamagedBody) -> None:
        self.stats.corrupt_frames += 1  # a decode peer sends no LAYER frames
        link.close(error)

    def closed(self, link: Link, error: BaseException) -> None:
        self.stats.links_lost += 1
        with contextlib.suppress(ValueError):
            self.links.remove(link)
        for rid in [r for r, p in self._pulls.items() if p.link is link]:
            del self._pulls[rid]
        for rid, (lk, cb) in list(self._watchers.items()):
            if lk is link:
                del self._watchers[rid]
                cb(error if isinstance(error, TransferError)
                   else LinkClosed(f"link to {link.name} lost: {error!r}"))

    async def close(self) -> None:
        for link in list(self.links):
            link.close()


# --------------------------------------------------------------------------- decode
@dataclass(eq=False)
class _Receive:
    request: str
    first: int
    ids: np.ndarray
    link: Link
    on_layer: Callable[[int], None]
    on_end: Callable[[BaseException | None], None]
    num_layers: int
    next: list[int] = field(default_factory=list)   # per layer: next position expected
    complete: int = 0                                # layers fully landed
    copies: int = 0                                  # copies in flight (a GPU's)
    settled: asyncio.Future[None] | None = None


class ReceivePort:
    """The decode instance's end: one link to a prefill peer, opened by ``connect``
    (called again after the link broke: a new connection for later requests)."""

    def __init__(self, memory: BlockMemory,
                 connect: Callable[[], Awaitable[Link]] | None = None,
                 link: Link | None = None) -> None:
        if (connect is None) == (link is None):
            raise ValueError("ReceivePort needs exactly one of connect= and link=")
        self.memory = memory
        self.stats = PortStats()
        self._connect = connect
        self.link: Link | None = None
        self._connecting: asyncio.Task[Link] | None = None
        self._recv: dict[str, _Receive] = {}
        #: Every link this port has had (a broken one is replaced on the next receive).
        self.links: list[Link] = []
        if link is not None:
            self._adopt(link)

    def _adopt(self, link: Link) -> None:
        link.handler = self  # type: ignore[attr-defined]
        self.link = link
        self.links.append(link)
        start = getattr(link, "start", None)
        if start is not None:
            start(self)

    async def _get_link(self) -> Link:
        """The open link, connecting first if there is none. The connection is its own
        task, shared by every caller: one that gives up waiting does not stop it."""
        if self.link is not None and not self.link.closed:
            return self.link
        if self._connect is None:
            raise LinkClosed("the link to the prefill peer is closed")
        task = self._connecting
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None
                                             or task.result().closed)):
            task = self._connecting = asyncio.get_running_loop().create_task(self._dial())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen by callers
        return await asyncio.shield(task)

    async def _dial(self) -> Link:
        link = await self._connect()  # type: ignore[misc]
        self._adopt(link)
        return link

    # -- the receive side's calls ---------------------------------------------------------
    async def expect(self, request: str, first: int, ids: np.ndarray, digest: int,
                     on_layer: Callable[[int], None],
                     on_end: Callable[[BaseException | None], None]) -> None:
        """Pull ``request``'s positions ``[first, first + len(ids))`` into our ``ids``.

        ``on_layer(l)`` as layers 0, 1, .. have fully landed, then ``on_end(None)``;
        or ``on_end(error)`` once, whenever it fails (nothing more is written then).
        """
        check_ids(self.memory, ids, f"request {request}: destination")
        if request in self._recv:
            raise TransferError(f"request {request} is already being received")
        try:
            link = await self._get_link()
        except asyncio.CancelledError:  # given up while connecting: tell the peer once up
            self.refuse(request, "cancelled before the link to the prefill peer was up")
            raise
        L = self.memory.num_layers
        rec = _Receive(request, first, ids, link, on_layer, on_end, L, [first] * L)
        self._recv[request] = rec
        if len(ids) == 0:
            self._land_all(rec)
            return
        try:
            await link.send(Frame(Kind.PULL, request, meta={
                "first": first, "ids": ids.tolist(), "digest": digest}))
        except TransferError as exc:
            self._end(rec, exc)

    def decline(self, request: str, first: int, digest: int) -> None:
        """Tell the peer we need none of ``request``'s KV (we hold its whole prompt):
        an empty pull from ``first`` (the prompt's length in blocks), so its send ends."""
        async def send() -> None:
            link = await self._get_link()
            await link.send(Frame(Kind.PULL, request, meta={
                "first": first, "ids": [], "digest": digest}))

        _spawn(send())

    def refuse(self, request: str, reason: str) -> None:
        """Tell the peer we will not take ``request`` at all (rejected here), so its
        send stops now rather than at its deadline."""
        async def send() -> None:
            link = await self._get_link()
            await link.send(Frame(Kind.CANCEL, request, meta={"reason": reason}))

        self.stats.cancels += 1
        _spawn(send())

    def cancel(self, request: str, reason: str) -> Awaitable[None] | None:
        """Stop receiving ``request`` and tell the peer; returns an awaitable if copies
        into our blocks are still in flight (the blocks are ours again once it resolves)."""
        rec = self._recv.get(request)
        if rec is None:
            return None
        self._end(rec, TransferError(f"receive of request {request} cancelled: {reason}"),
                  tell_peer=reason)
        return rec.settled

    # -- what the link delivers -----------------------------------------------------------
    def frame(self, link: Link, frame: Frame) -> Awaitable[None] | None:
        if frame.kind is Kind.LAYER:
            return self._layer(link, frame)
        rec = self._recv.get(frame.request)
        if frame.kind is Kind.ABORT:
            self.stats.aborts += 1
            if rec is not None:
                self._end(rec, TransferError(
                    f"prefill peer {link.name} gave up request {frame.request}: "
                    f"{frame.meta.get('reason', '?')}"))
            return None
        self.stats.protocol_errors += 1
        link.close(ProtocolError(f"unexpected {frame.kind.name} frame from prefill peer "
                                 f"{link.name}"))
        return None

    def _layer(self, link: Link, frame: Frame) -> Awaitable[None] | None:
        rec = self._recv.get(frame.request)
        if rec is None or rec.link is not link:
            self.stats.stale_frames += 1  # a request that ended (cancelled, failed)
            return None
        n = frame.count
        problem = None
        if not 0 <= frame.layer < rec.num_layers:
            problem = f"layer {frame.layer} out of range"
        elif frame.first != rec.next[frame.layer] or frame.first + n > rec.first + len(rec.ids):
            problem = (f"layer {frame.layer} positions [{frame.first}, {frame.first + n}) where "
                       f"[{rec.next[frame.layer]}, {rec.first + len(rec.ids)}) was due")
        else:
            off = frame.first - rec.first
            if not np.array_equal(frame.ids, rec.ids[off:off + n]):
                problem = f"layer {frame.layer}: destination blocks are not the ones pulled"
        if problem is None and frame.source is None and frame.payload is None:
            problem = "LAYER frame without data"
        if problem is not None:
            self.stats.protocol_errors += 1
            self._end(rec, ProtocolError(f"request {frame.request} from {link.name}: {problem}"),
                      tell_peer=problem)
            return None
        if frame.source is not None:
            src, src_ids = frame.source
            res = self.memory.copy_from(src, frame.layer, src_ids, frame.ids)
        else:
            self.memory.write(frame.layer, frame.ids, frame.payload)  # type: ignore[arg-type]
            res = None
        if res is not None:
            return self._after_copy(rec, frame, res)
        self._landed(rec, frame)
        return None

    async def _after_copy(self, rec: _Receive, frame: Frame, pending: Awaitable[None]) -> None:
        rec.copies += 1
        try:
            await pending
        finally:
            rec.copies -= 1
            if rec.copies == 0 and rec.settled is not None and not rec.settled.done():
                rec.settled.set_result(None)
        if self._recv.get(rec.request) is rec:
            self._landed(rec, frame)

    def _landed(self, rec: _Receive, frame: Frame) -> None:
        st = self.stats
        st.frames += 1
        st.blocks += frame.count
        st.bytes += frame.count * self.memory.layer_bytes
        rec.next[frame.layer] = frame.first + frame.count
        end = rec.first + len(rec.ids)
        while rec.complete < rec.num_layers and rec.next[rec.complete] == end:
            rec.on_layer(rec.complete)
            rec.complete += 1
        if rec.complete == rec.num_layers:
            self._end(rec, None)

    def _land_all(self, rec: _Receive) -> None:
        for layer in range(rec.num_layers):
            rec.on_layer(layer)
        rec.complete = rec.num_layers
        self._end(rec, None)

    def _end(self, rec: _Receive, error: BaseException | None,
             tell_peer: str | None = None) -> None:
        if self._recv.get(rec.request) is not rec:
            return
        del self._recv[rec.request]
        loop = asyncio.get_running_loop()
        rec.settled = loop.create_future()
        if rec.copies == 0:
            rec.settled.set_result(None)
        if tell_peer is not None and not rec.link.closed:
            self.stats.cancels += 1
            _spawn(rec.link.send(Frame(Kind.CANCEL, rec.request,
                                       meta={"reason": tell_peer or str(error)})))
        if rec.copies and error is not None:
            # Copies still write our blocks: report the end once they have stopped.
            settled = rec.settled

            def later(_: Any) -> None:
                rec.on_end(error)

            settled.add_done_callback(later)
        else:
            rec.on_end(error)

    def bad_frame(self, link: Link, error: DamagedBody) -> None:
        self.stats.corrupt_frames += 1
        rec = self._recv.get(error.request)
        if rec is not None and rec.link is link:
            self._end(rec, error, tell_peer="a frame arrived damaged")

    def closed(self, link: Link, error: BaseException) -> None:
        self.stats.links_lost += 1
        if self.link is link:
            self.link = None
        err = error if isinstance(error, TransferError) else LinkClosed(
            f"link to {link.name} lost: {error!r}")
        for rec in [r for r in self._recv.values() if r.link is link]:
            self._end(rec, err)

    async def close(self) -> None:
        if self.link is not None:
            self.link.close()
        await asyncio.sleep(0)

