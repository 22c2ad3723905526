"""Rebuild a prefix index from what a persistent store holds: a new process's warm start.

A storage tier outlives the process that filled it (a local directory, a
Redis server), but the manager's prefix index does not: a fresh engine would
treat every block in the store as absent, recompute it, and only then find
(``StoreBackend``'s ``contains_many`` check) that the write was unneeded.
``rediscover`` closes that gap at start:

1. the store lists the links ``StoreBackend`` recorded as it wrote blocks
   (``BlockStore.links``: each block's key and its parent's, in the store's
   own key space and namespace, so another model, layout or tenant lists
   nothing of ours);
2. ``contains_many`` keeps those whose block is still there (a directory's
   in-memory index, a Redis ``EXISTS``), and the store forgets the rest;
3. the links are put in prefix order (parents first; a block whose parent
   is not held cannot be matched, so it and its descendants are left out) and
   handed to ``CacheManager.found`` as ready storage copies, up to the storage
   tier's size.

Nothing is read or verified here: checksums (and Redis MACs) are checked
lazily, when a request reads a block, and a block that fails then is a miss
like any other — counted by the store (``corrupt`` / ``forged``), the load
fails, the request recomputes, and the manager drops the copy
(``StoreMissError``). Never wrong data.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass
from typing import Any

from kvflow.manager import CacheManager
from kvflow.radix import Tier
from kvflow.stores.base import BlockStore


def manager_key(key: int | bytes | str) -> Hashable:
    """The manager key of a store key: ``kvflow.store_backend.store_key`` inverted.

    ``store_key`` writes a tuple key (a replay's ``(tenant, hash)``) as
    ``"t" + repr(key)``; such a string becomes the tuple again. Every other
    key is the same in both spaces.
    """
    if isinstance(key, str) and key.startswith("t("):
        try:
            value = ast.literal_eval(key[1:])
        except (ValueError, SyntaxError):
            return key
        if isinstance(value, tuple):
            return value
    return key


@dataclass
class Rediscovered:
    """What a rebuild found: links listed, blocks present, entries the index took."""

    listed: int = 0
    present: int = 0
    orphans: int = 0
    indexed: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def prefix_order(links: dict[Hashable, Hashable | None]) -> tuple[list[tuple[Hashable, Any]], int]:
    """``(key, parent)`` pairs, every parent before its children, starting from roots
    (blocks without a parent); and how many blocks hang under a parent not in
    ``links`` (orphans, left out with their descendants)."""
    children: dict[Hashable, list[Hashable]] = {}
    roots: list[Hashable] = []
    for key, parent in links.items():
        if parent is None:
            roots.append(key)
        else:
            children.setdefault(parent, []).append(key)
    out: list[tuple[Hashable, Any]] = []
    stack = [(k, None) for k in reversed(roots)]
    while stack:
        key, parent = stack.pop()
        out.append((key, parent))
        stack.extend((c, key) for c in reversed(children.get(key, ())))
    return out, len(links) - len(out)


def rediscover(manager: CacheManager, store: BlockStore,
               to_manager: Callable[[Any], Hashable] = manager_key) -> Rediscovered:
    """Record the blocks ``store`` holds as ready storage copies in ``manager``'s index.

    Call it once, at start, before the first request (it makes room in the
    storage pool by eviction where the store holds more than the tier's size,
    which an empty index never needs). A store that keeps no links, or is
    down, lists nothing and the run starts cold.
    """
    out = Rediscovered()
    if not manager.has_tier(Tier.STORAGE):
        return out
    listed = store.links()
    out.listed = len(listed)
    if not listed:
        return out
    keys = [k for k, _ in listed]
    held = store.contains_many(keys)
    gone = [k for k, ok in zip(keys, held, strict=True) if not ok]
    if gone:
        store.forget_links(gone)
    links = {to_manager(k): (None if p is None else to_manager(p))
             for (k, p), ok in zip(listed, held, strict=True) if ok}
    out.present = len(links)
    ordered, out.orphans = prefix_order(links)
    out.indexed = manager.found(Tier.STORAGE, ordered)
    return out


__all__ = ["Rediscovered", "manager_key", "prefix_order", "rediscover"]
