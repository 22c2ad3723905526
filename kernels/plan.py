"""Pure-Python (numpy) planning for the swap kernels: no CuPy, no GPU.

Everything decided before a byte moves lives here, so it can be tested on any
machine: validating block ids (an op either moves every block or none), cutting
the pairs into copy-engine runs and scattered singletons, and building the
tables the kernel reads (per-layer base pointers, per-role chunking).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvflow.errors import InvalidBlockId

#: Bytes one warp moves per step: 32 lanes x 16-byte vectors x 8 in flight.
#: Must equal ``kChunkBytes`` in ``swap_copy.cuh``.
CHUNK_BYTES = 32 * 16 * 8
#: Vector width of the kernel's loads and stores; every base and role size is a multiple.
VEC_BYTES = 16
#: Roles per layer the kernel supports (``kMaxRoles`` in ``swap_copy.cuh``).
MAX_ROLES = 8


def validate_ids(
    src_ids: Sequence[int] | np.ndarray,
    dst_ids: Sequence[int] | np.ndarray,
    num_src_blocks: int,
    num_dst_blocks: int,
    *,
    src_name: str = "source",
    dst_name: str = "destination",
) -> tuple[np.ndarray, np.ndarray]:
    """Check every id before anything moves; return both as int32 arrays.

    Out-of-range ids on either side and duplicate destination ids (two blocks
    landing on one) raise ``InvalidBlockId`` naming the first offender and its
    position. Duplicate *source* ids are legal: one block copied twice.
    """
    src = _as_ids(src_ids, src_name)
    dst = _as_ids(dst_ids, dst_name)
    if src.shape != dst.shape:
        raise InvalidBlockId(
            f"{src_name} and {dst_name} id lists differ in length: {src.size} != {dst.size}"
        )
    _check_range(src, num_src_blocks, src_name)
    _check_range(dst, num_dst_blocks, dst_name)
    if dst.size > 1:
        sd = np.sort(dst)
        if (sd[1:] != sd[:-1]).all():
            return src.astype(np.int32, copy=False), dst.astype(np.int32, copy=False)
        order = np.argsort(dst, kind="stable")
        sd = dst[order]
        dup = np.flatnonzero(sd[1:] == sd[:-1])
        if dup.size:
            k = int(dup[0])
            first, second = sorted((int(order[k]), int(order[k + 1])))
            raise InvalidBlockId(
                f"duplicate {dst_name} block id {int(sd[k])} at positions {first} and {second}"
            )
    return src.astype(np.int32, copy=False), dst.astype(np.int32, copy=False)


def _as_ids(ids: Sequence[int] | np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise InvalidBlockId(f"{name} ids must be a flat list, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidBlockId(f"{name} ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_range(ids: np.ndarray, capacity: int, name: str) -> None:
    if ids.size == 0 or (ids.min() >= 0 and ids.max() < capacity):
        return  # the common case: two reductions, no temporaries
    bad = np.flatnonzero((ids < 0) | (ids >= capacity))
    if bad.size:
        k = int(bad[0])
        raise InvalidBlockId(
            f"{name} block id {int(ids[k])} at position {k} is out of range [0, {capacity})"
        )


@dataclass(frozen=True)
class Runs:
    """An op's pairs split by how they move.

    ``runs`` rows are ``(src_start, dst_start, length)``: consecutive ids on both
    sides, one copy-engine ``cudaMemcpyAsync`` per role and layer. ``src``/``dst``
    are the remaining pairs, copied by the kernel.
    """

    runs: np.ndarray
    src: np.ndarray
    dst: np.ndarray

    @property
    def num_run_blocks(self) -> int:
        return int(self.runs[:, 2].sum()) if self.runs.size else 0


def split_runs(src: np.ndarray, dst: np.ndarray, min_run_blocks: int) -> Runs:
    """Coalesce maximal runs of consecutive ids (on both sides) of ``min_run_blocks`` or more.

    A run is the copy engine's case: one memcpy moves it without touching an SM.
    Shorter runs and singletons stay with the kernel, which is faster there
    (each memcpy costs microseconds of setup). ``min_run_blocks <= 0`` sends
    everything to the kernel.
    """
    src = np.asarray(src, dtype=np.int32)
    dst = np.asarray(dst, dtype=np.int32)
    n = src.size
    empty = np.zeros((0, 3), dtype=np.int64)
    if min_run_blocks <= 0 or n < max(min_run_blocks, 2):
        return Runs(empty, src, dst)
    cont = (np.diff(src) == 1) & (np.diff(dst) == 1)
    if cont.sum() < min_run_blocks - 1:
        return Runs(empty, src, dst)  # scattered ids, the common case: no run can qualify
    # starts of maximal runs: positions where the chain breaks
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lengths = np.diff(np.concatenate((starts, [n])))
    long = lengths >= min_run_blocks
    if not long.any():
        return Runs(empty, src, dst)
    rs, rl = starts[long], lengths[long]
    runs = np.stack([src[rs].astype(np.int64), dst[rs].astype(np.int64), rl], axis=1)
    keep = np.ones(n, dtype=bool)
    for s, ln in zip(rs.tolist(), rl.tolist(), strict=True):
        keep[s : s + ln] = False
    return Runs(runs, src[keep], dst[keep])


#: Longest Python-list op ``descriptor_runs`` checks without numpy: every numpy call
#: costs microseconds (7 us on some GPU hosts), and a load's ids are checked on the
#: path between its submission and the step that waits for it.
FAST_IDS = 256


def descriptor_runs(
    src_ids: Sequence[int] | np.ndarray,
    dst_ids: Sequence[int] | np.ndarray,
    num_src_blocks: int,
    num_dst_blocks: int,
    *,
    src_name: str = "source",
    dst_name: str = "destination",
) -> tuple[list[int], list[int], list[int] | None]:
    """The copy-engine path's pieces: ``(src starts, dst starts, lengths)`` of every
    maximal run of consecutive ids on both sides, singletons included; ``lengths`` is
    ``None`` when every run is a single block.

    Validates as ``validate_ids`` does, with the same errors. Python lists of ints up
    to ``FAST_IDS`` long (what ``TransferOp`` carries) are checked in plain Python;
    anything else, and any op that fails, goes through ``validate_ids`` +
    ``split_runs``, so every message comes from one place.
    """
    n = len(src_ids)
    if (type(src_ids) is list and type(dst_ids) is list and n == len(dst_ids)
            and n <= FAST_IDS and all(type(x) is int for x in src_ids)
            and all(type(x) is int for x in dst_ids)
            and all(0 <= x < num_src_blocks for x in src_ids)
            and all(0 <= x < num_dst_blocks for x in dst_ids)
            and len(set(dst_ids)) == n):
        if n == 0:
            return [], [], None
        starts_s, starts_d, lengths = [src_ids[0]], [dst_ids[0]], [1]
        for s, d, ps, pd in zip(src_ids[1:], dst_ids[1:], src_ids[:-1], dst_ids[:-1],
                                strict=True):
            if s == ps + 1 and d == pd + 1:
                lengths[-1] += 1
            else:
                starts_s.append(s)
                starts_d.append(d)
                lengths.append(1)
        return starts_s, starts_d, (lengths if len(lengths) < n else None)
    src, dst = validate_ids(src_ids, dst_ids, num_src_blocks, num_dst_blocks,
                            src_name=src_name, dst_name=dst_name)
    r = split_runs(src, dst, 2)
    if not r.runs.size:
        return r.src.tolist(), r.dst.tolist(), None
    return ([*r.runs[:, 0].tolist(), *r.src.tolist()], [*r.runs[:, 1].tolist(), *r.dst.tolist()],
            [*r.runs[:, 2].tolist(), *[1] * r.src.size])


def min_run_blocks_for(min_run_bytes: int, bytes_per_layer_block: int) -> int:
    """Run length (blocks) from which a run goes to the copy engine; 0: never."""
    if min_run_bytes <= 0:
        return 0
    return max(2, -(-min_run_bytes // bytes_per_layer_block))


def role_table(role_bytes: Sequence[int]) -> tuple[np.ndarray, int]:
    """Per-role ``(bytes, first chunk)`` rows and chunks per block (all roles).

    The kernel cuts every (layer, block) into warp-sized chunks, roles one
    after another, so a 512 KB block feeds many warps and a 16-byte fp8
    scale still takes one.
    """
    if not 1 <= len(role_bytes) <= MAX_ROLES:
        raise ValueError(
            f"the kernel supports 1..{MAX_ROLES} roles per layer, got {len(role_bytes)}"
        )
    rows = []
    first = 0
    for b in role_bytes:
        if b <= 0 or b % VEC_BYTES:
            raise ValueError(
                f"role bytes per block must be a positive multiple of {VEC_BYTES}, got {b}"
            )
        rows.append((b, first))
        first += -(-b // CHUNK_BYTES)
    return np.asarray(rows, dtype=np.int64), first


def pointer_table(src_bases: np.ndarray, dst_bases: np.ndarray,
                  src_strides: np.ndarray | Sequence[int] | None = None,
                  dst_strides: np.ndarray | Sequence[int] | None = None) -> np.ndarray:
    """``[layers, roles, 4]`` uint64 of (source base, destination base, source block
    stride, destination block stride).

    Uploaded once per direction; a launch then names a layer range, which is
    how one kernel serves both the per-layer and the all-layer launch. The
    strides (bytes from one block id to the next) broadcast to ``[layers, roles]``;
    ``None`` gives each role's own bytes, set later by ``with_strides``.
    """
    s = np.asarray(src_bases, dtype=np.uint64)
    d = np.asarray(dst_bases, dtype=np.uint64)
    if s.shape != d.shape or s.ndim != 2:
        raise ValueError(f"base tables must both be [layers, roles]; got {s.shape} and {d.shape}")
    for name, t in (("source", s), ("destination", d)):
        bad = np.flatnonzero(t.ravel() % VEC_BYTES)
        if bad.size:
            addr = int(t.ravel()[bad[0]])
            raise ValueError(f"{name} base address {addr:#x} is not 16-byte aligned")
    zero = np.zeros(s.shape, dtype=np.uint64)
    ss = zero if src_strides is None else np.broadcast_to(
        np.asarray(src_strides, dtype=np.uint64), s.shape)
    ds = zero if dst_strides is None else np.broadcast_to(
        np.asarray(dst_strides, dtype=np.uint64), s.shape)
    for name, t in (("source", ss), ("destination", ds)):
        if src_strides is not None and np.count_nonzero(t % VEC_BYTES):
            raise ValueError(f"{name} block strides must be multiples of {VEC_BYTES}")
    return np.ascontiguousarray(np.stack([s, d, ss, ds], axis=-1))


def with_role_strides(table: np.ndarray, role_bytes: Sequence[int]) -> np.ndarray:
    """``table`` with every zero stride set to its role's bytes (blocks packed per role)."""
    rb = np.asarray(role_bytes, dtype=np.uint64)[None, :]
    out = table.copy()
    for k in (2, 3):
        col = out[:, :, k]
        out[:, :, k] = np.where(col == 0, np.broadcast_to(rb, col.shape), col)
    return out


def uniform_stride(bases: np.ndarray) -> int | None:
    """Stride between consecutive layers' bases if constant (one 2-D memcpy then covers all)."""
    b = np.asarray(bases, dtype=np.int64)
    if b.size < 2:
        return 0
    diffs = np.diff(b)
    return int(diffs[0]) if (diffs == diffs[0]).all() and diffs[0] > 0 else None


def pack_ids(src: np.ndarray, dst: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Interleave pairs as the kernel reads them: ``[src0, dst0, src1, dst1, ...]`` int32."""
    n = src.size
    buf = np.empty(2 * n, dtype=np.int32) if out is None else out[: 2 * n]
    buf[0::2] = src
    buf[1::2] = dst
    return buf


#: key[j+1] - key[j] for a pair consecutive on both sides, key = dst << 32 | src.
_RUN_STEP = (1 << 32) + 1
_NO_RUNS = np.zeros((0, 3), dtype=np.int64)
#: Id dtypes the fast path takes, and the unsigned view that makes negatives huge.
_UNSIGNED = {np.dtype(t): np.dtype(t.replace("int", "uint"))
             for t in ("int8", "int16", "int32", "int64")}
_UNSIGNED.update({u: u for u in list(_UNSIGNED.values())})

#: ``alloc(n)`` -> (handle, int32 buffer of 2n, address): where ``stage_ids`` packs pairs.
StageAlloc = Callable[[int], tuple[object, np.ndarray, int]]


def stage_ids(
    src_ids: Sequence[int] | np.ndarray,
    dst_ids: Sequence[int] | np.ndarray,
    num_src_blocks: int,
    num_dst_blocks: int,
    min_run_blocks: int,
    alloc: StageAlloc,
    *,
    src_name: str = "source",
    dst_name: str = "destination",
) -> tuple[np.ndarray, int, tuple[object, np.ndarray, int] | None]:
    """Validate, split into runs, and pack the kernel's pairs into ``alloc(n)``'s buffer.

    Returns ``(runs, num_scattered, staged)``; ``staged`` is ``None`` only if
    nothing was allocated. Same result and same errors as
    ``validate_ids`` + ``split_runs`` + ``pack_ids``, but the common case — a
    valid, scattered op — takes a handful of numpy calls (``count_nonzero``
    rather than ``max``/``any``, which cost more on small arrays): range checks
    on the ids viewed unsigned (negatives wrap to huge), duplicates by one
    sort, runs by one subtraction over the packed pairs. Anything unusual takes
    the slow path, which names the offending id. Nothing is allocated on error.
    """
    src, dst = np.asarray(src_ids), np.asarray(dst_ids)
    n = src.size
    us, ud = _UNSIGNED.get(src.dtype), _UNSIGNED.get(dst.dtype)
    fast = us is not None and ud is not None and src.ndim == 1 and src.shape == dst.shape
    cnt = np.count_nonzero
    if fast and n and not cnt(src.view(us) >= num_src_blocks) and not cnt(
        dst.view(ud) >= num_dst_blocks
    ):
        sd = np.sort(dst)
        if not cnt(sd[1:] == sd[:-1]):
            staged = alloc(n)
            buf = staged[1]
            buf[0::2] = src
            buf[1::2] = dst
            key = buf.view(np.int64)
            m = min_run_blocks
            if not (m and n >= m and cnt((key[1:] - key[:-1]) == _RUN_STEP) >= m - 1):
                return _NO_RUNS, n, staged
            runs = split_runs(buf[0::2].copy(), buf[1::2].copy(), m)
            k = int(runs.src.size)
            pack_ids(runs.src, runs.dst, out=buf)
            return runs.runs, k, staged  # staged even if k == 0: the caller frees it
    s, d = validate_ids(src_ids, dst_ids, num_src_blocks, num_dst_blocks,
                        src_name=src_name, dst_name=dst_name)
    runs = split_runs(s, d, min_run_blocks)
    k = int(runs.src.size)
    if k == 0:
        return runs.runs, 0, None
    staged = alloc(k)
    pack_ids(runs.src, runs.dst, out=staged[1])
    return runs.runs, k, staged
