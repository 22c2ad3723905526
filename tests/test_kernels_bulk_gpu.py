"""GPU tests of the experimental bulk-copy (TMA) swap kernel (skipped without a GPU).

Kept apart from test_kernels_gpu.py and best run in its own process: if the
bulk-copy engine cannot reach host memory, the fault poisons the CUDA context.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels import gpu_unavailable_reason
from kvflow.layout import ModelSpec

_REASON = gpu_unavailable_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_REASON is not None, reason=f"needs a CUDA GPU and CuPy: {_REASON}"),
]

if _REASON is None:
    import cupy as cp

    from kernels.backend import CudaBackend

SPECS = [
    ModelSpec("bulk-mha", num_layers=3, num_kv_heads=2, head_dim=64, block_tokens=32),
    ModelSpec("bulk-dsa", num_layers=2, num_kv_heads=1, head_dim=80, attention="mla",
              kv_lora_rank=64, qk_rope_head_dim=16, indexer_head_dim=32, dtype="fp8"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_bulk_round_trip_bit_exact(spec: ModelSpec) -> None:
    rng = np.random.default_rng(0)
    nd, nh, n = 64, 128, 50
    backend = CudaBackend(spec, nd, nh, min_run_bytes=0, engine="bulk")
    for layer in range(spec.num_layers):
        for role in backend.roles:
            h = backend.host_kv(layer, role)
            h[...] = rng.integers(0, 256, size=h.shape, dtype=np.uint8)
            backend.device_kv(layer, role)[...] = 0xCD
    host_src = rng.permutation(nh)[:n]
    dev = rng.permutation(nd)[:n]
    host_dst = rng.permutation(np.setdiff1d(np.arange(nh), host_src))[:n]
    keep_in = backend.h2d.copy(host_src, dev, backend.load_stream, ctas=3)
    backend.load_stream.synchronize()
    keep_out = backend.d2h.copy(dev, host_dst, backend.store_stream, ctas=2)
    backend.store_stream.synchronize()
    del keep_in, keep_out
    for layer in range(spec.num_layers):
        for role in backend.roles:
            h = backend.host_kv(layer, role)
            d = cp.asnumpy(backend.device_kv(layer, role))
            np.testing.assert_array_equal(d[dev], h[host_src])
            np.testing.assert_array_equal(h[host_dst], h[host_src])
