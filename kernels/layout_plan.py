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

import functools
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
    host: np.ndarray                # [group, run]: host address of each run (uint64)
    stage: np.ndarray               # [group, run]: offset of each run inside its slot
    sizes: np.ndarray               # [group, run]: bytes of each run


def plan_chunks(geo: HostGeometry, host_ptr: int, src: np.ndarray | list[int],
                dst: np.ndarray | list[int], per_chunk: int, to_device: bool) -> ChunkPlan:
    """Plan an op of validated ids (``src``/``dst``: host -> device when ``to_device``,
    else device -> host). Python lists take a plain-Python path (same plan): a short
    op's planning is then a handful of numpy calls instead of thirty."""
    if isinstance(src, list):
        return _plan_small(geo, host_ptr, src, dst, per_chunk, to_device)  # type: ignore[arg-type]
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
        empty = np.zeros((len(geo.groups), 0), dtype=np.uint64)
        return ChunkPlan([], pairs, [0], empty, empty, empty)
    brk = np.ones(n, dtype=bool)
    brk[1:] = (host[1:] != host[:-1] + 1) | (pos[1:] % m == 0)
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, n)).astype(np.uint64)
    nchunks = -(-n // m)
    bounds = np.searchsorted(starts // m, np.arange(nchunks + 1)).tolist()
    rel = (starts % m).astype(np.uint64)
    hosts, stages, sizes = _descriptors(geo, host_ptr, host[starts], rel, lengths)
    chunks = [(c * m, min(m, n - c * m)) for c in range(nchunks)]
    return ChunkPlan(chunks, pairs, bounds, hosts, stages, sizes)


@functools.lru_cache(maxsize=64)
def _group_columns(geo: HostGeometry, host_ptr: int) -> tuple[np.ndarray, np.ndarray]:
    """Each group's piece bytes and host address of its region, as ``[groups, 1]`` columns."""
    pieces = np.asarray([geo.piece_bytes(g) for g in range(len(geo.groups))],
                        dtype=np.uint64)[:, None]
    bases = np.asarray(geo.group_bases, dtype=np.uint64)[:, None] + np.uint64(host_ptr)
    pieces.flags.writeable = bases.flags.writeable = False
    return pieces, bases


def _descriptors(geo: HostGeometry, host_ptr: int, first_host: list[int], rel: list[int],
                 lengths: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pieces, bases = _group_columns(geo, host_ptr)
    return (bases + np.asarray(first_host, dtype=np.uint64)[None, :] * pieces,
            np.asarray(rel, dtype=np.uint64)[None, :] * pieces,
            np.asarray(lengths, dtype=np.uint64)[None, :] * pieces)


def _plan_small(geo: HostGeometry, host_ptr: int, src: list[int], dst: list[int],
                per_chunk: int, to_device: bool) -> ChunkPlan:
    n, m = len(src), per_chunk
    host = src if to_device else dst
    pairs: list[int] = []
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        pairs += (i % m, d) if to_device else (s, i % m)
    first_host: list[int] = []
    rel: list[int] = []
    lengths: list[int] = []
    bounds = [0]
    for i, h in enumerate(host):
        if i % m == 0:
            if i:
                bounds.append(len(first_host))
        elif h == host[i - 1] + 1:
            lengths[-1] += 1
            continue
        first_host.append(h)
        rel.append(i % m)
        lengths.append(1)
    if n:
        bounds.append(len(first_host))
    hosts, stages, sizes = _descriptors(geo, host_ptr, first_host, rel, lengths)
    chunks = [(c * m, min(m, n - c * m)) for c in range(-(-n // m))]
    return ChunkPlan(chunks, np.asarray(pairs, dtype=np.int32), bounds, hosts, stages, sizes)


@dataclass
class FixedTables:
    """Descriptor tables that do not depend on the op, built once per copier, so a scattered
    op's descriptors are one gather (host addresses) and pointers into these (staging
    addresses, sizes): on the H100 host every numpy call costs microseconds."""

    host: np.ndarray    # [group, host block]: host address of the block's piece (uint64)
    stage: np.ndarray   # [slot, group, position]: absolute staging address (uint64)
    sizes: np.ndarray   # [group, position]: the group's piece bytes (uint64)

    def gather(self, host_ids: list[int]) -> np.ndarray:
        """``[group, op block]`` host addresses of an op's pieces, C-contiguous (the copier
        hands row slices to the driver by address; ``host[:, ids]`` would be Fortran-ordered)."""
        return np.take(self.host, host_ids, axis=1)


def fixed_tables(geo: HostGeometry, host_ptr: int, ring_base: int, slot_bytes: int, slots: int,
                 per_chunk: int) -> FixedTables:
    pieces, bases = _group_columns(geo, host_ptr)
    blocks = np.arange(geo.num_blocks, dtype=np.uint64)[None, :]
    pos = np.arange(per_chunk, dtype=np.uint64)[None, :]
    slot_bases = (np.uint64(ring_base)
                  + np.arange(slots, dtype=np.uint64) * np.uint64(slot_bytes))[:, None, None]
    return FixedTables(np.ascontiguousarray(bases + blocks * pieces),
                       np.ascontiguousarray(slot_bases + (pos * pieces)[None, :, :]),
                       np.ascontiguousarray(np.broadcast_to(pieces, (len(pieces), per_chunk))))


def merges_none(host: list[int], per_chunk: int) -> bool:
    """Whether no two neighbours inside a chunk have consecutive host ids: then every block
    is its own descriptor, at its position in the chunk (``FixedTables`` applies)."""
    return not any(host[i] == host[i - 1] + 1 and i % per_chunk
                   for i in range(1, len(host)))
