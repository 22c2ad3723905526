"""The PD wire format: frames between a prefill and a decode instance.

Every frame is a fixed 40-byte header, a meta part and a payload::

    magic "KVPD" | version u16 | kind u16 | meta_len u32 | payload_len u64 |
    layout u64 | body_xxh u64 | header_xxh u32                (little-endian)

``layout`` is the sender's layout fingerprint (``layout_fingerprint``) on every
frame, so a frame of another model can never be written into this one's blocks.
``body_xxh`` is the XXH3-64 of meta + payload, ``header_xxh`` the XXH32 of the
36 header bytes before it. The header is checked before its lengths are
trusted: a corrupt length would otherwise make the reader wait for bytes that
never come, or read the next frame as payload. A bad header means the stream is
out of step (the link closes, every transfer on it fails); a bad body, under a
good header, fails only that frame's request.

``LAYER`` frames carry one layer of a run of a request's blocks: meta is a
small struct (request id, layer, first position, count) plus the destination
block ids; the payload is ``count`` blocks of ``layer_bytes`` each, every role
of the layer in the layout's order. Control frames (``HELLO``, ``REFUSE``,
``PULL``, ``CANCEL``, ``ABORT``) carry JSON meta and no payload.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np
import xxhash

from kvflow.errors import TransferError
from kvflow.layout import ModelSpec

MAGIC = b"KVPD"
VERSION = 1
HEADER = struct.Struct("<4sHHIQQQI")
HEADER_SIZE = HEADER.size  # 40
#: Refused before reading: a meta part this large is a corrupt or hostile header.
MAX_META = 1 << 20
#: Likewise for a payload (one layer of one request's run of blocks).
MAX_PAYLOAD = 1 << 32
_LAYER_META = struct.Struct("<IIII")  # layer, first position, count, request id length


class Kind(IntEnum):
    HELLO = 1    # both ways, first: who I am and my KV layout
    REFUSE = 2   # the handshake failed: {"reason"}; the link closes
    PULL = 3     # decode -> prefill: send request r's positions [first, first+count) into ids
    LAYER = 4    # prefill -> decode: one layer of a run of blocks
    CANCEL = 5   # decode -> prefill: stop sending request r (deadline, cancelled, bad frame)
    ABORT = 6    # prefill -> decode: request r will not be sent (its send failed or stopped)


class ProtocolError(TransferError):
    """The peer broke the protocol (or the bytes were damaged on the way)."""


class CorruptFrame(ProtocolError):
    """A frame's checksum did not match: its bytes were changed on the way."""


class DamagedBody(CorruptFrame):
    """A frame whose header was sound but whose body failed its checksum: the stream is
    still in step, only this frame (its ``request``'s transfer) is lost."""

    def __init__(self, message: str, request: str) -> None:
        super().__init__(message)
        self.request = request


class LayoutMismatch(ProtocolError):
    """The peer's KV layout (or protocol version) is not ours: it may not send us KV."""


def layout_descriptor(spec: ModelSpec) -> dict[str, Any]:
    """What both instances must agree on before any KV moves between them."""
    lay = spec.layout
    return {"model": spec.name, "dtype": spec.dtype, "num_layers": lay.num_layers,
            "block_tokens": lay.block_tokens,
            "roles": [[r.name, r.bytes_per_block] for r in lay.roles]}


def layout_fingerprint(descriptor: dict[str, Any]) -> int:
    return xxhash.xxh3_64_intdigest(json.dumps(descriptor, sort_keys=True).encode())


def layout_difference(ours: dict[str, Any], theirs: Any, us: str = "here",
                      them: str = "the peer") -> str | None:
    """None if the layouts agree, else a sentence naming the first field that differs
    and its value at each end (``us``, ``them``: the ends' names)."""
    if not isinstance(theirs, dict):
        return f"{them} sent no layout (got {theirs!r})"
    for k in ("model", "dtype", "num_layers", "block_tokens", "roles"):
        a, b = ours.get(k), theirs.get(k)
        if a != b:
            return f"{k} differs: {a!r} at {us}, {b!r} at {them}"
    return None


@dataclass(eq=False)
class Frame:
    """One frame, decoded. ``source`` replaces ``payload`` on an in-process link:
    ``(memory, src_ids)`` the receiver copies from directly (no staging)."""

    kind: Kind
    request: str = ""
    layer: int = 0
    first: int = 0
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    meta: dict[str, Any] = field(default_factory=dict)
    payload: np.ndarray | None = None
    source: tuple[Any, np.ndarray] | None = None

    @property
    def count(self) -> int:
        return len(self.ids)


def encode(frame: Frame, layout_fp: int) -> list[bytes | memoryview]:
    """The frame's bytes as pieces (header, meta, payload) for ``writelines``."""
    if frame.kind is Kind.LAYER:
        rid = frame.request.encode()
        ids = np.ascontiguousarray(frame.ids, dtype="<u4")
        meta = _LAYER_META.pack(frame.layer, frame.first, len(ids), len(rid)) + rid + ids.tobytes()
        if frame.payload is None:
            raise ValueError("a LAYER frame on the wire needs its payload")
        payload = memoryview(np.ascontiguousarray(frame.payload, dtype=np.uint8).reshape(-1))
    else:
        body = dict(frame.meta)
        if frame.request:
            body["request"] = frame.request
        meta = json.dumps(body).encode()
        payload = memoryview(b"")
    h = xxhash.xxh3_64()
    h.update(meta)
    h.update(payload)
    head = struct.pack("<4sHHIQQQ", MAGIC, VERSION, int(frame.kind), len(meta), len(payload),
                       layout_fp, h.intdigest())
    return [head + struct.pack("<I", xxhash.xxh32_intdigest(head)), meta, payload]


@dataclass(frozen=True)
class Header:
    kind: Kind
    meta_len: int
    payload_len: int
    layout_fp: int
    body_xxh: int


def decode_header(raw: bytes) -> Header:
    """Check and unpack a header; ``ProtocolError`` (``LayoutMismatch`` for another
    version) if it is not one, before any length in it is used."""
    if len(raw) != HEADER_SIZE:
        raise ProtocolError(f"frame header is {len(raw)} bytes, not {HEADER_SIZE}")
    magic, version, kind, meta_len, payload_len, fp, body, check = HEADER.unpack(raw)
    if xxhash.xxh32_intdigest(raw[:-4]) != check:
        if magic != MAGIC:
            raise ProtocolError(f"not a kvflow PD frame (magic {magic!r})")
        raise CorruptFrame("frame header checksum mismatch: the stream is damaged")
    if magic != MAGIC:
        raise ProtocolError(f"not a kvflow PD frame (magic {magic!r})")
    if version != VERSION:
        raise LayoutMismatch(f"peer speaks PD protocol version {version}, this is {VERSION}")
    try:
        k = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if meta_len > MAX_META or payload_len > MAX_PAYLOAD:
        raise ProtocolError(f"frame too large: meta {meta_len} B, payload {payload_len} B")
    if k is not Kind.LAYER and payload_len:
        raise ProtocolError(f"{k.name} frame with a {payload_len}-byte payload")
    return Header(k, meta_len, payload_len, fp, body)


def decode_body(header: Header, meta: bytes, payload: bytes | bytearray | memoryview,
                layer_bytes: int) -> Frame:
    """The frame of a checked header and its body; ``CorruptFrame`` if the body's
    checksum fails, ``ProtocolError`` if it does not parse.

    A LAYER frame's payload becomes ``uint8[count, layer_bytes]`` over ``payload``
    (no copy)."""
    h = xxhash.xxh3_64()
    h.update(meta)
    h.update(payload)
    if h.intdigest() != header.body_xxh:
        request = ""
        if header.kind is Kind.LAYER and len(meta) >= _LAYER_META.size:
            n = _LAYER_META.unpack_from(meta)[3]
            request = bytes(meta[_LAYER_META.size:_LAYER_META.size + n]).decode(errors="replace")
        raise DamagedBody(f"{header.kind.name} frame checksum mismatch"
                          + (f" (request {request})" if request else ""), request)
    if header.kind is not Kind.LAYER:
        try:
            body = json.loads(meta)
        except ValueError as exc:
            raise ProtocolError(f"{header.kind.name} frame meta is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ProtocolError(f"{header.kind.name} frame meta is not an object")
        request = body.pop("request", "")
        return Frame(header.kind, str(request), meta=body)
    if len(meta) < _LAYER_META.size:
        raise ProtocolError("LAYER frame meta too short")
    layer, first, count, n = _LAYER_META.unpack_from(meta)
    end = _LAYER_META.size + n
    if len(meta) != end + 4 * count:
        raise ProtocolError(f"LAYER frame meta is {len(meta)} bytes, expected {end + 4 * count}")
    if len(payload) != count * layer_bytes:
        raise ProtocolError(f"LAYER frame payload is {len(payload)} bytes, expected "
                            f"{count} blocks x {layer_bytes}")
    request = bytes(meta[_LAYER_META.size:end]).decode()
    ids = np.frombuffer(meta, dtype="<u4", count=count, offset=end).astype(np.int64)
    data = np.frombuffer(payload, dtype=np.uint8).reshape(count, layer_bytes)
    return Frame(Kind.LAYER, request, layer, first, ids, payload=data)


def wire_id(request_id: object) -> str:
    """A request id as the wire names it (both instances name requests alike)."""
    return str(request_id)
