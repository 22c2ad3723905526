"""Copies between a block-contiguous host layout and the device's per-(layer, role) caches.

With ``grouped:G`` or ``block_major`` (``kvflow.host_layout``) a host piece is
one block's G layers, every role, contiguous, while the device keeps each
(layer, role) as its own ``[blocks, role bytes]`` buffer, as attention needs
it. So the shapes differ, and a piece goes through a device-side staging
buffer: a load is one batched copy-engine call moving whole pieces host ->
staging (``kernels.dma``, a run of consecutive host ids in one descriptor),
then a D2D scatter staging -> caches by the swap kernel (its table's strides
name the staging side's piece size); a backup is the gather then the
device -> host batch. D2D runs at ~3 TB/s against PCIe's 55 GB/s, so the
scatter costs a few per cent of the copy and, on its own stream, overlaps
the next piece's copy.

The staging is a ring of slots in device memory allocated up front. An op's
group is cut into chunks of as many blocks as a slot holds; each chunk takes
the next slot, waiting (on the GPU) for the slot's previous user to finish.
The copy-engine side and the kernel side run on two streams (``head``, where
the op's dependencies are waited on, and ``tail``, where its layer events
are recorded: for a load the copy then the scatter, for a backup the gather
then the copy), so chunk c's scatter overlaps chunk c+1's copy. ``CudaBackend``
keeps the copies on its two copy streams (``load_stream``, ``store_stream``),
as in ``layer_major``, and gives each direction's kernels a stream of their own.

A launch covers whole groups: layer ``i``'s event, recorded after its group's
last chunk, resolves when every layer of the group is on the device (or host).
Use a copier from one thread (the event loop's).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np

from kernels._cuda import cupy_module
from kernels.dma import BatchMemcpy, batch_memcpy_unavailable_reason
from kernels.layout_plan import fixed_tables, merges_none, plan_chunks, staging_table
from kernels.plan import FAST_IDS, role_table, validate_ids
from kernels.staging import SlabAllocator, Slice
from kvflow.host_layout import HostGeometry

#: Device staging per direction, split into ``DEFAULT_SLOTS`` slots (a slot holds at least
#: one piece whatever this says).
DEFAULT_DEVICE_STAGING_BYTES = 64 << 20
DEFAULT_SLOTS = 4
#: CTAs of the D2D scatter / gather (1024 threads each, one SM each).
DEFAULT_SCATTER_CTAS = 4
#: Pinned bytes for the kernel's id pairs of ops in flight.
DEFAULT_ID_STAGING_BYTES = 1 << 20
_MEMCPY_DEFAULT = 4
_ALIGN = 256


class StagingRing:
    """``slots`` device slots of ``slot_bytes``; a slot is reused once the GPU is past it."""

    def __init__(self, slot_bytes: int, slots: int) -> None:
        cp = cupy_module()
        self._cp = cp
        self.slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        self.slots = slots
        self.mem = cp.empty(self.slot_bytes * slots, dtype=np.uint8)
        self.base = int(self.mem.data.ptr)
        self._free: list[object | None] = [None] * slots
        self.ready = [cp.cuda.Event(disable_timing=True) for _ in range(slots)]
        self._next = 0

    def acquire(self, head: object) -> int:
        """The next slot; ``head`` waits (on the GPU) until its previous user released it."""
        k = self._next
        self._next = (k + 1) % self.slots
        ev = self._free[k]
        if ev is not None:
            head.wait_event(ev)  # type: ignore[attr-defined]
        return k

    def release(self, k: int, tail: object) -> None:
        """Slot ``k`` is free once ``tail`` has passed what is enqueued on it now."""
        ev = self._free[k]
        if ev is None:
            ev = self._free[k] = self._cp.cuda.Event(disable_timing=True)
        ev.record(tail)  # type: ignore[attr-defined]


class PreparedGroups:
    """A validated op: its kernel id pairs (staged) and, per group, its copy descriptors."""

    __slots__ = ("_release", "bounds", "chunks", "host", "host_addr", "ids_ptr", "sizes",
                 "stage")

    def __init__(self, chunks: list[tuple[int, int]], ids_ptr: int,
                 release: Callable[[], None] | None, bounds: list[int],
                 host: np.ndarray, stage: np.ndarray | None, sizes: np.ndarray | None) -> None:
        self.chunks = chunks      # (first position, blocks) of each chunk
        self.ids_ptr = ids_ptr    # int32 pairs for the kernel, chunk after chunk
        self._release = release
        self.bounds = bounds      # chunk c's runs are [bounds[c], bounds[c + 1])
        self.host = host          # [group, run]: host address of each run (uint64)
        self.stage = stage        # [group, run]: offset of each run inside its slot
        self.sizes = sizes        # [group, run]: bytes of each run
        # ``stage``/``sizes`` None: one block per run at its chunk position (the copier's
        # ``FixedTables`` hold them); ``host`` is then contiguous from ``host_addr``.
        self.host_addr = 0
        if stage is None:
            if not host.flags.c_contiguous:  # rows are handed to the driver by address
                raise ValueError("a scattered plan's host addresses must be C-contiguous")
            self.host_addr = int(host.ctypes.data)

    def release(self) -> None:
        rel, self._release = self._release, None
        if rel is not None:
            rel()

    def __del__(self) -> None:
        self.release()


class GroupedCopier:
    """One direction between a block-contiguous pinned host pool and the device caches.

    ``geo``: the host pool's geometry (``kvflow.host_layout.HostGeometry``, a
    block-contiguous layout); ``host_ptr`` its pinned buffer; ``dev_bases``
    ``[layers, roles]`` addresses of device block 0. ``to_device``: loads
    (host ids are the sources) or backups (host ids are the destinations).
    ``head``/``tail``: the streams described in the module docstring.
    """

    def __init__(self, geo: HostGeometry, host_ptr: int, dev_bases: np.ndarray,
                 num_device_blocks: int, *, to_device: bool, head: object, tail: object,
                 kernels: object, ctas: int = DEFAULT_SCATTER_CTAS,
                 staging_bytes: int = DEFAULT_DEVICE_STAGING_BYTES, slots: int = DEFAULT_SLOTS,
                 id_staging_bytes: int = DEFAULT_ID_STAGING_BYTES, dma: str = "auto") -> None:
        if not geo.layout.block_contiguous:
            raise ValueError(f"GroupedCopier needs a block-contiguous layout, not {geo.layout}")
        cp = cupy_module()
        self._cp = cp
        self.geo = geo
        self.num_layers = geo.num_layers
        self.role_bytes = list(geo.role_bytes)
        self.num_roles = len(self.role_bytes)
        self.to_device = to_device
        self.head, self.tail = head, tail
        self.kernels = kernels
        self.ctas = ctas
        self.host_ptr = int(host_ptr)
        self.num_host_blocks = geo.num_blocks
        self.num_device_blocks = num_device_blocks
        if to_device:
            self.num_src_blocks, self.num_dst_blocks = geo.num_blocks, num_device_blocks
            self.src_name, self.dst_name = "host", "device"
        else:
            self.num_src_blocks, self.num_dst_blocks = num_device_blocks, geo.num_blocks
            self.src_name, self.dst_name = "device", "host"
        self.groups = geo.groups
        self.pieces = [geo.piece_bytes(g) for g in range(len(self.groups))]
        self.ring = StagingRing(max(staging_bytes // slots, max(self.pieces)), slots)
        #: Blocks of one chunk (the largest group's pieces that fit a slot).
        self.per_chunk = self.ring.slot_bytes // max(self.pieces)
        self.use_dma = batch_memcpy_unavailable_reason() is None and dma != "never"
        if dma == "always" and not self.use_dma:
            raise RuntimeError(f"dma='always' but {batch_memcpy_unavailable_reason()}")
        self._batch = BatchMemcpy() if self.use_dma else None
        table = staging_table(geo, dev_bases, self.ring.base, self.ring.slot_bytes, slots,
                              to_device)
        roles, self.chunks_per_block = role_table(self.role_bytes)
        self._table = cp.asarray(table)
        self._roles = cp.asarray(roles)
        self._table_ptr, self._roles_ptr = int(self._table.data.ptr), int(self._roles.data.ptr)
        self._slabs = SlabAllocator(id_staging_bytes)
        self._ids_mem = cp.cuda.alloc_pinned_memory(self._slabs.capacity)
        self._ids_ptr = int(self._ids_mem.ptr)
        self._ids_i32 = np.ndarray((self._slabs.capacity // 4,), np.int32, self._ids_mem)
        self._warned_full = False
        self._fixed = fixed_tables(geo, host_ptr, self.ring.base, self.ring.slot_bytes, slots,
                                   self.per_chunk)
        self._fixed_stage_ptr = int(self._fixed.stage.ctypes.data)
        self._fixed_sizes_ptr = int(self._fixed.sizes.ctypes.data)
        #: A benchmark's diagnostic only: move the pieces but skip the D2D step (what the
        #: copies alone cost); the bytes then never reach their destination.
        self.skip_kernel = False

    # ------------------------------------------------------------------ prepare
    def prepare(self, src_ids: Sequence[int] | np.ndarray, dst_ids: Sequence[int] | np.ndarray,
                stream: object = None) -> PreparedGroups:
        """Validate (``InvalidBlockId``: nothing staged), stage the kernel's pairs, build each
        group's copy descriptors (consecutive host ids in one chunk: one descriptor)."""
        src, dst = self._validate(src_ids, dst_ids)
        n = len(src)
        if n == 0:
            empty = np.zeros((len(self.groups), 0), dtype=np.uint64)
            return PreparedGroups([], 0, None, [0], empty, empty, empty)
        if type(src) is list:
            fast = self._prepare_scattered(src, dst)  # type: ignore[arg-type]
            if fast is not None:
                return fast
        plan = plan_chunks(self.geo, self.host_ptr, src, dst, self.per_chunk, self.to_device)
        handle, buf, ptr = self._stage(n)
        buf[:] = plan.pairs
        if isinstance(handle, Slice):
            slabs = self._slabs
            release: Callable[[], None] = lambda: slabs.free(handle)  # noqa: E731
        else:
            release = lambda: handle  # noqa: E731  (the closure keeps the pool memory)
        return PreparedGroups(plan.chunks, ptr, release, plan.bounds, plan.host, plan.stage,
                              plan.sizes)

    def _prepare_scattered(self, src: list[int], dst: list[int]) -> PreparedGroups | None:
        """``prepare`` of validated lists where no two neighbours in a chunk have consecutive
        host ids (each block its own descriptor): a gather of host addresses and the
        kernel's pairs; staging addresses and sizes come from the fixed tables."""
        m, n = self.per_chunk, len(src)
        host = src if self.to_device else dst
        if not merges_none(host, m):
            return None
        pairs = [0] * (2 * n)
        if self.to_device:
            pairs[0::2] = [i % m for i in range(n)] if n > m else range(n)
            pairs[1::2] = dst
        else:
            pairs[0::2] = src
            pairs[1::2] = [i % m for i in range(n)] if n > m else range(n)
        handle, buf, ptr = self._stage(n)
        buf[:] = pairs
        if isinstance(handle, Slice):
            slabs = self._slabs
            release: Callable[[], None] = lambda: slabs.free(handle)  # noqa: E731
        else:
            release = lambda: handle  # noqa: E731  (the closure keeps the pool memory)
        chunks = [(c, min(m, n - c)) for c in range(0, n, m)]
        bounds = [*range(0, n, m), n]
        return PreparedGroups(chunks, ptr, release, bounds, self._fixed.gather(host), None,
                              None)

    def _validate(self, src_ids: Sequence[int] | np.ndarray,
                  dst_ids: Sequence[int] | np.ndarray
                  ) -> tuple[np.ndarray | list[int], np.ndarray | list[int]]:
        """``validate_ids``, with short lists of ints (what a ``TransferOp`` carries) checked in
        plain Python first: each numpy call costs microseconds, and this is on the path from
        a load's submission to the step waiting for it. Anything else, and every error, goes
        through ``validate_ids``, so the messages come from one place."""
        n = len(src_ids)
        ns, nd = self.num_src_blocks, self.num_dst_blocks
        if (type(src_ids) is list and type(dst_ids) is list and n == len(dst_ids)
                and n <= FAST_IDS and all(type(x) is int and 0 <= x < ns for x in src_ids)
                and all(type(x) is int and 0 <= x < nd for x in dst_ids)
                and len(set(dst_ids)) == n):
            return src_ids, dst_ids  # (plan_chunks plans lists in plain Python)
        return validate_ids(src_ids, dst_ids, ns, nd, src_name=self.src_name,
                            dst_name=self.dst_name)

    def _stage(self, n: int) -> tuple[object, np.ndarray, int]:
        sl = self._slabs.alloc(8 * n)
        if sl is not None:
            off = sl.offset
            return sl, self._ids_i32[off // 4: off // 4 + 2 * n], self._ids_ptr + off
        if not self._warned_full:
            self._warned_full = True
            warnings.warn("layout copier id staging is full; falling back to cudaHostAlloc, "
                          "which waits for the GPU", RuntimeWarning, stacklevel=3)
        mem = self._cp.cuda.alloc_pinned_memory(8 * n)
        return mem, np.ndarray((2 * n,), np.int32, mem), int(mem.ptr)

    # ------------------------------------------------------------------ launch
    def launch(self, prep: PreparedGroups, stream: object, layer_begin: int = 0,
               num_layers: int | None = None, *, ctas: int | None = None) -> None:
        """Enqueue the groups of layers ``[layer_begin, layer_begin + num_layers)`` (whole
        groups); ``stream`` must be ``head``. Layer events go on ``tail`` after it."""
        if num_layers is None:
            num_layers = self.num_layers - layer_begin
        end = layer_begin + num_layers
        if layer_begin < 0 or num_layers < 0 or end > self.num_layers:
            raise ValueError(f"layer range [{layer_begin}, {end}) outside 0..{self.num_layers}")
        if num_layers == 0 or not prep.chunks:
            return
        head, tail = self.head, self.tail
        if stream is not head:
            raise ValueError("a GroupedCopier launches on its own head stream")
        L = self.num_layers
        c_ctas = self.ctas if ctas is None else ctas
        for g, (first, count) in enumerate(self.groups):
            if first + count <= layer_begin or first >= end:
                continue
            if first < layer_begin or first + count > end:
                raise ValueError(f"layers [{layer_begin}, {end}) cut group {g} "
                                 f"[{first}, {first + count}) of {self.geo.layout}")
            for c, (p0, nb) in enumerate(prep.chunks):
                k = self.ring.acquire(head)
                a, b = prep.bounds[c], prep.bounds[c + 1]
                descs = self._descriptors(prep, g, a, b, k)
                args = (self._table_ptr, self._roles_ptr, self.num_roles, self.chunks_per_block,
                        k * L + first, count, prep.ids_ptr + 8 * p0, nb)
                if self.to_device:
                    self._copy(descs[1], descs[0], descs[2], b - a, head)
                    self.ring.ready[k].record(head)
                    tail.wait_event(self.ring.ready[k])  # type: ignore[attr-defined]
                    if not self.skip_kernel:
                        self.kernels.launch(tail.ptr, c_ctas, args)  # type: ignore[attr-defined]
                else:
                    if not self.skip_kernel:
                        self.kernels.launch(head.ptr, c_ctas, args)  # type: ignore[attr-defined]
                    self.ring.ready[k].record(head)
                    tail.wait_event(self.ring.ready[k])  # type: ignore[attr-defined]
                    self._copy(descs[0], descs[1], descs[2], b - a, tail)
                self.ring.release(k, tail)

    def _descriptors(self, prep: PreparedGroups, g: int, a: int, b: int,
                     k: int) -> tuple[int | np.ndarray, int | np.ndarray, int | np.ndarray]:
        """(host, staging, sizes) of runs ``[a, b)`` of group ``g`` in slot ``k``: addresses of
        contiguous uint64 entries (scattered preps, batched copies) or arrays."""
        if prep.stage is None:
            G, m = len(self.groups), self.per_chunk
            n = prep.host.shape[1]
            host = prep.host_addr + 8 * (g * n + a)
            stage = self._fixed_stage_ptr + 8 * ((k * G + g) * m)
            sizes = self._fixed_sizes_ptr + 8 * (g * m)
            if self._batch is not None:
                return host, stage, sizes
            return (prep.host[g][a:b], self._fixed.stage[k, g, : b - a],
                    self._fixed.sizes[g, : b - a])
        slot = np.uint64(self.ring.base + k * self.ring.slot_bytes)
        return prep.host[g][a:b], prep.stage[g][a:b] + slot, prep.sizes[g][a:b]

    def _copy(self, dsts: int | np.ndarray, srcs: int | np.ndarray, sizes: int | np.ndarray,
              n: int, stream: object) -> None:
        """``n`` copies; the descriptors as addresses of contiguous uint64 entries or arrays."""
        if self._batch is not None:
            if isinstance(dsts, np.ndarray):  # (rows of the plan's arrays: contiguous already)
                dsts, srcs, sizes = (dsts.ctypes.data, srcs.ctypes.data,  # type: ignore[union-attr]
                                     sizes.ctypes.data)  # type: ignore[union-attr]
            self._batch.enqueue_at(dsts, srcs, sizes, n, stream.ptr)  # type: ignore
            return
        rt = self._cp.cuda.runtime  # fallback: one memcpy per run
        for d, s, z in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(),  # type: ignore
                           strict=True):
            rt.memcpyAsync(d, s, z, _MEMCPY_DEFAULT, stream.ptr)  # type: ignore[attr-defined]

    #: Grouped ops keep an event per layer (a chunk's copy, scatter and slot events):
    #: no single signalling launch moves them.
    progress = None

    def signals(self, prep: PreparedGroups) -> bool:
        return False

    def copy(self, src_ids: Sequence[int] | np.ndarray, dst_ids: Sequence[int] | np.ndarray,
             stream: object | None = None) -> PreparedGroups:
        """Every layer; keep the result until ``tail`` has passed it."""
        prep = self.prepare(src_ids, dst_ids)
        self.launch(prep, self.head)
        return prep
