"""GPU tests of progress words and the signalling swap kernel (skipped without a GPU).

The word of a layer must not say "landed" before the layer's bytes are on the
destination: a stream that waits on it (``cuStreamWaitValue32``) and then reads
must see every byte, while the copying stream is still held back by a spin.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels import gpu_unavailable_reason
from kernels.progress import progress_unavailable_reason
from kvflow.layout import ModelSpec

_REASON = gpu_unavailable_reason() or progress_unavailable_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_REASON is not None, reason=f"needs a CUDA GPU and CuPy: {_REASON}"),
]

if _REASON is None:
    import cupy as cp

    from kernels.backend import CudaBackend
    from kernels.progress import ProgressWords
    from kernels.testing import spin

SPEC = ModelSpec("mha-bf16", num_layers=5, num_kv_heads=2, head_dim=64)


def _signal_launch(backend: CudaBackend, words: ProgressWords, seq: int, src: list[int],
                   dst: list[int], stream: object, ctas: int = 4) -> object:
    c = backend.h2d
    prep = c.prepare(src, dst)
    assert prep.num_scattered == len(src)
    c.kernels.launch_signal(stream.ptr, ctas, (c._table_ptr, c._roles_ptr, c.num_roles,
                                               c.chunks_per_block, 0, c.num_layers,
                                               prep.ids_ptr, prep.num_scattered),
                            words.counters_ptr, words.ptr, seq)
    return prep


@pytest.mark.parametrize("ctas", [1, 4, 16])
def test_signal_kernel_words_say_landed_only_after_the_bytes(ctas: int) -> None:
    rng = np.random.default_rng(ctas)
    L = SPEC.num_layers
    backend = CudaBackend(SPEC, 64, 64, min_run_bytes=1 << 40, dma="never")
    for layer in range(L):
        for role in backend.roles:
            h = backend.host_kv(layer, role)
            h[...] = rng.integers(0, 256, size=h.shape, dtype=np.uint8)
            backend.device_kv(layer, role)[...] = 0
    cp.cuda.Device().synchronize()
    words = ProgressWords(L)
    load, reader = backend.load_stream, cp.cuda.Stream(non_blocking=True)
    src, dst = rng.permutation(64)[:40].tolist(), rng.permutation(64)[:40].tolist()
    for round_ in range(3):  # the counters must be back at zero for the next launch
        seq = words.take()
        spin(load, 0.05)
        prep = _signal_launch(backend, words, seq, src, dst, load, ctas)
        assert not any(words.landed(i, seq) for i in range(L))  # the spin holds them back
        got = []
        with reader:
            for layer in range(L):
                words.wait(reader.ptr, layer, seq)
                got.append([backend.device_kv(layer, r)[dst].copy() for r in backend.roles])
        reader.synchronize()  # not the load stream: the waits alone order the reads
        assert all(words.landed(i, seq) for i in range(L))
        assert (words.words == seq).all()
        load.synchronize()
        assert not cp.asnumpy(words.counters).any()
        for layer in range(L):
            for r, role in enumerate(backend.roles):
                np.testing.assert_array_equal(cp.asnumpy(got[layer][r]),
                                              backend.host_kv(layer, role)[src],
                                              err_msg=f"round {round_} layer {layer}")
        prep.release()


def test_write_and_wait_order_two_streams() -> None:
    words = ProgressWords(2)
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(1 << 20, dtype=np.uint8)
    seq = words.take()
    spin(a, 0.05)
    with a:
        x.fill(7)
    words.write(a.ptr, 1, seq)
    words.wait(b.ptr, 1, seq)
    with b:
        total = int(x.astype(np.int64).sum())  # synchronizes b only (a .item() on b)
    assert total == 7 * x.size
    assert words.landed(1, seq) and not words.landed(0, seq)
