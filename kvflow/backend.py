"""The one seam between the scheduler and a world that moves bytes.

The simulated world (``sim``) and the real one (``kernels``) each implement
``TransferBackend``; everything above — manager, runtime, engine — is shared.
A backend never decides anything: it runs the op it is handed, after the ops
it is told to follow, and reports each layer as it lands.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol, TypeVar, runtime_checkable

from kvflow.manager import TransferOp


@runtime_checkable
class LayerSink(Protocol):
    """Where a backend reports progress of one op.

    Both methods must be called on the event loop's thread (a backend whose
    completions arrive elsewhere — a CUDA host callback — hops over with
    ``loop.call_soon_threadsafe``). Layers are reported in order 0..L-1, then
    ``done`` exactly once; ``done(error)`` may come early, after any layer.
    """

    def layer_done(self, layer: int) -> None: ...

    def done(self, error: BaseException | None = None) -> None: ...


@runtime_checkable
class TransferBackend(Protocol):
    """Moves the blocks of ``TransferOp``s between tiers, layer by layer."""

    num_layers: int

    def submit(self, op: TransferOp, sink: LayerSink, after: Sequence[object]) -> object:
        """Start ``op`` without blocking; return a handle for ``after`` and ``cancel``.

        ``after`` holds handles of earlier ops that touch the same blocks:
        layer i of ``op`` may move only once layer i of each of them has.
        """
        ...

    def cancel(self, handle: object) -> None:
        """Stop an op if it has not finished; its sink then gets ``done(error)``."""
        ...


class _Handle(Protocol):
    finished: bool


H = TypeVar("H", bound=_Handle)


def pending_after(
    op: TransferOp, after: Sequence[object], handle_type: type[H], backend: str
) -> list[H]:
    """The handles in ``op``'s ``after`` that have not finished yet, for ``op`` to wait on.

    A backend can wait only on its own ops: a handle of another kind means ops of
    several backends were submitted past ``RoutedBackend``, the one place that
    orders them across backends. That is refused here, naming the op, rather
    than left to hang or race.
    """
    pending: list[H] = []
    for d in after:
        if not isinstance(d, handle_type):
            raise TypeError(f"op {op.op_id}: 'after' holds {d!r}, not a {backend} handle "
                            "(route mixed backends through RoutedBackend)")
        if not d.finished:
            pending.append(d)
    return pending


def submit_loop(fallback: asyncio.AbstractEventLoop | None, who: str) -> asyncio.AbstractEventLoop:
    """The loop an op's callbacks go to: the running one, else the one given at
    construction (a backend driven from outside its loop's thread, e.g. a test)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        if fallback is None:
            raise RuntimeError(f"{who} needs a running event loop "
                               "or loop= at construction") from None
        return fallback
