"""Launcher for the PD copy kernel (``pd_copy.cu``): one layer of a frame in one launch.

A PD frame moves one layer of a run of scattered blocks. The kernel reads both
sides from its arguments alone: per role a base address and a stride per index
and a stride per layer and per index (``Side``), and an optional int32 index table
on the device per side (no table: the index is the block's position in the frame,
which is how a contiguous staging buffer of rows in wire order is addressed). So
a frame costs one ``cuLaunchKernel`` with the arguments by value and no upload:
the index tables are uploaded once per transfer and the arguments packed once
per chunk by the caller (``kernels.pd_peer`` keeps both by content, so every
layer of a chunk reuses them; only the layer, the last argument, is patched).

The pure part (``Side``, ``role_chunks``, ``pack_args``, ``grid_for`` and
``emulate``, the kernel's address arithmetic in numpy) needs no GPU and is tested
on any machine; ``PdCopyKernel`` imports CuPy when built.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kernels._cuda import cupy_module, load_module
from kernels.plan import CHUNK_BYTES, MAX_ROLES, VEC_BYTES

#: Threads per CTA (``kPdThreads`` in ``pd_copy.cu``): 8 warps, one unit (chunk) each.
THREADS = 256
WARPS_PER_CTA = THREADS // 32
#: ``PdCopyArgs``: eight per-role arrays of 8 x 64-bit, two pointers, three counts, and
#: the layer last (``_LAYER`` packs it alone, at ``LAYER_OFFSET``).
_ARGS = struct.Struct(f"<{8 * MAX_ROLES}Q2Q4q")
ARGS_BYTES = _ARGS.size
_LAYER = struct.Struct("<q")
LAYER_OFFSET = ARGS_BYTES - _LAYER.size


@dataclass(frozen=True)
class Side:
    """One side of a copy: role ``r`` of the block at index ``x`` of layer ``l`` is at
    ``base[r] + l * layer_stride[r] + x * stride[r]``; ``x`` is ``ids[position]`` (an
    int32 device table's address) or, with ``ids == 0``, the position itself."""

    base: tuple[int, ...]
    layer_stride: tuple[int, ...]
    stride: tuple[int, ...]
    ids: int = 0


def cache_side(bases: Sequence[int], layer_strides: Sequence[int],
               block_strides: Sequence[int], ids: int) -> Side:
    """A cache kept as one ``[layers, blocks, role_bytes]`` array per role (addresses
    of element 0 and the two outer strides in bytes), indexed by block id."""
    return Side(tuple(bases), tuple(layer_strides), tuple(block_strides), ids)


def rows_side(base: int, role_bytes: Sequence[int]) -> Side:
    """Contiguous rows in wire order (per block every role side by side), indexed by
    position, the same for every layer: what a frame's payload is."""
    offs = np.concatenate([[0], np.cumsum(role_bytes)[:-1]]).astype(int)
    row = int(sum(role_bytes))
    n = len(role_bytes)
    return Side(tuple(base + int(o) for o in offs), (0,) * n, (row,) * n, 0)


def role_chunks(role_bytes: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """Each role's first chunk within a block's chunks, and the chunks per block."""
    first, n = [], 0
    for b in role_bytes:
        first.append(n)
        n += -(-int(b) // CHUNK_BYTES)
    return tuple(first), n


def check_layout(role_bytes: Sequence[int], addresses: Sequence[int]) -> str | None:
    """Why the kernel cannot copy these roles (None if it can): 16-byte vectors need
    every role size and address to be a multiple of 16, and at most ``MAX_ROLES``."""
    if not role_bytes or len(role_bytes) > MAX_ROLES:
        return f"{len(role_bytes)} roles (the kernel takes 1..{MAX_ROLES})"
    for v in (*role_bytes, *addresses):
        if int(v) % VEC_BYTES:
            return f"{int(v)} is not a multiple of {VEC_BYTES} bytes"
    return None


def pack_args(src: Side, dst: Side, role_bytes: Sequence[int], first: Sequence[int],
              chunks_per_block: int, num_blocks: int, layer: int = 0) -> bytes:
    """The kernel's ``PdCopyArgs`` by value (unused role slots zero)."""
    pad = (0,) * (MAX_ROLES - len(role_bytes))
    return _ARGS.pack(*src.base, *pad, *dst.base, *pad, *src.layer_stride, *pad,
                      *dst.layer_stride, *pad, *src.stride, *pad, *dst.stride, *pad,
                      *role_bytes, *pad, *first, *pad, src.ids, dst.ids,
                      len(role_bytes), chunks_per_block, num_blocks, layer)


def grid_for(num_blocks: int, chunks_per_block: int, max_ctas: int) -> int:
    """CTAs for a frame: one warp per unit, at most ``max_ctas`` (grid-stride past it)."""
    units = num_blocks * chunks_per_block
    return max(0, min(max_ctas, -(-units // WARPS_PER_CTA)))


def emulate(packed: bytes, space: np.ndarray, ids: dict[int, np.ndarray]) -> None:
    """The kernel's address arithmetic in numpy, over ``space`` (addresses are offsets
    into it) and index tables by address: what the CPU tests check the packing with."""
    v = _ARGS.unpack(packed)
    m = MAX_ROLES
    sb, db, sl, dl, ss, ds, nbytes, first = (v[k * m:(k + 1) * m] for k in range(8))
    src_ids, dst_ids, nroles, cpb, n, layer = v[8 * m:]
    sb = [b + layer * s for b, s in zip(sb, sl, strict=True)]
    db = [b + layer * s for b, s in zip(db, dl, strict=True)]
    for u in range(n * cpb):
        i, c = divmod(u, cpb)
        r = max(k for k in range(nroles) if c >= first[k])
        si = int(ids[src_ids][i]) if src_ids else i
        di = int(ids[dst_ids][i]) if dst_ids else i
        off = (c - first[r]) * CHUNK_BYTES
        ln = min(CHUNK_BYTES, nbytes[r] - off)
        s = sb[r] + si * ss[r] + off
        d = db[r] + di * ds[r] + off
        space[d:d + ln] = space[s:s + ln]


class PdCopyKernel:
    """The compiled kernel on one device, launched through ``cuLaunchKernel`` with one
    reused argument buffer (the driver copies arguments at launch). Shared by every
    memory on the device (``kernel_for``): launch from one thread, the event loop's,
    as the swap kernels are."""

    def __init__(self, device: int) -> None:
        cp = cupy_module()
        self.device = device
        fn = load_module("pd_copy.cu", device).get_function("kvflow_pd_copy")
        self._fn = fn  # keeps the module alive
        self._params = ctypes.create_string_buffer(ARGS_BYTES)
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self._params))
        self._argv_ptr = ctypes.addressof(self._argv)
        self._launch = cp.cuda.driver.launchKernel
        self._fptr = int(getattr(fn, "kernel", fn).ptr)
        with cp.cuda.Device(device):
            self.sms = int(cp.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])

    def launch(self, stream_ptr: int, packed: bytes, layer: int, grid: int) -> None:
        """Enqueue one launch on ``stream_ptr`` of ``packed`` for ``layer`` (nothing for
        an empty grid)."""
        if grid <= 0:
            return
        ctypes.memmove(self._params, packed, ARGS_BYTES)
        _LAYER.pack_into(self._params, LAYER_OFFSET, layer)
        self._launch(self._fptr, grid, 1, 1, THREADS, 1, 1, 0, stream_ptr, self._argv_ptr, 0)


_KERNELS: dict[int, PdCopyKernel] = {}


def kernel_for(device: int) -> PdCopyKernel:
    """One ``PdCopyKernel`` per device (compiled on first use)."""
    k = _KERNELS.get(device)
    if k is None:
        k = _KERNELS[device] = PdCopyKernel(device)
    return k
