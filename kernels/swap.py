"""CuPy launchers for the swap kernel (``swap.cu``) and the copy-engine runs.

``BlockCopier`` moves blocks one way between two sets of per-layer, per-role
buffers (device KV and pinned host KV, either direction). An op is first
*prepared* — ids validated (nothing moves if one is bad), split into
copy-engine runs and scattered pairs, pairs uploaded — and then *launched*
for any layer range: one layer at a time (the backend, which records an event
after each) or all layers at once.

The kernel reads the id pairs straight from the op's pinned staging buffer
(mapped host memory): no device allocation and no upload per op. Lifetime
rule: a ``PreparedCopy`` owns that buffer, so keep it alive until its stream
has passed the last launch (the backend drops it in the op's final host
callback). Launch from one thread at a time (the event loop's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kernels._cuda import cupy_module, load_module
from kernels.plan import (
    Runs,
    min_run_blocks_for,
    pack_ids,
    pointer_table,
    role_table,
    split_runs,
    uniform_stride,
    validate_ids,
)

#: Threads per CTA of the swap kernel (its ``__launch_bounds__``).
THREADS = 1024
#: Default CTAs per launch: few SMs, so compute keeps the GPU.
DEFAULT_CTAS = 8
#: Default source-load flavour (``KVFLOW_LOAD_VARIANT`` in ``swap_copy.cuh``).
DEFAULT_LOAD_VARIANT = 0
#: Default run size (bytes per layer, all roles) from which a run goes to the copy engine.
#: A memcpy costs microseconds of setup, so only long runs win there.
DEFAULT_MIN_RUN_BYTES = 1 << 20
#: cudaMemcpyDefault: direction inferred from the (unified) addresses.
_MEMCPY_DEFAULT = 4
#: cudaMemcpy2D rejects pitches of 2 GiB and more.
_MAX_PITCH = (1 << 31) - 1


class SwapKernels:
    """The compiled swap kernel on one device, with a lean launch path.

    CuPy's generic kernel call converts every argument on every launch; the
    backend launches once per layer per op, so this packs the eight 64-bit
    arguments into one reused buffer and calls ``cuLaunchKernel`` directly
    (the driver copies the arguments at launch, so the buffer is free again
    at once).
    """

    def __init__(self, device: int | None = None, load_variant: int = DEFAULT_LOAD_VARIANT) -> None:
        cp = cupy_module()
        self.device = cp.cuda.runtime.getDevice() if device is None else device
        self.load_variant = load_variant
        module = load_module("swap.cu", self.device, (f"KVFLOW_LOAD_VARIANT={load_variant}",))
        self._fn = module.get_function("kvflow_swap_blocks")
        self._params = np.zeros(8, dtype=np.int64)
        self._argv = np.array([self._params.ctypes.data + 8 * i for i in range(8)],
                              dtype=np.uint64)
        self._argv_ptr = int(self._argv.ctypes.data)
        raw = getattr(cp.cuda.driver, "launchKernel", None)
        fptr = getattr(self._fn, "ptr", None)
        self._raw = (raw, int(fptr)) if raw is not None and fptr else None

    def launch(
        self,
        stream: object,
        *,
        table: int,
        roles: int,
        num_roles: int,
        chunks_per_block: int,
        layer_begin: int,
        num_layers: int,
        ids: int,
        num_blocks: int,
        ctas: int,
    ) -> None:
        """Enqueue one launch; pointers are raw device (or mapped host) addresses."""
        warps = num_blocks * chunks_per_block * num_layers
        if warps <= 0:
            return
        grid = max(1, min(ctas, -(-warps // (THREADS // 32))))
        args = (table, roles, num_roles, chunks_per_block, layer_begin, num_layers, ids, num_blocks)
        if self._raw is None:
            self._fn((grid,), (THREADS,), args, stream=stream)
            return
        self._params[:] = args
        raw, fptr = self._raw
        raw(fptr, grid, 1, 1, THREADS, 1, 1, 0, stream.ptr, self._argv_ptr, 0)


@dataclass(eq=False)
class PreparedCopy:
    """A validated op, ready to launch for any layer range of its copier."""

    runs: Runs
    num_scattered: int
    staging: object = None   # pinned (mapped) host int32 [num_scattered, 2], read by the kernel

    @property
    def ids_ptr(self) -> int:
        return int(self.staging.ptr) if self.staging is not None else 0


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
        kernels: SwapKernels | None = None,
        src_name: str = "source",
        dst_name: str = "destination",
    ) -> None:
        cp = cupy_module()
        self._cp = cp
        self.kernels = kernels or SwapKernels()
        self.src_bases = np.asarray(src_bases, dtype=np.int64)
        self.dst_bases = np.asarray(dst_bases, dtype=np.int64)
        self.num_layers, self.num_roles = self.src_bases.shape
        self.role_bytes = [int(b) for b in role_bytes]
        if len(self.role_bytes) != self.num_roles:
            raise ValueError(f"{len(self.role_bytes)} role sizes for {self.num_roles} roles")
        self.num_src_blocks = num_src_blocks
        self.num_dst_blocks = num_dst_blocks
        self.ctas = ctas
        self.src_name, self.dst_name = src_name, dst_name
        self.min_run_blocks = min_run_blocks_for(min_run_bytes, sum(self.role_bytes))
        roles, self.chunks_per_block = role_table(self.role_bytes)
        table = pointer_table(self.src_bases, self.dst_bases)
        with cp.cuda.Device(self.kernels.device):
            self._table = cp.asarray(table)
            self._roles = cp.asarray(roles)
        self._table_ptr, self._roles_ptr = int(self._table.data.ptr), int(self._roles.data.ptr)
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
        stream: object,
    ) -> PreparedCopy:
        """Validate ids (``InvalidBlockId``: nothing enqueued), split them, stage them pinned.

        ``stream`` is unused now (the kernel reads the staging buffer directly)
        and kept so callers need not change if ids move to device memory.
        """
        src, dst = validate_ids(
            src_ids, dst_ids, self.num_src_blocks, self.num_dst_blocks,
            src_name=self.src_name, dst_name=self.dst_name,
        )
        runs = split_runs(src, dst, self.min_run_blocks)
        n = int(runs.src.size)
        prep = PreparedCopy(runs, n)
        if n:
            staging = self._cp.cuda.alloc_pinned_memory(8 * n)
            pack_ids(runs.src, runs.dst, out=np.ndarray((2 * n,), dtype=np.int32, buffer=staging))
            prep.staging = staging
        return prep

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
        if prep.runs.runs.size:
            self._launch_runs(prep.runs.runs, stream, layer_begin, num_layers)
        if prep.num_scattered:
            self.kernels.launch(
                stream,
                table=self._table_ptr,
                roles=self._roles_ptr,
                num_roles=self.num_roles,
                chunks_per_block=self.chunks_per_block,
                layer_begin=layer_begin,
                num_layers=num_layers,
                ids=prep.ids_ptr,
                num_blocks=prep.num_scattered,
                ctas=self.ctas if ctas is None else ctas,
            )

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
