"""CuPy launchers for the swap kernel (``swap.cu``) and the copy-engine runs.

``BlockCopier`` moves blocks one way between two sets of per-layer, per-role
buffers (device KV and pinned host KV, either direction). An op is first
*prepared* — ids validated (nothing moves if one is bad), split into
copy-engine runs and scattered pairs, pairs uploaded — and then *launched*
for any layer range: one layer at a time (the backend, which records an event
after each) or all layers at once.

Lifetime rule: a ``PreparedCopy`` owns the pinned staging and device id
buffers its launches read, so keep it alive until its stream has passed them
(the backend drops it in the op's final host callback).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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
#: Default run size (bytes per layer, all roles) from which a run goes to the copy engine.
#: A memcpy costs microseconds of setup, so only long runs win there.
DEFAULT_MIN_RUN_BYTES = 1 << 20
#: cudaMemcpyDefault: direction inferred from the (unified) addresses.
_MEMCPY_DEFAULT = 4
#: cudaMemcpy2D rejects pitches of 2 GiB and more.
_MAX_PITCH = (1 << 31) - 1


class SwapKernels:
    """The compiled swap kernel on one device."""

    def __init__(self, device: int | None = None) -> None:
        cp = cupy_module()
        self.device = cp.cuda.runtime.getDevice() if device is None else device
        self._fn = load_module("swap.cu", self.device).get_function("kvflow_swap_blocks")

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
        self._fn(
            (grid,), (THREADS,),
            (table, roles, num_roles, chunks_per_block, layer_begin, num_layers, ids, num_blocks),
            stream=stream,
        )


@dataclass(eq=False)
class PreparedCopy:
    """A validated op, ready to launch for any layer range of its copier."""

    runs: Runs
    num_scattered: int
    ids_dev: object = None   # cupy int32 [2 * num_scattered] on device
    staging: object = None   # pinned host memory the ids were uploaded from
    keep: list[object] = field(default_factory=list)

    @property
    def ids_ptr(self) -> int:
        return int(self.ids_dev.data.ptr) if self.ids_dev is not None else 0


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
        """Validate ids (``InvalidBlockId``: nothing enqueued), split them, upload on ``stream``."""
        src, dst = validate_ids(
            src_ids, dst_ids, self.num_src_blocks, self.num_dst_blocks,
            src_name=self.src_name, dst_name=self.dst_name,
        )
        runs = split_runs(src, dst, self.min_run_blocks)
        n = int(runs.src.size)
        prep = PreparedCopy(runs, n)
        if n:
            cp = self._cp
            nbytes = 8 * n
            staging = cp.cuda.alloc_pinned_memory(nbytes)
            host = np.ndarray((2 * n,), dtype=np.int32, buffer=staging)
            pack_ids(runs.src, runs.dst, out=host)
            with cp.cuda.Device(self.kernels.device):
                ids_dev = cp.empty(2 * n, dtype=np.int32)
            cp.cuda.runtime.memcpyAsync(
                ids_dev.data.ptr, staging.ptr, nbytes, _MEMCPY_DEFAULT, stream.ptr
            )
            prep.ids_dev, prep.staging = ids_dev, staging
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
                table=int(self._table.data.ptr),
                roles=int(self._roles.data.ptr),
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
