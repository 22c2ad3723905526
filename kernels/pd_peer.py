"""PD transfers between GPU caches: a ``BlockMemory`` over device KV (``kvflow.pd.memory``).

``CudaBlockMemory`` views a device cache laid out as ``CudaBackend`` keeps it
(one ``[num_layers, num_blocks, role_bytes]`` array per role). Over the
in-process link (``kvflow.pd.transports.inproc_ports``) two of them make the
GPU transports of prefill/decode disaggregation:

* both on one GPU (two engines' pools on one device): a device-to-device copy,
  per role a gather of the source blocks and a scatter into the destination;
* on two GPUs of one host: the gathered blocks cross with one
  ``cudaMemcpyPeerAsync`` per role and layer (NVLink or PCIe peer-to-peer where
  the devices can reach each other, staged by the driver otherwise), then are
  scattered on the destination device, ordered after the gather by an event.

``copy_from`` only enqueues; it returns an awaitable resolved once the layer's
last scatter has run (the temporaries live until then), which is when the
receiving port reports the frame landed. Over TCP the same object stages
through pinned host memory: ``read`` gathers a layer on the device in the wire
order and copies it to a pinned buffer in one piece, ``write`` copies a frame
into a pinned buffer, to the device in one piece and scatters it (synchronously:
the frame's buffer is reused).

CuPy is imported when an object is built, never at import: ``kvflow`` does not
import this module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels._cuda import cupy_module
from kvflow.errors import ConfigError

#: cudaMemcpyKind values (runtime API).
_H2D, _D2H = 1, 2


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
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
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

    # ------------------------------------------------------------- host staging (TCP)
    def read(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """Gather layer ``layer`` of ``ids`` on the device into wire order, then one
        contiguous copy into pinned host memory (the array returned owns it, so a frame
        being sent keeps its bytes however many reads follow)."""
        cp = self._cp
        n = len(ids)
        mem = cp.cuda.alloc_pinned_memory(max(n * self.layer_bytes, 1))
        out = np.frombuffer(mem, np.uint8, n * self.layer_bytes).reshape(n, self.layer_bytes)
        if n == 0:
            return out
        with cp.cuda.Device(self.device), self.stream:
            idx = cp.asarray(ids)
            if len(self.arrays) == 1:
                dev = self.arrays[0][layer][idx]
            else:
                dev = cp.empty((n, self.layer_bytes), cp.uint8)
                off = 0
                for a, b in zip(self.arrays, self.role_bytes, strict=True):
                    dev[:, off:off + b] = a[layer][idx]
                    off += b
            cp.cuda.runtime.memcpyAsync(out.ctypes.data, dev.data.ptr, out.nbytes,
                                        _D2H, self.stream.ptr)
            self.stream.synchronize()
        return out

    def write(self, layer: int, ids: np.ndarray, data: np.ndarray) -> None:
        """Copy ``data`` into a pinned staging buffer (reused), one contiguous copy to the
        device, scatter into the roles' blocks; returns once the blocks hold it (the
        frame's buffer is reused by the link after this)."""
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
        with cp.cuda.Device(self.device), self.stream:
            idx = cp.asarray(ids)
            src = cp.empty((n, self.layer_bytes), cp.uint8)
            cp.cuda.runtime.memcpyAsync(src.data.ptr, host.ctypes.data, nbytes, _H2D,
                                        self.stream.ptr)
            off = 0
            for a, b in zip(self.arrays, self.role_bytes, strict=True):
                a[layer][idx] = src[:, off:off + b]
                off += b
            self.stream.synchronize()

    # ------------------------------------------------------------- device to device
    def copy_from(self, src: Any, layer: int, src_ids: np.ndarray,
                  dst_ids: np.ndarray) -> Any:
        if not isinstance(src, CudaBlockMemory):  # another kind of memory: through the host
            self.write(layer, dst_ids, src.read(layer, src_ids))
            return None
        if src.role_bytes != self.role_bytes or src.num_layers != self.num_layers:
            raise ConfigError("CudaBlockMemory.copy_from: the two caches' layouts differ")
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


async def _landed(event: Any, keep: list[Any]) -> None:
    """Resolved once ``event`` has completed; ``keep`` (the temporaries the copy reads
    and writes) lives until then, and is released here, on the loop's thread."""
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
    return True


def gpu_count() -> int:
    """Visible CUDA devices (0 where CuPy or a driver is missing)."""
    try:
        return int(cupy_module().cuda.runtime.getDeviceCount())
    except Exception:
        return 0
