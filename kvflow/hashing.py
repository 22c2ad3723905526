"""Chained hashes of full blocks of token ids.

A block's hash covers its parent's hash, so equal hashes mean equal whole
prefixes, and the prefix index can be a flat dict. Anything besides the tokens
that changes the KV (a tenant's salt, a LoRA adapter, images inside the block)
goes into the hash too, so two tenants or two adapters never share a block.

Traces that already carry prefix-chained block ids (Mooncake) skip this module:
their ids are used as keys directly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import xxhash

from kvflow.errors import ConfigError

HashAlgo = Literal["sha256", "xxh3_128"]
HASH_ALGOS: tuple[str, ...] = ("sha256", "xxh3_128")


@dataclass(frozen=True)
class MMItem:
    """A multimodal item (an image...) occupying token positions [offset, offset+length)."""

    item_hash: bytes
    offset: int
    length: int


@dataclass(frozen=True)
class ExtraKeys:
    """What besides tokens determines a block's KV."""

    tenant_salt: bytes | str | None = None
    lora_id: int | None = None
    mm_items: tuple[MMItem, ...] = field(default_factory=tuple)


#: Longest tenant salt, in bytes: the chain's first link carries its length in 2 bytes.
MAX_SALT_BYTES = 2**16 - 1 - len(b"salt:")


def salt_bytes(salt: bytes | str) -> bytes:
    """A tenant salt as the bytes hashed; text must be valid Unicode, and short enough
    for the chain's 2-byte length field (a ConfigError naming the limit otherwise)."""
    if isinstance(salt, str):
        try:
            salt = salt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"tenant salt is not valid Unicode text: {exc.reason} at "
                              f"character {exc.start + 1}") from None
    if len(salt) > MAX_SALT_BYTES:
        raise ConfigError(f"tenant salt is {len(salt):,} bytes; at most {MAX_SALT_BYTES:,} "
                          "are allowed")
    return salt


class BlockHasher:
    """Hashes the full blocks of a token sequence, chained to a parent hash."""

    def __init__(self, block_tokens: int, algo: str = "sha256") -> None:
        if block_tokens <= 0:
            raise ConfigError(f"block_tokens must be positive, got {block_tokens}")
        if algo not in HASH_ALGOS:
            raise ConfigError(f"unknown hash algo {algo!r}; valid: {', '.join(HASH_ALGOS)}")
        self.block_tokens = block_tokens
        self.algo = algo

    def _new(self):  # type: ignore[no-untyped-def]
        return hashlib.sha256() if self.algo == "sha256" else xxhash.xxh3_128()

    def hash_blocks(
        self,
        tokens: Sequence[int] | np.ndarray,
        parent: bytes | None = None,
        extra: ExtraKeys | None = None,
        start_token: int = 0,
    ) -> list[bytes]:
        """Hashes of every *full* block of ``tokens``; a partial tail gets none.

        ``start_token`` is the position of ``tokens[0]`` in the whole sequence,
        so multimodal item offsets line up when hashing is resumed from a parent.
        """
        bt = self.block_tokens
        try:
            arr = np.asarray(tokens, dtype=np.int64)
        except OverflowError:
            raise ConfigError("token ids must fit in 64-bit signed integers") from None
        n_full = len(arr) // bt
        out: list[bytes] = []
        prev = parent if parent is not None else b""
        if extra is not None and extra.tenant_salt is not None and parent is None:
            prev = b"salt:" + salt_bytes(extra.tenant_salt)
        lora = b"" if extra is None or extra.lora_id is None else b"lora:%d" % extra.lora_id
        items = () if extra is None else extra.mm_items
        for b in range(n_full):
            h = self._new()
            h.update(len(prev).to_bytes(2, "little"))
            h.update(prev)
            h.update(arr[b * bt:(b + 1) * bt].astype("<i8").tobytes())
            if lora:
                h.update(lora)
            lo = start_token + b * bt
            hi = lo + bt
            for it in items:
                if it.offset < hi and it.offset + it.length > lo:
                    h.update(b"mm:")
                    h.update(it.item_hash)
            prev = h.digest()
            out.append(prev)
        return out
