"""Progress words: how an op's layers say they have landed without a CUDA event each.

Why: on the H100 host every CUDA call from Python costs microseconds (an event
record, a stream wait, a kernel launch: ~2-7 us each), and an op of 32 layers
that records an event, waits on it from a side stream and launches a host
function per layer spends most of its submit there. Instead each copier keeps
one 32-bit word per layer in pinned host memory, and an op takes the next
sequence number ``seq``: layer i of the op has landed once ``word[i] - seq``,
read as a signed 32-bit number, is >= 0 (sequence numbers of one copier only
grow, and its ops finish in stream order). The word is written by the swap
kernel itself as a layer lands (``kvflow_swap_blocks_signal``: one launch per
op, still per-layer completion) or by ``cuStreamWriteValue32``; it is kept
twice: in device memory, where a stream waits on it with ``cuStreamWaitValue32``
(GEQ compares exactly so, wrap-around included), and in pinned host memory,
where the host reads it with no CUDA call at all, which is what the runtime's
lazy layer reports need (``CudaTask.layers_reported``). Why twice: a stream
waiting on a host word polls it over PCIe, behind the copy's own reads. (A probe
stream on the H100 once saw layers up to ~1 ms late; that lag was the kernel's
warps drifting apart, fixed by handing out units in layer order:
``benchmarks/results/host_layouts.md``, call 5.)

Stream memory operations are part of the driver API (CUDA 11.7+ enables them
by default), which CuPy does not wrap: bound here with ctypes, as
``kernels.dma`` binds the batched memcpy. ``progress_unavailable_reason()``
says why they cannot be used, and the backend then keeps its events.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from kernels._cuda import cupy_module
from kernels.dma import _load_libcuda

#: u32 words ahead of the per-layer arrival counters in ``ProgressWords.counters`` (the
#: signal kernel's unit counter, a u64, and its exited-warps count); swap.cu kSignalHeader.
SIGNAL_HEADER = 4
#: CU_STREAM_WAIT_VALUE_GEQ: wait until (int32_t)(*addr - value) >= 0.
_WAIT_GEQ = 0
#: CU_STREAM_WRITE_VALUE_DEFAULT.
_WRITE_DEFAULT = 0
_MASK = 0xFFFFFFFF


def landed(word: int, seq: int) -> bool:
    """Whether a word reading ``word`` says the op of sequence number ``seq`` is past it
    (the comparison ``cuStreamWaitValue32``'s GEQ makes: signed 32-bit difference)."""
    return ((word - seq) & _MASK) < 0x80000000


def next_seq(seq: int) -> int:
    """The sequence number after ``seq`` (32-bit, wrapping)."""
    return (seq + 1) & _MASK


class _Driver:
    def __init__(self, lib: ctypes.CDLL) -> None:
        p, u32 = ctypes.c_void_p, ctypes.c_uint32
        self.wait = lib.cuStreamWaitValue32_v2
        self.write = lib.cuStreamWriteValue32_v2
        for fn in (self.wait, self.write):
            fn.argtypes = [p, ctypes.c_uint64, u32, ctypes.c_uint]
            fn.restype = ctypes.c_int


@functools.cache
def _driver() -> _Driver | str:
    try:
        lib = _load_libcuda()
    except OSError as exc:
        return str(exc)
    try:
        return _Driver(lib)
    except AttributeError:
        return "the driver does not export cuStreamWaitValue32_v2 (CUDA 11.7+ has it)"


def progress_unavailable_reason() -> str | None:
    """``None`` when stream memory operations can be used here; else why not."""
    d = _driver()
    return d if isinstance(d, str) else None


class ProgressError(RuntimeError):
    """The driver refused a stream memory operation (its ``CUresult`` is in the message)."""


class ProgressWords:
    """``n`` progress words (device and pinned host) and the signal kernel's counters
    (device: ``SIGNAL_HEADER`` words for handing out units, then one arrival count per layer).

    One per copier (one direction, its stream): ``seq`` numbers its ops. The
    counters are zero between launches (the kernel leaves them so); the launches
    that share them must be ordered (one stream), as a copier's are.
    """

    def __init__(self, n: int) -> None:
        d = _driver()
        if isinstance(d, str):
            raise ProgressError(f"stream memory operations unavailable: {d}")
        self._d = d
        cp = cupy_module()
        self.n = n
        self._mem = cp.cuda.alloc_pinned_memory(4 * n)
        self.words = np.ndarray((n,), np.uint32, self._mem)
        self.words[:] = 0
        self.ptr = int(self._mem.ptr)
        #: The device copy of the words: what streams wait on.
        self.dev = cp.zeros(n, dtype=np.uint32)
        self.dev_ptr = int(self.dev.data.ptr)
        self.counters = cp.zeros(SIGNAL_HEADER + n, dtype=np.uint32)
        self.counters_ptr = int(self.counters.data.ptr)
        self.seq = 0

    def take(self) -> int:
        """The next op's sequence number."""
        self.seq = next_seq(self.seq)
        return self.seq

    def landed(self, i: int, seq: int) -> bool:
        """Word ``i`` says op ``seq`` is past it (a read of pinned memory, no CUDA call)."""
        return ((int(self.words[i]) - seq) & _MASK) < 0x80000000

    def wait(self, stream_ptr: int, i: int, seq: int) -> None:
        """``stream`` waits (on the GPU, on the device word) until word ``i`` says op ``seq``
        is past it."""
        rc = self._d.wait(stream_ptr, self.dev_ptr + 4 * i, seq, _WAIT_GEQ)
        if rc != 0:
            raise ProgressError(f"cuStreamWaitValue32 failed with CUresult {rc}")

    def write(self, stream_ptr: int, i: int, seq: int) -> None:
        """Word ``i`` := ``seq`` (device, then host) once ``stream`` gets there."""
        rc = self._d.write(stream_ptr, self.dev_ptr + 4 * i, seq, _WRITE_DEFAULT)
        if rc == 0:
            rc = self._d.write(stream_ptr, self.ptr + 4 * i, seq, _WRITE_DEFAULT)
        if rc != 0:
            raise ProgressError(f"cuStreamWriteValue32 failed with CUresult {rc}")
