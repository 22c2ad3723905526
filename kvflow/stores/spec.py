"""A block store named on the command line: ``dir:PATH`` or ``redis://...``.

``kvflow replay --backend cuda --store SPEC`` gives the GPU world a real
storage tier. The spec is checked when the replay's config is built (so a
typo fails before any trace is read) and opened when the world starts:

* ``dir:PATH`` (or ``file:PATH``): a ``LocalDirStore`` under ``PATH``,
  persistent across runs (a new run rebuilds its index from it);
* ``redis://[user[:password]@]host:port/db`` or ``rediss://`` (TLS): a
  ``RedisStore``, its blocks authenticated with the deployment key from
  ``KVFLOW_STORE_KEY_FILE`` / ``KVFLOW_STORE_KEY`` (never a command-line
  argument). A password belongs in the URL only where nobody else can read
  the command line; reports show the address redacted.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvflow.errors import ConfigError
from kvflow.stores.base import BlockStore, Namespace

#: Bytes a blob adds to its payload at most (header, layout signature, key), for capacity.
BLOB_SLACK = 1024


def parse_store(spec: str) -> tuple[str, str]:
    """``(kind, target)`` of a store spec: ``("dir", path)`` or ``("redis", url)``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"store must be 'dir:PATH' or a redis:// URL, got {spec!r}")
    spec = spec.strip()
    scheme = spec.split("://", 1)[0].lower() if "://" in spec else ""
    if scheme in ("redis", "rediss"):
        return "redis", spec
    for prefix in ("dir:", "file:"):
        if spec.startswith(prefix):
            path = spec[len(prefix):]
            if path.startswith("//"):  # file:///abs/path
                path = path[2:]
            if not path:
                break
            return "dir", path
    raise ConfigError(f"store {spec!r}: give 'dir:PATH' (a local directory) or "
                      "'redis://host:port/db' ('rediss://' for TLS)")


def describe_store(spec: str) -> str:
    """The spec as a report may show it (a Redis password redacted)."""
    kind, target = parse_store(spec)
    if kind == "dir":
        return f"dir:{target}"
    from kvflow.stores.redis_store import redact_url

    return redact_url(target)


def default_storage_bytes(spec: str) -> int | None:
    """A storage tier's default size for ``spec``: half the free space of a directory's
    file system; None for Redis (its server's memory bounds it: give the size)."""
    kind, target = parse_store(spec)
    if kind != "dir":
        return None
    path = Path(target)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize // 2


def open_store(spec: str, namespace: Namespace, blocks: int | None = None) -> BlockStore:
    """Open the store ``spec`` names for ``namespace``.

    ``blocks``: the storage tier's size; a directory store's LRU capacity is
    that many blobs (the manager decides what to keep; the directory only
    bounds itself to the same size, so it never outgrows the tier).
    """
    kind, target = parse_store(spec)
    if kind == "dir":
        from kvflow.stores.local import LocalDirStore

        capacity = None
        if blocks is not None and namespace.block_bytes is not None:
            capacity = blocks * (namespace.block_bytes + BLOB_SLACK)
        return LocalDirStore(target, namespace, capacity_bytes=capacity)
    from kvflow.stores.redis_store import RedisStore

    return RedisStore(namespace, target)


__all__ = ["default_storage_bytes", "describe_store", "open_store", "parse_store"]
