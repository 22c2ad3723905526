"""Token ids derived from block keys (``prompt_tokens``), and the embedding kernel's
values (``embed``).

Traces carry block keys and lengths, not always tokens; deriving a block's tokens
from its key makes "same key" mean "same content", which is what the cache
assumes, and makes wrong or stale KV give different numbers.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Sequence

import numpy as np

_M64 = (1 << 64) - 1


def key_int(key: Hashable) -> int:
    """A 64-bit integer for a block key, the same in every process."""
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return int(key) & _M64
    if isinstance(key, (bytes, bytearray)):
        return int.from_bytes(bytes(key[:8]).ljust(8, b"\0"), "little")
    raw = repr(key).encode()
    return zlib.crc32(raw) | (zlib.adler32(raw) << 32)


def _mix(k: np.ndarray, j: np.ndarray) -> np.ndarray:
    """splitmix64 of (k, j) -> token ids in [0, 2^31)."""
    with np.errstate(over="ignore"):
        z = k * np.uint64(_MUL1) + j + np.uint64(1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MUL2)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MUL3)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(33)).astype(np.int32)


#: Longest range ``prompt_tokens`` computes in plain Python: each numpy call costs
#: microseconds (~7 us on some GPU hosts) and a step's items are built between its
#: loads' submission and its first kernel; a few tokens are cheaper one by one.
SMALL_TOKEN_RANGE = 32
_MUL1, _MUL2, _MUL3 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def prompt_tokens(keys: Sequence[Hashable], request_id: Hashable, block_tokens: int,
                  start: int, stop: int, *, vectorised: bool = False) -> np.ndarray:
    """Token ids of prompt positions ``[start, stop)``: a function of the block's key.

    Positions past the last key (a tail that hashing left without one) are a
    function of the request instead: nobody else can match them anyway.
    Ranges up to ``SMALL_TOKEN_RANGE`` are mixed in plain Python (the same
    splitmix64 bit for bit) unless ``vectorised``.
    """
    if stop <= start:
        return np.zeros(0, dtype=np.int32)

    def key_of(b: int) -> int:
        return key_int(keys[b]) if b < len(keys) else key_int(("tail", repr(request_id), b))

    if not vectorised and stop - start <= SMALL_TOKEN_RANGE:
        out = []
        b_prev, k = -1, 0
        for p in range(start, stop):
            b = p // block_tokens
            if b != b_prev:
                b_prev, k = b, key_of(b)
            out.append(_mix_one(k, p % block_tokens))
        return np.array(out, dtype=np.int32)
    pos = np.arange(start, stop, dtype=np.int64)
    blocks = pos // block_tokens
    b0, b1 = int(blocks[0]), int(blocks[-1])
    k = np.array([key_of(b) for b in range(b0, b1 + 1)], dtype=np.uint64)[blocks - b0]
    return _mix(k, (pos % block_tokens).astype(np.uint64))


def _mix_one(k: int, j: int) -> int:
    """``_mix`` of one (k, j), on Python ints."""
    z = (k * _MUL1 + j + 1) & _M64
    z = ((z ^ (z >> 30)) * _MUL2) & _M64
    z = ((z ^ (z >> 27)) * _MUL3) & _M64
    z ^= z >> 31
    return z >> 33


def _hash32(x: np.ndarray) -> np.ndarray:
    """lowbias32 on uint32 arrays (as the embedding kernel)."""
    x = x.astype(np.uint32)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return x


def _unit(h: np.ndarray) -> np.ndarray:
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 8388608.0) - np.float32(1.0)


def embed(tokens: np.ndarray, positions: np.ndarray, hidden: int) -> np.ndarray:
    """The embedding kernel's values (float32, bit for bit): hashes of (token, d), (pos, d)."""
    tok = tokens.astype(np.uint32)[:, None]
    pos = positions.astype(np.uint32)[:, None]
    d = np.arange(hidden, dtype=np.uint32)[None, :]
    with np.errstate(over="ignore"):
        a = _unit(_hash32(tok * np.uint32(0x9E3779B1) + d * np.uint32(0x85EBCA77)))
        b = _unit(_hash32(((pos + np.uint32(0x632BE5AB)) * np.uint32(0xC2B2AE3D))
                          ^ (d * np.uint32(0x27D4EB2F))))
    return a + np.float32(0.25) * b
