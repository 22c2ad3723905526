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
