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
through host memory: ``read`` gathers a layer to host bytes in the wire order,
``write`` scatters them back (synchronously: the frame's buffer is reused).

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
        cp = self._cp
        out = np.empty((len(ids), self.layer_bytes), np.uint8)
        with cp.cuda.Device(self.device), self.stream:
            idx = cp.asarray(ids)
            off = 0
            for a, b in zip(self.arrays, self.role_bytes, strict=True):
                out[:, off:off + b] = cp.asnumpy(a[layer][idx], stream=self.stream)
                off += b
            self.stream.synchronize()
        return out

    def write(self, layer: int, ids: np.ndarray, data: np.ndarray) -> None:
        cp = self._cp
        with cp.cuda.Device(self.device), self.stream:
            idx = cp.asarray(ids)
            src = cp.asarray(data)
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
