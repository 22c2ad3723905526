"""Compile every CUDA source under ``kernels/`` with NVRTC, as ``kernels._cuda.load_module``
(CuPy's ``RawModule``) does at run time on the GPU machine.

nvcc accepts things NVRTC does not (``offsetof`` / ``__builtin_offsetof`` in a
``static_assert`` once reached the GPU machine and failed there only), so the nvcc
PTX test is not enough. Skipped where no ``libnvrtc`` is found: the NVIDIA toolkit's
lib directory, or the ``nvidia-cuda-nvrtc`` wheel's (``pip install
nvidia-cuda-nvrtc==13.0.*``; its directory may also be given as ``KVFLOW_NVRTC_DIR``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
from pathlib import Path

import pytest

from kernels import SOURCE_DIR

SOURCES = sorted(SOURCE_DIR.glob("*.cu"))


def _find_nvrtc() -> ctypes.CDLL | None:
    dirs = [os.environ.get("KVFLOW_NVRTC_DIR", ""), "/usr/local/cuda/lib64",
            *(str(Path(p) / "nvidia" / "*" / "lib") for p in sys.path if p)]
    for pattern in dirs:
        if not pattern:
            continue
        for d in glob.glob(pattern):
            libs = sorted(glob.glob(os.path.join(d, "libnvrtc.so*")))
            if libs:
                # NVRTC dlopens its builtins by name: load them first, from the same place.
                for b in sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so*"))):
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(libs[0])
    name = ctypes.util.find_library("nvrtc")
    return ctypes.CDLL(name) if name else None


_NVRTC = _find_nvrtc()


@pytest.mark.skipif(_NVRTC is None, reason="libnvrtc not found (see the module docstring)")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles_with_nvrtc_for_sm_90(source: Path) -> None:
    lib = _NVRTC
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.read_bytes(),
                                  source.name.encode(), 0, None, None) == 0
    opts = [b"-std=c++17", b"-I" + str(SOURCE_DIR).encode(), b"-arch=compute_90"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert rc == 0, log.value.decode(errors="replace")
