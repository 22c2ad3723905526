"""CuPy launchers for the swap kernel (``swap.cu``) and the copy-engine runs.

``BlockCopier`` moves blocks one way between two sets of per-layer, per-role
buffers (device KV and pinned host KV, either direction). An op is first
*prepared* — ids validated (nothing moves if one is bad), split into
copy-engine runs and scattered pairs, the pairs staged — and then *launched*
for any layer range: one layer at a time (the backend, which records an event
after each) or all layers at once.

The kernel reads the id pairs straight from the op's slice of a pinned
staging buffer (mapped host memory) allocated once per copier: no allocation,
no upload per op (``cudaHostAlloc`` would wait for the GPU). Lifetime rule: a
``PreparedCopy`` owns its slice until ``release()`` (or garbage collection),
so keep it until its stream has passed the last launch; the backend releases
it in the op's final host callback. Use a copier from one thread (the event loop's).

Large pieces go to the copy engine instead, as one batched driver call per
launch (``kernels/dma.py``): SM-issued PCIe traffic tops out at ~92% of the
link one way and ~80% both ways on an H100, the copy engine does not, and it
leaves every SM to compute. Its cost is time per descriptor (~0.5 us on the
host, more on the engine for small pieces), so
only pieces of ``dma_min_bytes`` and more take it; small pieces stay with the
kernel, which is faster there.
"""

from __future__ import annotations

import ctypes
import struct
import warnings
from collections.abc import Callable, Sequence

import numpy as np

from kernels._cuda import cupy_module, load_module
from kernels.dma import BatchMemcpy, DescriptorBuilder, batch_memcpy_unavailable_reason
from kernels.plan import (
    FAST_IDS,
    descriptor_runs,
    min_run_blocks_for,
    pointer_table,
    role_table,
    stage_ids,
    uniform_stride,
    with_role_strides,
)
from kernels.progress import ProgressWords, progress_unavailable_reason
from kernels.staging import SlabAllocator, Slice

#: ``PreparedCopy.runs`` of an op with no copy-engine runs (shared, read-only).
_NO_RUNS = np.zeros((0, 3), np.int64)
_NO_RUNS.flags.writeable = False

#: Threads per CTA of the swap kernel (its ``__launch_bounds__``).
THREADS = 1024
#: Default CTAs per launch: few SMs, so compute keeps the GPU.
DEFAULT_CTAS = 4
#: The backend's defaults each way (H100 sweep: 4 CTAs saturate host -> device and
#: 2 device -> host; 4 + 2 was the best split with both ways at once).
DEFAULT_LOAD_CTAS = 4
DEFAULT_STORE_CTAS = 2
#: Default run size (bytes per layer, all roles) from which a run goes to the copy engine.
#: A memcpy costs microseconds of setup, so only long runs win there.
DEFAULT_MIN_RUN_BYTES = 1 << 20
#: Default piece size (bytes of one role of one layer of one block) from which an op goes to
#: the copy engine as one batched memcpy per launch. H100 (bench_kernels.py, per-layer
#: launches): the batch moved 52 GB/s each way at 128 KB and 54 at 512 KB against the
#: kernel's 50-52, but only 18 h2d / 40 d2h at 32 KB, where the kernel moved 48 / 52.
DEFAULT_DMA_MIN_BYTES = 128 << 10
#: Copy-engine modes: by piece size, never, or for every op (errors if unavailable).
DMA_MODES = ("auto", "never", "always")
#: Default pinned staging per copier: 1 MiB holds ~64K id pairs of ops in flight.
DEFAULT_STAGING_BYTES = 1 << 20
#: cudaMemcpyDefault: direction inferred from the (unified) addresses.
_MEMCPY_DEFAULT = 4
#: cudaMemcpy2D rejects pitches of 2 GiB and more.
_MAX_PITCH = (1 << 31) - 1
#: Units (chunks) per layer the signal kernel counts in 32 bits (with the layer's token).
_MAX_LAYER_UNITS = (1 << 32) - 1
_PACK8 = struct.Struct("<8q")
_PACK12 = struct.Struct("<12q")


class SwapKernels:
    """The compiled swap kernel on one device, with a lean launch path.

    CuPy's generic kernel call converts every argument on every launch (10 us
    measured against 6 us here); the backend launches once per layer per op,
    so this packs the eight 64-bit arguments into one reused buffer and calls
    ``cuLaunchKernel`` directly (the driver copies the arguments at launch, so
    the buffer is free again at once).
    """

    def __init__(self, device: int | None = None) -> None:
        cp = cupy_module()
        self.device = cp.cuda.runtime.getDevice() if device is None else device
        module = load_module("swap.cu", self.device)
        self._fn = module.get_function("kvflow_swap_blocks")
        self._fn_signal = module.get_function("kvflow_swap_blocks_signal")
        self._params = ctypes.create_string_buffer(8 * 12)
        base = ctypes.addressof(self._params)
        self._argv = (ctypes.c_void_p * 12)(*(base + 8 * i for i in range(12)))
        self._argv_ptr = ctypes.addressof(self._argv)
        raw = getattr(cp.cuda.driver, "launchKernel", None)
        # RawModule.get_function gives a RawKernel; its compiled Function has the pointer.
        fptr = getattr(getattr(self._fn, "kernel", self._fn), "ptr", None)
        sptr = getattr(getattr(self._fn_signal, "kernel", self._fn_signal), "ptr", None)
        self._raw = (raw, int(fptr), int(sptr)) if raw is not None and fptr and sptr else None

    def launch(self, stream_ptr: int, ctas: int, args: tuple[int, ...]) -> None:
        """Enqueue one launch. ``args``: table, roles, num_roles, chunks_per_block,
        layer_begin, num_layers, ids, num_blocks (raw addresses and counts)."""
        units = args[7] * args[3] * args[5]  # one warp per unit
        if units <= 0:
            return
        grid = min(ctas, -(-units // (THREADS // 32)))
        if self._raw is None:  # pragma: no cover - CuPy without the driver binding
            self._fn((grid,), (THREADS,), args, stream=_StreamPtr(stream_ptr))
            return
        _PACK8.pack_into(self._params, 0, *args)
        raw, fptr, _ = self._raw
        raw(fptr, grid, 1, 1, THREADS, 1, 1, 0, stream_ptr, self._argv_ptr, 0)

    def launch_signal(self, stream_ptr: int, ctas: int, args: tuple[int, ...],
                      counters_ptr: int, dev_words_ptr: int, words_ptr: int, seq: int) -> None:
        """``launch``, and layer i of the launch, once landed, sets ``dev_words[i]`` and
        ``words[i]`` to ``seq`` (``kernels.progress``; ``counters``: the words' device
        counters, ``ProgressWords.counters``; the words' pointers at the launch's first
        layer). Layers are signalled in order, every one, even with no blocks; the
        warps take units from one counter in layer order, so layers land in order too."""
        per_layer = args[7] * args[3]
        if per_layer >= _MAX_LAYER_UNITS:
            raise ValueError(f"{args[7]} blocks of {args[3]} chunks: over the signal kernel's "
                             f"{_MAX_LAYER_UNITS - 1} units per layer")
        units = per_layer * args[5]
        grid = max(1, min(ctas, -(-units // (THREADS // 32))))
        full = (*args, counters_ptr, dev_words_ptr, words_ptr, seq)
        if self._raw is None:  # pragma: no cover - CuPy without the driver binding
            self._fn_signal((grid,), (THREADS,), full, stream=_StreamPtr(stream_ptr))
            return
        _PACK12.pack_into(self._params, 0, *full)
        raw, _, sptr = self._raw
        raw(sptr, grid, 1, 1, THREADS, 1, 1, 0, stream_ptr, self._argv_ptr, 0)


class _StreamPtr:
    """Minimal stand-in for a CuPy stream where only ``.ptr`` is read."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class PreparedCopy:
    """A validated op, ready to launch for any layer range of its copier."""

    __slots__ = ("_release", "dma", "ids_ptr", "num_scattered", "runs")

    def __init__(self, runs: np.ndarray, num_scattered: int, ids_ptr: int,
                 release: Callable[[], None] | None,
                 dma: tuple[np.ndarray, np.ndarray, np.ndarray, int, tuple[int, int, int]]
                 | None = None) -> None:
        self.runs = runs                    # [k, 3] (src start, dst start, length) for the CE
        self.num_scattered = num_scattered  # pairs the kernel copies
        self.ids_ptr = ids_ptr              # their int32 pairs in mapped pinned memory
        self._release = release
        # the batched path: (dsts, srcs, sizes, descriptors per layer, their addresses)
        self.dma = dma

    def release(self) -> None:
        """Give the staging slice back; only once the GPU is past every launch of this op."""
        rel, self._release = self._release, None
        if rel is not None:
            rel()

    def __del__(self) -> None:
        self.release()


class BlockCopier:
    """Copies blocks between two sets of ``[num_blocks, role_bytes]`` buffers per (layer, role).

    ``src_bases``/``dst_bases`` are ``[layers, roles]`` addresses (device
    pointers or mapped pinned host pointers). The pointer table is uploaded
    once; every launch then only names ids and a layer range.
    """

    def __init__(
        self,
        src_bases: np.ndarray,
        dst_bases: np.ndarray,
        role_bytes: Sequence[int],
        num_src_blocks: int,
        num_dst_blocks: int,
        *,
        ctas: int = DEFAULT_CTAS,
        min_run_bytes: int = DEFAULT_MIN_RUN_BYTES,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        kernels: SwapKernels | None = None,
        src_name: str = "source",
        dst_name: str = "destination",
        dma: str = "auto",
        dma_min_bytes: int = DEFAULT_DMA_MIN_BYTES,
    ) -> None:
        if dma not in DMA_MODES:
            raise ValueError(f"dma must be one of {', '.join(DMA_MODES)}; got {dma!r}")
        cp = cupy_module()
        self._cp = cp
        self.kernels = kernels or SwapKernels()
        self.src_bases = np.asarray(src_bases, dtype=np.int64)
        self.dst_bases = np.asarray(dst_bases, dtype=np.int64)
        self.num_layers, self.num_roles = self.src_bases.shape
        self.role_bytes = [int(b) for b in role_bytes]
        if len(self.role_bytes) != self.num_roles:
            raise ValueError(f"{len(self.role_bytes)} role sizes for {self.num_roles} roles")
        if max(num_src_blocks, num_dst_blocks) >= 1 << 31:
            raise ValueError("block ids must fit in int32")
        self.num_src_blocks = num_src_blocks
        self.num_dst_blocks = num_dst_blocks
        self.ctas = ctas
        self.src_name, self.dst_name = src_name, dst_name
        self.min_run_blocks = min_run_blocks_for(min_run_bytes, sum(self.role_bytes))
        roles, self.chunks_per_block = role_table(self.role_bytes)
        table = with_role_strides(pointer_table(self.src_bases, self.dst_bases),
                                  self.role_bytes)
        with cp.cuda.Device(self.kernels.device):
            self._table = cp.asarray(table)
            self._roles = cp.asarray(roles)
        self._table_ptr, self._roles_ptr = int(self._table.data.ptr), int(self._roles.data.ptr)
        self._slabs = SlabAllocator(staging_bytes)
        self._staging = cp.cuda.alloc_pinned_memory(self._slabs.capacity)
        self._staging_ptr = int(self._staging.ptr)
        self._staging_i32 = np.ndarray((self._slabs.capacity // 4,), np.int32, self._staging)
        self._warned_full = False
        # The copy engine takes an op when every role's piece is large (a tiny fp8 scale
        # role would cost a descriptor per block for a few bytes) and the driver has it.
        why_not = batch_memcpy_unavailable_reason()
        if dma == "always" and why_not is not None:
            raise RuntimeError(f"dma='always' but {why_not}")
        self.use_dma = why_not is None and (
            dma == "always" or (dma == "auto" and min(self.role_bytes) >= dma_min_bytes))
        self._dma = BatchMemcpy() if self.use_dma else None
        self._descriptors = DescriptorBuilder(self.src_bases, self.dst_bases, self.role_bytes)
        #: One word per layer for ops moved by one signalling launch (``signals``); ``None``
        #: where they cannot be (copy-engine copier, no stream memory operations).
        self.progress: ProgressWords | None = None
        if self._dma is None and progress_unavailable_reason() is None:
            with cp.cuda.Device(self.kernels.device):
                self.progress = ProgressWords(self.num_layers)
        # 2-D memcpy over all layers needs a constant layer stride on both sides.
        self._strides: list[tuple[int, int] | None] = []
        for r in range(self.num_roles):
            s = uniform_stride(self.src_bases[:, r])
            d = uniform_stride(self.dst_bases[:, r])
            ok = s is not None and d is not None and 0 < s <= _MAX_PITCH and 0 < d <= _MAX_PITCH
            self._strides.append((s, d) if ok else None)

    # ------------------------------------------------------------------ prepare
    def prepare(
        self,
        src_ids: Sequence[int] | np.ndarray,
        dst_ids: Sequence[int] | np.ndarray,
        stream: object = None,
    ) -> PreparedCopy:
        """Validate ids (``InvalidBlockId``: nothing staged or enqueued), split, stage them.

        See ``plan.stage_ids``; ``stream`` is unused (the kernel reads the staging).
        On the copy-engine path the descriptors of every layer are built here.
        """
        if self._dma is not None:
            return self._prepare_dma(src_ids, dst_ids)
        small = self._prepare_small(src_ids, dst_ids)
        if small is not None:
            return small
        runs, n, staged = stage_ids(
            src_ids, dst_ids, self.num_src_blocks, self.num_dst_blocks, self.min_run_blocks,
            self._stage, src_name=self.src_name, dst_name=self.dst_name,
        )
        if staged is None:
            return PreparedCopy(runs, 0, 0, None)
        sl, _, ptr = staged
        if isinstance(sl, Slice):
            slabs = self._slabs
            return PreparedCopy(runs, n, ptr, lambda: slabs.free(sl))
        return PreparedCopy(runs, n, ptr, lambda: sl)  # the closure keeps the pool memory

    def _prepare_small(self, src_ids: Sequence[int] | np.ndarray,
                       dst_ids: Sequence[int] | np.ndarray) -> PreparedCopy | None:
        """``stage_ids`` for what a ``TransferOp`` carries (lists of ints, up to ``FAST_IDS``),
        in plain Python, same result (each numpy call costs microseconds on the H100 host:
        46 us for 16 scattered ids through ``stage_ids``, 143 us for 16 consecutive ones);
        ``None``: anything else, bad ids included (``stage_ids`` names the offending one)."""
        n = len(src_ids)
        if not (type(src_ids) is list and type(dst_ids) is list and 0 < n == len(dst_ids)
                and n <= FAST_IDS):
            return None
        ns, nd = self.num_src_blocks, self.num_dst_blocks
        if not (all(type(x) is int and 0 <= x < ns for x in src_ids)
                and all(type(x) is int and 0 <= x < nd for x in dst_ids)
                and len(set(dst_ids)) == n):
            return None
        runs = _NO_RUNS
        m = self.min_run_blocks
        if m and n >= max(m, 2):  # maximal runs of m+ consecutive pairs: the copy engine's
            found: list[tuple[int, int, int]] = []
            rest_s: list[int] = []
            rest_d: list[int] = []
            i, s, d = 0, src_ids, dst_ids
            while i < n:
                j = i + 1
                while j < n and s[j] == s[j - 1] + 1 and d[j] == d[j - 1] + 1:
                    j += 1
                if j - i >= m:
                    found.append((src_ids[i], dst_ids[i], j - i))
                else:
                    rest_s += src_ids[i:j]
                    rest_d += dst_ids[i:j]
                i = j
            if found:
                runs = np.array(found, dtype=np.int64)
                src_ids, dst_ids, n = rest_s, rest_d, len(rest_s)
                if n == 0:
                    return PreparedCopy(runs, 0, 0, None)
        sl, buf, ptr = self._stage(n)
        pairs = [0] * (2 * n)
        pairs[0::2] = src_ids
        pairs[1::2] = dst_ids
        buf[:] = pairs
        if isinstance(sl, Slice):
            slabs = self._slabs
            return PreparedCopy(runs, n, ptr, lambda: slabs.free(sl))
        return PreparedCopy(runs, n, ptr, lambda: sl)  # the closure keeps the pool memory

    def _prepare_dma(self, src_ids: Sequence[int] | np.ndarray,
                     dst_ids: Sequence[int] | np.ndarray) -> PreparedCopy:
        # Consecutive ids on both sides make one longer descriptor.
        starts_s, starts_d, lengths = descriptor_runs(
            src_ids, dst_ids, self.num_src_blocks, self.num_dst_blocks,
            src_name=self.src_name, dst_name=self.dst_name)
        if not starts_s:
            return PreparedCopy(_NO_RUNS, 0, 0, None)
        dsts, srcs, sizes = self._descriptors(starts_s, starts_d, lengths)
        # The arrays' addresses once per op: each layer's launch adds its offset.
        ptrs = (dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data)
        return PreparedCopy(_NO_RUNS, 0, 0, None,
                            dma=(dsts, srcs, sizes, self.num_roles * len(starts_s), ptrs))

    def _stage(self, n: int) -> tuple[Slice | object, np.ndarray, int]:
        """A pinned slice for ``n`` pairs: from the slabs, else (rarely) CuPy's pinned pool."""
        sl = self._slabs.alloc(8 * n)
        if sl is not None:
            off = sl.offset
            return sl, self._staging_i32[off // 4: off // 4 + 2 * n], self._staging_ptr + off
        if not self._warned_full:
            self._warned_full = True
            warnings.warn(
                "swap staging buffer is full; falling back to cudaHostAlloc, which waits for the "
                "GPU (raise staging_bytes)", RuntimeWarning, stacklevel=3,
            )
        mem = self._cp.cuda.alloc_pinned_memory(8 * n)
        return mem, np.ndarray((2 * n,), np.int32, mem), int(mem.ptr)

    # ------------------------------------------------------------------ launch
    def launch(
        self,
        prep: PreparedCopy,
        stream: object,
        layer_begin: int = 0,
        num_layers: int | None = None,
        *,
        ctas: int | None = None,
    ) -> None:
        """Enqueue the copy of layers ``[layer_begin, layer_begin + num_layers)`` on ``stream``."""
        if num_layers is None:
            num_layers = self.num_layers - layer_begin
        end = layer_begin + num_layers
        if layer_begin < 0 or num_layers < 0 or end > self.num_layers:
            raise ValueError(f"layer range [{layer_begin}, {end}) outside 0..{self.num_layers}")
        if num_layers == 0:
            return
        if prep.dma is not None:
            per = prep.dma[3]
            d, s, z = prep.dma[4]
            at = 8 * layer_begin * per  # byte offset of the first layer's descriptors
            self._dma.enqueue_at(d + at, s + at, z + at, num_layers * per,  # type: ignore[union-attr]
                                 stream.ptr)
            return
        if prep.runs.size:
            self._launch_runs(prep.runs, stream, layer_begin, num_layers)
        if prep.num_scattered:
            self.kernels.launch(
                stream.ptr, self.ctas if ctas is None else ctas,
                (self._table_ptr, self._roles_ptr, self.num_roles, self.chunks_per_block,
                 layer_begin, num_layers, prep.ids_ptr, prep.num_scattered),
            )

    def signals(self, prep: PreparedCopy) -> bool:
        """Whether ``prep`` can move in one ``launch_signal``: all of it on the kernel."""
        return (self.progress is not None and prep.dma is None and prep.num_scattered > 0
                and not prep.runs.size)

    def launch_signal(self, prep: PreparedCopy, stream: object, seq: int, *,
                      ctas: int | None = None) -> None:
        """Every layer in one launch; layer i, once landed, sets its progress words (device
        and host) to ``seq`` (take ``seq`` from ``progress.take()``; see ``signals``)."""
        pw = self.progress
        if pw is None:
            raise RuntimeError("this copier has no progress words (see signals())")
        self.kernels.launch_signal(
            stream.ptr, self.ctas if ctas is None else ctas,  # type: ignore[attr-defined]
            (self._table_ptr, self._roles_ptr, self.num_roles, self.chunks_per_block, 0,
             self.num_layers, prep.ids_ptr, prep.num_scattered),
            pw.counters_ptr, pw.dev_ptr, pw.ptr, seq)

    def copy(
        self,
        src_ids: Sequence[int] | np.ndarray,
        dst_ids: Sequence[int] | np.ndarray,
        stream: object,
        *,
        ctas: int | None = None,
    ) -> PreparedCopy:
        """All layers in one launch (+ one 2-D memcpy per role and run); keep the result alive."""
        prep = self.prepare(src_ids, dst_ids, stream)
        self.launch(prep, stream, ctas=ctas)
        return prep

    def _launch_runs(
        self, runs: np.ndarray, stream: object, layer_begin: int, n_layers: int
    ) -> None:
        rt = self._cp.cuda.runtime
        sp = stream.ptr
        for r, rb in enumerate(self.role_bytes):
            strides = self._strides[r]
            for s0, d0, length in runs.tolist():
                width = length * rb
                if n_layers > 1 and strides is not None:
                    src = int(self.src_bases[layer_begin, r]) + s0 * rb
                    dst = int(self.dst_bases[layer_begin, r]) + d0 * rb
                    rt.memcpy2DAsync(dst, strides[1], src, strides[0], width, n_layers,
                                     _MEMCPY_DEFAULT, sp)
                    continue
                for layer in range(layer_begin, layer_begin + n_layers):
                    src = int(self.src_bases[layer, r]) + s0 * rb
                    dst = int(self.dst_bases[layer, r]) + d0 * rb
                    rt.memcpyAsync(dst, src, width, _MEMCPY_DEFAULT, sp)
