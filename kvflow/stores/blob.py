"""The blob every block store keeps for a block: header, checksum, optional MAC.

Blob format (version 1)
-----------------------
Every stored value is ``header || layout signature || key || payload``::

    offset size  field
    0      4     magic  b"KVFB"
    4      2     format version (1), little-endian
    6      2     flags: 0, or 1 when a MAC follows the fixed header
    8      2     length of the layout signature (UTF-8 bytes)
    10     2     length of the encoded key (ASCII bytes)
    12     8     payload length
    20     8     checksum: xxh3_64 over bytes [0, 20) + signature + key + payload
    28     32    (flag 1 only) MAC: HMAC-SHA256 over bytes [0, 28) + signature
                 + key + payload
    ...    ...   signature, key, payload

The checksum covers the header too, so a flipped byte anywhere is detected.
It does not stop a forger, who can compute it: blobs in a shared store (Redis)
carry flag 1 and a MAC under a key derived per namespace from a deployment
key (``kvflow.stores.mac``), and a store holding the key accepts no blob
without a valid one. A local directory store keeps the checksum alone.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from kvflow.stores.mac import BlockMac

MAGIC = b"KVFB"
FORMAT_VERSION = 1
#: ``magic, version, flags, sig_len, key_len, payload_len`` — the part before the checksum.
_PREFIX = struct.Struct("<4sHHHHQ")
_CHECKSUM = struct.Struct("<Q")
HEADER_SIZE = _PREFIX.size + _CHECKSUM.size  # 28 bytes before the variable parts
#: Flag bit: a MAC of ``MAC_SIZE`` bytes follows the fixed header.
FLAG_MAC = 1
MAC_SIZE = 32


def encode_header(layout: str, encoded_key: str, payload: bytes | memoryview,
                  mac: BlockMac | None = None) -> bytes:
    """The header (fixed part, MAC if ``mac``, signature, key) to write before ``payload``."""
    sig = layout.encode()
    key = encoded_key.encode("ascii")
    flags = 0 if mac is None else FLAG_MAC
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, flags, len(sig), len(key), len(payload))
    h = xxhash.xxh3_64()
    h.update(prefix)
    h.update(sig)
    h.update(key)
    h.update(payload)
    checksum = _CHECKSUM.pack(h.intdigest())
    tag = b"" if mac is None else mac.tag(prefix, checksum, sig, key, payload)
    return prefix + checksum + tag + sig + key


def encode_blob(layout: str, encoded_key: str, payload: bytes | memoryview,
                mac: BlockMac | None = None) -> bytes:
    """Header and payload as one byte string (what Redis stores)."""
    return encode_header(layout, encoded_key, payload, mac) + payload


def parse_header(head: bytes | memoryview) -> tuple[int, int, int] | None:
    """``(signature length, key length, payload length)`` of a plain blob's fixed header.

    ``None`` if ``head`` is shorter than a header, has the wrong magic or
    version, or has flags (a MAC'd blob is not a plain one). Lets a reader size
    its reads before it has the whole blob.
    """
    if len(head) < HEADER_SIZE:
        return None
    magic, version, flags, sig_len, key_len, payload_len = _PREFIX.unpack_from(head, 0)
    if magic != MAGIC or version != FORMAT_VERSION or flags:
        return None
    return sig_len, key_len, payload_len


def verify_parts(
    head: bytes | memoryview,
    var: bytes | memoryview,
    payload: bytes | memoryview,
    layout: str,
    encoded_key: str,
    block_bytes: int | None = None,
) -> bool:
    """Whether a blob read in pieces (fixed header, signature + key, payload) is whole
    and is ``encoded_key``'s block of ``layout``."""
    parsed = parse_header(head)
    if parsed is None or len(head) != HEADER_SIZE:
        return False
    sig_len, key_len, payload_len = parsed
    if len(var) != sig_len + key_len or len(payload) != payload_len:
        return False
    if block_bytes is not None and payload_len != block_bytes:
        return False
    var = memoryview(var)
    if var[:sig_len] != layout.encode() or var[sig_len:] != encoded_key.encode("ascii"):
        return False
    (checksum,) = _CHECKSUM.unpack_from(head, _PREFIX.size)
    h = xxhash.xxh3_64()
    h.update(memoryview(head)[:_PREFIX.size])
    h.update(var)
    h.update(payload)
    return h.intdigest() == checksum


def payload_view(
    blob: bytes | memoryview, layout: str, encoded_key: str, block_bytes: int | None = None,
    mac: BlockMac | None = None,
) -> memoryview | None:
    """A view of ``blob``'s payload if the blob is whole and is ``encoded_key``'s block of
    ``layout``; ``None`` for anything else (see :func:`decode_blob`). No copy.

    With ``mac``, only a blob carrying a valid MAC under it is accepted (see
    :func:`authenticated`); without, only a plain blob.
    """
    mv = memoryview(blob)
    if mac is not None:
        if not is_tagged(mv):
            return None
        return _tagged_payload(mv, layout, encoded_key, block_bytes, mac)
    parsed = parse_header(mv)
    if parsed is None:
        return None
    sig_len, key_len, payload_len = parsed
    start = HEADER_SIZE + sig_len + key_len
    if len(mv) != start + payload_len:
        return None
    if not verify_parts(mv[:HEADER_SIZE], mv[HEADER_SIZE:start], mv[start:], layout,
                        encoded_key, block_bytes):
        return None
    return mv[start:]


def is_tagged(blob: bytes | memoryview) -> bool:
    """Whether ``blob`` says it carries a MAC (a header with flag 1); checks nothing else."""
    if len(blob) < HEADER_SIZE + MAC_SIZE:
        return False
    magic, version, flags = struct.unpack_from("<4sHH", blob, 0)
    return magic == MAGIC and version == FORMAT_VERSION and flags == FLAG_MAC


def authenticated(blob: bytes | memoryview, mac: BlockMac) -> bool:
    """Whether a tagged blob's MAC verifies (header, signature, key and payload as stored)."""
    mv = memoryview(blob)
    if not is_tagged(mv):
        return False
    _, _, _, sig_len, key_len, payload_len = _PREFIX.unpack_from(mv, 0)
    start = HEADER_SIZE + MAC_SIZE
    if len(mv) != start + sig_len + key_len + payload_len:
        return False
    return mac.verify(mv[HEADER_SIZE:start], mv[:HEADER_SIZE], mv[start:])


def _tagged_payload(mv: memoryview, layout: str, encoded_key: str, block_bytes: int | None,
                    mac: BlockMac) -> memoryview | None:
    _, _, _, sig_len, key_len, payload_len = _PREFIX.unpack_from(mv, 0)
    var_at = HEADER_SIZE + MAC_SIZE
    start = var_at + sig_len + key_len
    if len(mv) != start + payload_len:
        return None
    if block_bytes is not None and payload_len != block_bytes:
        return None
    if (mv[var_at:var_at + sig_len] != layout.encode()
            or mv[var_at + sig_len:start] != encoded_key.encode("ascii")):
        return None
    if not mac.verify(mv[HEADER_SIZE:var_at], mv[:HEADER_SIZE], mv[var_at:]):
        return None
    return mv[start:]


def failure_kind(blob: bytes | memoryview, layout: str, encoded_key: str,
                 block_bytes: int | None = None) -> str:
    """Why a store with a MAC key refused ``blob``: ``"forged"`` when it is well formed
    (its checksum, layout and key check out) but carries no valid MAC — someone
    without the key wrote it, or changed it and fixed the checksum — else ``"corrupt"``."""
    mv = memoryview(blob)
    if not is_tagged(mv):
        plain = payload_view(mv, layout, encoded_key, block_bytes)
        return "forged" if plain is not None else "corrupt"
    _, _, _, sig_len, key_len, payload_len = _PREFIX.unpack_from(mv, 0)
    var_at = HEADER_SIZE + MAC_SIZE
    start = var_at + sig_len + key_len
    if len(mv) != start + payload_len:
        return "corrupt"
    h = xxhash.xxh3_64()  # the checksum, over what encode_header summed
    h.update(mv[:_PREFIX.size])
    h.update(mv[var_at:])
    ok = h.intdigest() == _CHECKSUM.unpack_from(mv, _PREFIX.size)[0] and (
        mv[var_at:var_at + sig_len] == layout.encode()
        and mv[var_at + sig_len:start] == encoded_key.encode("ascii"))
    return "forged" if ok else "corrupt"


def decode_blob(
    blob: bytes | memoryview, layout: str, encoded_key: str, block_bytes: int | None = None,
    mac: BlockMac | None = None,
) -> bytes | None:
    """The payload of ``blob`` if it is whole and is ``encoded_key``'s block of ``layout``.

    ``None`` for anything else: truncated, wrong magic or version, another
    layout or key, a payload of the wrong size, a checksum mismatch; with
    ``mac``, a missing or wrong MAC.
    """
    view = payload_view(blob, layout, encoded_key, block_bytes, mac)
    return None if view is None else bytes(view)
