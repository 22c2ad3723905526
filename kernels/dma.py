"""Scattered block copies on the copy engine: one batched driver call per launch.

The swap kernel's PCIe traffic is issued by SMs as 128-byte transactions and
tops out near 51/52 GB/s each way and ~80 both ways on an H100, where the
copy engine moves 55 / 55 / 93-101. ``cuMemcpyBatchAsync`` (CUDA 12.8+) hands
the copy engine a whole list of ``(dst, src, size)`` descriptors in one call,
so scattered blocks get the engine's rate without one ``cudaMemcpyAsync`` per
block (4.8 GB/s at 16 KB) and without taking SMs from compute.

CuPy does not wrap that call, so this binds the driver's C entry point with
ctypes: ``libcuda`` is always present where CuPy can run, whatever CUDA build
of CuPy is installed. ``batch_memcpy_unavailable_reason()`` says why the path
cannot be used (older driver, no libcuda), and callers fall back to the kernel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Sequence

import numpy as np

#: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: read the source in stream order (it may
#: have just been written by an earlier op on the stream).
_SRC_ORDER_STREAM = 1
#: CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE (a hint; ignored where unsupported).
_FLAG_PREFER_OVERLAP = 1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes_v1`` from ``cuda.h``."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


class BatchMemcpyError(RuntimeError):
    """The driver refused a batch (its ``CUresult`` is in the message)."""


class _Binding:
    """The resolved driver entry point and its calling convention."""

    def __init__(self, fn: ctypes._CFuncPtr, has_fail_idx: bool) -> None:  # type: ignore[name-defined]
        self.fn = fn
        self.has_fail_idx = has_fail_idx  # CUDA 12.8/12.9 ABI: a size_t* failIdx before the stream


def _load_libcuda() -> ctypes.CDLL:
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda") or "", "nvcuda.dll"):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("the CUDA driver library (libcuda) was not found")


@functools.cache
def _binding() -> _Binding | str:
    """The driver's batched memcpy, or a string saying why there is none."""
    try:
        lib = _load_libcuda()
    except OSError as exc:
        return str(exc)
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return "cuDriverGetVersion failed"
    if version.value < 12080:
        return f"the driver supports CUDA {version.value // 1000}.{version.value % 1000 // 10}; "\
               "batched memcpy needs 12.8 or newer"
    p = ctypes.c_void_p
    # CUDA 13 renamed the ABI without failIdx to ``_v2``; 12.8/12.9 export only the first.
    fn = getattr(lib, "cuMemcpyBatchAsync_v2", None)
    if fn is not None:
        fn.argtypes = [p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t, p]
        fn.restype = ctypes.c_int
        return _Binding(fn, has_fail_idx=False)
    fn = getattr(lib, "cuMemcpyBatchAsync", None)
    if fn is None:
        return "the driver does not export cuMemcpyBatchAsync"
    fn.argtypes = [p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t, p, p]
    fn.restype = ctypes.c_int
    return _Binding(fn, has_fail_idx=True)


def batch_memcpy_unavailable_reason() -> str | None:
    """``None`` when batched copy-engine memcpy can be used here; else why not."""
    b = _binding()
    return b if isinstance(b, str) else None


class BatchMemcpy:
    """Enqueues lists of copies on a stream, one driver call per list.

    The descriptor arrays are read during the call (like kernel arguments), so
    they need not outlive it; the bytes they point at must, until the stream
    passes the batch. One attribute set covers every copy: sources are read in
    stream order, so a batch may read what an earlier op on its stream wrote.
    """

    def __init__(self, prefer_overlap: bool = True) -> None:
        b = _binding()
        if isinstance(b, str):
            raise BatchMemcpyError(f"batched memcpy unavailable: {b}")
        self._b = b
        self._attrs = _MemcpyAttributes(_SRC_ORDER_STREAM, _MemLocation(0, 0),
                                        _MemLocation(0, 0),
                                        _FLAG_PREFER_OVERLAP if prefer_overlap else 0)
        self._attrs_ptr = ctypes.addressof(self._attrs)
        self._idx = (ctypes.c_size_t * 1)(0)
        self._idx_ptr = ctypes.addressof(self._idx)
        self._fail = ctypes.c_size_t(0)

    def enqueue(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                stream_ptr: int) -> None:
        """Copy ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` for every i (uint64 arrays).

        Copies within one batch may run in any order: destinations must not overlap.
        """
        n = int(dsts.size)
        if n == 0:
            return
        if not (srcs.size == n == sizes.size):
            raise ValueError(f"descriptor arrays differ in length: {n}, {srcs.size}, {sizes.size}")
        for a in (dsts, srcs, sizes):
            if a.dtype != np.uint64 or not a.flags.c_contiguous:
                raise ValueError("descriptor arrays must be contiguous uint64")
        self.enqueue_at(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n, stream_ptr)

    def enqueue_at(self, dsts_ptr: int, srcs_ptr: int, sizes_ptr: int, n: int,
                   stream_ptr: int) -> None:
        """``enqueue`` from the addresses of ``n`` contiguous uint64 entries of each array:
        for a caller that keeps the arrays and launches slices of them layer by layer
        (no views or checks per launch)."""
        if n <= 0:
            return
        if self._b.has_fail_idx:
            rc = self._b.fn(dsts_ptr, srcs_ptr, sizes_ptr, n, self._attrs_ptr, self._idx_ptr, 1,
                            ctypes.addressof(self._fail), stream_ptr)
        else:
            rc = self._b.fn(dsts_ptr, srcs_ptr, sizes_ptr, n, self._attrs_ptr, self._idx_ptr, 1,
                            stream_ptr)
        if rc != 0:
            raise BatchMemcpyError(f"cuMemcpyBatchAsync failed with CUresult {rc} "
                                   f"({n} copies on stream {stream_ptr:#x})")


class DescriptorBuilder:
    """``block_descriptors`` for one copier: its bases and role sizes kept ready.

    An op's descriptors are built on the path from its submission to the step
    waiting for it, once per op; here that is a handful of numpy calls whatever
    the layers and roles (each numpy call costs microseconds on some hosts).
    """

    def __init__(self, src_bases: np.ndarray, dst_bases: np.ndarray,
                 role_bytes: Sequence[int]) -> None:
        self._src = np.asarray(src_bases, dtype=np.uint64)[:, :, None]
        self._dst = np.asarray(dst_bases, dtype=np.uint64)[:, :, None]
        self._rb = np.asarray(role_bytes, dtype=np.uint64)[None, :, None]
        self._layers_roles = self._src.shape[:2]

    def __call__(self, src_ids: Sequence[int] | np.ndarray, dst_ids: Sequence[int] | np.ndarray,
                 lengths: Sequence[int] | np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(dsts, srcs, sizes)`` of every (layer, role, piece), layer-major."""
        rb = self._rb
        srcs = (self._src + np.asarray(src_ids, dtype=np.uint64)[None, None, :] * rb).ravel()
        dsts = (self._dst + np.asarray(dst_ids, dtype=np.uint64)[None, None, :] * rb).ravel()
        sizes = np.empty((*self._layers_roles, len(src_ids)), dtype=np.uint64)
        sizes[...] = rb if lengths is None else (
            rb * np.asarray(lengths, dtype=np.uint64)[None, None, :])
        return dsts, srcs, sizes.ravel()


def block_descriptors(src_bases: np.ndarray, dst_bases: np.ndarray, role_bytes: Sequence[int],
                      src_ids: np.ndarray, dst_ids: np.ndarray,
                      lengths: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dsts, srcs, sizes)`` of every (layer, role, piece), layer-major.

    ``src_bases``/``dst_bases`` are ``[layers, roles]`` addresses; a block's
    piece of a role starts at ``base + id * role_bytes``. ``lengths`` (blocks,
    default 1 each) turns a pair into a run of consecutive ids on both sides,
    one descriptor. Layer-major order lets a launch of layers ``[a, b)`` take
    one contiguous slice of each array.
    """
    return DescriptorBuilder(src_bases, dst_bases, role_bytes)(src_ids, dst_ids, lengths)
