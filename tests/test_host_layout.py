"""Host layouts (``kvflow.host_layout``): parsing, groups, byte offsets and pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.errors import ConfigError
from kvflow.host_layout import HostGeometry, HostLayout, pieces_per_unit

layouts = st.one_of(st.just(HostLayout("layer_major")), st.just(HostLayout("block_major")),
                    st.integers(1, 9).map(lambda g: HostLayout("grouped", g)))
geometries = st.builds(
    HostGeometry, layouts, st.integers(1, 9), st.integers(1, 6),
    st.lists(st.integers(1, 4).map(lambda k: 16 * k), min_size=1, max_size=3).map(tuple))


@pytest.mark.parametrize("text, want", [("layer_major", HostLayout("layer_major")),
                                        ("block_major", HostLayout("block_major")),
                                        ("grouped:4", HostLayout("grouped", 4)),
                                        (" grouped:1 ", HostLayout("grouped", 1))])
def test_parse(text: str, want: HostLayout) -> None:
    assert HostLayout.parse(text) == want
    assert HostLayout.parse(str(want)) == want


@pytest.mark.parametrize("bad", ["", "row_major", "grouped", "grouped:", "grouped:0",
                                 "grouped:-2", "grouped:x", "layer-major", 4, None])
def test_parse_rejects(bad: object) -> None:
    with pytest.raises(ConfigError, match="host_layout"):
        HostLayout.parse(bad)  # type: ignore[arg-type]


@given(layouts, st.integers(1, 40))
def test_groups_tile_the_layers(layout: HostLayout, layers: int) -> None:
    groups = layout.groups(layers)
    covered = [a + i for a, n in groups for i in range(n)]
    assert covered == list(range(layers))
    g = layout.group_size(layers)
    assert all(n == g for _, n in groups[:-1]) and 1 <= groups[-1][1] <= g
    if layout.kind == "layer_major":
        assert g == 1
    if layout.kind == "block_major":
        assert groups == ((0, layers),)


@settings(max_examples=150, deadline=None)
@given(geometries)
def test_offsets_tile_the_pool_exactly(geo: HostGeometry) -> None:
    """Every (block, layer, role) gets its own bytes, and together they fill the pool."""
    spans = sorted((geo.offset(b, layer, r), rb) for b in range(geo.num_blocks)
                   for layer in range(geo.num_layers) for r, rb in enumerate(geo.role_bytes))
    at = 0
    for off, n in spans:
        assert off == at
        at += n
    assert at == geo.total_bytes == geo.num_blocks * geo.num_layers * sum(geo.role_bytes)


@settings(max_examples=150, deadline=None)
@given(geometries, st.data())
def test_pieces_hold_exactly_their_layers(geo: HostGeometry, data: st.DataObject) -> None:
    """A unit's pieces cover exactly the bytes of its blocks' layers, and a block-contiguous
    piece holds its layers in the store's order, [layer][role]."""
    g = data.draw(st.integers(0, len(geo.groups) - 1))
    first, count = geo.groups[g]
    blocks = data.draw(st.lists(st.integers(0, geo.num_blocks - 1), min_size=1, max_size=4,
                                unique=True))
    pieces = geo.pieces(blocks, first, count)
    assert len(pieces) == pieces_per_unit(geo.layout, len(geo.role_bytes), len(blocks)) * (
        count if not geo.layout.block_contiguous else 1)
    got = sorted(o + i for o, n in pieces for i in range(n))
    want = sorted(geo.offset(b, layer, r) + i for b in blocks
                  for layer in range(first, first + count)
                  for r, rb in enumerate(geo.role_bytes) for i in range(rb))
    assert got == want
    if geo.layout.block_contiguous:
        for b, (off, n) in zip(blocks, pieces, strict=True):
            assert n == count * geo.layer_bytes
            assert off == geo.offset(b, first, 0)
            assert geo.offset(b, first + count - 1, len(geo.role_bytes) - 1) + \
                geo.role_bytes[-1] == off + n


@given(geometries)
def test_block_offset_only_where_contiguous(geo: HostGeometry) -> None:
    b = geo.num_blocks - 1
    off = geo.block_offset(b)
    if geo.layout.kind == "block_major" or (geo.layout.block_contiguous
                                            and len(geo.groups) == 1):
        assert off == geo.offset(b, 0, 0) == b * geo.bytes_per_block
    else:
        assert off is None


def test_cutting_a_group_is_an_error() -> None:
    geo = HostGeometry(HostLayout("grouped", 4), 8, 2, (32, 32))
    with pytest.raises(ValueError, match="cut group"):
        geo.pieces([0], 2, 4)


def test_layer_major_matches_the_per_role_pool() -> None:
    """Default layout: role r's (layer, block) at the same place as today's
    ``[layers, blocks, role bytes]`` buffer per role, roles one after another."""
    geo = HostGeometry(HostLayout("layer_major"), 3, 5, (32, 16))
    assert geo.offset(2, 1, 0) == (1 * 5 + 2) * 32
    assert geo.offset(2, 1, 1) == 3 * 5 * 32 + (1 * 5 + 2) * 16
