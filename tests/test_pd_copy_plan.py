"""The PD copy kernel's arguments (``kernels.pd_copy``) checked without a GPU: the packed
``PdCopyArgs`` run through the kernel's address arithmetic in numpy (``emulate``) over
caches and staging rows laid out in one flat byte space, against numpy's own gather and
scatter. Catches wrong bases, strides, role offsets, chunking and table rows."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import SOURCE_DIR
from kernels.pd_copy import (
    ARGS_BYTES,
    LAYER_OFFSET,
    cache_side,
    check_layout,
    emulate,
    grid_for,
    pack_args,
    role_chunks,
    rows_side,
)
from kernels.plan import CHUNK_BYTES

#: Role sizes (bytes per block, multiples of 16) of the layouts PD moves, and one whose
#: roles span several chunks with a partial last one.
LAYOUTS = [(1024, 1024), (512, 512, 16, 16), (1280,), (640, 16, 320),
           (CHUNK_BYTES * 2 + 48, 16, CHUNK_BYTES)]


class Space:
    """A flat byte space holding regions at 16-aligned offsets (the 'addresses')."""

    def __init__(self) -> None:
        self.regions: list[tuple[int, np.ndarray]] = []
        self.size = 64  # address 0 is never used: it means "no table"

    def add(self, data: np.ndarray) -> int:
        addr = self.size
        self.regions.append((addr, data))
        self.size += -(-data.nbytes // 16) * 16 + 16
        return addr

    def flat(self) -> np.ndarray:
        out = np.zeros(self.size, np.uint8)
        for addr, d in self.regions:
            out[addr:addr + d.nbytes] = d.reshape(-1).view(np.uint8)
        return out


def caches(rng: np.random.Generator, roles: tuple[int, ...], layers: int, blocks: int,
           fill: int | None) -> list[np.ndarray]:
    if fill is None:
        return [rng.integers(1, 256, (layers, blocks, b), np.uint8) for b in roles]
    return [np.full((layers, blocks, b), fill, np.uint8) for b in roles]


def side(space_arrays: list[np.ndarray], addrs: list[int], ids: int):
    return cache_side(addrs, [a.strides[0] for a in space_arrays],
                      [a.strides[1] for a in space_arrays], ids)


def view(flat: np.ndarray, addr: int, like: np.ndarray) -> np.ndarray:
    return flat[addr:addr + like.nbytes].reshape(like.shape)


def ids_pair(rng: np.random.Generator, n: int, src_blocks: int, dst_blocks: int):
    """Out of order; the source may repeat a block (one block to two places)."""
    src = rng.integers(0, src_blocks, n)
    dst = rng.permutation(dst_blocks)[:n]
    return src, dst


@pytest.mark.parametrize("roles", LAYOUTS)
def test_cache_to_cache_moves_every_role_of_one_layer(roles: tuple[int, ...]) -> None:
    rng = np.random.default_rng(len(roles))
    L, layer = 3, 1
    src, dst = caches(rng, roles, L, 9, None), caches(rng, roles, L, 11, 0xA5)
    s_ids, d_ids = ids_pair(rng, 7, 9, 11)
    sp = Space()
    sa, da = [sp.add(a) for a in src], [sp.add(a) for a in dst]
    table = np.stack([s_ids, d_ids]).astype(np.int32)
    ta = sp.add(table)
    first, cpb = role_chunks(roles)
    packed = pack_args(side(src, sa, ta), side(dst, da, ta + 4 * len(s_ids)),
                       roles, first, cpb, len(s_ids), layer)
    assert len(packed) == ARGS_BYTES
    flat = sp.flat()
    emulate(packed, flat, {ta: table[0], ta + 4 * len(s_ids): table[1]})
    for r, (a, b) in enumerate(zip(src, dst, strict=True)):
        want = b.copy()
        want[layer][d_ids] = a[layer][s_ids]
        assert np.array_equal(view(flat, da[r], b), want), f"role {r}"
        assert np.array_equal(view(flat, sa[r], a), a), "the source changed"


@settings(max_examples=25, deadline=None)
@given(roles=st.sampled_from(LAYOUTS), n=st.integers(1, 6), layer=st.integers(0, 2),
       seed=st.integers(0, 2**32 - 1))
def test_gather_into_rows_then_scatter_back_is_the_identity(roles, n, layer, seed) -> None:
    rng = np.random.default_rng(seed)
    cache = caches(rng, roles, 3, 8, None)
    back = caches(rng, roles, 3, 8, 0xA5)
    s_ids = rng.integers(0, 8, n)          # may repeat
    d_ids = rng.permutation(8)[:n]
    rows = np.zeros((n, sum(roles)), np.uint8)
    sp = Space()
    ca, ba = [sp.add(a) for a in cache], [sp.add(a) for a in back]
    ra = sp.add(rows)
    ts, td = sp.add(s_ids.astype(np.int32)), sp.add(d_ids.astype(np.int32))
    tables = {ts: s_ids, td: d_ids}
    first, cpb = role_chunks(roles)
    flat = sp.flat()
    emulate(pack_args(side(cache, ca, ts), rows_side(ra, roles), roles, first, cpb, n, layer),
            flat, tables)
    wire = np.concatenate([a[layer][s_ids] for a in cache], axis=1)  # the wire order
    assert np.array_equal(view(flat, ra, rows), wire)
    emulate(pack_args(rows_side(ra, roles), side(back, ba, td), roles, first, cpb, n, layer),
            flat, tables)
    for r, (a, b) in enumerate(zip(cache, back, strict=True)):
        want = b.copy()
        want[layer][d_ids] = a[layer][s_ids]
        assert np.array_equal(view(flat, ba[r], b), want), f"role {r}"


def test_role_chunks_and_grid() -> None:
    assert role_chunks([1024, 1024]) == ((0, 1), 2)
    assert role_chunks([CHUNK_BYTES * 2 + 16, 16]) == ((0, 3), 4)
    assert role_chunks([32768, 32768]) == ((0, 8), 16)
    assert grid_for(32, 16, 10_000) == 64     # 512 units, 8 warps a CTA
    assert grid_for(32, 16, 16) == 16         # capped: grid-stride past it
    assert grid_for(0, 16, 16) == 0


def test_layouts_the_kernel_cannot_take_are_named() -> None:
    assert check_layout([1024, 16], [0, 4096]) is None
    assert "multiple of 16" in check_layout([1024, 8], [0])
    assert "multiple of 16" in check_layout([1024], [8])
    assert "roles" in check_layout([16] * 9, [])


def test_patching_the_layer_is_packing_it() -> None:
    """``PdCopyKernel.launch`` patches the layer into a chunk's packed arguments."""
    roles = (512, 512, 16, 16)
    first, cpb = role_chunks(roles)
    a, b = cache_side([4096] * 4, [1 << 20] * 4, [64] * 4, 96), rows_side(8192, roles)
    buf = bytearray(pack_args(a, b, roles, first, cpb, 7))
    struct.pack_into("<q", buf, LAYER_OFFSET, 5)
    assert bytes(buf) == pack_args(a, b, roles, first, cpb, 7, layer=5)


def test_the_kernels_argument_struct_is_the_one_packed() -> None:
    """The sizes ``pd_copy.cu`` asserts at compile time are the ones packed here."""
    src = (SOURCE_DIR / "pd_copy.cu").read_text()
    assert re.search(r"sizeof\(PdCopyArgs\) == (\d+)", src).group(1) == str(ARGS_BYTES)
    assert LAYER_OFFSET == ARGS_BYTES - 8
    assert re.search(r"i64 layer;\s+// last", src), "the layer must stay the last member"


def test_the_launcher_hands_the_driver_the_packed_layer() -> None:
    """What ``PdCopyKernel.launch`` passes to ``cuLaunchKernel`` (its one argument
    pointer, read back here as bytes), built without a GPU around the driver call."""
    import ctypes

    from kernels.pd_copy import PdCopyKernel

    seen: list[tuple[int, bytes]] = []

    def driver(fptr, gx, gy, gz, bx, by, bz, smem, stream, argv, extra) -> None:
        arg0 = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))[0]
        seen.append((gx, ctypes.string_at(arg0, ARGS_BYTES)))

    k = object.__new__(PdCopyKernel)
    k._params = ctypes.create_string_buffer(ARGS_BYTES)
    k._argv = (ctypes.c_void_p * 1)(ctypes.addressof(k._params))
    k._argv_ptr = ctypes.addressof(k._argv)
    k._launch, k._fptr = driver, 1
    roles = (1024, 1024)
    first, cpb = role_chunks(roles)
    a, b = cache_side([4096] * 2, [1 << 20] * 2, [1024] * 2, 96), rows_side(8192, roles)
    packed = pack_args(a, b, roles, first, cpb, 3)
    for layer in (4, 0, 31):
        k.launch(0, packed, layer, 2)
    k.launch(0, packed, 9, 0)  # an empty grid launches nothing
    assert seen == [(2, pack_args(a, b, roles, first, cpb, 3, layer=x)) for x in (4, 0, 31)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) is not on PATH")
def test_the_kernel_keeps_its_registers_and_its_arguments_in_place(tmp_path: Path) -> None:
    """No spill (a chunk's 8 vectors a lane in local memory would halve the rate), and the
    per-role arguments read in place from parameter space (no copy of the struct to a
    stack frame), 16-byte loads."""
    cubin, ptx = tmp_path / "pd.cubin", tmp_path / "pd.ptx"
    base = ["nvcc", "-arch=sm_90", "-std=c++17", f"-I{SOURCE_DIR}", str(SOURCE_DIR / "pd_copy.cu")]
    proc = subprocess.run([*base, "-cubin", "-Xptxas", "-v", "-o", str(cubin)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in proc.stderr
    subprocess.run([*base, "-ptx", "-o", str(ptx)], check=True)
    assert "ld.global.cs.v4.u32" in ptx.read_text()
