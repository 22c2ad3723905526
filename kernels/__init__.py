"""The real world: CUDA swap kernels, their CuPy launchers and ``CudaBackend``.

Importing this package needs neither CuPy nor a GPU (CI has neither): the
pure planning code is in ``kernels.plan``; ``kernels.swap`` and
``kernels.backend`` import CuPy only when an object that moves bytes is built.
"""

from kernels._cuda import SOURCE_DIR, gpu_unavailable_reason

__all__ = ["SOURCE_DIR", "gpu_unavailable_reason"]
