"""PD transports between GPU caches (``kernels.pd_peer``), every cache role bit-exact:
device to device on one GPU, over TCP staged through host memory, and GPU to GPU
between two devices of one host. Skipped, saying why, without CuPy and a GPU (and the
two-GPU test without a second GPU: issue 25's run).

Plain (not pytest-asyncio) tests on the real world's loop, like the other GPU tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from pd_helpers import POISON, ROLE_SPECS, assert_moved, ports

from kernels import gpu_unavailable_reason
from kvflow.layout import ModelSpec
from kvflow.pd.ports import prompt_digest

_REASON = gpu_unavailable_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_REASON is not None, reason=f"needs a CUDA GPU and CuPy: {_REASON}"),
]


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(fn())


def memory(spec: ModelSpec, device: int, blocks: int, fill: int | None) -> Any:
    """A cache on ``device``: random bytes (never zero) or all ``fill``."""
    import cupy as cp

    from kernels.pd_peer import CudaBlockMemory

    sizes = [r.bytes_per_block for r in spec.layout.roles]
    with cp.cuda.Device(device):
        if fill is None:
            arrays = [cp.random.randint(1, 256, (spec.num_layers, blocks, b), dtype=np.uint8)
                      for b in sizes]
        else:
            arrays = [cp.full((spec.num_layers, blocks, b), fill, dtype=np.uint8)
                      for b in sizes]
        cp.cuda.Device().synchronize()
    return CudaBlockMemory(device, arrays)


def wire_order(mem: Any) -> np.ndarray:
    """``uint8[L, N, layer_bytes]`` on the host: each block's roles side by side."""
    import cupy as cp

    return np.concatenate([cp.asnumpy(a) for a in mem.arrays], axis=2)


async def move(kind: str, spec: ModelSpec, src: Any, dst: Any) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(5)
    src_ids = rng.permutation(src.num_blocks)[:20]
    dst_ids = rng.permutation(dst.num_blocks)[:20]
    keys = list(range(20))
    done = asyncio.get_running_loop().create_future()
    landed: list[int] = []
    async with ports(kind, (spec, src), (spec, dst)) as (send, recv):
        await recv.expect("r", 4, dst_ids[4:], prompt_digest(keys, 4, 20), landed.append,
                          done.set_result)
        pull = await send.pull("r")
        for layer in range(spec.num_layers):
            await send.put(pull, layer, 4, src_ids[4:11])
            await send.put(pull, layer, 11, src_ids[11:])
        assert await asyncio.wait_for(done, 30) is None
    assert landed == list(range(spec.num_layers))
    return src_ids[4:], dst_ids[4:]


@pytest.mark.parametrize("kind", ["inproc", "tcp"])
@pytest.mark.parametrize("name", sorted(ROLE_SPECS))
def test_one_gpu_round_trips_every_role(kind: str, name: str) -> None:
    """Two pools on one GPU: in-process a device-to-device copy, over TCP through host."""
    spec = ROLE_SPECS[name]

    async def main() -> None:
        src, dst = memory(spec, 0, 32, None), memory(spec, 0, 48, POISON)
        s_ids, d_ids = await move(kind, spec, src, dst)
        assert_moved(spec, wire_order(src), s_ids, wire_order(dst), d_ids)

    run(main)


def test_two_gpus_of_one_host_round_trip_every_role() -> None:
    from kernels.pd_peer import enable_peer_access, gpu_count

    if gpu_count() < 2:
        pytest.skip("needs two GPUs of one host (issue 25's run on nvidia-h200-x2)")
    enable_peer_access(0, 1)

    async def main() -> None:
        for spec in ROLE_SPECS.values():
            src, dst = memory(spec, 0, 32, None), memory(spec, 1, 48, POISON)
            s_ids, d_ids = await move("inproc", spec, src, dst)
            assert_moved(spec, wire_order(src), s_ids, wire_order(dst), d_ids)

    run(main)


def test_a_cuda_backends_caches_are_the_memory_it_views() -> None:
    import cupy as cp

    from kernels.backend import CudaBackend
    from kernels.pd_peer import CudaBlockMemory

    spec = ROLE_SPECS["mla-fp8-dsa"]

    async def main() -> None:
        backend = CudaBackend(spec, 8, 4)
        mem = CudaBlockMemory.for_backend(backend)
        data = np.random.default_rng(2).integers(1, 256, (2, mem.layer_bytes), np.uint8)
        mem.write(1, np.array([5, 2]), data)
        off = 0
        for r in spec.layout.roles:
            got = cp.asnumpy(backend.device_kv(1, r.name))[[5, 2]]
            assert np.array_equal(got, data[:, off:off + r.bytes_per_block]), r.name
            off += r.bytes_per_block
        assert np.array_equal(mem.read(1, np.array([5, 2])), data)

    run(main)
