"""A block store in process memory, with the same format, checks and LRU as the others.

For tests and tools that want the store semantics (checksummed blobs,
namespaces, LRU under a byte capacity, stats) without disk or a server — a
runtime test that needs a storage tier, a fault-injection wrapper's inner
store. It keeps encoded blobs, not bare payloads, so a test can corrupt one
(:meth:`blob_for` / :meth:`set_blob`) and see the miss counted as ``corrupt``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvflow.errors import ConfigError
from kvflow.stores.base import (
    BlockStore,
    Link,
    Namespace,
    StoreStats,
    encode_blob,
    encode_key,
    storage_name,
)


class MemoryStore(BlockStore):
    """Blobs in a dict, least recently used first; ``capacity_bytes`` counts blob bytes."""

    def __init__(self, namespace: Namespace, capacity_bytes: int | None = None) -> None:
        super().__init__(namespace)
        if capacity_bytes is not None and (
            not isinstance(capacity_bytes, int) or capacity_bytes <= 0
        ):
            raise ConfigError(f"capacity_bytes must be a positive integer or None, "
                              f"got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._blobs: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._links: dict[str, str] = {}

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._blobs)

    def get_many(self, keys: Sequence[Hashable]) -> list[bytes | None]:
        self._check_open()
        out: list[bytes | None] = []
        delta = StoreStats()
        for k in keys:
            enc = encode_key(k)
            name = storage_name(enc)
            with self._lock:
                blob = self._blobs.get(name)
                if blob is not None:
                    self._blobs.move_to_end(name)
            payload = None if blob is None else self._decode(blob, enc)
            if blob is not None and payload is None:
                delta.corrupt += 1
                with self._lock:
                    if self._blobs.get(name) is blob:
                        del self._blobs[name]
                        self._used -= len(blob)
            if payload is None:
                delta.misses += 1
            else:
                delta.hits += 1
                delta.bytes_read += len(payload)
            out.append(payload)
        self._count(delta)
        return out

    def put_many(self, items: Sequence[tuple[Hashable, bytes]]) -> list[bool]:
        self._check_open()
        prepared = [(encode_key(k), self._check_payload(k, p)) for k, p in items]
        out: list[bool] = []
        delta = StoreStats()
        for enc, payload in prepared:
            blob = encode_blob(self.namespace.layout, enc, payload)
            name = storage_name(enc)
            cap = self.capacity_bytes
            with self._lock:
                old = self._blobs.pop(name, None)
                if old is not None:
                    self._used -= len(old)
                if cap is not None and len(blob) > cap:  # refused; the old entry is gone
                    delta.put_failed += 1
                    out.append(False)
                    continue
                while cap is not None and self._used + len(blob) > cap:
                    _, victim = self._blobs.popitem(last=False)
                    self._used -= len(victim)
                    delta.evictions += 1
                self._blobs[name] = blob
                self._used += len(blob)
            delta.put_ok += 1
            delta.bytes_written += payload.nbytes
            out.append(True)
        self._count(delta)
        return out

    def contains_many(self, keys: Sequence[Hashable]) -> list[bool]:
        self._check_open()
        names = [storage_name(encode_key(k)) for k in keys]
        with self._lock:
            return [n in self._blobs for n in names]

    def delete(self, key: Hashable) -> bool:
        self._check_open()
        with self._lock:
            blob = self._blobs.pop(storage_name(encode_key(key)), None)
            if blob is not None:
                self._used -= len(blob)
        return blob is not None

    def put_links(self, items: Sequence[Link]) -> bool:
        self._check_open()
        with self._lock:
            self._links.update(self._encode_link(k, p) for k, p in items)
        return True

    def links(self) -> list[Link]:
        """Links of this object's life (a memory store does not outlive its process)."""
        self._check_open()
        with self._lock:
            pairs = list(self._links.items())
        return [link for link in (self._decode_link(k, p) for k, p in pairs) if link]

    def lru_order(self) -> list[str]:
        """Storage names, least recently used first."""
        with self._lock:
            return list(self._blobs)

    def blob_for(self, key: Hashable) -> bytes | None:
        """The stored blob of ``key`` (header + payload), for tests."""
        return self._blobs.get(storage_name(encode_key(key)))

    def set_blob(self, key: Hashable, blob: bytes) -> None:
        """Replace ``key``'s stored blob with arbitrary bytes (tests: corruption)."""
        name = storage_name(encode_key(key))
        with self._lock:
            old = self._blobs.pop(name, None)
            self._used += len(blob) - (0 if old is None else len(old))
            self._blobs[name] = blob
