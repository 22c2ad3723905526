"""Where a PD transfer reads and writes KV: one instance's device blocks, layer by layer.

A transport moves one layer of a run of blocks at a time, as bytes in the wire
order (per block, every role of the layer in the layout's order: what
``HostCopyBackend``'s device rows already are). ``BlockMemory`` is that view of
an instance's device cache: ``read`` gathers a layer of some blocks into host
bytes (the staging copy a socket sends), ``write`` scatters them back, and
``copy_from`` moves them straight from another memory in the same address space
(two engines' numpy pools; on a GPU, a device-to-device or peer copy:
``kernels.pd_peer``), returning an awaitable when the copy finishes later.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol, runtime_checkable

import numpy as np

from kvflow.errors import ConfigError, InvalidBlockId


@runtime_checkable
class BlockMemory(Protocol):
    num_layers: int
    num_blocks: int
    layer_bytes: int

    def read(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """``uint8[len(ids), layer_bytes]``: layer ``layer`` of blocks ``ids`` (a copy)."""
        ...

    def write(self, layer: int, ids: np.ndarray, data: np.ndarray) -> None:
        """Write ``data`` (``uint8[len(ids), layer_bytes]``) into layer ``layer`` of ``ids``."""
        ...

    def copy_from(self, src: BlockMemory, layer: int, src_ids: np.ndarray,
                  dst_ids: np.ndarray) -> Awaitable[None] | None:
        """Copy layer ``layer`` of ``src``'s ``src_ids`` into our ``dst_ids``; None when
        done at once, else an awaitable resolved once the bytes are there."""
        ...


def check_ids(memory: BlockMemory, ids: np.ndarray, what: str) -> None:
    """``InvalidBlockId`` naming ``what`` if an id is outside ``memory``."""
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= memory.num_blocks):
        bad = next(int(b) for b in ids if not 0 <= b < memory.num_blocks)
        raise InvalidBlockId(f"{what} block {bad} out of range [0, {memory.num_blocks})")


class ArrayMemory:
    """Device KV as one numpy array ``uint8[num_layers, num_blocks, layer_bytes]``
    (``HostCopyBackend.device``, the CPU world's device)."""

    def __init__(self, array: np.ndarray) -> None:
        if array.ndim != 3 or array.dtype != np.uint8:
            raise ConfigError(f"ArrayMemory needs uint8[layers, blocks, layer_bytes], "
                              f"got {array.dtype}{list(array.shape)}")
        self.array = array
        self.num_layers, self.num_blocks, self.layer_bytes = array.shape

    def read(self, layer: int, ids: np.ndarray) -> np.ndarray:
        return self.array[layer][ids]

    def write(self, layer: int, ids: np.ndarray, data: np.ndarray) -> None:
        self.array[layer][ids] = data

    def copy_from(self, src: BlockMemory, layer: int, src_ids: np.ndarray,
                  dst_ids: np.ndarray) -> None:
        if isinstance(src, ArrayMemory):
            self.array[layer][dst_ids] = src.array[layer][src_ids]
        else:
            self.write(layer, dst_ids, src.read(layer, src_ids))
        return None
