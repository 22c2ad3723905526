"""The PD wire format (``kvflow.pd.wire``): round trips, and every damage is caught."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.layout import ModelSpec
from kvflow.pd.wire import (
    HEADER_SIZE,
    MAGIC,
    CorruptFrame,
    DamagedBody,
    Frame,
    Kind,
    LayoutMismatch,
    ProtocolError,
    decode_body,
    decode_header,
    encode,
    layout_descriptor,
    layout_difference,
    layout_fingerprint,
)

FP = 0x1234_5678_9ABC_DEF0


def wire(frame: Frame) -> bytes:
    return b"".join(bytes(p) for p in encode(frame, FP))


def parse(raw: bytes, layer_bytes: int) -> Frame:
    h = decode_header(raw[:HEADER_SIZE])
    meta = raw[HEADER_SIZE:HEADER_SIZE + h.meta_len]
    payload = raw[HEADER_SIZE + h.meta_len:]
    assert len(payload) == h.payload_len and h.layout_fp == FP
    return decode_body(h, meta, payload, layer_bytes)


@settings(max_examples=60, deadline=None)
@given(request=st.text(max_size=40), layer=st.integers(0, 1000), first=st.integers(0, 1 << 20),
       ids=st.lists(st.integers(0, (1 << 32) - 1), max_size=40),
       layer_bytes=st.integers(1, 64), seed=st.integers(0, 1 << 30))
def test_layer_frames_round_trip(request: str, layer: int, first: int, ids: list[int],
                                 layer_bytes: int, seed: int) -> None:
    payload = np.random.default_rng(seed).integers(0, 256, (len(ids), layer_bytes), np.uint8)
    out = parse(wire(Frame(Kind.LAYER, request, layer, first, np.asarray(ids, np.int64),
                           payload=payload)), layer_bytes)
    assert (out.kind, out.request, out.layer, out.first) == (Kind.LAYER, request, layer, first)
    assert out.ids.tolist() == ids and np.array_equal(out.payload, payload)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from([Kind.HELLO, Kind.REFUSE, Kind.PULL, Kind.CANCEL, Kind.ABORT]),
       request=st.text(max_size=20),
       meta=st.dictionaries(st.text(max_size=8).filter(lambda k: k != "request"),
                            st.one_of(st.integers(-5, 5), st.text(max_size=8),
                                      st.lists(st.integers(0, 99), max_size=5)), max_size=4))
def test_control_frames_round_trip(kind: Kind, request: str, meta: dict) -> None:
    out = parse(wire(Frame(kind, request, meta=meta)), 8)
    assert (out.kind, out.request, out.meta) == (kind, request, meta)


def _layer_frame() -> bytes:
    data = np.arange(3 * 16, dtype=np.uint8).reshape(3, 16)
    return wire(Frame(Kind.LAYER, "req-7", 2, 5, np.array([9, 4, 1]), payload=data))


def test_every_damaged_header_byte_is_caught_before_its_lengths_are_used() -> None:
    raw = _layer_frame()
    for i in range(HEADER_SIZE):
        for bit in (0x01, 0x80):
            bad = bytearray(raw)
            bad[i] ^= bit
            with pytest.raises(ProtocolError):
                decode_header(bytes(bad[:HEADER_SIZE]))


def test_a_damaged_body_names_its_request_and_keeps_the_stream_in_step() -> None:
    raw = _layer_frame()
    h = decode_header(raw[:HEADER_SIZE])
    for i in range(HEADER_SIZE, len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x10
        with pytest.raises(DamagedBody) as err:
            decode_body(h, bytes(bad[HEADER_SIZE:HEADER_SIZE + h.meta_len]),
                        bytes(bad[HEADER_SIZE + h.meta_len:]), 16)
        if i >= HEADER_SIZE + 16 + len("req-7"):  # past the id: the request is still named
            assert err.value.request == "req-7"


def test_other_versions_kinds_sizes_and_magic_are_refused() -> None:
    def header(magic: bytes = MAGIC, version: int = 1, kind: int = 3, meta: int = 2,
               payload: int = 0) -> bytes:
        import xxhash
        head = struct.pack("<4sHHIQQQ", magic, version, kind, meta, payload, FP, 0)
        return head + struct.pack("<I", xxhash.xxh32_intdigest(head))

    decode_header(header())
    with pytest.raises(LayoutMismatch, match="version 2"):
        decode_header(header(version=2))
    with pytest.raises(ProtocolError, match="unknown frame kind"):
        decode_header(header(kind=99))
    with pytest.raises(ProtocolError, match="too large"):
        decode_header(header(meta=1 << 30))
    with pytest.raises(ProtocolError, match="payload"):
        decode_header(header(payload=16))  # a PULL carries none
    with pytest.raises(ProtocolError, match="magic"):
        decode_header(header(magic=b"HTTP"))
    with pytest.raises(CorruptFrame):
        decode_header(header()[:-1] + b"\0")


def test_a_layer_frame_whose_payload_does_not_fit_its_blocks_is_refused() -> None:
    raw = _layer_frame()
    with pytest.raises(ProtocolError, match="payload"):
        parse(raw, 15)


def test_layouts_differing_in_any_role_name_or_size_are_told_apart() -> None:
    specs = [ModelSpec("m", num_layers=2, num_kv_heads=2, head_dim=16),
             ModelSpec("m", num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp8"),
             ModelSpec("m", num_layers=3, num_kv_heads=2, head_dim=16),
             ModelSpec("m", num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=32),
             ModelSpec("m", num_layers=2, num_kv_heads=1, head_dim=16, attention="mla",
                       kv_lora_rank=16, qk_rope_head_dim=8),
             ModelSpec("m", num_layers=2, num_kv_heads=1, head_dim=16, attention="mla",
                       kv_lora_rank=16, qk_rope_head_dim=8, indexer_head_dim=8, dtype="fp8"),
             ModelSpec("other", num_layers=2, num_kv_heads=2, head_dim=16)]
    descs = [layout_descriptor(s) for s in specs]
    assert len({layout_fingerprint(d) for d in descs}) == len(descs)
    for i, a in enumerate(descs):
        for j, b in enumerate(descs):
            assert (layout_difference(a, b) is None) == (i == j)
    assert layout_difference(descs[0], descs[2], "P", "D") == "num_layers differs: 2 at P, 3 at D"
    assert "no layout" in layout_difference(descs[0], None)
