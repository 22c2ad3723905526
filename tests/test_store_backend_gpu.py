"""The storage tier behind a real ``CudaBackend`` (skipped without CuPy or a GPU).

device -> pinned host (CUDA) -> store (StoreBackend staging through
``CudaHostBlocks``) -> other pinned host blocks -> other device blocks, ordered
by ``RoutedBackend`` across the two backends: the bytes come back bit-exact,
for MHA and MLA layouts (roles of different sizes).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels import gpu_unavailable_reason
from kvflow.backends import RoutedBackend
from kvflow.layout import ModelSpec
from kvflow.manager import OpKind, TransferOp
from kvflow.radix import Tier
from kvflow.store_backend import StoreBackend
from kvflow.stores import LocalDirStore, Namespace

_REASON = gpu_unavailable_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_REASON is not None, reason=f"needs a CUDA GPU and CuPy: {_REASON}"),
]

SPECS = [
    ModelSpec("mha-bf16", num_layers=3, num_kv_heads=2, head_dim=64),
    ModelSpec("mla-fp8-dsa", num_layers=2, num_kv_heads=1, head_dim=80, attention="mla",
              kv_lora_rank=64, qk_rope_head_dim=16, indexer_head_dim=32, dtype="fp8"),
]


class Sink:
    def __init__(self) -> None:
        self.layers: list[int] = []
        self.finished = asyncio.get_running_loop().create_future()

    def layer_done(self, layer: int) -> None:
        self.layers.append(layer)

    def done(self, error: BaseException | None = None) -> None:
        self.finished.set_result(error)


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_device_host_store_host_device_round_trip(spec: ModelSpec, tmp_path: Path) -> None:
    import cupy as cp

    from kernels.backend import CudaBackend
    from kernels.host_blocks import CudaHostBlocks

    async def main() -> None:
        gpu = CudaBackend(spec, 16, 16)
        store = LocalDirStore(tmp_path, Namespace.for_model(spec))
        storage = StoreBackend(store, CudaHostBlocks(gpu), spec.num_layers)
        be = RoutedBackend({(Tier.HOST, Tier.DEVICE): gpu, (Tier.DEVICE, Tier.HOST): gpu,
                            (Tier.STORAGE, Tier.HOST): storage,
                            (Tier.HOST, Tier.STORAGE): storage})
        rng = np.random.default_rng(0)
        for layer in range(gpu.num_layers):
            for role in gpu.roles:
                d = gpu.device_kv(layer, role)
                d[...] = cp.asarray(rng.integers(0, 256, size=d.shape, dtype=np.uint8))
                gpu.host_kv(layer, role)[...] = 0xAA  # poison: unwritten blocks show
        cp.cuda.Device().synchronize()
        keys = [101, 102, 103]
        ids = iter(range(1 << 20))

        def op(kind: OpKind, src: Tier, dst: Tier, s: list[int], d: list[int]) -> TransferOp:
            return TransferOp(next(ids), kind, src, dst, s, d, keys)

        steps = [op(OpKind.EVICT, Tier.DEVICE, Tier.HOST, [0, 5, 9], [1, 2, 3]),
                 op(OpKind.WRITE, Tier.HOST, Tier.STORAGE, [1, 2, 3], [0, 1, 2]),
                 op(OpKind.PREFETCH, Tier.STORAGE, Tier.HOST, [0, 1, 2], [10, 11, 12]),
                 op(OpKind.SWAP_IN, Tier.HOST, Tier.DEVICE, [10, 11, 12], [13, 14, 15])]
        handles: list[Any] = []
        sinks = []
        for o in steps:  # each after the previous one: the runtime would order them so
            s = Sink()
            handles.append(be.submit(o, s, handles[-1:]))
            sinks.append(s)
        errors = await asyncio.gather(*(s.finished for s in sinks))
        assert errors == [None] * 4, errors
        assert all(s.layers == list(range(spec.num_layers)) for s in sinks)
        gpu.synchronize()
        for layer in range(gpu.num_layers):
            for role in gpu.roles:
                d = cp.asnumpy(gpu.device_kv(layer, role))
                assert np.array_equal(d[[13, 14, 15]], d[[0, 5, 9]]), (layer, role)
        assert store.stats.put_ok == 3 and store.stats.hits == 3
        await storage.drain()
        storage.close()
        store.close()

    asyncio.run(main())
