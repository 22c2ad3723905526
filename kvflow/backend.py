"""The one seam between the scheduler and a world that moves bytes.

The simulated world (``sim``) and the real one (``kernels``) each implement
``TransferBackend``; everything above — manager, runtime, engine — is shared.
A backend never decides anything: it runs the op it is handed, after the ops
it is told to follow, and reports each layer as it lands.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

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
