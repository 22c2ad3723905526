"""Helpers for GPU tests and benchmarks (not used on the serving path)."""

from __future__ import annotations

from kernels._cuda import cupy_module, load_module


def spin(stream: object, seconds: float, device: int | None = None) -> None:
    """Keep ``stream`` busy for ``seconds`` (one thread sleeping on the GPU clock).

    Put ahead of a transfer it makes any missing device-side wait visible: the
    data would be read while the transfer is still queued.
    """
    cp = cupy_module()
    dev = cp.cuda.runtime.getDevice() if device is None else device
    fn = load_module("spin.cu", dev).get_function("kvflow_spin")
    fn((1,), (1,), (int(seconds * 1e9),), stream=stream)
