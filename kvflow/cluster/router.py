"""Routers: which instance a request goes to.

Every router sees the cluster through ``InstanceView``s, either **exactly**
(the instances' own events: prefill done, request finished, and each
instance's prefix index) or **approximately** (only its own record of what it
routed where, aged by the cost model's predictions), because real routers run
both ways: SGLang's cache-aware router keeps an approximate radix tree of
what it sent where; Dynamo's KV router takes the workers' stored/removed
events. A router never reaches into an engine; the driver feeds it events.

``round_robin`` and ``random`` (seeded) ignore the instances' state.
``least_loaded`` takes the smallest load: prefill tokens routed and not yet
prefilled, plus the blocks of requests decoding (times ``block_tokens``).
``prefix`` takes the smallest cost in the shape of Dynamo's KV router,
``cost = prefill_weight * blocks to prefill + active blocks``, where blocks to
prefill are the request's blocks minus its cached prefix on the instance,
each cached block weighted by the tier it sits on (``TIER_WEIGHTS``: a device
hit saves all of a block's prefill, a host hit most of it, a storage hit
less), plus the prefill blocks already queued there, and active blocks are
those of its decoding requests. ``ttft`` predicts each instance's time to
first token from the cost model (the Mooncake Conductor's idea): the prefill
queued ahead of the request, the load of its cached blocks from host and
storage behind whatever those links still carry, and its own prefill of the
uncached rest; it takes the smallest.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.engine import EngineRequest

ROUTERS = ("round_robin", "random", "least_loaded", "prefix", "ttft")
VIEWS = ("exact", "approx")
#: How much of a block's prefill a cached copy saves, by tier (device, host, storage).
TIER_WEIGHTS = (1.0, 0.8, 0.5)
#: Weight of prefill blocks against decode blocks in the prefix router's cost (Dynamo's
#: ``kv_overlap_score_weight``, default 1).
PREFILL_WEIGHT = 1.0


@dataclass
class Prediction:
    """Seconds a request would take on an instance, for the ``ttft`` router and approx views."""

    #: Prefill seconds per token at a full chunk (the queue's rate).
    queue_s_per_token: float
    #: Prefill seconds of ``tokens`` new tokens after ``context`` cached ones.
    prefill_s: Callable[[int, int], float]
    #: Seconds to load one block over h2d, and from storage.
    h2d_s_per_block: float
    storage_s_per_block: float
    #: Seconds of one decode step at a typical batch (approx view: when decodes end).
    decode_step_s: float


@dataclass
class InstanceView:
    """What a router knows of one instance."""

    index: int
    block_tokens: int
    #: Blocks the instance can hold (device + host): the approx view's record size.
    capacity_blocks: int
    #: Exact view: the instance's prefix lookup, ``keys -> (device, host, storage) hits``.
    lookup: Callable[[Sequence[Hashable]], tuple[int, int, int]] | None = None
    #: Exact view: seconds of transfers queued on (h2d, storage read) links now.
    backlog_s: Callable[[], tuple[float, float]] | None = None
    #: This instance's own predictions where instances differ (None: the router's).
    predict: Prediction | None = None
    pending_prefill_tokens: int = 0
    decode_blocks: int = 0
    routed: int = 0
    routed_tokens: int = 0
    # approx view: the router's own record
    seen: OrderedDict[Hashable, None] = field(default_factory=OrderedDict)
    busy_until: float = 0.0
    decoding: list[tuple[float, int]] = field(default_factory=list)  # (predicted end, blocks)


class Router:
    """Base: bookkeeping both views share. Subclasses choose (``choose``)."""

    name = "?"

    def __init__(self, views: list[InstanceView], view: str = "exact",
                 predict: Prediction | None = None, seed: int = 0) -> None:
        self.views = views
        self.exact = view == "exact"
        self.predict = predict
        self.rng = random.Random(seed)
        #: Requests routed to an instance where the router saw a cached prefix.
        self.routed_to_prefix = 0
        self._hits: dict[int, tuple[int, int, int]] = {}

    # -- the decision ----------------------------------------------------------------------
    def route(self, req: EngineRequest, now: float) -> int:
        if not self.exact:
            self._age(now)
        i = self.choose(req, now)
        v = self.views[i]
        hits = self._hits.get(i) if self._hits else None
        if hits is None:
            hits = self.hits(v, req.keys)
        if sum(hits):
            self.routed_to_prefix += 1
        self._hits = {}
        v.routed += 1
        v.routed_tokens += req.input_len
        v.pending_prefill_tokens += req.input_len
        if not self.exact:
            self._record(v, req, now, hits)
        return i

    def choose(self, req: EngineRequest, now: float) -> int:
        raise NotImplementedError

    # -- what an instance holds ----------------------------------------------------------------
    def hits(self, v: InstanceView, keys: Sequence[Hashable]) -> tuple[int, int, int]:
        """Cached prefix of ``keys`` on instance ``v``, per tier, as this view sees it."""
        if self.exact:
            return v.lookup(keys) if v.lookup is not None else (0, 0, 0)
        n = 0
        for k in keys:
            if k not in v.seen:
                break
            n += 1
        return (n, 0, 0)

    def load_tokens(self, v: InstanceView) -> float:
        return v.pending_prefill_tokens + v.decode_blocks * v.block_tokens

    # -- events (exact view) --------------------------------------------------------------------
    def first_token(self, i: int, req: EngineRequest, blocks: int) -> None:
        if self.exact:
            v = self.views[i]
            v.pending_prefill_tokens -= req.input_len
            v.decode_blocks += blocks

    def finished(self, i: int, req: EngineRequest, blocks: int, decoded: bool) -> None:
        if self.exact:
            v = self.views[i]
            if decoded:
                v.decode_blocks -= blocks
            else:  # rejected before its prefill ended
                v.pending_prefill_tokens -= req.input_len

    # -- the approximate view: the router's own record -----------------------------------------
    def _record(self, v: InstanceView, req: EngineRequest, now: float,
                hits: tuple[int, int, int]) -> None:
        seen = v.seen
        for k in req.keys:
            if k in seen:
                seen.move_to_end(k)
            else:
                seen[k] = None
        while len(seen) > v.capacity_blocks:
            seen.popitem(last=False)
        p = v.predict or self.predict
        if p is None:
            return
        cached_tokens = min(req.input_len, sum(hits) * v.block_tokens)
        start = max(now, v.busy_until)
        v.busy_until = start + p.prefill_s(req.input_len - cached_tokens, cached_tokens)
        blocks = len(req.keys) + req.output_len // v.block_tokens
        heapq.heappush(v.decoding, (v.busy_until + req.output_len * p.decode_step_s, blocks))
        v.decode_blocks += blocks

    def _age(self, now: float) -> None:
        """Approx view: what the record predicts has happened by ``now``."""
        for v in self.views:
            p = v.predict or self.predict
            if p is not None:
                left = max(0.0, v.busy_until - now)
                v.pending_prefill_tokens = int(left / p.queue_s_per_token) \
                    if p.queue_s_per_token > 0 else 0
            while v.decoding and v.decoding[0][0] <= now:
                v.decode_blocks -= heapq.heappop(v.decoding)[1]

    def stats(self) -> dict[str, Any]:
        routed = [v.routed for v in self.views]
        tokens = [v.routed_tokens for v in self.views]
        total = sum(routed)
        mean = total / len(routed) if routed else 0.0
        mean_t = sum(tokens) / len(tokens) if tokens else 0.0
        return {
            "router": self.name, "view": "exact" if self.exact else "approx",
            "routed": routed,
            "prefix_routed_share": self.routed_to_prefix / total if total else 0.0,
            "imbalance_requests": max(routed) / mean if mean else 0.0,
            "imbalance_prompt_tokens": max(tokens) / mean_t if mean_t else 0.0,
        }


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self._next = 0

    def choose(self, req: EngineRequest, now: float) -> int:
        i = self._next
        self._next = (i + 1) % len(self.views)
        return i


class RandomRouter(Router):
    name = "random"

    def choose(self, req: EngineRequest, now: float) -> int:
        return self.rng.randrange(len(self.views))


class LeastLoaded(Router):
    name = "least_loaded"

    def choose(self, req: EngineRequest, now: float) -> int:
        return min(range(len(self.views)), key=lambda i: (self.load_tokens(self.views[i]), i))


class PrefixRouter(Router):
    """Dynamo-shaped cost: ``PREFILL_WEIGHT * blocks to prefill + active decode blocks``."""

    name = "prefix"

    def choose(self, req: EngineRequest, now: float) -> int:
        n = len(req.keys)
        best, best_cost = 0, float("inf")
        for v in self.views:
            hits = self.hits(v, req.keys)
            self._hits[v.index] = hits
            saved = sum(w * h for w, h in zip(TIER_WEIGHTS, hits, strict=True))
            queued = v.pending_prefill_tokens / v.block_tokens
            cost = PREFILL_WEIGHT * (queued + n - saved) + v.decode_blocks
            if cost < best_cost:
                best, best_cost = v.index, cost
        return best


class TtftRouter(Router):
    """Predicted time to first token; needs a ``Prediction`` (the cost model's)."""

    name = "ttft"

    def predicted_ttft(self, v: InstanceView, req: EngineRequest) -> float:
        p = v.predict or self.predict
        assert p is not None
        hits = self.hits(v, req.keys)
        self._hits[v.index] = hits
        cached = min(req.input_len, sum(hits) * v.block_tokens)
        queue = v.pending_prefill_tokens * p.queue_s_per_token
        h2d_backlog, storage_backlog = (v.backlog_s() if self.exact and v.backlog_s is not None
                                        else (0.0, 0.0))
        load = 0.0
        if hits[1] or hits[2]:
            load = h2d_backlog + (hits[1] + hits[2]) * p.h2d_s_per_block
        if hits[2]:
            load = max(load, storage_backlog + hits[2] * p.storage_s_per_block)
        prefill = p.prefill_s(req.input_len - cached, cached)
        # Loads run layer by layer under the prefill: the slower of the two bounds it.
        return queue + max(prefill, load)

    def choose(self, req: EngineRequest, now: float) -> int:
        return min(range(len(self.views)),
                   key=lambda i: (self.predicted_ttft(self.views[i], req), i))


_CLASSES: dict[str, type[Router]] = {
    "round_robin": RoundRobin, "random": RandomRouter, "least_loaded": LeastLoaded,
    "prefix": PrefixRouter, "ttft": TtftRouter,
}


def make_router(name: str, views: list[InstanceView], view: str = "exact",
                predict: Prediction | None = None, seed: int = 0) -> Router:
    """The router called ``name`` over ``views`` (``ROUTERS``; ``VIEWS`` for ``view``)."""
    return _CLASSES[name](views, view, predict, seed)
