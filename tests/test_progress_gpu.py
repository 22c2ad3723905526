"""GPU tests of progress words and the signalling swap kernel (skipped without a GPU).

The word of a layer must not say "landed" before the layer's bytes are on the
destination: a stream that waits on it (``cuStreamWaitValue32``) and then reads
must see every byte, while the copying stream is still held back by a spin.

Words also flip in layer order (the kernel hands out units from one counter and
passes a token from layer to layer). Run on the H100 (2026-11-25, call 5 of
``benchmarks/results/host_layouts.md``): 13 passed.
"""

from __future__ import annotations

import asyncio
import ctypes
import time

import numpy as np
import pytest

from kernels import gpu_unavailable_reason
from kernels.progress import progress_unavailable_reason
from kvflow.errors import InvalidBlockId, TransferError
from kvflow.layout import ModelSpec
from kvflow.manager import OpKind, TransferOp
from kvflow.radix import Tier
from kvflow.world import new_loop

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
                            words.counters_ptr, words.dev_ptr, words.ptr, seq)
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
        assert (cp.asnumpy(words.dev) == seq).all()  # what streams wait on
        assert not cp.asnumpy(words.counters).any()
        for layer in range(L):
            for r, role in enumerate(backend.roles):
                np.testing.assert_array_equal(cp.asnumpy(got[layer][r]),
                                              backend.host_kv(layer, role)[src],
                                              err_msg=f"round {round_} layer {layer}")
        prep.release()


#: Bigger than SPEC: 16 chunks a block, so an op of 128 blocks gives 300 CTAs work.
ORDER_SPEC = ModelSpec("order", num_layers=12, num_kv_heads=8, head_dim=128)


@pytest.mark.parametrize("way", ["h2d", "d2h"])
@pytest.mark.parametrize("ctas", [4, 300])
def test_signal_kernel_flips_words_in_layer_order(way: str, ctas: int) -> None:
    """Words flip strictly in layer order (a late unit of layer i holds back layer i + 1's
    word, so waiting on a layer covers the ones before it), also with more CTAs than the
    GPU holds at once (300 > 132 SMs: the late ones find no work left); a device -> host
    layer's bytes are in host memory when the host sees its word."""
    rng = np.random.default_rng(ctas)
    L, n = ORDER_SPEC.num_layers, 128
    backend = CudaBackend(ORDER_SPEC, n, n, min_run_bytes=1 << 40, dma="never")
    c = backend.h2d if way == "h2d" else backend.d2h
    words, stream = c.progress, (backend.load_stream if way == "h2d" else backend.store_stream)
    src, dst = rng.permutation(n).tolist(), rng.permutation(n).tolist()
    want = {}  # d2h: what each layer and role's destination blocks must hold
    for layer in range(L):
        for role in backend.roles:
            fill = rng.integers(0, 256, size=(n, backend.host_kv(layer, role).shape[1]),
                                dtype=np.uint8)
            want[layer, role] = fill[src]
            if way == "h2d":
                backend.host_kv(layer, role)[...] = fill
                backend.device_kv(layer, role)[...] = 0
            else:
                backend.host_kv(layer, role)[...] = 0
                backend.device_kv(layer, role)[...] = cp.asarray(fill)
    cp.cuda.Device().synchronize()
    for _ in range(2):  # the second launch finds the counters at zero again
        seq = words.take()
        prep = c.prepare(src, dst)
        assert c.signals(prep)
        spin(stream, 0.02)
        c.launch_signal(prep, stream, seq, ctas=ctas)
        top, checked, deadline = -1, 0, time.monotonic() + 20
        while top < L - 1:
            # read from the last layer down: once word j says landed, every word read after
            # it (the layers before j) must say so too
            top = next((j for j in reversed(range(L)) if words.landed(j, seq)), -1)
            late = [i for i in range(top) if not words.landed(i, seq)]
            assert not late, f"layer {top} landed before layers {late}"
            if way == "d2h":  # the bytes of every layer the host has seen land
                for layer in range(checked, top + 1):
                    for role in backend.roles:
                        np.testing.assert_array_equal(
                            backend.host_kv(layer, role)[dst], want[layer, role],
                            err_msg=f"layer {layer} {role}: word before bytes")
                checked = top + 1
            assert time.monotonic() < deadline, "the words never all flipped"
        stream.synchronize()
        assert not cp.asnumpy(words.counters).any()
        assert (cp.asnumpy(words.dev) == seq).all()
        prep.release()


def test_signal_kernel_with_no_blocks_signals_every_layer() -> None:
    backend = CudaBackend(SPEC, 8, 8, min_run_bytes=1 << 40, dma="never")
    c, L = backend.h2d, SPEC.num_layers
    words, stream = ProgressWords(L), backend.load_stream
    for ctas in (1, 3):
        seq = words.take()
        c.kernels.launch_signal(stream.ptr, ctas, (c._table_ptr, c._roles_ptr, c.num_roles,
                                                   c.chunks_per_block, 0, L, 0, 0),
                                words.counters_ptr, words.dev_ptr, words.ptr, seq)
        stream.synchronize()
        assert (words.words == seq).all() and (cp.asnumpy(words.dev) == seq).all()
        assert not cp.asnumpy(words.counters).any()


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
    a.synchronize()
    assert words.landed(1, seq) and not words.landed(0, seq)
    assert cp.asnumpy(words.dev).tolist() == [0, seq]


# ---------------------------------------------------------------- through CudaBackend
class LazySink:
    """A sink that reads layers from the handle, as the runtime's tasks do."""

    lazy_layers = True

    def __init__(self) -> None:
        self.reported: list[int] = []
        self.error: BaseException | None = None
        self.ended = asyncio.Event()
        self.got = asyncio.Event()

    def layer_done(self, layer: int) -> None:
        self.reported.append(layer)
        self.got.set()

    def done(self, error: BaseException | None = None) -> None:
        self.error = error
        self.ended.set()


def _op(kind: OpKind, src: list[int], dst: list[int], i: int = 0) -> TransferOp:
    tiers = (Tier.HOST, Tier.DEVICE) if kind is OpKind.SWAP_IN else (Tier.DEVICE, Tier.HOST)
    return TransferOp(i, kind, tiers[0], tiers[1], list(src), list(dst), keys=[])


def _filled(one_launch: bool, seed: int) -> CudaBackend:
    rng = np.random.default_rng(seed)
    backend = CudaBackend(SPEC, 64, 64, eager_layers=1, one_launch=one_launch)
    for layer in range(SPEC.num_layers):
        for role in backend.roles:
            h = backend.host_kv(layer, role)
            h[...] = rng.integers(0, 256, size=h.shape, dtype=np.uint8)
            backend.device_kv(layer, role)[...] = 0
    cp.cuda.Device().synchronize()
    return backend


@pytest.mark.parametrize("one_launch", [True, False])
def test_lazy_sink_gets_the_layer_it_watches_then_the_end(one_launch: bool) -> None:
    """A lazy sink is told of a layer only when it asks (``watch``) and at the op's end;
    ``layers_reported`` reads the GPU's progress; a stream ordered by ``wait_layer``
    sees the layer's bytes."""
    L = SPEC.num_layers
    backend = _filled(one_launch, 3)
    rng = np.random.default_rng(4)
    src, dst = rng.permutation(64)[:24].tolist(), rng.permutation(64)[:24].tolist()
    compute = cp.cuda.Stream(non_blocking=True)

    async def main() -> tuple[LazySink, list[object]]:
        sink = LazySink()
        spin(backend.load_stream, 0.05)
        task = backend.submit(_op(OpKind.SWAP_IN, src, dst), sink, ())
        assert task.lazy_layers is True
        assert (task.words is not None) == one_launch
        if one_launch:
            assert task.next_layer == L  # one launch: the whole op at submit
        assert task.layers_reported() == 0  # the spin holds it back
        task.watch(1)
        await sink.got.wait()
        # layer 1's report first (the op's end may follow it at once: a small op). One
        # launch lands the whole op at once: the watcher's host function and the end's
        # run on different streams and may come in either order (seen on the H100).
        first = (1, L - 1) if one_launch else (1,)
        assert sink.reported[0] in first and task.layers_reported() >= 2
        with compute:
            backend.wait_layer(compute, task, L - 1)
            got = [backend.device_kv(layer, "k")[dst].copy() for layer in range(L)]
        await sink.ended.wait()
        assert task.layers_reported() == L
        return sink, got

    with asyncio.Runner(loop_factory=new_loop) as runner:
        sink, got = runner.run(main())
    compute.synchronize()
    assert sink.error is None
    # the watched layer, then the end (one launch: the end may come first, and then
    # the watcher's late report is dropped, the op being finished)
    ends = ([1, L - 1], [L - 1]) if one_launch else ([1, L - 1],)
    assert sink.reported in ends
    for layer in range(L):
        np.testing.assert_array_equal(cp.asnumpy(got[layer]),
                                      backend.host_kv(layer, "k")[src])
    backend.synchronize()
    assert not backend._live


def test_cancelled_lazy_op_vouches_for_nothing_past_the_cancel() -> None:
    backend = _filled(True, 5)

    async def main() -> tuple[LazySink, object]:
        sink = LazySink()
        spin(backend.load_stream, 0.03)
        task = backend.submit(_op(OpKind.SWAP_IN, [1, 2], [3, 4]), sink, ())
        backend.cancel(task)
        task.watch(0)
        await sink.ended.wait()
        return sink, task

    with asyncio.Runner(loop_factory=new_loop) as runner:
        sink, task = runner.run(main())
    assert isinstance(sink.error, TransferError)
    assert sink.reported == [] and task.layers_reported() == 0


def test_small_op_staging_matches_the_numpy_path() -> None:
    """``BlockCopier._prepare_small`` (lists) stages what ``stage_ids`` (arrays) does,
    and leaves ops with a copy-engine run to it."""
    backend = CudaBackend(SPEC, 64, 64, min_run_bytes=4 * sum(backend_roles()))
    c = backend.h2d
    rng = np.random.default_rng(6)
    for src, dst in ((rng.permutation(64)[:20].tolist(), rng.permutation(64)[:20].tolist()),
                     ([5, 6, 7, 9], [10, 11, 12, 30]),          # a run of 3 < 4: kernel
                     ([5, 6, 7, 8, 9], [10, 11, 12, 13, 30])):  # a run of 4: copy engine
        a, b = c.prepare(src, dst), c.prepare(np.array(src), np.array(dst))
        assert a.runs.tolist() == b.runs.tolist() and a.num_scattered == b.num_scattered
        n = a.num_scattered
        staged = [np.ctypeslib.as_array((ctypes.c_int32 * (2 * n)).from_address(p.ids_ptr))
                  .tolist() for p in (a, b)]
        assert staged[0] == staged[1]
        assert c.signals(a) == (not a.runs.size)
        a.release()
        b.release()
    with pytest.raises(InvalidBlockId, match="duplicate"):
        c.prepare([1, 2], [3, 3])


def backend_roles() -> list[int]:
    return [r.bytes_per_block for r in SPEC.layout.roles]
