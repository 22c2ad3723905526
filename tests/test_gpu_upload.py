"""How a step's metadata reaches the device (``GpuExecutor.upload``, issue 22).

With the fast executor, steps of 2,048 tokens overlapped a 1 GiB layer-wise
load by 11-24%: the step began only once the whole load had landed. The step's
first act was a ``cudaMemcpyAsync`` of its packed metadata on the compute
stream, which goes to a host -> device copy engine, where the load's copies
were queued (benchmarks/results/gpu_overlap_fast.md). The default upload is
now a kernel that reads the pinned host buffer (``kvflow_upload16``): no copy
engine on the step's path. CPU parts run everywhere; GPU tests skip without one.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_gpu_engine import BT, SPEC, _run_uvloop

from kernels import gpu_unavailable_reason
from kernels.compute import UPLOAD_MODES, upload_grid, upload_mode
from kernels.model import StepItem, prompt_tokens
from kvflow.errors import ConfigError
from kvflow.layout import ModelSpec

_GPU = gpu_unavailable_reason()
gpu = pytest.mark.skipif(_GPU is not None, reason=f"needs a CUDA GPU and CuPy: {_GPU}")

_BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_overlap.py"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_overlap", _BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------- CPU parts
def test_upload_mode_defaults_to_the_kernel_and_reads_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFLOW_UPLOAD", raising=False)
    assert upload_mode() == "kernel" == UPLOAD_MODES[0]
    monkeypatch.setenv("KVFLOW_UPLOAD", "memcpy")
    assert upload_mode() == "memcpy"
    assert upload_mode("kernel") == "kernel"  # an explicit choice wins
    monkeypatch.setenv("KVFLOW_UPLOAD", "dma")
    with pytest.raises(ConfigError, match="KVFLOW_UPLOAD"):
        upload_mode()
    with pytest.raises(ConfigError, match="upload must be one of"):
        upload_mode("copy")


@pytest.mark.parametrize(("size", "ctas", "words"),
                         [(16, 1, 1), (4096, 1, 256), (4112, 2, 257),
                          (33 << 10, 9, 2112), (1 << 20, 32, 65536)])
def test_upload_grid_covers_every_word_with_few_ctas(size: int, ctas: int, words: int) -> None:
    assert upload_grid(size) == (ctas, words)
    got_ctas, n16 = upload_grid(size)
    assert got_ctas * 256 >= n16 or got_ctas == 32  # a grid-stride loop covers the rest


@pytest.mark.parametrize("size", [0, -16, 24])
def test_upload_grid_refuses_sizes_the_packing_never_makes(size: int) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        upload_grid(size)


def test_bench_overlap_parses_cases_and_uploads() -> None:
    import argparse

    b = _bench()
    assert b.parse_case("worst:1:48:14") == ("worst", 1, 48, [14])
    assert b.parse_case("batch:8:2") == ("batch", 8, 2, None)
    assert b.parse_uploads("memcpy, kernel") == ("memcpy", "kernel")
    for bad in ("worst:1", "x:1:0", "x:one:2", "x:1:2:0", ":1:2"):
        with pytest.raises(argparse.ArgumentTypeError, match="--case"):
            b.parse_case(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="--upload"):
        b.parse_uploads("memcpy,dma")


# ---------------------------------------------------------------------- GPU
def _steps() -> list[list[StepItem]]:
    ta, tb = np.arange(0, 5, dtype=np.int32), np.arange(5, 10, dtype=np.int32)
    toks_a = prompt_tokens([1, 2, 3, 4, 5], "a", BT, 0, 70)
    toks_b = prompt_tokens([9, 8, 7], "b", BT, 0, 40)
    return [
        [StepItem("a", False, toks_a[:30], 0, ta, False),
         StepItem("b", False, toks_b, 0, tb, True)],
        [StepItem("a", False, toks_a[30:], 30, ta, True),
         StepItem("b", True, np.array([3], dtype=np.int32), 40, tb, True)],
        [StepItem("a", True, np.array([11], dtype=np.int32), 70, ta, True),
         StepItem("b", True, np.array([4], dtype=np.int32), 41, tb, True)],
    ]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["exact", "fast"])
def test_gpu_kernel_upload_gives_the_memcpy_uploads_outputs(kind: str) -> None:
    """Same metadata bytes, so the very same tokens, checksums and rows either way."""
    from kernels.backend import CudaBackend
    from kernels.fast import make_executor

    async def go(upload: str) -> tuple[dict[Any, Any], dict[Any, Any]]:
        ex = make_executor(kind, CudaBackend(SPEC, 16, 1), seed=5, max_tokens=16,
                           record_rows=True, upload=upload)
        assert ex.upload == upload
        for items in _steps():
            await ex.run_items(items)
        return ex.outputs, {k: np.stack(v) for k, v in ex.rows.items()}

    out_m, rows_m = _run_uvloop(lambda: go("memcpy"))
    out_k, rows_k = _run_uvloop(lambda: go("kernel"))
    assert out_k == out_m and set(rows_k) == set(rows_m) == {"a", "b"}
    for rid in rows_m:
        np.testing.assert_array_equal(rows_k[rid], rows_m[rid])


@gpu
@pytest.mark.gpu
def test_gpu_default_step_issues_no_copy_engine_upload(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default upload never calls ``cudaMemcpyAsync`` (the memcpy mode does: the spy works)."""
    import cupy as cp

    from kernels.backend import CudaBackend
    from kernels.compute import GpuExecutor

    calls: list[int] = []
    real = cp.cuda.runtime.memcpyAsync

    def spy(*args: Any) -> Any:
        calls.append(args[2])
        return real(*args)

    monkeypatch.delenv("KVFLOW_UPLOAD", raising=False)

    async def go(upload: str | None) -> None:
        ex = GpuExecutor(CudaBackend(SPEC, 16, 1), seed=5, max_tokens=16, upload=upload)
        monkeypatch.setattr(cp.cuda.runtime, "memcpyAsync", spy)
        try:
            for items in _steps():
                await ex.run_items(items)
        finally:
            monkeypatch.setattr(cp.cuda.runtime, "memcpyAsync", real)

    _run_uvloop(lambda: go(None))
    assert calls == []
    _run_uvloop(lambda: go("memcpy"))
    assert len(calls) == 3


#: Pieces of 512 KB (a role of a layer of a block): loads go to the copy engine.
BIG = ModelSpec("big-pieces", num_layers=8, num_kv_heads=8, head_dim=128, hidden_size=512,
                num_attention_heads=32, intermediate_size=512, block_tokens=256)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("upload", [
    "kernel",
    pytest.param("memcpy", marks=pytest.mark.xfail(
        strict=False, reason="the bug this guards against: the memcpy queues behind the load")),
])
def test_gpu_step_does_not_start_behind_a_queued_load(upload: str) -> None:
    """A step that reads none of a load's blocks starts while the load is on the copy engine.

    An ordering check, not a speed one: 96 blocks x 8 layers x 2 roles of 512 KB
    (768 MiB, ~14 ms on an H100's link) are queued on the copy engine before the
    step (2,048 tokens: ~33 KB of metadata) is enqueued; the step's start event
    must come before half the load is through.
    """
    import cupy as cp

    from kernels.backend import CudaBackend
    from kernels.compute import BackendTask, GpuExecutor
    from kernels.dma import batch_memcpy_unavailable_reason
    from kvflow.manager import OpKind, TransferOp
    from kvflow.radix import Tier

    why = batch_memcpy_unavailable_reason()
    if why is not None:
        pytest.skip(why)
    load_blocks, bt, new = 96, BIG.block_tokens, 2048
    step_blocks = new // bt

    async def go() -> tuple[float, float]:
        be = CudaBackend(BIG, load_blocks + step_blocks, load_blocks, dma="always",
                         eager_layers=None)
        ex = GpuExecutor(be, seed=0, max_tokens=new, upload=upload)
        table = np.arange(load_blocks, load_blocks + step_blocks, dtype=np.int32)
        items = [StepItem("s", False, prompt_tokens(list(range(step_blocks)), "s", bt, 0, new),
                          0, table, True)]
        await ex.run_items(items)  # warm: kernels loaded, buffers sized
        ids = list(range(load_blocks))
        lags = []
        for rep in range(3):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(be.load_stream)
            load = BackendTask(be, TransferOp(rep + 1, OpKind.SWAP_IN, Tier.HOST, Tier.DEVICE,
                                              ids, ids, []))
            b.record(be.load_stream)
            await ex.run_items(items)  # waits on nothing: its blocks are its own
            await load.wait()
            lags.append((cp.cuda.get_elapsed_time(a, ex._ev_start),
                         cp.cuda.get_elapsed_time(a, b)))
        return min(lags)

    start, load = _run_uvloop(go)
    assert start < 0.5 * load, f"the step started {start:.2f} ms into a {load:.2f} ms load"
