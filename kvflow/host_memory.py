"""Host (pinned CPU) memory as whole blocks: what a storage backend reads and writes.

A block store keeps a block as one opaque byte string: every layer, every
role, in one fixed order (layer-major; within a layer the layout's roles in
order — ``[L][roles][role bytes]``). Host memory is laid out however its owner
needs: ``HostArrays`` keeps each block contiguous in exactly that order (the
CPU world), while the CUDA world's pinned pool is one buffer per role and
layer (``CudaBackend.host_kv(layer, role)``), where a block is ``L x R``
separate rows. ``HostMemory`` covers both: ``block_view`` hands out the block
itself where it is contiguous, so a store reads straight into it
(``get_many_into``) and writes straight from it, with no copy; otherwise
``gather``/``scatter`` copy through a contiguous staging buffer.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from kvflow.errors import ConfigError, InvalidBlockId
from kvflow.layout import KVLayout


@runtime_checkable
class HostMemory(Protocol):
    """Host blocks as ``bytes_per_block`` byte strings in the store's order."""

    num_blocks: int
    bytes_per_block: int

    def block_view(self, block_id: int) -> np.ndarray | None:
        """A writable, C-contiguous ``uint8[bytes_per_block]`` aliasing the block, or
        ``None`` where the block is not contiguous (then use gather / scatter)."""
        ...

    def gather(self, block_id: int, out: np.ndarray) -> None:
        """Copy the block's bytes into ``out`` (``uint8[bytes_per_block]``)."""
        ...

    def scatter(self, block_id: int, src: np.ndarray) -> None:
        """Copy ``src`` (``uint8[bytes_per_block]``) into the block."""
        ...


class HostArrays:
    """Host blocks in one numpy array ``uint8[num_blocks, num_layers, layer_bytes]``.

    Block-major, so every block is contiguous in the store's order and a store
    reads into it in place; ``layer(i)`` is the strided
    ``[num_blocks, layer_bytes]`` view a device <-> host copy moves per layer.
    Plain (pageable) memory: this is the CPU world's host tier.
    """

    def __init__(self, num_blocks: int, num_layers: int, layer_bytes: int) -> None:
        for name, v in (("num_blocks", num_blocks), ("num_layers", num_layers),
                        ("layer_bytes", layer_bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"HostArrays {name} must be a positive integer, got {v!r}")
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.layer_bytes = layer_bytes
        self.bytes_per_block = num_layers * layer_bytes
        self.array = np.zeros((num_blocks, num_layers, layer_bytes), dtype=np.uint8)

    @classmethod
    def for_layout(cls, layout: KVLayout, num_blocks: int) -> HostArrays:
        return cls(num_blocks, layout.num_layers, layout.bytes_per_layer_block)

    def _check(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockId(f"host block {block_id} out of range [0, {self.num_blocks})")
        return block_id

    def block_view(self, block_id: int) -> np.ndarray:
        return self.array[self._check(block_id)].reshape(-1)

    def gather(self, block_id: int, out: np.ndarray) -> None:
        out[:] = self.block_view(block_id)

    def scatter(self, block_id: int, src: np.ndarray) -> None:
        self.block_view(block_id)[:] = src

    def layer(self, layer: int) -> np.ndarray:
        """``uint8[num_blocks, layer_bytes]`` of one layer (a strided view)."""
        return self.array[:, layer, :]
