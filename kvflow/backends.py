"""``RoutedBackend``: one ``TransferBackend`` made of several, one per tier pair.

A real deployment moves device <-> host with one backend (CUDA streams, or the
CPU world's copies) and host <-> storage with another (``StoreBackend`` on a
thread pool); the runtime talks to exactly one backend. This composite routes
each op by ``(src_tier, dst_tier)`` to its sub-backend and translates ordering:

* ``after`` handles of the *same* sub-backend pass through (it orders them
  layer by layer, as it knows how);
* handles of *another* sub-backend cannot be given to it — it does not know
  them — so the op waits, on the loop, until those ops have finished before it
  is submitted at all. Coarse (no layer-wise overlap across backends) but
  correct; the pairs that meet this way (a swap-in reading a host block a
  prefetch is filling, an eviction overwriting a host block a storage write
  still reads) would serialise on the host block anyway. A same-backend op
  that is itself still waiting (not submitted yet) is waited for the same way.

Each sub-backend's ``done`` is seen through a thin sink wrapper, which is how
the composite knows when a handle has finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from kvflow.backend import TransferBackend, submit_loop
from kvflow.errors import ConfigError, TransferError
from kvflow.manager import TransferOp
from kvflow.radix import Tier


class RoutedHandle:
    """A composite handle: which sub-backend runs the op, and its handle there once submitted."""

    __slots__ = ("_waiters", "backend", "cancelled", "finished", "inner", "op", "sink")

    def __init__(self, backend: TransferBackend, op: TransferOp, sink: Any) -> None:
        self.backend = backend
        self.op = op
        self.sink = sink
        self.inner: object = None          # the sub-backend's handle, once submitted
        self.cancelled = False
        self.finished = False
        self._waiters: list[Any] = []      # callbacks run when the op finishes

    def __repr__(self) -> str:
        state = ("finished" if self.finished else "submitted" if self.inner is not None
                 else "waiting")
        return (f"RoutedHandle(op={self.op.op_id}, {self.op.kind.value}, "
                f"{type(self.backend).__name__}, {state})")


class _Sink:
    """Forwards a sub-backend's reports to the runtime's sink and marks the handle finished."""

    __slots__ = ("h",)

    def __init__(self, h: RoutedHandle) -> None:
        self.h = h

    def layer_done(self, layer: int) -> None:
        self.h.sink.layer_done(layer)

    def done(self, error: BaseException | None = None) -> None:
        h = self.h
        if h.finished:
            return
        h.finished = True
        try:
            h.sink.done(error)
        finally:  # ops waiting on this one must start even if the sink raised
            waiters, h._waiters = h._waiters, []
            for cb in waiters:
                cb()


class RoutedBackend:
    """Routes ops by ``(src_tier, dst_tier)``; see the module docstring.

    ``routes`` maps tier pairs to sub-backends, e.g.
    ``{(HOST, DEVICE): gpu, (DEVICE, HOST): gpu, (STORAGE, HOST): store,
    (HOST, STORAGE): store}``. Every sub-backend must have the same
    ``num_layers``.
    """

    def __init__(self, routes: Mapping[tuple[int, int], TransferBackend],
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not routes:
            raise ConfigError("RoutedBackend needs at least one route")
        self.routes: dict[tuple[Tier, Tier], TransferBackend] = {
            (Tier(s), Tier(d)): be for (s, d), be in routes.items()}
        layers = {be.num_layers for be in self.routes.values()}
        if len(layers) != 1:
            raise ConfigError(f"sub-backends disagree on num_layers: {sorted(layers)}")
        self.num_layers = layers.pop()
        self._loop = loop

    @property
    def backends(self) -> list[TransferBackend]:
        """The distinct sub-backends, in route order."""
        out: list[TransferBackend] = []
        for be in self.routes.values():
            if all(be is not b for b in out):
                out.append(be)
        return out

    def submit(self, op: TransferOp, sink: Any, after: Sequence[object] = ()) -> RoutedHandle:
        pair = (Tier(op.src_tier), Tier(op.dst_tier))
        backend = self.routes.get(pair)
        if backend is None:
            served = ", ".join(f"{s.name.lower()}->{d.name.lower()}" for s, d in self.routes)
            raise TransferError(
                f"no backend moves {pair[0].name.lower()} -> {pair[1].name.lower()} "
                f"(op {op.op_id}, {op.kind.value}); routes: {served}")
        h = RoutedHandle(backend, op, sink)
        waits: list[RoutedHandle] = []
        for d in after:
            if not isinstance(d, RoutedHandle):
                raise TypeError(f"op {op.op_id}: 'after' holds {d!r}, not a RoutedBackend handle")
            if d.finished:
                continue
            if d.backend is not backend or d.inner is None:
                waits.append(d)
        if not waits:
            self._start(h, after)
            return h
        pending = {"n": len(waits)}

        def one_finished() -> None:
            pending["n"] -= 1
            if pending["n"] == 0 and not h.finished:
                self._start(h, after)

        for d in waits:
            d._waiters.append(one_finished)
        return h

    def _start(self, h: RoutedHandle, after: Sequence[object]) -> None:
        if h.cancelled:
            self._end_unstarted(h)
            return
        inner_after = [d.inner for d in after  # type: ignore[attr-defined]
                       if d.backend is h.backend and d.inner is not None  # type: ignore[attr-defined]
                       and not d.finished]  # type: ignore[attr-defined]
        try:
            h.inner = h.backend.submit(h.op, _Sink(h), inner_after)
        except Exception as exc:  # refused at submit: report it like any failure, on the loop
            err = exc if isinstance(exc, TransferError) else TransferError(
                f"op {h.op.op_id} ({h.op.kind.value}): {exc}")
            self._event_loop().call_soon(_Sink(h).done, err)

    def _end_unstarted(self, h: RoutedHandle) -> None:
        """A cancelled op that never reached its sub-backend: nothing to stop, end it now."""
        if h.finished:
            return
        err = TransferError(f"op {h.op.op_id} ({h.op.kind.value}) was cancelled")
        self._event_loop().call_soon(_Sink(h).done, err)

    def cancel(self, handle: object) -> None:
        if not isinstance(handle, RoutedHandle):
            raise TypeError(f"cancel: {handle!r} is not a RoutedBackend handle")
        if handle.finished or handle.cancelled:
            return
        handle.cancelled = True
        if handle.inner is not None:
            handle.backend.cancel(handle.inner)
        else:
            self._end_unstarted(handle)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        return submit_loop(self._loop, "RoutedBackend")
