"""CPU tests of the swap kernels' planning: validation, runs, tables (no CuPy, no GPU)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from kernels.plan import (
    CHUNK_BYTES,
    MAX_ROLES,
    descriptor_runs,
    min_run_blocks_for,
    pack_ids,
    pointer_table,
    role_table,
    split_runs,
    stage_ids,
    uniform_stride,
    validate_ids,
    with_role_strides,
)
from kvflow.errors import InvalidBlockId


def test_import_without_cupy() -> None:
    """``import kernels`` (and the backend module) must work where CuPy is absent."""
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import kernels, kernels.plan, kernels.swap, kernels.backend\n"
        "r = kernels.gpu_unavailable_reason(); assert r and 'CuPy' in r, r\n"
        "try:\n    kernels._cuda.cupy_module()\nexcept ImportError as e:\n"
        "    assert 'CuPy' in str(e)\nelse:\n    raise SystemExit('no ImportError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kvflow_never_imports_cupy() -> None:
    code = (
        "import sys, pkgutil, importlib, kvflow\n"
        "for m in pkgutil.iter_modules(kvflow.__path__):\n"
        "    importlib.import_module('kvflow.' + m.name)\n"
        "assert 'cupy' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- validation
def test_validate_ok_returns_int32() -> None:
    src, dst = validate_ids([3, 3, 0], [1, 0, 2], 4, 3)  # duplicate source is legal
    assert src.dtype == np.int32 and dst.dtype == np.int32
    assert src.tolist() == [3, 3, 0] and dst.tolist() == [1, 0, 2]


def test_validate_empty() -> None:
    src, dst = validate_ids([], [], 4, 4)
    assert src.size == 0 and dst.size == 0


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        ([0, 9], [0, 1], r"source block id 9 at position 1 is out of range \[0, 8\)"),
        ([0, 1], [0, 4], r"destination block id 4 at position 1 is out of range \[0, 4\)"),
        ([-1, 1], [0, 1], r"source block id -1 at position 0"),
        ([0, 1, 2], [3, 1, 3], r"duplicate destination block id 3 at positions 0 and 2"),
        ([0, 1], [0], r"differ in length"),
        ([0.5], [1], r"must be integers"),
    ],
)
def test_validate_rejects_naming_the_id(src: list, dst: list, match: str) -> None:
    with pytest.raises(InvalidBlockId, match=match):
        validate_ids(src, dst, 8, 4)


def test_validate_names_tiers() -> None:
    with pytest.raises(InvalidBlockId, match="host block id 7"):
        validate_ids([7], [0], 4, 4, src_name="host", dst_name="device")


# ---------------------------------------------------------------- runs
def test_split_runs_example() -> None:
    src = np.array([10, 11, 12, 13, 5, 20, 21, 7, 8, 9])
    dst = np.array([0, 1, 2, 3, 9, 4, 6, 30, 31, 32])
    r = split_runs(src, dst, 3)
    assert r.runs.tolist() == [[10, 0, 4], [7, 30, 3]]
    assert r.src.tolist() == [5, 20, 21] and r.dst.tolist() == [9, 4, 6]
    assert r.num_run_blocks == 7


def test_split_runs_disabled_or_short() -> None:
    src = np.arange(10)
    assert split_runs(src, src, 0).runs.size == 0
    assert split_runs(src, src, 11).runs.size == 0
    assert split_runs(src, src, 10).runs.tolist() == [[0, 0, 10]]


@pytest.mark.parametrize("seed", range(20))
def test_split_runs_partitions_pairs(seed: int) -> None:
    """Runs + singletons are exactly the input pairs; runs are maximal and long enough."""
    rng = np.random.default_rng(seed)
    pieces, s, d = [], 0, 0
    for _ in range(rng.integers(1, 15)):
        ln = int(rng.integers(1, 12))
        pieces.append((np.arange(s, s + ln), np.arange(d, d + ln)))
        s += ln + int(rng.integers(1, 5))  # gaps: pieces never touch on the source side
        d += ln + int(rng.integers(0, 3))
    order = rng.permutation(len(pieces))
    src = np.concatenate([pieces[i][0] for i in order]).astype(np.int32)
    dst = np.concatenate([pieces[i][1] for i in order]).astype(np.int32)
    k = int(rng.integers(2, 8))
    r = split_runs(src, dst, k)
    pairs = {(a, b) for a, b in zip(src.tolist(), dst.tolist(), strict=True)}
    got = {(a, b) for a, b in zip(r.src.tolist(), r.dst.tolist(), strict=True)}
    for s0, d0, ln in r.runs.tolist():
        assert ln >= k
        run = {(s0 + i, d0 + i) for i in range(ln)}
        assert not run & got
        got |= run
    assert got == pairs and r.src.size + r.num_run_blocks == src.size


def test_min_run_blocks_for() -> None:
    assert min_run_blocks_for(0, 4096) == 0
    assert min_run_blocks_for(1 << 20, 32 << 10) == 32
    assert min_run_blocks_for(1, 1 << 20) == 2


# ---------------------------------------------------------------- tables
def test_role_table_chunks() -> None:
    rows, per_block = role_table([CHUNK_BYTES * 2, 16, CHUNK_BYTES + 16])
    assert rows.tolist() == [[CHUNK_BYTES * 2, 0], [16, 2], [CHUNK_BYTES + 16, 3]]
    assert per_block == 5


def test_role_table_rejects() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        role_table([24])
    with pytest.raises(ValueError, match="roles per layer"):
        role_table([16] * (MAX_ROLES + 1))


def test_pointer_table_layout_and_alignment() -> None:
    src = np.array([[0x1000, 0x2000], [0x3000, 0x4000]])
    dst = src + 0x100000
    t = pointer_table(src, dst)
    assert t.shape == (2, 2, 4) and t.dtype == np.uint64
    assert t[1, 0].tolist() == [0x3000, 0x103000, 0, 0]
    assert with_role_strides(t, [32, 48])[1, 1].tolist() == [0x4000, 0x104000, 48, 48]
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        pointer_table(src + 8, dst)


def test_pointer_table_strides() -> None:
    """A staging side's stride (a piece of several layers) beside the device's role bytes."""
    src = np.array([[0x1000, 0x1020], [0x1040, 0x1060]])
    t = pointer_table(src, src + 0x100000, 0x80, [[32, 16]])
    assert t[:, :, 2].tolist() == [[0x80, 0x80], [0x80, 0x80]]
    assert t[:, :, 3].tolist() == [[32, 16], [32, 16]]
    assert with_role_strides(t, [1, 1])[0, 1].tolist() == [0x1020, 0x101020, 0x80, 16]
    with pytest.raises(ValueError, match="multiples of 16"):
        pointer_table(src, src, 24, 32)


def test_uniform_stride() -> None:
    assert uniform_stride(np.array([100, 300, 500])) == 200
    assert uniform_stride(np.array([100, 300, 600])) is None
    assert uniform_stride(np.array([5])) == 0


def test_pack_ids_interleaves() -> None:
    assert pack_ids(np.array([1, 2]), np.array([7, 8])).tolist() == [1, 7, 2, 8]


# ---------------------------------------------------------------- stage_ids (the fast path)
def _alloc_into(arena: np.ndarray):
    def alloc(n: int) -> tuple[object, np.ndarray, int]:
        return "slice", arena[: 2 * n], 0
    return alloc


def _random_ops(rng: np.random.Generator, count: int = 600
                ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """``(kind, src, dst)`` id arrays for 100 source and 50 destination blocks: kind 1 a
    source out of range, 2 a destination out of range, 3 a duplicate destination, 4 a
    run of 5 consecutive ids on both sides first, else plain scattered ids."""
    for _ in range(count):
        n = int(rng.integers(0, 40))
        kind = int(rng.integers(0, 6))
        src = rng.integers(0, 100, n)
        dst = rng.permutation(50)[:n]
        if kind == 1 and n:
            src[rng.integers(n)] = rng.choice([-1, 100, 2**40])
        if kind == 2 and n:
            dst[rng.integers(n)] = rng.choice([-5, 50, 2**33 + 1])
        if kind == 3 and n > 1:
            dst[1] = dst[0]
        if kind == 4 and n > 5:
            s0, d0 = int(rng.integers(0, 90)), int(rng.integers(0, 40))
            src[:5] = np.arange(s0, s0 + 5)
            rest = [x for x in rng.permutation(50) if not d0 <= x < d0 + 5][: n - 5]
            dst = np.concatenate([np.arange(d0, d0 + 5), rest])
        yield kind, src, dst


@pytest.mark.parametrize("seed", range(4))
def test_stage_ids_matches_slow_path(seed: int) -> None:
    """Same runs, pairs and errors (same message) as validate_ids + split_runs, any dtype."""
    rng = np.random.default_rng(seed)
    arena = np.zeros(256, dtype=np.int32)
    for kind, src, dst in _random_ops(rng):
        dtype = [np.int32, np.int64, np.uint32][int(rng.integers(3))]
        s_in = src.tolist() if kind == 5 else src.astype(dtype)
        d_in = dst.tolist() if kind == 5 else dst.astype(np.int64)
        try:
            ref = split_runs(*validate_ids(s_in, d_in, 100, 50), 3)
        except InvalidBlockId as exc:
            with pytest.raises(InvalidBlockId) as got:
                stage_ids(s_in, d_in, 100, 50, 3, _alloc_into(arena))
            assert str(got.value) == str(exc)
            continue
        runs, k, staged = stage_ids(s_in, d_in, 100, 50, 3, _alloc_into(arena))
        assert runs.tolist() == ref.runs.tolist()
        assert k == ref.src.size
        if k:
            buf = staged[1]
            assert buf[0:2 * k:2].tolist() == ref.src.tolist()
            assert buf[1:2 * k:2].tolist() == ref.dst.tolist()


def _triples(starts_s: list[int], starts_d: list[int], lengths: list[int] | None) -> list:
    return sorted(zip(starts_s, starts_d, lengths or [1] * len(starts_s), strict=True))


@pytest.mark.parametrize("seed", range(4))
def test_descriptor_runs_matches_validate_and_split(seed: int) -> None:
    """The copy-engine path's pieces: every maximal run of consecutive ids on both sides
    (singletons included), the same set as ``validate_ids`` + ``split_runs(.., 2)``, and
    the same error (same message) for a bad op, whether the ids come as Python lists
    (the fast path: ``TransferOp`` carries lists) or arrays of any integer dtype."""
    rng = np.random.default_rng(seed)
    for kind, src, dst in _random_ops(rng):
        as_list = kind == 5 or rng.random() < 0.5
        s_in = src.tolist() if as_list else src.astype(np.int64)
        d_in = dst.tolist() if as_list else dst.astype(np.int32)
        try:
            ref = split_runs(*validate_ids(s_in, d_in, 100, 50, src_name="host",
                                           dst_name="device"), 2)
        except InvalidBlockId as exc:
            with pytest.raises(InvalidBlockId) as got:
                descriptor_runs(s_in, d_in, 100, 50, src_name="host", dst_name="device")
            assert str(got.value) == str(exc)
            continue
        got_s, got_d, got_len = descriptor_runs(s_in, d_in, 100, 50, src_name="host",
                                                dst_name="device")
        want = sorted([*((int(s), int(d), int(k)) for s, d, k in ref.runs.tolist()),
                       *((int(s), int(d), 1) for s, d in zip(ref.src.tolist(),
                                                              ref.dst.tolist(), strict=True))])
        assert _triples(got_s, got_d, got_len) == want
        assert got_len is None or any(k > 1 for k in got_len)  # None: all singletons
    with pytest.raises(InvalidBlockId, match="differ in length"):
        descriptor_runs([1, 2], [3], 10, 10)
