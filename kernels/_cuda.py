"""Lazy access to CuPy, so ``import kernels`` works where there is no GPU.

CI and the simulator run without CuPy; only code that actually moves bytes
calls ``cupy_module()``, which says clearly what is missing.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

#: Directory holding the ``.cu``/``.cuh`` sources.
SOURCE_DIR = Path(__file__).resolve().parent


def cupy_module() -> ModuleType:
    """Import and return ``cupy``, or raise an ImportError that says what to install."""
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(
            "kvflow's CUDA backend needs CuPy built for your CUDA version "
            "(pip install kvflow[gpu], or the cupy wheel matching your CUDA)"
        ) from exc
    return cupy


def gpu_unavailable_reason() -> str | None:
    """``None`` if CuPy imports and sees a GPU; otherwise why not (for test skips)."""
    try:
        cp = cupy_module()
    except ImportError as exc:
        return f"CuPy is not importable: {exc.__cause__ or exc}"
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no usable CUDA device: {exc}"
    return None if n > 0 else "no CUDA device visible"


@functools.cache
def load_module(filename: str, device: int) -> object:
    """Compile ``filename`` (under ``SOURCE_DIR``) with NVRTC for the given device, once."""
    cp = cupy_module()
    code = (SOURCE_DIR / filename).read_text()
    with cp.cuda.Device(device):
        return cp.RawModule(code=code, options=("-std=c++17", f"-I{SOURCE_DIR}"))
