"""kvflow: KV-cache tiering for LLM serving (GPU, pinned host memory, storage).

The core imports neither simpy nor cupy: the simulated world lives in ``sim``,
the real one in ``kernels``.
"""

__version__ = "0.1.0"
