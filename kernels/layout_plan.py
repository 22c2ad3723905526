"""Pure-numpy planning for ``kernels.layout_copy``: no CuPy, no GPU, tested on any machine.

Two things are decided before a byte moves, and both are here:

* ``staging_table``: the swap kernel's ``[slot * layers + layer][role]`` table
  between a staging slot (a chunk's pieces, each G layers x every role) and
  the device caches, with each side's block stride;
* ``plan_chunks``: an op cut into chunks of at most ``per_chunk`` blocks (what
  a slot holds), its kernel id pairs (slot position, device id), and per
  group the copy descriptors (host address, offset in the slot, bytes), a run
  of consecutive host ids inside one chunk as one descriptor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.plan import pointer_table
from kvflow.host_layout import HostGeometry


def staging_table(geo: HostGeometry, dev_bases: np.ndarray, ring_base: int, slot_bytes: int,
                  slots: int, to_device: bool) -> np.ndarray:
    """``[slots * layers, roles, 4]`` for the swap kernel: staging -> caches (``to_device``)
    or caches -> staging. In slot k, layer l of group g sits at ``(l - first(g)) *
    layer_bytes`` inside each block's piece; a block id on the staging side is its
    position in the chunk, stride the group's piece bytes."""
    L, R = geo.num_layers, len(geo.role_bytes)
    stage = np.zeros((slots * L, R), dtype=np.int64)
    dev = np.zeros((slots * L, R), dtype=np.int64)
    stage_stride = np.zeros((slots * L, R), dtype=np.int64)
    dev_stride = np.broadcast_to(np.asarray(geo.role_bytes, dtype=np.int64)[None, :],
                                 (slots * L, R))
    for k in range(slots):
        base = ring_base + k * slot_bytes
        for layer in range(L):
            g = geo.group_of(layer)
            first = geo.groups[g][0]
            for r in range(R):
                stage[k * L + layer, r] = (base + (layer - first) * geo.layer_bytes
                                           + geo.role_offsets[r])
                dev[k * L + layer, r] = int(dev_bases[layer][r])
                stage_stride[k * L + layer, r] = geo.piece_bytes(g)
    if to_device:
        return pointer_table(stage, dev, stage_stride, dev_stride)
    return pointer_table(dev, stage, dev_stride, stage_stride)


@dataclass
class ChunkPlan:
    """An op's chunks and, per group, its copy descriptors (see the module docstring)."""

    chunks: list[tuple[int, int]]   # (first position, blocks) of each chunk
    pairs: np.ndarray               # int32 [2n]: the kernel's (src, dst) pairs, in op order
    bounds: list[int]               # chunk c's runs are [bounds[c], bounds[c + 1])
    host: list[np.ndarray]          # per group: host address of each run (uint64)
    stage: list[np.ndarray]         # per group: offset of each run inside its slot (uint64)
    sizes: list[np.ndarray]         # per group: bytes of each run (uint64)


def plan_chunks(geo: HostGeometry, host_ptr: int, src: np.ndarray, dst: np.ndarray,
                per_chunk: int, to_device: bool) -> ChunkPlan:
    """Plan an op of validated ids (``src``/``dst``: host -> device when ``to_device``,
    else device -> host)."""
    n = int(src.size)
    m = per_chunk
    pos = np.arange(n, dtype=np.int64)
    slot_pos = (pos % m).astype(np.int32)
    pairs = np.empty(2 * n, dtype=np.int32)
    if to_device:
        pairs[0::2], pairs[1::2] = slot_pos, dst
        host = np.asarray(src, dtype=np.int64)
    else:
        pairs[0::2], pairs[1::2] = src, slot_pos
        host = np.asarray(dst, dtype=np.int64)
    if n == 0:
        return ChunkPlan([], pairs, [0], [], [], [])
    brk = np.ones(n, dtype=bool)
    brk[1:] = (host[1:] != host[:-1] + 1) | (pos[1:] % m == 0)
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, n)).astype(np.uint64)
    nchunks = -(-n // m)
    bounds = np.searchsorted(starts // m, np.arange(nchunks + 1)).tolist()
    rel = (starts % m).astype(np.uint64)
    first_host = host[starts].astype(np.uint64)
    hosts, stages, sizes = [], [], []
    for g in range(len(geo.groups)):
        p = np.uint64(geo.piece_bytes(g))
        hosts.append(np.uint64(host_ptr + geo.group_bases[g]) + first_host * p)
        stages.append(rel * p)
        sizes.append(lengths * p)
    chunks = [(c * m, min(m, n - c * m)) for c in range(nchunks)]
    return ChunkPlan(chunks, pairs, bounds, hosts, stages, sizes)
