"""PD transfers between GPU caches: a ``BlockMemory`` over device KV (``kvflow.pd.memory``).

``CudaBlockMemory`` views a device cache laid out as ``CudaBackend`` keeps it
(one ``[num_layers, num_blocks, role_bytes]`` array per role). Over the
in-process link (``kvflow.pd.transports.inproc_ports``) two of them make the
GPU transports of prefill/decode disaggregation. Every frame (one layer of a
run of blocks, every role) is one launch of the PD copy kernel
(``kernels/pd_copy.cu``), which reads both block tables on the device:

* both on one GPU (two engines' pools on one device): source blocks straight
  into the destination's blocks;
* on two GPUs of one host whose peer access is on (``enable_peer_access``): the
  same kernel on the destination device reads the source device's memory
  (NVLink or PCIe peer-to-peer). Where peer access is off, the kernel cannot
  address the peer: the blocks are gathered on the source device, cross with
  one ``cudaMemcpyPeerAsync`` per role (staged by the driver) and are scattered
  on the destination, ordered by an event (``_copy_by_gather``);
* over TCP (``read``/``write``): the kernel gathers a layer straight into pinned
  host memory in the wire order, or scatters a frame from pinned memory into the
  blocks (the SMs reach pinned memory through unified addressing).

The block tables go to the device once per transfer, not per frame: they are
kept by content (a small LRU), so every layer of a chunk reuses them; each is
range-checked (and a destination table checked for duplicates) when uploaded.
``copy_from`` only enqueues; it returns an awaitable resolved once the layer's
kernel has run, which is when the receiving port reports the frame landed.

CuPy is imported when an object is built, never at import: ``kvflow`` does not
import this module.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels._cuda import cupy_module
from kernels.pd_copy import (
    Side,
    cache_side,
    check_layout,
    grid_for,
    kernel_for,
    pack_args,
    role_chunks,
    rows_side,
)
from kernels.plan import validate_ids
from kvflow.errors import ConfigError

#: cudaMemcpyKind values (runtime API).
_H2D, _D2H = 1, 2
#: Block tables kept on the device per memory (by content): a transfer's chunks.
IDS_CACHE = 256
#: CTAs of a frame through pinned host memory: PCIe is saturated by a few
#: (the swap kernel's 4 x 32 warps, kernels/swap.py), more only contend.
HOST_CTAS = 16
#: CTAs per SM at most for a device-to-device frame (8 warps each).
DEVICE_CTAS_PER_SM = 4
#: Peer pairs (reader device, device read) whose access ``enable_peer_access`` turned on.
_PEERS: set[tuple[int, int]] = set()


class _Chunk:
    """A chunk's block table on the device, and the kernel's arguments packed for it
    (by the other side's addresses)."""

    __slots__ = ("packed", "table")

    def __init__(self, table: Any) -> None:
        self.table = table
        self.packed: dict[Any, bytes] = {}


class CudaBlockMemory:
    """Device KV of one instance: per role a ``cupy`` uint8 ``[L, N, role_bytes]`` array,
    all on ``device``."""

    def __init__(self, device: int, arrays: Sequence[Any]) -> None:
        cp = cupy_module()
        self._cp = cp
        if not arrays:
            raise ConfigError("CudaBlockMemory needs at least one role array")
        shapes = {a.shape[:2] for a in arrays}
        if len(shapes) != 1 or any(a.dtype != np.uint8 or a.ndim != 3 for a in arrays):
            raise ConfigError("CudaBlockMemory: role arrays must be uint8 [layers, blocks, "
                              f"role_bytes] of one shape; got {[a.shape for a in arrays]}")
        for a in arrays:
            if a.device.id != device:
                raise ConfigError(f"a role array is on GPU {a.device.id}, not {device}")
        self.device = device
        self.arrays = list(arrays)
        self.num_layers, self.num_blocks = arrays[0].shape[:2]
        self.role_bytes = [int(a.shape[2]) for a in arrays]
        self.layer_bytes = sum(self.role_bytes)
        # What the kernel addresses: element 0 and the layer / block strides per role.
        self._bases = [int(a.data.ptr) for a in arrays]
        self._layer_strides = [int(a.strides[0]) for a in arrays]
        self._block_strides = [int(a.strides[1]) for a in arrays]
        #: What a destination keeps packed arguments by: these addresses.
        self._key = (device, *self._bases, *self._layer_strides, *self._block_strides)
        addresses = [*self._bases, *self._layer_strides, *self._block_strides]
        #: Why the kernel cannot move these caches (None: it can); the CuPy ops then.
        self.kernel_unfit = check_layout(self.role_bytes, addresses)
        if self.kernel_unfit is None and any(int(a.strides[2]) != 1 for a in arrays):
            self.kernel_unfit = "a role's bytes are not contiguous"
        self._first, self._chunks = role_chunks(self.role_bytes)
        self._ids: OrderedDict[bytes, _Chunk] = OrderedDict()
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self._kernel = kernel_for(device) if self.kernel_unfit is None else None
        self._staging: np.ndarray | None = None  # pinned, for ``write``

    @classmethod
    def for_backend(cls, backend: Any) -> CudaBlockMemory:
        """The device caches of a ``kernels.backend.CudaBackend``."""
        arrays = [backend._dev[i] for i in range(len(backend.roles))]
        return cls(backend.device, arrays)

    @classmethod
    def allocate(cls, device: int, num_layers: int, num_blocks: int,
                 role_bytes: Sequence[int]) -> CudaBlockMemory:
        cp = cupy_module()
        with cp.cuda.Device(device):
            arrays = [cp.zeros((num_layers, num_blocks, b), dtype=np.uint8) for b in role_bytes]
        return cls(device, arrays)

    # ------------------------------------------------------------- block tables
    def _chunk(self, src_ids: np.ndarray | None, dst_ids: np.ndarray | None,
               src_blocks: int) -> _Chunk:
        """The int32 device table for a frame's ids (rows: the source ids, the destination
        ids, whichever are given), uploaded on first sight and then kept by content with
        the kernel's packed arguments, so every layer of a chunk reuses both. Checked
        when uploaded (``InvalidBlockId``): ids in range, no destination id twice (two
        blocks landing on one)."""
        given = [x for x in (src_ids, dst_ids) if x is not None]
        key = b"|".join((b"%d %d" % (src_ids is not None, src_blocks),
                         *(np.asarray(x, np.int64).tobytes() for x in given)))
        chunk = self._ids.get(key)
        if chunk is not None:
            self._ids.move_to_end(key)
            return chunk
        n = len(given[0])
        s32, d32 = validate_ids(np.zeros(n, np.int64) if src_ids is None else src_ids,
                                np.arange(n) if dst_ids is None else dst_ids,
                                src_blocks if src_ids is not None else 1,
                                self.num_blocks if dst_ids is not None else n)
        rows = [x for x, g in ((s32, src_ids), (d32, dst_ids)) if g is not None]
        cp = self._cp
        with cp.cuda.Device(self.device), self.stream:
            chunk = self._ids[key] = _Chunk(cp.asarray(np.stack(rows)))
        if len(self._ids) > IDS_CACHE:
            self._ids.popitem(last=False)
        return chunk

    def _check_layer(self, layer: int) -> None:
        """The kernel adds ``layer`` times a stride: a bad layer would address past the
        cache, so it is refused here (the CuPy ops raised ``IndexError`` for it)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")

    def _launch(self, packed: bytes, layer: int, n: int, max_ctas: int) -> None:
        self._kernel.launch(self.stream.ptr, packed, layer, grid_for(n, self._chunks, max_ctas))

    def _pack(self, src: Side, dst: Side, n: int) -> bytes:
        return pack_args(src, dst, self.role_bytes, self._first, self._chunks, n)

    def _device_ctas(self) -> int:
        return self._kernel.sms * DEVICE_CTAS_PER_SM

    # ------------------------------------------------------------- host staging (TCP)
    def read(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """Gather layer ``layer`` of ``ids`` straight into pinned host memory in wire
        order (one kernel; the array returned owns the memory, so a frame being sent
        keeps its bytes however many reads follow)."""
        cp = self._cp
        n = len(ids)
        mem = cp.cuda.alloc_pinned_memory(max(n * self.layer_bytes, 1))
        out = np.frombuffer(mem, np.uint8, n * self.layer_bytes).reshape(n, self.layer_bytes)
        if n == 0:
            return out
        if self._kernel is None:
            return self._read_by_gather(layer, ids, out)
        self._check_layer(layer)
        table = self._chunk(ids, None, self.num_blocks).table
        src = cache_side(self._bases, self._layer_strides, self._block_strides,
                         table.data.ptr)
        packed = self._pack(src, rows_side(out.ctypes.data, self.role_bytes), n)
        with cp.cuda.Device(self.device):
            self._launch(packed, layer, n, HOST_CTAS)
            self.stream.synchronize()
        return out

    def write(self, layer: int, ids: np.ndarray, data: np.ndarray) -> None:
        """Copy ``data`` into a pinned staging buffer (reused), then one kernel scatters
        it into the roles' blocks; returns once the blocks hold it (the frame's buffer
        is reused by the link after this)."""
        cp = self._cp
        n = len(ids)
        if n == 0:
            return
        nbytes = n * self.layer_bytes
        if self._staging is None or self._staging.nbytes < nbytes:
            mem = cp.cuda.alloc_pinned_memory(max(nbytes, 2 * getattr(self._staging, "nbytes",
                                                                        0)))
            self._staging = np.frombuffer(mem, np.uint8)
        host = self._staging[:nbytes].reshape(n, self.layer_bytes)
        np.copyto(host, np.asarray(data, np.uint8).reshape(n, self.layer_bytes))
        if self._kernel is None:
            self._write_by_scatter(layer, ids, host)
            return
        self._check_layer(layer)
        chunk = self._chunk(None, ids, n)
        packed = chunk.packed.get(host.ctypes.data)  # the staging buffer is reused
        if packed is None:
            dst = cache_side(self._bases, self._layer_strides, self._block_strides,
                             chunk.table.data.ptr)
            packed = chunk.packed[host.ctypes.data] = self._pack(
                rows_side(host.ctypes.data, self.role_bytes), dst, n)
        with cp.cuda.Device(self.device):
            self._launch(packed, layer, n, HOST_CTAS)
            self.stream.synchronize()

    # ------------------------------------------------------------- device to device
    def copy_from(self, src: Any, layer: int, src_ids: np.ndarray,
                  dst_ids: np.ndarray) -> Any:
        if not isinstance(src, CudaBlockMemory):  # another kind of memory: through the host
            self.write(layer, dst_ids, src.read(layer, src_ids))
            return None
        if src.role_bytes != self.role_bytes or src.num_layers != self.num_layers:
            raise ConfigError("CudaBlockMemory.copy_from: the two caches' layouts differ")
        if len(src_ids) != len(dst_ids):
            raise ConfigError(f"copy_from: {len(src_ids)} source ids, {len(dst_ids)} "
                              "destination ids")
        reach = src.device == self.device or (self.device, src.device) in _PEERS
        if not reach or self._kernel is None or src._kernel is None:
            return self._copy_by_gather(src, layer, src_ids, dst_ids)
        n = len(src_ids)
        if n == 0:
            return None
        self._check_layer(layer)
        cp = self._cp
        chunk = self._chunk(src_ids, dst_ids, src.num_blocks)
        packed = chunk.packed.get(src._key)  # a chunk may come from several sources
        if packed is None:
            ptr = chunk.table.data.ptr
            packed = chunk.packed[src._key] = self._pack(
                cache_side(src._bases, src._layer_strides, src._block_strides, ptr),
                cache_side(self._bases, self._layer_strides, self._block_strides, ptr + 4 * n),
                n)
        with cp.cuda.Device(self.device):
            self._launch(packed, layer, n, self._device_ctas())
            done = cp.cuda.Event(disable_timing=True)
            done.record(self.stream)
        return _landed(done, [chunk])

    # ------------------------------------------------------------- CuPy ops (fallback)
    def _read_by_gather(self, layer: int, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``read`` as CuPy ops (caches the kernel cannot address)."""
        cp = self._cp
        n = len(ids)
        with cp.cuda.Device(self.device), self.stream:
            idx = cp.asarray(ids)
            dev = cp.empty((n, self.layer_bytes), cp.uint8)
            off = 0
            for a, b in zip(self.arrays, self.role_bytes, strict=True):
                dev[:, off:off + b] = a[layer][idx]
                off += b
            cp.cuda.runtime.memcpyAsync(out.ctypes.data, dev.data.ptr, out.nbytes,
                                        _D2H, self.stream.ptr)
            self.stream.synchronize()
        return out

    def _write_by_scatter(self, layer: int, ids: np.ndarray, host: np.ndarray) -> None:
        """``write`` as CuPy ops, from the pinned ``host`` rows."""
        cp = self._cp
        n = len(ids)
        with cp.cuda.Device(self.device), self.stream:
            idx = cp.asarray(ids)
            src = cp.empty((n, self.layer_bytes), cp.uint8)
            cp.cuda.runtime.memcpyAsync(src.data.ptr, host.ctypes.data, host.nbytes, _H2D,
                                        self.stream.ptr)
            off = 0
            for a, b in zip(self.arrays, self.role_bytes, strict=True):
                a[layer][idx] = src[:, off:off + b]
                off += b
            self.stream.synchronize()

    def _copy_by_gather(self, src: CudaBlockMemory, layer: int, src_ids: np.ndarray,
                        dst_ids: np.ndarray) -> Any:
        """``copy_from`` as CuPy ops: per role a gather on the source device, a peer copy
        where the devices differ, a scatter here (the path where peer access is off)."""
        cp = self._cp
        keep: list[Any] = []
        with cp.cuda.Device(src.device), src.stream:
            sidx = cp.asarray(src_ids)
            gathered = [a[layer][sidx] for a in src.arrays]  # contiguous, on the source GPU
            keep += [sidx, *gathered]
            ready = cp.cuda.Event(disable_timing=True)
            ready.record(src.stream)
        with cp.cuda.Device(self.device), self.stream:
            didx = cp.asarray(dst_ids)
            keep.append(didx)
            self.stream.wait_event(ready)  # the gather ran on the source's stream
            if src.device == self.device:
                parts = gathered
            else:
                parts = []
                for g in gathered:
                    d = cp.empty_like(g)
                    cp.cuda.runtime.memcpyPeerAsync(d.data.ptr, self.device, g.data.ptr,
                                                    src.device, g.nbytes, self.stream.ptr)
                    parts.append(d)
                keep += parts
            for a, p in zip(self.arrays, parts, strict=True):
                a[layer][didx] = p
            done = cp.cuda.Event(disable_timing=True)
            done.record(self.stream)
        return _landed(done, keep)


#: Polls of a copy's event on the loop before waiting in a thread: a frame's kernel
#: is often done by the time its awaitable runs, and a thread hop costs ~50 us.
_QUICK_POLLS = 3


async def _landed(event: Any, keep: list[Any]) -> None:
    """Resolved once ``event`` has completed; ``keep`` (the temporaries the copy reads
    and writes) lives until then, and is released here, on the loop's thread."""
    for _ in range(_QUICK_POLLS):
        if event.done:
            break
        await asyncio.sleep(0)
    else:
        if not event.done:
            await asyncio.get_running_loop().run_in_executor(None, event.synchronize)
    keep.clear()


def enable_peer_access(a: int, b: int) -> bool:
    """Let GPUs ``a`` and ``b`` reach each other's memory (both ways) where they can;
    True if they can. Peer copies work without it, through the host."""
    cp = cupy_module()
    rt = cp.cuda.runtime
    if a == b:
        return True
    if not (rt.deviceCanAccessPeer(a, b) and rt.deviceCanAccessPeer(b, a)):
        return False
    for x, y in ((a, b), (b, a)):
        with cp.cuda.Device(x):
            try:
                rt.deviceEnablePeerAccess(y)
            except rt.CUDARuntimeError as exc:  # already enabled is fine
                if "PeerAccessAlreadyEnabled" not in str(exc):
                    raise
    _PEERS.update(((a, b), (b, a)))
    return True


def gpu_count() -> int:
    """Visible CUDA devices (0 where CuPy or a driver is missing)."""
    try:
        return int(cupy_module().cuda.runtime.getDeviceCount())
    except Exception:
        return 0
