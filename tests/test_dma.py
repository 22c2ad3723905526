"""The copy-engine path's pure parts: descriptors and the driver probe (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.dma import (
    BatchMemcpy,
    BatchMemcpyError,
    DescriptorBuilder,
    batch_memcpy_unavailable_reason,
    block_descriptors,
)


def test_descriptors_are_layer_major_with_each_roles_offsets() -> None:
    src_bases = np.array([[1000, 5000], [9000, 13000]])  # [layers, roles]
    dst_bases = np.array([[100, 200], [300, 400]])
    dsts, srcs, sizes = block_descriptors(src_bases, dst_bases, [16, 32], np.array([3, 0]),
                                          np.array([1, 2]))
    assert dsts.dtype == srcs.dtype == sizes.dtype == np.uint64
    # layer 0 role 0 (2 blocks), layer 0 role 1, layer 1 role 0, layer 1 role 1
    assert srcs.tolist() == [1000 + 48, 1000, 5000 + 96, 5000,
                             9000 + 48, 9000, 13000 + 96, 13000]
    assert dsts.tolist() == [100 + 16, 100 + 32, 200 + 32, 200 + 64,
                             300 + 16, 300 + 32, 400 + 32, 400 + 64]
    assert sizes.tolist() == [16, 16, 32, 32] * 2
    # a launch of layer 1 alone is one contiguous slice
    per_layer = 2 * 2
    assert srcs[per_layer:].tolist() == [9000 + 48, 9000, 13000 + 96, 13000]


def test_a_run_is_one_descriptor_of_its_whole_length() -> None:
    dsts, srcs, sizes = block_descriptors(np.array([[0]]), np.array([[10_000]]), [64],
                                          np.array([4, 9]), np.array([0, 7]),
                                          lengths=np.array([3, 1]))
    assert list(zip(srcs.tolist(), dsts.tolist(), sizes.tolist(), strict=True)) == [
        (256, 10_000, 192), (576, 10_000 + 448, 64)]


def test_builder_with_lists_matches_block_descriptors() -> None:
    """``DescriptorBuilder`` keeps a copier's bases and role sizes ready (the submit path
    runs once per op); from Python lists it gives the arrays ``block_descriptors`` does."""
    rng = np.random.default_rng(3)
    src_bases = rng.integers(0, 1 << 40, (5, 3)) // 16 * 16
    dst_bases = rng.integers(0, 1 << 40, (5, 3)) // 16 * 16
    roles = [1 << 20, 1 << 20, 4096]
    build = DescriptorBuilder(src_bases, dst_bases, roles)
    for lengths in (None, [2, 1, 3]):
        s, d = [7, 0, 12], [3, 9, 20]
        want = block_descriptors(src_bases, dst_bases, roles, np.array(s), np.array(d),
                                 None if lengths is None else np.array(lengths))
        got = build(s, d, lengths)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == np.uint64 and a.flags.c_contiguous
            assert a.tolist() == b.tolist()


def test_batch_memcpy_refuses_clearly_without_a_driver() -> None:
    reason = batch_memcpy_unavailable_reason()
    if reason is None:
        pytest.skip("this machine has a CUDA 12.8+ driver: the GPU tests cover the path")
    assert isinstance(reason, str) and reason
    with pytest.raises(BatchMemcpyError, match="batched memcpy unavailable"):
        BatchMemcpy()
