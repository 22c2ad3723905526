"""Errors kvflow raises on purpose.

One base class so callers (the CLI above all) can tell a user's mistake or an
exhausted resource from a bug, and print one line instead of a traceback.
"""

from __future__ import annotations


class KvflowError(Exception):
    """Base of every error kvflow raises deliberately."""


class ConfigError(KvflowError, ValueError):
    """A value given by the user is invalid; the message names the field."""


class PoolExhausted(KvflowError):
    """A pool has fewer free blocks than asked for; nothing was allocated."""

    def __init__(self, pool: str, wanted: int, free: int) -> None:
        super().__init__(f"pool {pool!r}: asked for {wanted} blocks, only {free} free")
        self.pool = pool
        self.wanted = wanted
        self.free = free


class InvalidBlockId(KvflowError, ValueError):
    """A block id is out of range, not allocated, or given twice."""


class NotEnoughBlocks(KvflowError):
    """A plan needs more device blocks than free plus evictable ones; nothing changed."""

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"plan needs {needed} device blocks, only {available} can be made free")
        self.needed = needed
        self.available = available


class TransferError(KvflowError):
    """A transfer failed or was cancelled; its destination blocks hold no valid data."""


class BlocksLost(TransferError):
    """A read found blocks gone from the tier it read (a store that restarted, evicted
    them on its own, or found them corrupt).

    ``keys`` (manager keys) are known to be gone from ``tier``: the runtime tells
    the manager, which drops its copies there, so they are neither matched nor
    read again and a later backup writes them anew.
    """

    def __init__(self, message: str, tier: int, keys: list[object]) -> None:
        super().__init__(message)
        self.tier = tier
        self.keys = keys
