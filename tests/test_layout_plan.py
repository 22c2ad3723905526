"""``kernels.layout_plan`` on the CPU: the staging table and chunk descriptors, run by a
numpy model of the copy engine (descriptors) and of the swap kernel (table + id pairs),
must move exactly the bytes the host layout's offsets name, both ways."""

from __future__ import annotations

import ctypes

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.layout_plan import plan_chunks, staging_table
from kvflow.host_layout import HostGeometry, HostLayout

layouts = st.one_of(st.just(HostLayout("block_major")),
                    st.integers(1, 5).map(lambda g: HostLayout("grouped", g)))


def kernel(mem: np.ndarray, table: np.ndarray, role_bytes: list[int], layer_begin: int,
           num_layers: int, pairs: np.ndarray) -> None:
    """What ``swap.cu`` does, byte for byte: every (layer, role, pair)."""
    for layer in range(layer_begin, layer_begin + num_layers):
        for r, rb in enumerate(role_bytes):
            sb, db, ss, ds = (int(x) for x in table[layer, r])
            for x, y in pairs.reshape(-1, 2).tolist():
                mem[db + y * ds: db + y * ds + rb] = mem[sb + x * ss: sb + x * ss + rb].copy()


def run_op(geo: HostGeometry, host: np.ndarray, mem: np.ndarray, dev_bases: np.ndarray,
           ring: int, slot_bytes: int, slots: int, src: np.ndarray, dst: np.ndarray,
           per_chunk: int, to_device: bool) -> int:
    """Every group, every chunk, as ``GroupedCopier.launch`` enqueues them; returns the
    descriptors used. ``host`` is the host pool at address 0 (a separate memory)."""
    table = staging_table(geo, dev_bases, ring, slot_bytes, slots, to_device)
    plan = plan_chunks(geo, 0, src, dst, per_chunk, to_device)
    small = plan_chunks(geo, 0, src.tolist(), dst.tolist(), per_chunk, to_device)
    assert small.chunks == plan.chunks and small.bounds == plan.bounds
    for a, b in ((small.pairs, plan.pairs), (small.host, plan.host), (small.stage, plan.stage),
                 (small.sizes, plan.sizes)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    seq = used = 0
    for g, (first, count) in enumerate(geo.groups):
        for c, (p0, nb) in enumerate(plan.chunks):
            k = seq % slots
            seq += 1
            a, b = plan.bounds[c], plan.bounds[c + 1]
            stage = plan.stage[g][a:b] + np.uint64(ring + k * slot_bytes)
            pairs = plan.pairs[2 * p0: 2 * (p0 + nb)]
            descs = zip(plan.host[g][a:b].tolist(), stage.tolist(), plan.sizes[g][a:b].tolist(),
                        strict=True)
            used += b - a
            if to_device:
                for h, s, z in descs:
                    assert s + z <= ring + (k + 1) * slot_bytes, "a run spills out of its slot"
                    mem[s: s + z] = host[h: h + z]
                kernel(mem, table, list(geo.role_bytes), k * geo.num_layers + first, count,
                       pairs)
            else:
                kernel(mem, table, list(geo.role_bytes), k * geo.num_layers + first, count,
                       pairs)
                for h, s, z in descs:
                    host[h: h + z] = mem[s: s + z]
    return used


@settings(max_examples=60, deadline=None)
@given(layouts, st.integers(1, 7), st.lists(st.integers(1, 3).map(lambda k: 16 * k),
                                            min_size=1, max_size=3), st.data())
def test_round_trip_through_the_staging_ring(layout: HostLayout, layers: int,
                                             role_bytes: list[int], data: st.DataObject) -> None:
    nh, nd = data.draw(st.integers(2, 12)), data.draw(st.integers(2, 12))
    geo = HostGeometry(layout, layers, nh, tuple(role_bytes))
    n = data.draw(st.integers(1, min(nh, nd)))
    host_ids = np.array(data.draw(st.permutations(range(nh)))[:n])
    if data.draw(st.booleans()):  # runs of consecutive host ids
        start = data.draw(st.integers(0, nh - n))
        host_ids = np.arange(start, start + n)
    dev_ids = np.array(data.draw(st.permutations(range(nd)))[:n])
    per_chunk = data.draw(st.integers(1, n + 1))
    slots = data.draw(st.integers(1, 3))
    max_piece = max(geo.piece_bytes(g) for g in range(len(geo.groups)))
    slot_bytes = per_chunk * max_piece
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    # device memory: the caches ([layer][role] buffers of nd blocks), then the ring
    dev_bases = np.zeros((layers, len(role_bytes)), dtype=np.int64)
    at = 0
    for layer in range(layers):
        for r, rb in enumerate(role_bytes):
            dev_bases[layer, r] = at
            at += nd * rb
    ring = at
    mem = rng.integers(0, 256, size=ring + slots * slot_bytes, dtype=np.uint8)
    host = rng.integers(0, 256, size=geo.total_bytes, dtype=np.uint8)
    host0 = host.copy()

    def dev_piece(b: int, layer: int, r: int) -> np.ndarray:
        o = int(dev_bases[layer, r]) + b * role_bytes[r]
        return mem[o: o + role_bytes[r]]

    def host_piece(h: np.ndarray, b: int, layer: int, r: int) -> np.ndarray:
        o = geo.offset(b, layer, r)
        return h[o: o + role_bytes[r]]

    used = run_op(geo, host, mem, dev_bases, ring, slot_bytes, slots, host_ids, dev_ids,
                  per_chunk, True)
    for h, d in zip(host_ids.tolist(), dev_ids.tolist(), strict=True):
        for layer in range(layers):
            for r in range(len(role_bytes)):
                assert np.array_equal(dev_piece(d, layer, r), host_piece(host0, h, layer, r))
    # runs of consecutive host ids inside a chunk are one descriptor each
    chunks = -(-n // per_chunk)
    assert used <= len(geo.groups) * n
    if np.all(np.diff(host_ids) == 1):
        assert used == len(geo.groups) * chunks
    # back: the device blocks into other host blocks (or the same ones, poisoned first)
    back = np.array(data.draw(st.permutations(range(nh)))[:n])
    for b in back.tolist():
        for layer in range(layers):
            for r in range(len(role_bytes)):
                host_piece(host, b, layer, r)[:] = 0xAB
    expect = host.copy()
    for h, b in zip(host_ids.tolist(), back.tolist(), strict=True):
        for layer in range(layers):
            for r in range(len(role_bytes)):
                host_piece(expect, b, layer, r)[:] = host_piece(host0, h, layer, r)
    run_op(geo, host, mem, dev_bases, ring, slot_bytes, slots, dev_ids, back, per_chunk, False)
    assert np.array_equal(host, expect)


def test_fixed_tables_give_the_plan_of_a_scattered_op() -> None:
    """Where no neighbours in a chunk have consecutive host ids, the fixed tables (a gather
    of host addresses, staging slots' positions, the group's piece size) are exactly
    ``plan_chunks``' descriptors, chunk by chunk and slot by slot."""
    from kernels.layout_plan import fixed_tables, merges_none

    geo = HostGeometry(HostLayout.parse("grouped:3"), 8, 50, (48, 16))
    ring, slot_bytes, slots = 1 << 30, 4096, 3
    m = slot_bytes // max(geo.piece_bytes(g) for g in range(len(geo.groups)))
    fixed = fixed_tables(geo, 7 << 20, ring, slot_bytes, slots, m)
    rng = np.random.default_rng(2)
    checked = 0
    for _ in range(40):
        src = rng.permutation(50)[:20].tolist()
        dst = rng.permutation(50)[:20].tolist()
        if not merges_none(src, m):
            continue
        plan = plan_chunks(geo, 7 << 20, src, dst, m, True)
        assert plan.bounds == [*range(0, 20, m), 20]
        hosts = fixed.gather(src)
        np.testing.assert_array_equal(plan.host, hosts)
        # the copier reads group g's runs [a, b) from address host_addr + 8 * (g * n + a):
        # the gathered array must be C-ordered (``fixed.host[:, src]`` is Fortran-ordered,
        # which sent group 1's copies to other blocks' pieces on the GPU)
        raw = np.ctypeslib.as_array((ctypes.c_uint64 * hosts.size).from_address(
            hosts.ctypes.data))
        n = len(src)
        for g in range(hosts.shape[0]):
            assert raw[g * n: (g + 1) * n].tolist() == plan.host[g].tolist()
        for c, (_p0, nb) in enumerate(plan.chunks):
            a, b = plan.bounds[c], plan.bounds[c + 1]
            k = c % slots
            np.testing.assert_array_equal(plan.stage[:, a:b] + np.uint64(ring + k * slot_bytes),
                                          fixed.stage[k, :, :nb])
            np.testing.assert_array_equal(plan.sizes[:, a:b], fixed.sizes[:, :nb])
        checked += 1
    assert checked > 10
    assert not merges_none([4, 5], 2) and merges_none([4, 5], 1) and merges_none([5, 4], 2)
