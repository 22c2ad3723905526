"""What every block store shares: the interface, namespaces, keys, the blob format, stats.

A block store is the third tier of the cache: it keeps whole KV blocks (every
layer, every role, as one opaque byte string) keyed by the block's chained hash.
It is a *cache*, never a source of truth, so its contract is built around one
rule: **every failure is a miss, never wrong data**. A block that cannot be read,
fails its checksum, carries the wrong layout or belongs to another key is
reported as ``None`` (and counted); a block that cannot be written makes
``put_many`` answer ``False`` (and counted). Store trouble is never an exception
to the caller, who simply recomputes. Only caller bugs raise (a key of an
unsupported type, a payload of the wrong size, use after ``close``).

Namespaces
----------
A store instance serves one :class:`Namespace`: a model (its name should
identify the weights, revision included), the layout signature of its KV
(layers, block tokens, dtype, roles and their sizes) and the tenant salt. The
namespace's ``name`` — a slug of the model name plus a 64-bit digest of all
three — prefixes every file path and Redis key, so blocks of another model, of a
changed layout or of another tenant are simply never found (no cross-tenant
hits even if two tenants' block hashes were equal). The blob header repeats the
layout signature and the key, and a read checks both: a misplaced or stale
entry is a miss, not data of the wrong shape.

Blob format
-----------
Every stored value is a self-describing blob (magic, version, lengths, an
xxh3 checksum, optionally a keyed MAC, the layout signature and the key):
see :mod:`kvflow.stores.blob`.
"""

from __future__ import annotations

import abc
import dataclasses
import re
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from kvflow.errors import KvflowError
from kvflow.stores.blob import (  # noqa: F401  (the blob format, re-exported)
    FLAG_MAC,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAC_SIZE,
    MAGIC,
    authenticated,
    decode_blob,
    encode_blob,
    encode_header,
    failure_kind,
    is_tagged,
    parse_header,
    payload_view,
    verify_parts,
)

if TYPE_CHECKING:
    from kvflow.layout import ModelSpec

#: Encoded keys longer than this are stored under a digest (file names are <= 255 bytes).
MAX_PLAIN_KEY = 200


class StoreClosedError(KvflowError):
    """A store (or its async wrapper) was used after ``close()``."""


class MissingDependencyError(KvflowError, ImportError):
    """An optional dependency a store needs is not installed; the message says which extra."""


class BlockSizeError(KvflowError, ValueError):
    """A payload handed to ``put_many`` does not have the namespace's block size."""


# --------------------------------------------------------------------------- namespaces


def layout_signature(spec: ModelSpec) -> str:
    """A string that changes whenever the bytes of a block would mean something else.

    It names the model and every shape parameter that decides the block's byte
    layout (layers, block tokens, dtype, attention kind, each role's size), so
    two layouts that merely happen to have equal block sizes still differ.
    """
    lay = spec.layout
    roles = ",".join(f"{r.name}:{r.bytes_per_block}" for r in lay.roles)
    return (
        f"{spec.name};L={lay.num_layers};bt={lay.block_tokens};dtype={spec.dtype};"
        f"attn={spec.attention};roles={roles};bpb={lay.bytes_per_block}"
    )


_SLUG = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Namespace:
    """Which blocks a store instance sees: one model, one layout, one tenant.

    Build it with :meth:`for_model` from a ``ModelSpec``; the plain constructor
    is for tests and tools that store opaque blobs (``layout`` any string,
    ``block_bytes`` ``None`` to accept payloads of any size).
    """

    model: str
    layout: str
    tenant_salt: bytes | None = None
    block_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("Namespace.model must be a non-empty string")
        if isinstance(self.tenant_salt, str):  # accept str like ExtraKeys does
            object.__setattr__(self, "tenant_salt", self.tenant_salt.encode())
        if len(self.layout.encode()) > 0xFFFF:
            raise ValueError("Namespace.layout signature is longer than 65535 bytes")
        if self.block_bytes is not None and self.block_bytes <= 0:
            raise ValueError(f"Namespace.block_bytes must be positive, got {self.block_bytes}")

    @classmethod
    def for_model(cls, spec: ModelSpec, tenant_salt: bytes | str | None = None) -> Namespace:
        """The namespace of ``spec``'s blocks for one tenant (``None``: no salt)."""
        salt = tenant_salt.encode() if isinstance(tenant_salt, str) else tenant_salt
        return cls(spec.name, layout_signature(spec), salt, spec.bytes_per_block)

    @property
    def name(self) -> str:
        """Path- and key-safe id: ``<model slug>-<16 hex digits of model+layout+salt>``."""
        h = xxhash.xxh3_64()
        h.update(self.model.encode())
        h.update(b"\0")
        h.update(self.layout.encode())
        h.update(b"\0")
        h.update(b"nosalt" if self.tenant_salt is None else b"salt:" + self.tenant_salt)
        slug = _SLUG.sub("_", self.model)[:48] or "model"
        return f"{slug}-{h.hexdigest()}"


# ------------------------------------------------------------------------------ keys


def encode_key(key: Hashable) -> str:
    """A stable, path- and Redis-safe text form of a block key.

    ints (trace hash ids, possibly negative) -> ``i<decimal>``; bytes (sha256
    digests) -> ``h<hex>``; str -> ``s<hex of UTF-8>``. The prefixes keep the
    three spaces apart (``1`` and ``b"\\x01"`` differ).
    """
    if isinstance(key, bool):
        raise TypeError("block keys must be int, bytes or str, got bool")
    if isinstance(key, int):
        return f"i{key}"
    if isinstance(key, (bytes, bytearray, memoryview)):
        return "h" + bytes(key).hex()
    if isinstance(key, str):
        return "s" + key.encode().hex()
    raise TypeError(f"block keys must be int, bytes or str, got {type(key).__name__}")


def decode_key(encoded: str) -> int | bytes | str:
    """The key ``encode_key`` encoded (``ValueError`` if ``encoded`` is not one).

    A store's listing of its block links (``BlockStore.links``) keeps encoded
    keys, so a new process can name the blocks an earlier one wrote.
    """
    tag, body = encoded[:1], encoded[1:]
    try:
        if tag == "i":
            return int(body)
        if tag == "h":
            return bytes.fromhex(body)
        if tag == "s":
            return bytes.fromhex(body).decode()
    except (ValueError, UnicodeDecodeError):
        pass
    raise ValueError(f"not an encoded block key: {encoded[:80]!r}")


#: A block and its parent block (``None`` for the first block of a prompt).
Link = tuple[Hashable, "Hashable | None"]


def storage_name(encoded_key: str) -> str:
    """The file / Redis key suffix for an encoded key (a digest when it is too long)."""
    if len(encoded_key) <= MAX_PLAIN_KEY:
        return encoded_key
    return "z" + xxhash.xxh3_128_hexdigest(encoded_key.encode())


# ------------------------------------------------------------------------------ stats


@dataclass
class StoreStats:
    """Counters of one store since it was opened.

    ``misses`` counts every ``None`` a get returned, including ``corrupt``
    entries (failed checksum / header / layout check; the entry is deleted)
    and ``forged`` ones (a store with a MAC key found a blob without a valid
    MAC: written by someone without the key, or altered; deleted too).
    ``errors`` counts failures of the store itself, for gets and puts alike:
    one per failed file operation (local), one per failed round trip or
    refused command (Redis, including calls answered at once while the
    server is marked down).
    ``put_failed`` counts every ``False`` from a put (no room, an error, a
    block larger than the whole capacity). ``bytes_*`` count payload bytes.
    ``evictions`` counts entries removed to make room (stores that track
    capacity themselves; Redis evicts server-side and reports 0).
    """

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    forged: int = 0
    put_ok: int = 0
    put_failed: int = 0
    errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0

    def add(self, other: StoreStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------- interface


class BlockStore(abc.ABC):
    """A block store: batched, thread-safe, failures are misses.

    Every method may be called from several threads at once (``AsyncStore``
    runs them on a thread pool). Batches are the unit because a store's cost
    is per round trip (Redis) or per syscall batch (disk); a single-key
    ``get``/``put`` is a batch of one.
    """

    def __init__(self, namespace: Namespace) -> None:
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a kvflow.stores.Namespace, got {namespace!r}")
        self.namespace = namespace
        self._stats = StoreStats()
        self._stats_lock = threading.Lock()
        self._closed = False
        #: The last store error seen (``"ENOSPC: ..."``), for reports and logs.
        self.last_error: str | None = None

    # -- the interface
    @abc.abstractmethod
    def get_many(self, keys: Sequence[Hashable]) -> list[bytes | None]:
        """The payload of each key, ``None`` for a miss (absent, corrupt, unreadable)."""

    @abc.abstractmethod
    def put_many(self, items: Sequence[tuple[Hashable, bytes]]) -> list[bool]:
        """Store each ``(key, payload)``; ``False`` where it was not stored. Overwrites."""

    @abc.abstractmethod
    def contains_many(self, keys: Sequence[Hashable]) -> list[bool]:
        """Whether each key is (believed) present; a later get may still miss."""

    @abc.abstractmethod
    def delete(self, key: Hashable) -> bool:
        """Remove a key; ``True`` if it was there. Never raises for store trouble."""

    def get_many_into(self, keys: Sequence[Hashable], buffers: Sequence[object]) -> list[bool]:
        """Read each key's payload into ``buffers[i]``; ``False`` for a miss.

        For the real world, where a block's destination is already allocated
        (a pinned host block): a store that can (``LocalDirStore``) reads into
        it directly, skipping an allocation and a copy of every block. Each
        buffer must be writable and C-contiguous; with a namespace block size it
        must have exactly that many bytes. A payload of another size than its
        buffer is a miss. Where the answer is ``False`` the buffer's contents are
        unspecified (possibly partly overwritten): like a failed transfer, its
        destination holds no valid data.
        """
        views = self._check_buffers(keys, buffers)
        out = []
        for payload, view in zip(self.get_many(keys), views, strict=True):
            if payload is None or len(payload) != view.nbytes:
                out.append(False)
            else:
                view[:] = payload
                out.append(True)
        return out

    def put_links(self, items: Sequence[Link]) -> bool:
        """Record each stored block's parent, so that a later process can rebuild a
        prefix index from the store (``kvflow.store_index.rediscover``).

        Links are hints, not data: a link whose block is gone is skipped at
        rebuild, one whose block is corrupt is a miss at read. ``False`` where
        they were not recorded (store trouble, counted; never raised). A store
        that keeps no links (the default) answers ``False`` and lists none.
        """
        return False

    def links(self) -> list[Link]:
        """The ``(key, parent key or None)`` pairs recorded by ``put_links`` (in any
        order; a key whose block has since gone may be among them). Store trouble
        lists nothing (counted), never raises."""
        return []

    def forget_links(self, keys: Sequence[Hashable]) -> None:
        """Drop the links of ``keys``, whose blocks were found gone (a store that
        prunes its links itself, or keeps none, ignores this)."""
        return None

    def close(self) -> None:
        """Release files, locks and connections; the store cannot be used afterwards."""
        self._closed = True

    # -- conveniences
    def get(self, key: Hashable) -> bytes | None:
        return self.get_many([key])[0]

    def put(self, key: Hashable, payload: bytes) -> bool:
        return self.put_many([(key, payload)])[0]

    def contains(self, key: Hashable) -> bool:
        return self.contains_many([key])[0]

    @property
    def stats(self) -> StoreStats:
        """A snapshot of the counters (a copy: safe to keep and compare)."""
        with self._stats_lock:
            return dataclasses.replace(self._stats)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers for implementations
    @staticmethod
    def _encode_link(key: Hashable, parent: Hashable | None) -> tuple[str, str]:
        """A link as two encoded keys (``""`` for no parent)."""
        return encode_key(key), "" if parent is None else encode_key(parent)

    @staticmethod
    def _decode_link(enc: str, enc_parent: str) -> Link | None:
        """A link from two encoded keys; ``None`` if either is malformed (skipped)."""
        try:
            return decode_key(enc), (decode_key(enc_parent) if enc_parent else None)
        except ValueError:
            return None

    def _count(self, delta: StoreStats) -> None:
        with self._stats_lock:
            self._stats.add(delta)

    def _note_error(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{type(self).__name__} {self.namespace.name!r} is closed")

    def _check_payload(self, key: Hashable, payload: object) -> memoryview:
        """``payload`` as a flat byte view, checked against the namespace's block size."""
        try:
            mv = memoryview(payload)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"payload of key {key!r} must be bytes-like, got {type(payload).__name__}"
            ) from None
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")  # numpy arrays, pinned host buffers: raw bytes, C order
        want = self.namespace.block_bytes
        if want is not None and mv.nbytes != want:
            raise BlockSizeError(
                f"payload of key {key!r} has {mv.nbytes} bytes; "
                f"namespace {self.namespace.name!r} holds blocks of {want} bytes"
            )
        return mv

    def _check_buffers(
        self, keys: Sequence[Hashable], buffers: Sequence[object]
    ) -> list[memoryview]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        views = []
        for k, b in zip(keys, buffers, strict=True):
            mv = memoryview(b)  # type: ignore[arg-type]
            if mv.readonly:
                raise TypeError(f"buffer for key {k!r} is read-only")
            if mv.ndim != 1 or mv.format != "B":
                mv = mv.cast("B")
            want = self.namespace.block_bytes
            if want is not None and mv.nbytes != want:
                raise BlockSizeError(
                    f"buffer for key {k!r} has {mv.nbytes} bytes; "
                    f"namespace {self.namespace.name!r} holds blocks of {want} bytes"
                )
            views.append(mv)
        return views

    def _decode(self, blob: bytes | memoryview, encoded_key: str) -> bytes | None:
        return decode_blob(blob, self.namespace.layout, encoded_key, self.namespace.block_bytes)
