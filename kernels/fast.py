"""``FastExecutor``: the GPU world's compute as fast as a serving engine's (issue 22).

``GpuExecutor`` (``--executor exact``) runs kvflow's batch-invariant kernels:
bit-identical outputs whatever the batching, which is what lets a test compare
a swapped-and-restored run with a resident one token for token, but at about
a fifth of what the GPU can do. Overlap measured against such slow compute
flatters kvflow: a transfer hides easily under it. This executor
(``--executor fast``, the default for ``--backend cuda``) runs the same model
and step metadata with:

* the weight GEMMs on cuBLAS (``cublasGemmEx`` through CuPy's bindings: bf16
  in, fp32 accumulate; the residual projections accumulate straight into the
  fp32 hidden state with beta = 1, as the exact kernels' mode 1 does);
* a paged causal GQA prefill attention kernel in the FlashAttention-2 style
  (``fast.cu``, ``mma.sync``) or, on Hopper and by default there, the
  FlashAttention-3 style (``fast_wg.cu``: ``wgmma``, producer / consumer
  warpgroups over mbarriers, compiled for sm_90a), and a split-K paged decode
  kernel (``fast.cu``), whose splits are merged by ``compute.cu``'s combine kernel;
* everything else (embedding, RMSNorm, KV write, SiLU, final row) as the exact
  executor, on the same compute stream behind the same per-layer device-side
  waits (``CudaBackend.wait_layer`` before layer i writes or reads KV).

Outputs agree with the exact executor to bf16 rounding, not bit for bit
(``tests/test_gpu_fast.py`` states the tolerance). The executor choice flows
from ``ReplayConfig.executor`` (``kvflow replay --executor``) through
``make_executor``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kernels._cuda import SOURCE_DIR, cupy_module, load_module
from kernels.backend import CudaBackend
from kernels.compute import _LOG2E, GpuExecutor, _env_choice
from kernels.model import DECODE_SPLIT, TILE, StepItem, StepPlan, build_step
from kvflow.errors import ConfigError

#: Executors ``make_executor`` builds, the default first.
EXECUTORS = ("fast", "exact")
DEFAULT_EXECUTOR = "fast"

#: Prefill kernels of fast.cu by name: (warps a CTA, m-tiles of 16 query rows a warp, keys a
#: K/V tile, K/V tiles in shared memory, opt). A work item is 16 * warps * m-tiles rows.
#: More rows a warp share each K/V fragment it reads from shared memory (less traffic per
#: MMA) for more registers; opt: one block-table division per tile instead of per chunk, O
#: rescaled only when a row's max moved (bit 0); bit 1 ("q" names): Q read from shared
#: memory for each tile instead of held in registers, which frees 64 registers for 64-key
#: tiles. On an H100 (benchmarks/results/gpu_executor.md), 8k causal tokens: w4m2n32o
#: 0.288 of the bf16 peak (16-token blocks), w8m2n32 0.252,
#: w4m2n32 0.240, w8m1n64 0.236; at 1k tokens w8m1n64 is best (0.120, w4m2n32o 0.103).
PREFILL_VARIANTS = {"w8m1n64": (8, 1, 64, 2, 0), "w4m1n64": (4, 1, 64, 2, 0),
                    "w4m2n32": (4, 2, 32, 2, 0), "w4m2n64": (4, 2, 64, 2, 0),
                    "w4m2n32s3": (4, 2, 32, 3, 0), "w8m2n32": (8, 2, 32, 2, 0),
                    "w4m2n32o": (4, 2, 32, 2, 1), "w4m2n32s3o": (4, 2, 32, 3, 1),
                    "w4m2n64q": (4, 2, 64, 2, 3), "w4m2n32q": (4, 2, 32, 2, 3),
                    "w8m2n64q": (8, 2, 64, 2, 3)}
#: Hopper (sm_90a) prefill kernels of fast_wg.cu by name: (keys a K/V tile, stages). A CTA
#: is 3 warpgroups (a producer, two consumers of 64 query rows each): a work item is 128 rows.
#: "v" names: FlashAttention-3's intra-warpgroup overlap (the softmax of tile j + 1 runs
#: while P V of tile j is on the tensor cores).
WG_PREFILL_VARIANTS = {"wg128s2": (128, 2, 0), "wg128s3": (128, 3, 0), "wg64s3": (64, 3, 0),
                       "wg128s3v": (128, 3, 1), "wg64s3v": (64, 3, 1)}
for _name, (_keys, _stages, _ov) in WG_PREFILL_VARIANTS.items():
    # (warps, m-tiles of 16 rows a consumer warp, keys, stages, opt bit 2: wgmma kernel,
    # bit 3: overlap)
    PREFILL_VARIANTS[_name] = (12, 1, _keys, _stages, 4 | 8 * _ov)
#: Rows a work item of a wgmma kernel: two consumer warpgroups of 64 rows.
_WG_ROWS = 128
#: w4m2n64q (Q in shared memory, 64-key tiles): 0.298 / 0.318 of the peak at 8k (16- /
#: 32-token blocks) against w4m2n32o's 0.289 / 0.297, 3-12% faster at every size measured,
#: head dims 64 and 128 checked against the reference on the H100 (2026-11-25). The default
#: where the GPU is not a Hopper one.
DEFAULT_PREFILL = "w4m2n64q"
#: The default on a Hopper GPU (compute capability 9.0): wg128s3 (wgmma, 128-key tiles,
#: 3 stages) reached 0.423-0.430 of the peak at 8k (16- and 32-token blocks, two runs)
#: against w4m2n64q's 0.313-0.325 on the H100 (2026-11-25), 1.08-1.49x as fast at every
#: size from 1k to 8k, and passed the reference test at head dims 64 and 128.
DEFAULT_PREFILL_HOPPER = "wg128s3"
#: Keys per K/V tile of the decode kernel (16 per warp).
_BN = 64
_DECODE_WARPS, _DECODE_STAGES = 4, 3
#: Decode splits: about this many CTAs per SM in a step, splits never shorter than this.
_DECODE_CTAS_PER_SM = 8
_MIN_DECODE_SPLIT = 256


def default_prefill(compute_capability: str) -> str:
    """The prefill kernel used unless one is named, for a GPU of ``compute_capability``
    (CuPy's form, ``"90"``): the wgmma kernel on Hopper, which alone can run it."""
    return DEFAULT_PREFILL_HOPPER if compute_capability == "90" else DEFAULT_PREFILL


def make_executor(kind: str, backend: CudaBackend, **kwargs: Any) -> GpuExecutor:
    """The executor named ``kind`` (see ``EXECUTORS``) over ``backend``."""
    if kind == "fast":
        return FastExecutor(backend, **kwargs)
    if kind == "exact":
        return GpuExecutor(backend, **kwargs)
    raise ConfigError(f"unknown executor {kind!r}; valid: {', '.join(EXECUTORS)}")


@functools.cache
def load_sm90a_module(filename: str, device: int) -> Any:
    """Compile ``filename`` for sm_90a (``wgmma`` and ``setmaxnreg`` need the arch-specific
    target, which CuPy's ``RawModule`` does not pass) and load it, once.

    NVRTC through CuPy's bindings, else ``nvcc`` where NVRTC fails; the cubin goes to
    CuPy's kernel cache directory (``CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``) under
    a name hashed from source and options.
    """
    cp = cupy_module()
    code = (SOURCE_DIR / filename).read_text()
    opts = ("-std=c++17", f"-I{SOURCE_DIR}", "-arch=sm_90a")
    key = hashlib.sha256((code + "\0".join(opts)).encode()).hexdigest()[:24]
    cache = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"kvflow_{Path(filename).stem}_{key}.cubin"
    if not path.exists():
        errors = []
        try:
            cubin = _nvrtc_cubin(code, filename, opts)
        except Exception as exc:  # NVRTC missing or too old: nvcc next
            errors.append(f"nvrtc: {exc}")
            cubin = _nvcc_cubin(filename, errors)
        tmp = path.with_suffix(f".{id(cubin)}.tmp")
        tmp.write_bytes(cubin)
        tmp.replace(path)
    with cp.cuda.Device(device):
        return cp.RawModule(path=str(path))


def _nvrtc_cubin(code: str, filename: str, opts: tuple[str, ...]) -> bytes:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(code, filename, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, list(opts))
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"{exc}\n{nvrtc.getProgramLog(prog)}") from exc
        return bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


def _nvcc_cubin(filename: str, errors: list[str]) -> bytes:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise ConfigError(f"cannot compile {filename} for sm_90a: " + "; ".join(errors)
                          + "; nvcc: not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.cubin"
        proc = subprocess.run([nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a",
                               "-std=c++17", f"-I{SOURCE_DIR}", str(SOURCE_DIR / filename),
                               "-o", str(out)], capture_output=True, text=True)
        if proc.returncode:
            raise ConfigError(f"cannot compile {filename} for sm_90a: " + "; ".join(errors)
                              + f"; nvcc: {proc.stderr[-2000:]}")
        return out.read_bytes()


def auto_decode_split(contexts: Sequence[int], kv_heads: int, sms: int) -> int:
    """Keys per decode split so that a step's decode CTAs fill ``sms`` SMs a few times over.

    One CTA per (split, kv head): few long sequences get many splits (else a
    handful of CTAs would stream all their KV), many sequences one or two.
    Splits are whole key tiles and never shorter than ``_MIN_DECODE_SPLIT``
    (a CTA's pipeline needs a few tiles to stream at full speed).
    """
    if not contexts:
        return DECODE_SPLIT
    per_seq = max(1, round(_DECODE_CTAS_PER_SM * sms / (len(contexts) * kv_heads)))
    split = -(-max(contexts) // per_seq)
    return max(_MIN_DECODE_SPLIT, -(-split // _BN) * _BN)


class CublasGemm:
    """Row-major ``C[M,N] (+)= A[M,K] . W[N,K]^T`` in bf16 with fp32 accumulation, on one stream.

    Its own cuBLAS handle. CuPy's ``gemmEx`` binds the handle to CuPy's
    *current* stream on every call, so each call runs with the compute stream
    made current: otherwise the GEMMs go to the legacy default stream, which
    the (non-blocking) compute stream does not wait for, and race with the
    attention kernels and the per-layer waits (seen on an H100: wrong rows,
    and GEMM "times" of 37x the peak from events that never saw them).
    """

    def __init__(self, stream: Any) -> None:
        from cupy.cuda import runtime
        from cupy_backends.cuda.libs import cublas

        self._cublas = cublas
        self._stream = stream
        self.handle = cublas.create()
        cublas.setStream(self.handle, stream.ptr)
        self._finalizer = weakref.finalize(self, cublas.destroy, self.handle)
        self._one = np.ones(1, np.float32)    # host scalars (pointer mode host)
        self._zero = np.zeros(1, np.float32)
        self._bf16, self._f32 = int(runtime.CUDA_R_16BF), int(runtime.CUDA_R_32F)
        self._args = (int(cublas.CUBLAS_OP_T), int(cublas.CUBLAS_OP_N))
        self._compute = int(cublas.CUBLAS_COMPUTE_32F)
        self._algo = int(cublas.CUBLAS_GEMM_DEFAULT)

    def __call__(self, a: int, w: int, c: int, m: int, n: int, k: int, mode: int) -> None:
        """mode 0: C is bf16, overwritten; mode 1: C is fp32, added to."""
        # Column-major view: C^T [N, M] = W [K, N]^T . A^T [K, M].
        beta = self._one if mode else self._zero
        with self._stream:
            self._cublas.gemmEx(self.handle, *self._args, n, m, k, self._one.ctypes.data,
                                int(w), self._bf16, k, int(a), self._bf16, k, beta.ctypes.data,
                                int(c), self._f32 if mode else self._bf16, n, self._compute,
                                self._algo)

    def close(self) -> None:
        self._finalizer()


class FastExecutor(GpuExecutor):
    """``GpuExecutor`` with cuBLAS GEMMs and FlashAttention-style paged attention.

    ``prefill``: which prefill kernel (``PREFILL_VARIANTS``; default
    ``KVFLOW_FAST_PREFILL`` from the environment, else ``default_prefill`` of the GPU:
    ``DEFAULT_PREFILL_HOPPER`` on an H100 / H200, ``DEFAULT_PREFILL`` elsewhere;
    ``use_prefill`` changes it). ``decode_split``: keys per decode split; ``None`` sizes the
    splits per step so that the step's decode CTAs fill the GPU a few times
    over (long contexts of few sequences get more splits).
    Other arguments as ``GpuExecutor``.
    """

    kind = "fast"

    def __init__(self, backend: CudaBackend, *, decode_split: int | None = None,
                 prefill: str | None = None, **kwargs: Any) -> None:
        if decode_split is not None and (decode_split <= 0 or decode_split % TILE):
            raise ConfigError(f"decode_split must be a positive multiple of {TILE}")
        super().__init__(backend, decode_split=decode_split or DECODE_SPLIT, **kwargs)
        cp = self._cp
        self.fixed_split = decode_split
        hd = self.shape.head_dim
        with cp.cuda.Device(self.device):
            self._mod = load_module("fast.cu", self.device)
            default = default_prefill(cp.cuda.Device(self.device).compute_capability)
            self.use_prefill(prefill or _env_choice("KVFLOW_FAST_PREFILL", default,
                                                    tuple(PREFILL_VARIANTS)))
            dec = self._fn["fast_decode"] = self._mod.get_function(
                f"kvflow_fast_decode_hd{hd}_w{_DECODE_WARPS}")
            self._smem_decode = max(_DECODE_STAGES * 2 * _BN * (hd + 8) * 2,
                                    _DECODE_WARPS * 16 * (2 + hd) * 4)
            dec.max_dynamic_shared_size_bytes = self._smem_decode  # past the default 48 KB
            self.sms = int(cp.cuda.runtime.getDeviceProperties(self.device)
                           ["multiProcessorCount"])
            self.gemm = CublasGemm(self.stream)

    def use_prefill(self, name: str) -> None:
        """Run prefill attention with the kernel ``name`` of ``PREFILL_VARIANTS`` from now on."""
        if name not in PREFILL_VARIANTS:
            raise ConfigError(f"unknown prefill kernel {name!r}; valid: "
                              f"{', '.join(PREFILL_VARIANTS)}")
        if name in WG_PREFILL_VARIANTS:
            self._use_wg_prefill(name)
            return
        warps, mtiles, keys, stages, opt = PREFILL_VARIANTS[name]
        hd = self.shape.head_dim
        with self._cp.cuda.Device(self.device):
            fn = self._mod.get_function(
                f"kvflow_fast_prefill_hd{hd}_w{warps}_m{mtiles}_n{keys}_s{stages}_o{opt}")
            smem = stages * 2 * keys * (hd + 8) * 2  # K and V, padded rows
            if opt & 2:  # and Q (the CTA's rows)
                smem += 16 * warps * mtiles * (hd + 8) * 2
            fn.max_dynamic_shared_size_bytes = smem
        self._fn["fast_prefill"], self._smem_prefill = fn, smem
        self.prefill, self.prefill_threads = name, 32 * warps
        self.prefill_rows = 16 * warps * mtiles

    def _use_wg_prefill(self, name: str) -> None:
        keys, stages, overlap = WG_PREFILL_VARIANTS[name]
        hd = self.shape.head_dim
        cc = self._cp.cuda.Device(self.device).compute_capability
        if cc != "90":
            raise ConfigError(f"prefill kernel {name!r} needs a Hopper GPU (sm_90a), "
                              f"this one is sm_{cc}")
        with self._cp.cuda.Device(self.device):
            fn = load_sm90a_module("fast_wg.cu", self.device).get_function(
                f"kvflow_wg_prefill_hd{hd}_n{keys}_s{stages}_v{overlap}")
            # Q of both consumers, K and V stages, the mbarriers, 1 KB to align to 1024 bytes
            smem = 1024 + 2 * 64 * hd * 2 + stages * 2 * keys * hd * 2 + 16 * stages
            fn.max_dynamic_shared_size_bytes = smem
        self._fn["fast_prefill"], self._smem_prefill = fn, smem
        self.prefill, self.prefill_threads, self.prefill_rows = name, 384, _WG_ROWS

    # ------------------------------------------------------------------ step layout
    def decode_split_for(self, items: Sequence[StepItem]) -> int:
        """Keys per decode split for a step of ``items`` (``fixed_split`` if one was given)."""
        if self.fixed_split is not None:
            return self.fixed_split
        return auto_decode_split([it.pos0 + 1 for it in items if it.decode],
                                 self.shape.kv_heads, self.sms)

    def _build(self, items: Sequence[StepItem]) -> StepPlan:
        return build_step(items, self.shape, self.decode_split_for(items),
                          prefill_tile=self.prefill_rows)

    def kernel_info(self) -> dict[str, dict[str, int]]:
        """Registers and local (spill) bytes of the attention kernels, as loaded."""
        return {name: {"regs": int(self._fn[name].num_regs),
                       "local_bytes": int(self._fn[name].local_size_bytes),
                       "smem": self._smem_prefill if name == "fast_prefill"
                       else self._smem_decode}
                for name in ("fast_prefill", "fast_decode")}

    # ------------------------------------------------------------------ kernels
    def _gemm(self, a: np.uint64, w: Any, c: np.uint64, m: int, n: int, k: int,
              mode: int) -> None:
        self.gemm(int(a), int(w.data.ptr), int(c), m, n, k, mode)

    def _attend(self, plan: StepPlan, meta: Callable[[str], np.uint64], layer: int) -> None:
        s, fn, stream = self.shape, self._fn, self.stream
        u64, i32 = np.uint64, np.int32
        wp, wd, nd = len(plan.prefill_work), len(plan.decode_work), len(plan.combine)
        scale = np.float32(s.softmax_scale * _LOG2E)
        o = u64(self._o.data.ptr)
        attn = (u64(self._qkv.data.ptr), i32(s.qkv_dim), u64(self._kc[layer]),
                u64(self._vc[layer]), np.int64(s.block_stride), i32(s.block_tokens),
                i32(s.kv_heads), i32(s.group))
        if wp:  # longest work items first: the kernel walks grid y backwards
            fn["fast_prefill"]((s.heads, wp), (self.prefill_threads,),
                               (*attn, meta("prefill_work"), meta("tables"), o, scale),
                               stream=stream, shared_mem=self._smem_prefill)
        if wd:
            po, pml = u64(self._part_o.data.ptr), u64(self._part_ml.data.ptr)
            fn["fast_decode"]((s.kv_heads, wd), (32 * _DECODE_WARPS,),
                              (*attn, meta("decode_work"), meta("tables"), po, pml, scale),
                              stream=stream, shared_mem=self._smem_decode)
            fn["kvflow_attn_combine"]((nd, s.heads), (32,),
                                      (meta("combine"), po, pml, o, i32(s.heads),
                                       i32(s.head_dim)), stream=stream)
