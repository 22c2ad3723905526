"""GPU tests of the host layouts (``kernels.layout_copy``; skipped without CuPy or a GPU).

Each layout round-trips device -> host -> device bit-exact, through a staging
ring small enough that ops wrap it many times; a layer's future and event
resolve only once that layer is on the device (a group's layers together).
"""

from __future__ import annotations

import asyncio
import time
import zlib

import numpy as np
import pytest

from kernels import gpu_unavailable_reason
from kvflow.layout import ModelSpec
from kvflow.manager import OpKind

_REASON = gpu_unavailable_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_REASON is not None, reason=f"needs a CUDA GPU and CuPy: {_REASON}"),
]

if _REASON is None:
    import cupy as cp
    from test_kernels_gpu import fill_random, mixed_ids, op, run

    from kernels.backend import CudaBackend, FutureSink
    from kernels.testing import spin

LAYOUTS = ("layer_major", "grouped:2", "grouped:3", "block_major")
SPECS = {
    "mha-bf16": ModelSpec("mha-bf16", num_layers=5, num_kv_heads=2, head_dim=64),
    "mla-fp8-dsa": ModelSpec("mla-fp8-dsa", num_layers=4, num_kv_heads=1, head_dim=80,
                             attention="mla", kv_lora_rank=64, qk_rope_head_dim=16,
                             indexer_head_dim=32, dtype="fp8"),
}


def small_backend(spec: ModelSpec, layout: str, nd: int, nh: int, **kw: object) -> CudaBackend:
    # staging of a few pieces per slot: an op of dozens of blocks wraps the ring many times
    piece = spec.bytes_per_block
    return CudaBackend(spec, nd, nh, host_layout=layout, device_staging_bytes=4 * 3 * piece,
                       **kw)


@pytest.mark.parametrize("dma", ["auto", "never"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(SPECS))
def test_round_trip_bit_exact(name: str, layout: str, dma: str) -> None:
    spec = SPECS[name]
    rng = np.random.default_rng(zlib.crc32(f"{name}/{layout}/{dma}".encode()))
    nd, nh, n = 64, 150, 50
    backend = small_backend(spec, layout, nd, nh, dma=dma)
    fill_random(backend, rng)
    host_src, dev = mixed_ids(rng, n, nh, nd)
    free_host = sorted(set(range(nh)) - set(host_src))
    host_dst = rng.permutation(free_host)[:n].tolist()
    before = {(layer, role): backend.host_kv(layer, role).copy()
              for layer in range(spec.num_layers) for role in backend.roles}
    for layer in range(spec.num_layers):  # poison what must be overwritten
        for role in backend.roles:
            backend.device_kv(layer, role)[dev] = 0xCD
            backend.host_kv(layer, role)[host_dst] = 0xAB
    cp.cuda.Device().synchronize()

    # and back again, after the backup, into device blocks the first load left alone
    back = [b for b in range(nd) if b not in set(dev)][: n // 5]

    async def main() -> tuple[FutureSink, FutureSink]:
        s_in, s_out = FutureSink(spec.num_layers), FutureSink(spec.num_layers)
        t_in = backend.submit(op(OpKind.SWAP_IN, host_src, dev), s_in, ())
        t_out = backend.submit(op(OpKind.EVICT, dev, host_dst), s_out, (t_in,))
        s_back = FutureSink(spec.num_layers)
        backend.submit(op(OpKind.SWAP_IN, host_dst[: len(back)], back), s_back, (t_out,))
        await asyncio.gather(s_in.wait(), s_out.wait(), s_back.wait())
        return s_in, s_out

    s_in, s_out = run(main)
    assert s_in.reported == list(range(spec.num_layers)) == s_out.reported
    for layer in range(spec.num_layers):
        for role in backend.roles:
            h = backend.host_kv(layer, role)
            d = cp.asnumpy(backend.device_kv(layer, role))
            want = before[layer, role][host_src]
            np.testing.assert_array_equal(d[dev], want, err_msg=f"{layer}/{role} h2d")
            np.testing.assert_array_equal(h[host_dst], want, err_msg=f"{layer}/{role} d2h")
            np.testing.assert_array_equal(d[back], want[: len(back)],
                                          err_msg=f"{layer}/{role} h2d again")
            others = sorted(set(range(nh)) - set(host_dst))
            np.testing.assert_array_equal(h[others], before[layer, role][others],
                                          err_msg=f"{layer}/{role}: a host block not written")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_major_blocks_are_the_stores_bytes(layout: str) -> None:
    """A block's bytes in the store's order ([layer][role]) where the layout has it whole."""
    spec = SPECS["mha-bf16"]
    backend = small_backend(spec, layout, 8, 8)
    fill_random(backend, np.random.default_rng(3))
    view = backend.host_block_view(5)
    if layout != "block_major":
        assert view is None
        return
    want = np.concatenate([backend.host_kv(layer, role)[5] for layer in range(spec.num_layers)
                           for role in backend.roles])
    np.testing.assert_array_equal(view, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_futures_resolve_only_once_their_layer_landed(layout: str) -> None:
    """Hold the load stream, submit, check nothing resolves; then each layer's future, when
    it resolves, finds its layer's bytes on the device, and a compute stream ordered after
    layer i with ``wait_layer`` reads layer i complete. A group's layers resolve together."""
    spec = SPECS["mha-bf16"]
    rng = np.random.default_rng(7)
    nd, nh, n = 48, 96, 40
    backend = small_backend(spec, layout, nd, nh)
    fill_random(backend, rng)
    host_src, dev = mixed_ids(rng, n, nh, nd)
    want = {(layer, r): backend.host_kv(layer, r)[host_src].copy()
            for layer in range(spec.num_layers) for r in backend.roles}
    for layer in range(spec.num_layers):
        for r in backend.roles:
            backend.device_kv(layer, r)[dev] = 0xCD
    cp.cuda.Device().synchronize()
    side = cp.cuda.Stream(non_blocking=True)
    compute = cp.cuda.Stream(non_blocking=True)
    groups = backend.host_layout.groups(spec.num_layers)

    dev_gpu = cp.asarray(dev)
    with side:  # compile and load every kernel used below now, not behind the spin
        cp.asnumpy(backend.device_kv(0, "k")[dev_gpu].copy())
    spin(side, 1e-6)
    side.synchronize()

    async def main() -> list[tuple[int, int]]:
        sink = FutureSink(spec.num_layers)
        spin(backend.load_stream, 0.3)  # the copies wait behind 300 ms of GPU work
        t0 = time.perf_counter()
        task = backend.submit(op(OpKind.SWAP_IN, host_src, dev), sink, ())
        copies = []
        for layer in range(spec.num_layers):
            backend.wait_layer(compute, task, layer)
            with compute:
                copies.append(backend.device_kv(layer, "k")[dev_gpu].copy())
        await asyncio.sleep(0.05)
        held = time.perf_counter() - t0
        assert held < 0.2, f"the host took {held:.3f} s: the check below would prove nothing"
        assert not any(f.done() for f in sink.layers), "a layer resolved before its copy ran"
        order: list[tuple[int, int]] = []
        seen = wake = 0
        while seen < spec.num_layers:
            wake += 1
            await asyncio.wait([f for f in sink.layers if not f.done()],
                               return_when=asyncio.FIRST_COMPLETED)
            done = [i for i, f in enumerate(sink.layers) if f.done()]
            for layer in done[seen:]:
                with side:  # what is on the device now, read beside the copies
                    got = {r: cp.asnumpy(backend.device_kv(layer, r)[dev_gpu])
                           for r in backend.roles}
                side.synchronize()
                for r in backend.roles:
                    np.testing.assert_array_equal(got[r], want[layer, r],
                                                  err_msg=f"layer {layer} {r} resolved early")
                order.append((wake, layer))
            seen = len(done)
        await sink.wait()
        compute.synchronize()
        for layer in range(spec.num_layers):
            np.testing.assert_array_equal(cp.asnumpy(copies[layer]), want[layer, "k"],
                                          err_msg=f"compute read layer {layer} early")
        return order

    order = run(main)
    assert [layer for _, layer in order] == list(range(spec.num_layers))
    # a group's layers come in one wake-up: never split across two
    for first, count in groups:
        batches = {b for b, layer in order if first <= layer < first + count}
        assert len(batches) == 1, f"group {first}..{first + count - 1} split: {order}"
