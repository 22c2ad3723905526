"""Eviction, write and prefetch policies.

An eviction policy only *orders* the blocks resident on one tier; the prefix
index decides which of them may go (unreferenced, leaf-first). Keeping the two
apart lets every policy obey the same invariants without knowing about them.

Write and prefetch policies are plain data read by the manager and runtime.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from itertools import islice
from types import ModuleType
from typing import Any, Protocol

from kvflow.arc import ARC
from kvflow.belady import Belady, FutureUses
from kvflow.cost import BlockCosts
from kvflow.errors import ConfigError
from kvflow.ranked import CostAware, LengthAware


def _load_native_core() -> ModuleType | None:
    """The compiled index core, or None where it was not built (a source checkout
    used without ``pip install``). A build that fails to load is worth a warning:
    everything still works, only slower."""
    try:
        from kvflow import _index_core
    except ModuleNotFoundError:
        return None
    except ImportError as e:
        warnings.warn(f"kvflow._index_core did not load ({e}); using the Python index core",
                      RuntimeWarning, stacklevel=2)
        return None
    return _index_core


#: ``kvflow._index_core`` where it was built, else None (see ``kvflow.radix``).
NATIVE_CORE = _load_native_core()


class EvictionPolicy(Protocol):
    """Order of eviction among the blocks resident on one tier.

    Nodes are opaque hashable objects with ``ref``, ``hits`` and ``key``
    attributes. The index calls ``insert``/``remove`` when a tier's copy
    becomes ready or goes, and ``ref``/``unref`` when a node's reference count
    leaves or returns to zero (only for tiers where its copy is ready).
    ``candidates`` may yield referenced nodes; the index skips them.

    Where ``orders_referenced`` is false, inserting a referenced node is a
    no-op (it enters the order at ``unref``), so the index may skip the call.
    ``pop_front``/``push_front`` let the index take victims in bulk where the
    policy has an O(1) order: it drops what it can and hands back the rest.
    """

    orders_referenced: bool

    def insert(self, node: Any) -> None: ...
    def remove(self, node: Any) -> None: ...
    def ref(self, node: Any) -> None: ...
    def unref(self, node: Any) -> None: ...
    def unref_all(self, nodes: list[Any]) -> None: ...
    def candidates(self) -> Iterator[Any]: ...
    def first(self) -> Any | None: ...
    def pop_front(self, k: int) -> list[Any]: ...
    def push_front(self, nodes: list[Any]) -> None: ...
    def tracked(self) -> set[Any]: ...


def _rotating_scan(order: OrderedDict[Any, None]) -> Iterator[Any]:
    """Yield nodes front to back while the caller removes the ones it takes.

    A node the caller declines (an inner node whose children are still
    cached) is moved behind them: that is where a tree-aware LRU would rank it
    anyway, and it keeps every scan linear. Each node is offered once.
    """
    for _ in range(len(order)):
        node = next(iter(order), None)
        if node is None:
            return
        yield node
        if node in order:
            order.move_to_end(node)


class LRU:
    """Least recently *released* first; referenced blocks are not in the order.

    A request releases its blocks tail-first, so a parent is always released
    after its children and the least recent block is a leaf: the front of the
    order is the victim, with no scan.
    """

    orders_referenced = False

    def __init__(self, capacity: int = 0) -> None:
        self._order: OrderedDict[Any, None] = OrderedDict()

    def insert(self, node: Any) -> None:
        if node.ref == 0:
            self._order[node] = None

    def remove(self, node: Any) -> None:
        self._order.pop(node, None)

    def ref(self, node: Any) -> None:
        del self._order[node]

    def unref(self, node: Any) -> None:
        self._order[node] = None

    def unref_all(self, nodes: list[Any]) -> None:
        order = self._order
        for node in nodes:
            order[node] = None

    def candidates(self) -> Iterator[Any]:
        return _rotating_scan(self._order)

    def first(self) -> Any | None:
        """The first candidate, in O(1)."""
        return next(iter(self._order), None)

    def pop_front(self, k: int) -> list[Any]:
        """Remove and return the first ``k`` candidates (fewer if the order is shorter)."""
        order = self._order
        # islice + del beats popitem(last=False), which is slow to call in CPython.
        nodes = list(islice(order, k))
        for node in nodes:
            del order[node]
        return nodes

    def push_front(self, nodes: list[Any]) -> None:
        """Undo ``pop_front`` for ``nodes`` (its tail, in the order it returned them)."""
        order = self._order
        for node in reversed(nodes):
            order[node] = None
            order.move_to_end(node, last=False)

    def tracked(self) -> set[Any]:
        return set(self._order)

    def __iter__(self) -> Iterator[Any]:
        """The order, front (next victim) first."""
        return iter(list(self._order))


if NATIVE_CORE is not None:

    class LinkedLRU(NATIVE_CORE.LinkedLRU):  # type: ignore[name-defined,misc]
        """``LRU`` for the native core's nodes: the same order, kept as a list linked
        through the nodes themselves (no dict), one per tier, hence ``tier``."""

        def candidates(self) -> Iterator[Any]:
            """As ``LRU.candidates``: a declined node moves behind the rest."""
            for _ in range(len(self)):
                node = self.first()
                if node is None:
                    return
                yield node
                if self.holds(node):
                    self.move_to_end(node)

else:  # a source tree without the extension: the Python orders serve
    LinkedLRU = None  # type: ignore[assignment,misc]

#: The native bucketed order, where the built extension has it (one built from an older
#: kvflow/_index_core.c does not: rebuild it; meanwhile length_aware runs in Python).
_LINKED_BUCKETS = getattr(NATIVE_CORE, "LinkedBuckets", None)
if NATIVE_CORE is not None and _LINKED_BUCKETS is None:
    warnings.warn("kvflow._index_core predates kvflow/_index_core.c (no LinkedBuckets): "
                  "rebuild it (pip install, or build_ext); length_aware runs in Python",
                  RuntimeWarning, stacklevel=1)

if _LINKED_BUCKETS is not None:

    class LinkedLengthAware(_LINKED_BUCKETS):  # type: ignore[misc,valid-type]
        """``LengthAware`` for the native core's nodes: the same order (rank
        ``hits << 20 - depth``, oldest first within one), in buckets linked through
        the nodes themselves. Python's version costs ~3.4x LRU's time in cache mode,
        a dict operation or two per block; this one keeps the policy off the
        interpreter (``benchmarks/results/policies.md``)."""

        def __new__(cls, tier: int) -> LinkedLengthAware:
            return super().__new__(cls, tier, 0)

        def candidates(self) -> Iterator[Any]:
            """As ``LengthAware.candidates``: a declined node moves behind the rest of
            its bucket."""
            for node in list(self):
                if self.holds(node):
                    yield node
                    if self.holds(node):
                        self.move_to_end(node)

    class LinkedLFU(_LINKED_BUCKETS):  # type: ignore[misc,valid-type]
        """``LFU`` for the native core's nodes: the same order (fewest hits, oldest
        first within one; ``pop_front`` from the lowest bucket only), in buckets
        linked through the nodes. Python's version costs ~2.1-2.9x LRU's time in
        cache mode (``benchmarks/results/policies.md``)."""

        def __new__(cls, tier: int) -> LinkedLFU:
            return super().__new__(cls, tier, 1)

        candidates = LinkedLengthAware.candidates
        # LFU's ref is its remove: a node not in the order is no error (C, both).
        ref = _LINKED_BUCKETS.remove

else:
    LinkedLengthAware = None  # type: ignore[assignment,misc]
    LinkedLFU = None  # type: ignore[assignment,misc]


class LFU:
    """Fewest hits first, ties by least recently released. A parent has at
    least its children's hits, so the first candidate is a leaf here too."""

    orders_referenced = False

    def __init__(self, capacity: int = 0) -> None:
        self._buckets: dict[int, OrderedDict[Any, None]] = {}
        self._freq: dict[Any, int] = {}
        self._popped_freq = 0  # the bucket ``pop_front`` last took from

    def insert(self, node: Any) -> None:
        if node.ref == 0:
            self.unref(node)

    def unref(self, node: Any) -> None:
        f = node.hits
        self._freq[node] = f
        bucket = self._buckets.get(f)
        if bucket is None:
            bucket = self._buckets[f] = OrderedDict()
        bucket[node] = None

    def remove(self, node: Any) -> None:
        f = self._freq.pop(node, None)
        if f is None:
            return
        bucket = self._buckets[f]
        del bucket[node]
        if not bucket:
            del self._buckets[f]

    ref = remove

    def unref_all(self, nodes: list[Any]) -> None:
        for node in nodes:
            self.unref(node)

    def candidates(self) -> Iterator[Any]:
        for f in sorted(self._buckets):
            bucket = self._buckets.get(f)
            if bucket:
                yield from _rotating_scan(bucket)

    def first(self) -> Any | None:
        """The first candidate, in O(distinct hit counts)."""
        if not self._buckets:
            return None
        return next(iter(self._buckets[min(self._buckets)]))

    def pop_front(self, k: int) -> list[Any]:
        """Remove and return up to ``k`` first candidates, all from the lowest bucket."""
        if not self._buckets:
            return []
        f = self._popped_freq = min(self._buckets)
        bucket = self._buckets[f]
        nodes = list(islice(bucket, k))
        freq = self._freq
        for node in nodes:
            del bucket[node], freq[node]
        if not bucket:
            del self._buckets[f]
        return nodes

    def push_front(self, nodes: list[Any]) -> None:
        """Undo the last ``pop_front`` for ``nodes`` (its tail, in its order)."""
        if not nodes:
            return
        f = self._popped_freq
        bucket = self._buckets.get(f)
        if bucket is None:
            bucket = self._buckets[f] = OrderedDict()
        for node in reversed(nodes):
            self._freq[node] = f
            bucket[node] = None
            bucket.move_to_end(node, last=False)

    def tracked(self) -> set[Any]:
        return set(self._freq)


class S3FIFO:
    """S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO (10% of the
    tier), a main FIFO with lazy promotion, and a ghost FIFO of recently
    evicted keys that sends returning blocks straight to main.

    Blocks keep their queue position while referenced (an access only bumps
    their frequency, as the algorithm wants). ``candidates`` performs the
    algorithm's queue moves as it scans; a candidate the index declines is
    rotated to its queue's tail, and once the scan meets a declined node again
    the rest are offered in plain order.
    """

    SMALL_FRACTION = 0.1
    MAX_FREQ = 3
    orders_referenced = True

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._small: OrderedDict[Any, None] = OrderedDict()
        self._main: OrderedDict[Any, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[Any, int] = {}

    def insert(self, node: Any) -> None:
        if node in self._freq:  # queued already (a ready copy marked ready again):
            self._freq[node] = 0  # it keeps its place (it went in both queues before)
            return
        self._freq[node] = 0
        if node.key in self._ghost:
            del self._ghost[node.key]
            self._main[node] = None
        else:
            self._small[node] = None

    def ref(self, node: Any) -> None:
        self._freq[node] = min(self._freq[node] + 1, self.MAX_FREQ)

    def unref(self, node: Any) -> None:
        pass

    def unref_all(self, nodes: list[Any]) -> None:
        pass

    def remove(self, node: Any) -> None:
        del self._freq[node]
        if node in self._small:
            del self._small[node]
            self._ghost[node.key] = None
            while len(self._ghost) > self.capacity:
                self._ghost.popitem(last=False)
        else:
            del self._main[node]

    def first(self) -> Any | None:
        """No O(1) answer: eviction moves queues, so callers scan ``candidates``."""
        return None

    def pop_front(self, k: int) -> list[Any]:
        """Nothing: see ``first``."""
        return []

    def push_front(self, nodes: list[Any]) -> None:
        assert not nodes, "S3FIFO.pop_front hands out no nodes"

    def tracked(self) -> set[Any]:
        return set(self._freq)

    def candidates(self) -> Iterator[Any]:
        offered: set[Any] = set()
        while self._small or self._main:
            use_small = bool(self._small) and (
                len(self._small) >= self.SMALL_FRACTION * self.capacity or not self._main
            )
            queue = self._small if use_small else self._main
            node = next(iter(queue))
            if node in offered:
                break
            freq = self._freq[node]
            if freq > 0:  # promote from small, or give a main block another round
                del queue[node]
                self._freq[node] = 0 if use_small else freq - 1
                self._main[node] = None
                continue
            offered.add(node)
            yield node
            if node in self._freq:
                queue.move_to_end(node)
        for node in [*self._small, *self._main]:
            if node not in offered:
                offered.add(node)
                yield node


_LINKED_S3FIFO = getattr(NATIVE_CORE, "LinkedS3FIFO", None)

if _LINKED_S3FIFO is not None:

    class LinkedS3FIFO(_LINKED_S3FIFO):  # type: ignore[misc,valid-type]
        """``S3FIFO`` for the native core's nodes: its two queues linked through the
        nodes, its scan an iterator in C, its ghost FIFO kept in C as S3FIFO keeps it. The
        Python class costs ~4-8x LRU's time in cache mode: every eviction runs its
        scan, one generator step per block, and each victim's ``remove`` feeds the
        ghost FIFO in Python (``benchmarks/results/policies.md``); this one gives the
        same victims in the same order (``tests/test_native_orders.py``,
        ``tests/test_index_core_equivalence.py``)."""

        def __new__(cls, tier: int, capacity: int = 0) -> LinkedS3FIFO:
            return super().__new__(cls, tier, capacity)

        @property
        def _small(self) -> list[Any]:
            return self.queue(1)

        @property
        def _main(self) -> list[Any]:
            return self.queue(2)

        @property
        def _freq(self) -> dict[Any, int]:
            return {n: self.freq(n) for q in (1, 2) for n in self.queue(q)}

else:
    LinkedS3FIFO = None  # type: ignore[assignment,misc]


#: Eviction policies by name: the online ones, then the offline optimum. Constructors
#: take the tier's capacity; ``make_eviction_policy`` gives the rest what they need.
EVICTION_POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRU,
    "lfu": LFU,
    "s3fifo": S3FIFO,
    "arc": ARC,
    "length_aware": LengthAware,
    "cost_aware": CostAware,
    "belady": Belady,
}
#: Policies that read the future: yardsticks for a replayed trace, never for deployment.
OFFLINE_POLICIES = frozenset({"belady"})
#: What ``--eviction`` takes, for help texts.
EVICTION_HELP = ("lru, lfu, s3fifo, arc, length_aware or cost_aware; belady is the offline "
                 "optimum (reads the trace's future: a yardstick, not deployable)")


def eviction_label(name: str) -> str:
    """``name`` as reports print it: the offline optimum says that it is offline."""
    return f"{name} (offline)" if name.lower() in OFFLINE_POLICIES else name


def make_eviction_policy(name: str, capacity: int, tier: int = 0, *,
                         future: FutureUses | None = None,
                         costs: BlockCosts | None = None) -> EvictionPolicy:
    """The eviction policy called ``name`` for ``tier``, a tier of ``capacity`` blocks.

    ``future``: the trace's next uses, which ``belady`` (offline) needs; ``costs``:
    what blocks cost to get back, for ``cost_aware`` (default: ``DEFAULT_COSTS``).
    """
    key = name.lower()
    factory = EVICTION_POLICIES.get(key)
    if factory is None:
        raise ConfigError(
            f"unknown eviction policy {name!r}; valid: {', '.join(EVICTION_POLICIES)}"
        )
    if key == "belady":
        return Belady(capacity, future)
    if key == "cost_aware":
        return CostAware(capacity, tier, costs)
    return factory(capacity)


WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True)
class WritePolicy:
    """When a block gets a copy on the next tier down.

    * ``write_through``: as soon as it is inserted (finish of its request);
    * ``write_through_selective``: once it has been hit ``threshold`` times;
    * ``write_back``: only when it is evicted from the tier above.
    """

    name: str = "write_through"
    threshold: int = 1

    def __post_init__(self) -> None:
        if self.name not in WRITE_POLICIES:
            raise ConfigError(
                f"unknown write policy {self.name!r}; valid: {', '.join(WRITE_POLICIES)}"
            )
        if self.threshold < 0:
            raise ConfigError(f"write policy threshold must be >= 0, got {self.threshold}")

    def backup_on_insert(self, hits: int) -> bool:
        if self.name == "write_through":
            return True
        if self.name == "write_through_selective":
            return hits >= self.threshold
        return False

    @property
    def backup_min_hits(self) -> int | None:
        """``backup_on_insert`` as a bound: a block is backed up on insert iff its hits
        are at least this (None: never). The manager's bulk paths test it in the core."""
        if self.name == "write_through":
            return 0
        if self.name == "write_through_selective":
            t = self.threshold
            if not math.isfinite(t):
                return None
            return min(math.ceil(t), sys.maxsize)
        return None

    @property
    def copy_on_evict(self) -> bool:
        return self.name == "write_back"


PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True)
class PrefetchPolicy:
    """How long a request waits for its storage -> host prefetch.

    * ``best_effort``: it uses what has arrived when it is scheduled;
    * ``wait_complete``: it waits for the whole prefetch;
    * ``timeout``: it waits until ``base_s + per_1k_tokens_s * tokens/1000``,
      capped at ``max_s``, then recomputes what is missing.
    """

    name: str = "best_effort"
    base_s: float = 0.005
    per_1k_tokens_s: float = 0.002
    max_s: float = 0.5

    def __post_init__(self) -> None:
        if self.name not in PREFETCH_POLICIES:
            raise ConfigError(
                f"unknown prefetch policy {self.name!r}; valid: {', '.join(PREFETCH_POLICIES)}"
            )
        for f in ("base_s", "per_1k_tokens_s", "max_s"):
            if getattr(self, f) < 0:
                raise ConfigError(f"prefetch policy {f} must be >= 0, got {getattr(self, f)}")

    def deadline_s(self, tokens: int) -> float | None:
        """Seconds a request of ``tokens`` prompt tokens may wait; None = no limit."""
        if self.name == "wait_complete":
            return None
        if self.name == "best_effort":
            return 0.0
        return min(self.base_s + self.per_1k_tokens_s * tokens / 1000.0, self.max_s)
