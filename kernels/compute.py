"""``GpuExecutor``: the engine's compute on a real GPU, layer by layer over paged KV.

Each step runs the model of ``kernels.model`` (RMSNorm, QKV projection, K/V
written into the requests' blocks, attention read through their block tables,
output projection, gated MLP) with the kernels of ``compute.cu`` on one compute
stream. Loads the step depends on are waited for *on the GPU*, one layer at a
time: before layer i writes or reads KV, the compute stream waits on layer i's
event of every load (``CudaBackend.wait_layer``), so layer i computes while
layers i+1.. are still crossing PCIe. The CPU enqueues the whole step without
waiting for anything and awaits one future at the end (an event, then a host
function on a side stream that resolves it on the loop), which is also when
the step's sampled tokens are read back.

Outputs are bit-identical whatever the batching (see ``compute.cu``), so a run
that swapped KV out and back, or evicted and recomputed it, must produce the
very tokens and checksums of a run that kept everything resident.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from kernels._cuda import cupy_module, load_module
from kernels.backend import CudaBackend, CudaTask
from kernels.model import (
    DECODE_SPLIT,
    ModelShape,
    PagedExecutorBase,
    StepItem,
    StepPlan,
    build_step,
    pack_step,
    packed_size,
)
from kvflow.errors import ConfigError, TransferError

_H2D = 1  # cudaMemcpyHostToDevice
_LOG2E = 1.4426950408889634
#: Rows from which the GEMM uses 128-row tiles (same numbers either way, see compute.cu).
_BM128_FROM = 512

#: Rows up to which the skinny (decode) GEMM runs, when enabled.
_SKINNY_UPTO = 64

_KERNELS = ("kvflow_gemm_bm64", "kvflow_gemm_bm128", "kvflow_gemm_skinny", "kvflow_attn_combine",
            "kvflow_embed", "kvflow_rmsnorm", "kvflow_kv_write", "kvflow_silu_mul",
            "kvflow_final", "kvflow_upload16")

#: How a step's metadata reaches the device: ``kernel`` (SMs read the pinned host buffer,
#: the default) or ``memcpy`` (``cudaMemcpyAsync``, a host -> device copy engine, where it
#: queues behind the loads; kept to measure that). See ``upload_mode``.
UPLOAD_MODES = ("kernel", "memcpy")
#: Threads a CTA and most CTAs of the upload kernel (a few tens of KB a step).
_UPLOAD_THREADS, _UPLOAD_MAX_CTAS = 256, 32


def _env_choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, default).strip() or default
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def upload_mode(value: str | None = None) -> str:
    """``value`` if given, else ``KVFLOW_UPLOAD`` from the environment, else ``kernel``;
    ``ConfigError`` unless one of ``UPLOAD_MODES``."""
    if value is None:
        return _env_choice("KVFLOW_UPLOAD", UPLOAD_MODES[0], UPLOAD_MODES)
    if value not in UPLOAD_MODES:
        raise ConfigError(f"upload must be one of {', '.join(UPLOAD_MODES)}, got {value!r}")
    return value


def upload_grid(size: int) -> tuple[int, int]:
    """(CTAs, 16-byte words) of the upload kernel for ``size`` bytes (a multiple of 16)."""
    if size <= 0 or size % 16:
        raise ValueError(f"the packed metadata is a positive multiple of 16 bytes, got {size}")
    n16 = size // 16
    return min(-(-n16 // _UPLOAD_THREADS), _UPLOAD_MAX_CTAS), n16


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _resolve(arg: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]) -> None:
    """On a CUDA driver thread: hop to the loop; never raise, never call CUDA."""
    loop, fut = arg
    with contextlib.suppress(RuntimeError):  # closed loop: nobody waits any more
        loop.call_soon_threadsafe(_set_done, fut)


def to_bf16(x: Any) -> Any:
    """float32 CuPy array -> bf16 bits (uint16), round to nearest even."""
    cp = cupy_module()
    u = cp.ascontiguousarray(x, dtype=cp.float32).view(cp.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)


def make_weights(shape: ModelShape, seed: int = 0) -> list[dict[str, Any]]:
    """Seeded bf16 weights on the current device, N(0, 1/K): activations stay O(1)."""
    cp = cupy_module()
    rs = cp.random.RandomState(seed)
    out = []
    for _ in range(shape.num_layers):
        layer = {}
        for name, (n, k) in shape.weight_shapes().items():
            layer[name] = to_bf16(rs.standard_normal((n, k), dtype=cp.float32)
                                  * np.float32(1.0 / math.sqrt(k)))
        out.append(layer)
    return out


def cuda_task(handle: object) -> CudaTask | None:
    """The ``CudaTask`` of a runtime task's handle: the handle itself, or, behind a
    ``kvflow.backends.RoutedBackend`` (a world with a storage tier), the sub-backend's
    handle once the op has been submitted to the GPU (None before that)."""
    if isinstance(handle, CudaTask):
        return handle
    inner = getattr(handle, "inner", None)
    return inner if isinstance(inner, CudaTask) else None


class GpuExecutor(PagedExecutorBase):
    """``ComputeExecutor`` of the real world, over a ``CudaBackend``'s device KV.

    ``max_tokens``: tokens per step the workspace is sized for up front (it
    grows if a step needs more). ``record_rows``: also keep each sampled
    token's final hidden row (float32), for comparison with the numpy reference.
    ``attn_keys``: keys per attention tile, 16 or 32 (numbers differ between the
    two, never between batchings); ``skinny``: steps of at most 64 tokens use
    the decode GEMM (same numbers). Both default to ``KVFLOW_ATTN_KEYS`` /
    ``KVFLOW_GEMM_SKINNY`` from the environment, else 32 / on. ``upload``: how
    the step's metadata reaches the device (``UPLOAD_MODES``, ``upload_mode``):
    by a kernel reading pinned host memory, so that it never waits behind a
    load on the copy engine; the attribute may be changed between steps.
    Call from the event loop's thread.
    """

    #: Name of this executor (``--executor``; ``kernels.fast.EXECUTORS``).
    kind = "exact"

    def __init__(self, backend: CudaBackend, *, seed: int = 0, max_tokens: int = 1024,
                 decode_split: int = DECODE_SPLIT, record_rows: bool = False,
                 weights: list[dict[str, Any]] | None = None, attn_keys: int | None = None,
                 skinny: bool | None = None, upload: str | None = None) -> None:
        cp = cupy_module()
        self._cp = cp
        shape = ModelShape.from_spec(backend.spec)
        super().__init__(shape, decode_split)
        self.backend = backend
        self.device = backend.device
        self.upload = upload_mode(upload)
        self.record_rows = record_rows
        self.rows: dict[Hashable, list[np.ndarray]] = {}
        self.busy_s = 0.0           # GPU time of all steps (events)
        self.steps = 0
        self.last_gpu_s = 0.0
        self.last_enqueue_s = 0.0   # CPU time to enqueue the last step (never waits on the GPU)
        self.last_wall_s = 0.0
        #: When a list: one (prefill (new, context) pairs, decode contexts, GPU s, wall s,
        #: start on ``time.perf_counter``) per step, in the cost model's terms (calibration
        #: fits to engine steps, and the host's share to the gaps between their starts).
        self.step_log: list[tuple[list[tuple[int, int]], list[int], float, float, float]] | None \
            = None
        with cp.cuda.Device(self.device):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self._notify = cp.cuda.Stream(non_blocking=True)
            mod = load_module("compute.cu", self.device)
            hd = shape.head_dim
            if attn_keys is None:
                attn_keys = int(_env_choice("KVFLOW_ATTN_KEYS", "32", ("16", "32")))
            if attn_keys not in (16, 32):
                raise ConfigError(f"attn_keys must be 16 or 32, got {attn_keys!r}")
            if skinny is None:
                skinny = _env_choice("KVFLOW_GEMM_SKINNY", "1", ("0", "1")) == "1"
            self.attn_keys, self.skinny = attn_keys, skinny
            self._fn = {name: mod.get_function(name) for name in _KERNELS}
            self._fn["prefill"] = mod.get_function(f"kvflow_attn_prefill_hd{hd}_k{attn_keys}")
            self._fn["decode"] = mod.get_function(f"kvflow_attn_decode_hd{hd}_k{attn_keys}")
            self.weights = weights if weights is not None else make_weights(shape, seed)
            self._kc = [int(backend.device_kv(i, "k").data.ptr) for i in range(shape.num_layers)]
            self._vc = [int(backend.device_kv(i, "v").data.ptr) for i in range(shape.num_layers)]
            self._ev_start = cp.cuda.Event()
            self._ev_end = cp.cuda.Event()
            self._cap_tokens = self._cap_parts = self._cap_meta = self._cap_emit = 0
            self._ensure(max(max_tokens, 16), 256, 1 << 16, 256)
            # The weights were written on CuPy's (legacy) default stream, which our
            # non-blocking compute stream does not wait for: finish them now.
            cp.cuda.runtime.deviceSynchronize()

    # ------------------------------------------------------------------ buffers
    def _ensure(self, tokens: int, parts: int, meta: int, emit: int) -> None:
        cp, s = self._cp, self.shape
        u16, f32 = cp.uint16, cp.float32
        if tokens > self._cap_tokens:
            n = max(tokens, 2 * self._cap_tokens)
            self._h = cp.empty((n, s.hidden), f32)
            self._x = cp.empty((n, s.hidden), u16)
            self._qkv = cp.empty((n, s.qkv_dim), u16)
            self._o = cp.empty((n, s.q_dim), u16)
            self._gu = cp.empty((n, 2 * s.intermediate), u16)
            self._act = cp.empty((n, s.intermediate), u16)
            self._cap_tokens = n
        if parts > self._cap_parts:
            n = max(parts, 2 * self._cap_parts)
            self._part_o = cp.empty((n, s.heads, s.head_dim), f32)
            self._part_ml = cp.empty((n, s.heads, 2), f32)
            self._cap_parts = n
        if meta > self._cap_meta:
            n = max(meta, 2 * self._cap_meta)
            self._meta_mem = cp.cuda.alloc_pinned_memory(n)
            self._meta_host = np.ndarray((n,), np.uint8, self._meta_mem)
            self._meta_dev = cp.empty(n, cp.uint8)
            self._cap_meta = n
        if emit > self._cap_emit:
            n = max(emit, 2 * self._cap_emit)
            self._out_mem = cp.cuda.alloc_pinned_memory(8 * n)  # mapped: the kernel writes it
            self._out = np.ndarray((n, 2), np.uint32, self._out_mem)
            self._rows_dev = cp.empty((n, s.hidden), f32) if self.record_rows else None
            self._cap_emit = n

    # ------------------------------------------------------------------ the protocol
    async def run_step(self, batch: Any, waits: Sequence[Any]) -> None:
        """``ComputeExecutor.run_step``: the batch's requests on the GPU, after their loads."""
        await self.run_items(self.items_for(batch), waits)

    async def run_items(self, items: Sequence[StepItem], waits: Sequence[Any] = ()) -> StepPlan:
        """Enqueue one step of ``items``, layer i after layer i of each wait; await the end.

        Raises ``TransferError`` (nothing recorded) if a wait failed: before
        anything is enqueued when it is known, else after the step, whose
        results are then dropped.
        """
        t0 = time.perf_counter()
        plan = self._build(items)
        if plan.num_tokens == 0:
            return plan
        pending = []
        for t in waits:
            if t.finished:
                if not t.ok:
                    await t.wait()  # raises TransferError
                continue
            handle = cuda_task(t.handle)
            if handle is None:
                # Behind a RoutedBackend and not on the GPU yet: it waits for an op of
                # another backend (a swap-in for the store read filling its host blocks).
                # No CUDA event to wait on exists: wait for the whole op here.
                await t.wait()  # raises TransferError if it failed
                continue
            if not handle.started:
                await t.wait()  # failed before it started: its done(error) is on its way
            pending.append(handle)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._cp.cuda.Device(self.device):
            self._enqueue(plan, pending)
            self._notify.wait_event(self._ev_end)
            self._notify.launch_host_func(_resolve, (loop, fut))
        self.last_enqueue_s = time.perf_counter() - t0
        await fut
        gpu = self._cp.cuda.get_elapsed_time(self._ev_start, self._ev_end) / 1e3
        self.busy_s += gpu
        self.last_gpu_s = gpu
        self.steps += 1
        for t in waits:
            if not t.ok:
                await t.wait()  # the GPU is past it: resolves at once, raises if it failed
        if not all(t.ok for t in waits):  # pragma: no cover - wait() raised above
            raise TransferError("a load this step waited for did not land")
        e = len(plan.emit_ids)
        if e:
            out = self._out[:e].copy()
            if self.record_rows:
                rows = self._cp.asnumpy(self._rows_dev[:e])
                for rid, row in zip(plan.emit_ids, rows, strict=True):
                    self.rows.setdefault(rid, []).append(row)
            self.record(plan.emit_ids, out[:, 0].tolist(), out[:, 1].tolist())
        self.last_wall_s = time.perf_counter() - t0
        if self.step_log is not None:
            self.step_log.append((
                [(len(it.tokens), it.pos0) for it in items if not it.decode],
                [it.pos0 + 1 for it in items if it.decode], gpu, self.last_wall_s, t0))
        return plan

    # ------------------------------------------------------------------ kernels
    def _build(self, items: Sequence[StepItem]) -> StepPlan:
        """The step's metadata as this executor's kernels read it."""
        return build_step(items, self.shape, self.decode_split)

    def _upload(self, plan: StepPlan) -> Callable[[str], np.uint64]:
        """Copy the step's metadata to the device (on the stream); the address of each array."""
        cp = self._cp
        size = packed_size(plan)
        self._ensure(plan.num_tokens, max(plan.num_partials, 1), size,
                     max(len(plan.emit_ids), 1))
        _, off = pack_step(plan, self._meta_host)
        src, dst = int(self._meta_mem.ptr), int(self._meta_dev.data.ptr)
        if self.upload == "kernel":  # SMs, not a copy engine: never behind a load's copies
            ctas, n16 = upload_grid(size)
            self._fn["kvflow_upload16"]((ctas,), (_UPLOAD_THREADS,),
                                        (np.uint64(src), np.uint64(dst), np.int64(n16)),
                                        stream=self.stream)
        else:
            cp.cuda.runtime.memcpyAsync(dst, src, size, _H2D, self.stream.ptr)
        base = dst

        def meta(name: str) -> np.uint64:
            return np.uint64(base + off[name])

        return meta

    def _enqueue(self, plan: StepPlan, pending: Sequence[Any]) -> None:
        s = self.shape
        T, E = plan.num_tokens, len(plan.emit_ids)
        meta = self._upload(plan)
        stream = self.stream
        u64, i32 = np.uint64, np.int32
        h, x, qkv = (u64(a.data.ptr) for a in (self._h, self._x, self._qkv))
        o, gu, act = (u64(a.data.ptr) for a in (self._o, self._gu, self._act))
        fn = self._fn
        self._ev_start.record(stream)
        fn["kvflow_embed"]((T,), (256,), (meta("tokens"), meta("positions"), h, i32(s.hidden)),
                           stream=stream)
        for layer in range(s.num_layers):
            w = self.weights[layer]
            self._rmsnorm(h, x, T)
            self._gemm(x, w["wqkv"], qkv, T, s.qkv_dim, s.hidden, 0)
            for t in pending:  # layer i of every load this step reads (or overwrites) lands first
                self.backend.wait_layer(stream, t, layer)
            self.backend.pump()  # other ops' deferred layers keep pace (``eager_layers``)
            fn["kvflow_kv_write"]((T,), (128,), (qkv, i32(s.qkv_dim), i32(s.q_dim),
                                                 i32(s.kv_dim), meta("slots"),
                                                 u64(self._kc[layer]), u64(self._vc[layer])),
                                  stream=stream)
            self._attend(plan, meta, layer)
            self._gemm(o, w["wo"], h, T, s.hidden, s.q_dim, 1)
            self._rmsnorm(h, x, T)
            self._gemm(x, w["wgu"], gu, T, 2 * s.intermediate, s.hidden, 0)
            pairs = T * (s.intermediate // 2)
            fn["kvflow_silu_mul"]((min(-(-pairs // 256), 132 * 16),), (256,),
                                  (gu, act, i32(T), i32(s.intermediate)), stream=stream)
            self._gemm(act, w["wd"], h, T, s.hidden, s.intermediate, 1)
        if E:
            rows = u64(self._rows_dev.data.ptr) if self.record_rows else u64(0)
            fn["kvflow_final"]((E,), (32,), (h, meta("emit_rows"), i32(s.hidden),
                                             u64(self._out_mem.ptr), rows), stream=stream)
        self._ev_end.record(stream)

    def _attend(self, plan: StepPlan, meta: Callable[[str], np.uint64], layer: int) -> None:
        """One layer's attention: the step's queries (``_qkv``) over their paged KV -> ``_o``."""
        s, fn, stream = self.shape, self._fn, self.stream
        u64, i32 = np.uint64, np.int32
        wp, wd, nd = len(plan.prefill_work), len(plan.decode_work), len(plan.combine)
        scale = np.float32(s.softmax_scale * _LOG2E)
        o = u64(self._o.data.ptr)
        attn = (u64(self._qkv.data.ptr), i32(s.qkv_dim), u64(self._kc[layer]),
                u64(self._vc[layer]), np.int64(s.block_stride), i32(s.block_tokens),
                i32(s.kv_heads), i32(s.group))
        if wp:
            fn["prefill"]((wp, s.kv_heads), (32 * s.group,),
                          (*attn, meta("prefill_work"), meta("tables"), o, scale),
                          stream=stream)
        if wd:
            po, pml = u64(self._part_o.data.ptr), u64(self._part_ml.data.ptr)
            fn["decode"]((wd, s.kv_heads), (32,),
                         (*attn, meta("decode_work"), meta("tables"), po, pml, scale),
                         stream=stream)
            fn["kvflow_attn_combine"]((nd, s.heads), (32,),
                                      (meta("combine"), po, pml, o, i32(s.heads),
                                       i32(s.head_dim)), stream=stream)

    def _gemm(self, a: np.uint64, w: Any, c: np.uint64, m: int, n: int, k: int,
              mode: int) -> None:
        args = (a, np.uint64(w.data.ptr), c, np.int32(m), np.int32(n), np.int32(k),
                np.int32(mode))
        if self.skinny and m <= _SKINNY_UPTO:
            self._fn["kvflow_gemm_skinny"]((n // 32, -(-m // 16)), (32,), args,
                                           stream=self.stream)
            return
        bm = 128 if m >= _BM128_FROM else 64
        fn = self._fn["kvflow_gemm_bm128" if bm == 128 else "kvflow_gemm_bm64"]
        fn((n // 64, -(-m // bm)), (2 * bm,), args, stream=self.stream)

    def _rmsnorm(self, h: np.uint64, x: np.uint64, rows: int) -> None:
        self._fn["kvflow_rmsnorm"]((-(-rows // 8),), (256,),
                                   (h, x, np.int32(rows), np.int32(self.shape.hidden)),
                                   stream=self.stream)

    # ------------------------------------------------------------------ helpers
    async def warm_up(self, block: int = 0) -> None:
        """Load and run every kernel once (prefill + decode) on device block ``block``.

        Writes KV into that block, so call it before the block holds anything
        (a fresh backend); forgets the outputs.
        """
        bt = self.shape.block_tokens
        n = min(bt - 1, 32)
        table = np.array([block], dtype=np.int32)
        rid = ("__warm_up__",)
        await self.run_items([StepItem(rid, False, np.arange(n, dtype=np.int32), 0, table,
                                       True)])
        await self.run_items([StepItem(rid, True, np.array([1], dtype=np.int32), n, table,
                                       True)])
        self.outputs.pop(rid, None)
        self.rows.pop(rid, None)
        self._last.pop(rid, None)
        self.busy_s = 0.0
        self.steps = 0

    def weights_numpy(self) -> list[dict[str, np.ndarray]]:
        """The bf16 weights as float64 numpy arrays (for ``kernels.model.NumpyModel``)."""
        cp = self._cp
        out = []
        for layer in self.weights:
            out.append({name: (cp.asnumpy(w).astype(np.uint32) << 16).view(np.float32)
                        .astype(np.float64) for name, w in layer.items()})
        return out


class BackendTask:
    """A stand-in for ``kvflow.runtime.TransferTask`` over a ``FutureSink``.

    For callers that drive ``CudaBackend`` directly (benchmarks, calibration,
    tests) and hand the op to ``GpuExecutor.run_items`` as a wait: it has what
    the executor reads (``handle``, ``finished``, ``ok``, ``wait()``).
    """

    def __init__(self, backend: CudaBackend, op: Any) -> None:
        from kernels.backend import FutureSink

        self.op = op
        self.sink = FutureSink(backend.num_layers)
        self.handle = backend.submit(op, self.sink)

    @property
    def finished(self) -> bool:
        return self.sink.finished.done()

    @property
    def ok(self) -> bool:
        return self.finished and self.sink.finished.exception() is None

    def wait(self) -> asyncio.Future[None]:
        return self.sink.finished
