"""``CudaHostBlocks``: ``CudaBackend``'s pinned host pool as whole blocks, for a store.

``CudaBackend`` keeps its pinned host pool as one buffer per role, each
``[num_layers, num_host_blocks, role_bytes]`` (``host_kv(layer, role)`` is one
layer's rows): the layout its copy kernels want. A block store wants a block
as one byte string in the order ``[layer][role][role bytes]`` (see
``kvflow.host_memory``), which in that pool is ``L x R`` separate rows. So
this adapter has no ``block_view`` (``None``) and copies through a staging
buffer: ``gather`` before a store write, ``scatter`` after a store read — one
row copy per (layer, role), host memory to host memory. ``StoreBackend`` does
the staging; wire it as::

    gpu = CudaBackend(spec, device_blocks, host_blocks)
    store = StoreBackend(AsyncStore(LocalDirStore(root, Namespace.for_model(spec))),
                         CudaHostBlocks(gpu), spec.num_layers)
    backend = RoutedBackend({(HOST, DEVICE): gpu, (DEVICE, HOST): gpu,
                             (STORAGE, HOST): store, (HOST, STORAGE): store})

With ``--host-layout block_major`` (``kvflow.host_layout``) a block is one
contiguous piece of the pool, in exactly the store's order, so ``block_view``
hands it out and stores read into pinned memory in place.

Needs only numpy and the backend's ``host_kv``; importing it needs no GPU.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from kvflow.errors import InvalidBlockId


class CudaHostBlocks:
    """``kvflow.host_memory.HostMemory`` over a ``CudaBackend``'s pinned host pool."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.num_layers = int(backend.num_layers)
        self.num_blocks = int(backend.num_host_blocks)
        self.roles = tuple(backend.roles)
        self.role_bytes = tuple(int(b) for b in backend.role_bytes)
        self.layer_bytes = sum(self.role_bytes)
        self.bytes_per_block = self.num_layers * self.layer_bytes
        offsets = [int(x) for x in np.cumsum((0, *self.role_bytes))]
        self._slices = [slice(a, b) for a, b in itertools.pairwise(offsets)]

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockId(f"host block {block_id} out of range [0, {self.num_blocks})")

    def block_view(self, block_id: int) -> np.ndarray | None:
        """The block itself where the pool's host layout keeps it contiguous
        (``block_major``: stores read and write it in place); else ``None``."""
        self._check(block_id)
        view = getattr(self.backend, "host_block_view", None)
        return None if view is None else view(block_id)

    def gather(self, block_id: int, out: np.ndarray) -> None:
        self._check(block_id)
        rows = out.reshape(self.num_layers, self.layer_bytes)
        for layer in range(self.num_layers):
            for role, sl in zip(self.roles, self._slices, strict=True):
                rows[layer, sl] = self.backend.host_kv(layer, role)[block_id]

    def scatter(self, block_id: int, src: np.ndarray) -> None:
        self._check(block_id)
        rows = src.reshape(self.num_layers, self.layer_bytes)
        for layer in range(self.num_layers):
            for role, sl in zip(self.roles, self._slices, strict=True):
                self.backend.host_kv(layer, role)[block_id] = rows[layer, sl]
