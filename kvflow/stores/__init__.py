"""Block stores: the storage tier (local directory, Redis, memory) behind one interface.

Every store keeps whole blocks keyed by block hash inside a :class:`Namespace`
(model + layout signature + tenant salt), each as a checksummed blob; every
failure is a miss (or a ``False`` put), counted in ``stats``, never wrong data.
``AsyncStore`` runs a store's calls on a bounded thread pool as asyncio
awaitables with deadlines. See ``README.md`` in this directory for the format.

``redis`` is an optional extra: ``RedisStore`` imports it when constructed.
"""

from kvflow.stores.aio import AsyncStats, AsyncStore, StoreDeadlineError
from kvflow.stores.base import (
    FORMAT_VERSION,
    MAGIC,
    BlockSizeError,
    BlockStore,
    MissingDependencyError,
    Namespace,
    StoreClosedError,
    StoreStats,
    decode_blob,
    decode_key,
    encode_blob,
    encode_key,
    layout_signature,
)
from kvflow.stores.local import LocalDirStore
from kvflow.stores.memory import MemoryStore
from kvflow.stores.redis_store import RedisStore

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "AsyncStats",
    "AsyncStore",
    "BlockSizeError",
    "BlockStore",
    "LocalDirStore",
    "MemoryStore",
    "MissingDependencyError",
    "Namespace",
    "RedisStore",
    "StoreClosedError",
    "StoreDeadlineError",
    "StoreStats",
    "decode_blob",
    "decode_key",
    "encode_blob",
    "encode_key",
    "layout_signature",
]
