"""PD transports between GPU caches (``kernels.pd_peer``), every cache role bit-exact:
device to device on one GPU, over TCP staged through host memory, and GPU to GPU
between two devices of one host. Skipped, saying why, without CuPy and a GPU (and the
two-GPU test without a second GPU: issue 25's run).

Plain (not pytest-asyncio) tests on the real world's loop, like the other GPU tests.
"""

from __future__ import annotations

import asyncio
import zlib
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


# --------------------------------------------------------------------------- the copy kernel
#: Role sizes beside the ROLE_SPECS layouts: roles of several 4 KiB chunks with a partial
#: last one, and one the kernel cannot take (not 16-byte multiples: the CuPy ops then).
ODD_ROLES = {"multi-chunk": (2 * 4096 + 48, 16, 4096), "unaligned": (24, 40)}


def raw_memories(role_bytes: tuple[int, ...], layers: int, src_blocks: int,
                 dst_blocks: int) -> tuple[Any, Any]:
    import cupy as cp

    from kernels.pd_peer import CudaBlockMemory

    src = CudaBlockMemory(0, [cp.random.randint(1, 256, (layers, src_blocks, b),
                                                dtype=np.uint8) for b in role_bytes])
    dst = CudaBlockMemory(0, [cp.full((layers, dst_blocks, b), POISON, dtype=np.uint8)
                              for b in role_bytes])
    cp.cuda.Device().synchronize()
    return src, dst


def role_bytes_of(name: str) -> tuple[int, ...]:
    if name in ODD_ROLES:
        return ODD_ROLES[name]
    return tuple(r.bytes_per_block for r in ROLE_SPECS[name].layout.roles)


def random_tables(rng: np.random.Generator, n: int, src_blocks: int,
                  dst_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Out of order both sides; the source may name a block twice (one block to two
    places); ids span both ends of each cache."""
    src = rng.integers(0, src_blocks, n)
    src[0], src[-1] = 0, src_blocks - 1
    return src, rng.permutation(dst_blocks)[:n]


@pytest.mark.parametrize("name", [*sorted(ROLE_SPECS), *ODD_ROLES])
def test_copy_kernel_random_tables_every_role_bit_exact(name: str) -> None:
    """``copy_from`` between two caches on one GPU, frames of random tables enqueued
    back to back (layers in any order), against numpy on the host copies."""
    roles = role_bytes_of(name)
    rng = np.random.default_rng(zlib.crc32(name.encode()))

    async def main() -> None:
        src, dst = raw_memories(roles, 3, 40, 56)
        assert (dst.kernel_unfit is None) == (name != "unaligned"), dst.kernel_unfit
        want, have = wire_order(dst), wire_order(src)
        pending = []
        for _ in range(3):
            s_ids, d_ids = random_tables(rng, int(rng.integers(1, 17)), 40, 56)
            for layer in rng.permutation(3):
                pending.append(dst.copy_from(src, int(layer), s_ids, d_ids))
                want[layer][d_ids] = have[layer][s_ids]
        await asyncio.gather(*[p for p in pending if p is not None])
        assert np.array_equal(wire_order(dst), want)
        assert np.array_equal(wire_order(src), have), "the source changed"
        if dst.kernel_unfit is None:
            assert len(dst._ids) == 3, "a table was uploaded more than once a chunk"

    run(main)


@pytest.mark.parametrize("name", [*sorted(ROLE_SPECS), *ODD_ROLES])
def test_gather_to_pinned_and_scatter_back_every_role_bit_exact(name: str) -> None:
    """``read`` (the kernel gathers into pinned rows) and ``write`` (scatters them)."""
    roles = role_bytes_of(name)
    rng = np.random.default_rng(7 + len(roles))
    src, dst = raw_memories(roles, 2, 30, 45)
    have, want = wire_order(src), wire_order(dst)
    for _ in range(4):
        layer = int(rng.integers(0, 2))
        s_ids, d_ids = random_tables(rng, int(rng.integers(1, 20)), 30, 45)
        rows = src.read(layer, s_ids)
        assert np.array_equal(rows, have[layer][s_ids])
        dst.write(layer, d_ids, rows)
        want[layer][d_ids] = have[layer][s_ids]
    assert np.array_equal(wire_order(dst), want)


def test_bad_tables_are_refused_before_anything_moves() -> None:
    from kvflow.errors import InvalidBlockId

    src, dst = raw_memories((1024, 1024), 2, 8, 8)

    async def main() -> None:
        with pytest.raises(InvalidBlockId, match="duplicate"):
            dst.copy_from(src, 0, np.array([1, 2]), np.array([3, 3]))
        with pytest.raises(InvalidBlockId, match="out of range"):
            dst.copy_from(src, 0, np.array([1, 8]), np.array([3, 4]))
        with pytest.raises(InvalidBlockId, match="out of range"):
            src.read(1, np.array([0, 9]))
        with pytest.raises(InvalidBlockId, match="duplicate"):
            dst.write(1, np.array([5, 5]), np.ones((2, 2048), np.uint8))
        with pytest.raises(IndexError, match="layer 2"):
            dst.copy_from(src, 2, np.array([1, 2]), np.array([3, 4]))
        assert (wire_order(dst) == POISON).all()

    run(main)
