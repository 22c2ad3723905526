"""Compile every CUDA source under ``kernels/`` to PTX for sm_90, so CI catches a broken kernel."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kernels import SOURCE_DIR

SOURCES = sorted(SOURCE_DIR.glob("*.cu"))


def test_sources_exist() -> None:
    assert {p.name for p in SOURCES} >= {"swap.cu", "spin.cu"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) is not on PATH")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles_to_ptx(source: Path, tmp_path: Path) -> None:
    out = tmp_path / (source.stem + ".ptx")
    proc = subprocess.run(
        ["nvcc", "-ptx", "-arch=sm_90", "-std=c++17", f"-I{SOURCE_DIR}",
         "-Werror", "all-warnings", str(source), "-o", str(out)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert ".entry" in out.read_text()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) is not on PATH")
def test_swap_kernel_does_not_spill(tmp_path: Path) -> None:
    """1024 threads per CTA allow 64 registers; a spill would put the buffer in local memory."""
    proc = subprocess.run(
        ["nvcc", "-cubin", "-arch=sm_90", "-std=c++17", f"-I{SOURCE_DIR}", "-Xptxas", "-v",
         str(SOURCE_DIR / "swap.cu"), "-o", str(tmp_path / "swap.cubin")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "0 bytes spill stores" in proc.stderr, proc.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) is not on PATH")
def test_wgmma_prefill_builds_for_sm90a_without_spills_or_serialised_wgmma(
        tmp_path: Path) -> None:
    """fast_wg.cu for sm_90a: every kernel assembles with no spill, and ptxas neither
    ignores setmaxnreg nor serialises the wgmma, which would cost most of what the
    warpgroup MMA is for."""
    proc = subprocess.run(
        ["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17",
         f"-I{SOURCE_DIR}", "-Xptxas", "-v", str(SOURCE_DIR / "fast_wg.cu"),
         "-o", str(tmp_path / "fast_wg.cubin")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    entries = proc.stderr.count("Compiling entry function")
    assert entries >= 6, proc.stderr
    assert proc.stderr.count("0 bytes spill stores") == entries, proc.stderr
    # C7508: setmaxnreg ignored; C7512/C7514/C7520: wgmma serialised (a register limit, an
    # accumulator read inside the pipeline, a branch not known to be warp-uniform)
    for code in ("C7508", "C7512", "C7514", "C7520"):
        assert code not in proc.stderr, proc.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) is not on PATH")
def test_wgmma_prefill_traps_when_built_for_plain_sm90(tmp_path: Path) -> None:
    """Built for sm_90 (no arch-specific features) the wgmma kernels compile to a trap, not
    to silently wrong code; for sm_90a the PTX holds the wgmma."""
    texts = {}
    for arch in ("sm_90", "sm_90a"):
        out = tmp_path / f"{arch}.ptx"
        proc = subprocess.run(["nvcc", "-ptx", f"-arch={arch}", "-std=c++17", f"-I{SOURCE_DIR}",
                               str(SOURCE_DIR / "fast_wg.cu"), "-o", str(out)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        texts[arch] = out.read_text()
    assert "wgmma" not in texts["sm_90"] and "trap;" in texts["sm_90"]
    assert "wgmma.mma_async" in texts["sm_90a"] and "setmaxnreg" in texts["sm_90a"]
