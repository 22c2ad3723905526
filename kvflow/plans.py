"""The manager's decisions as data: the kinds of copy, one copy (``TransferOp``), what a
request needs (``Plan``) and what a waiting one holds (``Reservation``).

Kept apart from ``kvflow.manager`` because every world, the runtime and the tests
read these without needing the manager that makes them.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum

from kvflow.radix import Node, Tier

# Enum member lookups cost ~0.1 us each on CPython 3.11; these aliases keep
# them off every request's path.
DEVICE, HOST, STORAGE = Tier.DEVICE, Tier.HOST, Tier.STORAGE

class OpKind(str, Enum):
    SWAP_IN = "swap_in"      # host (or storage) -> device, for a request about to run
    EVICT = "evict"          # device -> host copy-out of an evicted block (write_back)
    BACKUP = "backup"        # a copy down one tier of a block that stays (write_through)
    PREFETCH = "prefetch"    # storage -> host, ahead of a swap-in
    WRITE = "write"          # host -> storage copy-out of a block evicted from host
    # Prefill/decode disaggregation (kvflow.pd): one side of the op is another instance's.
    SEND = "send"            # device -> a peer: reads local device blocks for a decode instance
    RECEIVE = "receive"      # a peer -> device: writes local device blocks from a prefill instance


#: Op kinds with only one local side: SEND's destinations and RECEIVE's sources are
#: positions in the request's prompt on the peer, not blocks of this instance.
REMOTE_KINDS = frozenset({OpKind.SEND, OpKind.RECEIVE})


@dataclass(eq=False)
class TransferOp:
    """Copy ``src_ids`` on ``src_tier`` to ``dst_ids`` on ``dst_tier``, block by block."""

    op_id: int
    kind: OpKind
    src_tier: Tier
    dst_tier: Tier
    src_ids: list[int]
    dst_ids: list[int]
    keys: list[Hashable]
    nodes: list[Node] = field(repr=False, default_factory=list)
    plan: Plan | None = field(repr=False, default=None)
    # Plans that read what this op writes instead of loading it again.
    sharers: list[Plan] = field(repr=False, default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.src_ids)

    @property
    def reads_local(self) -> bool:
        """Whether ``src_ids`` are blocks of this instance (not a peer's positions)."""
        return self.kind is not OpKind.RECEIVE

    @property
    def writes_local(self) -> bool:
        """Whether ``dst_ids`` are blocks of this instance (not a peer's positions)."""
        return self.kind is not OpKind.SEND


@dataclass(eq=False)
class Plan:
    """What one request needs before and while it computes.

    ``device_ids[i]`` holds prompt block i; blocks ``[0, num_cached)`` come
    from the cache (some through ``ops``, some through loads of other plans in
    ``shared``), the rest are computed by the request (``computing`` nodes,
    plus ``private`` blocks whose key another request is computing right now).
    ``nodes`` lists the indexed blocks the plan holds, cached ones first.
    """

    request_id: Hashable
    keys: tuple[Hashable, ...]
    nodes: list[Node]
    device_ids: list[int]
    source_tiers: list[int]
    ops: list[TransferOp]
    shared: list[TransferOp]
    computing: list[Node]
    private: list[int]
    extra_ids: list[int]
    committed: bool = False
    finished: bool = False

    @property
    def num_cached(self) -> int:
        return len(self.source_tiers)

    def hits(self, tier: Tier) -> int:
        return self.source_tiers.count(tier)


@dataclass(eq=False)
class Reservation:
    """A waiting request's prefetch: its ops, and the blocks held until it is planned."""

    ops: list[TransferOp]
    nodes: list[Node]
