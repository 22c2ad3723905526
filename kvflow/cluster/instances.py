"""Several engine instances behind one router: what the driver needs to run a cluster.

Each instance is the reference engine, unchanged, with its own manager (device,
host and storage tiers), runtime, backend and executor; the replay driver
(``kvflow.replay``) builds them and hands them here. ``Cluster.add`` routes an
arriving request and queues it on the chosen engine; the engines' public
hooks (``on_first_token``, ``on_finish``) and the managers' ``match`` keep the
router's exact view current. Nothing here reaches into an engine's state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from kvflow.cluster.pd import Disaggregation, parse_pd
from kvflow.cluster.router import InstanceView, Prediction, Router, make_router
from kvflow.cost import CostModel
from kvflow.engine import Engine, EngineRequest, RequestState
from kvflow.manager import CacheManager, OpKind
from kvflow.profile import GpuProfile
from kvflow.radix import FILLING, READY, Tier

_USABLE = (READY, FILLING)


def tier_hits(manager: CacheManager, keys: Sequence[Hashable],
              reads_storage: bool = True) -> tuple[int, int, int]:
    """The cached prefix of ``keys`` on ``manager``'s tiers: blocks by their best tier.

    ``reads_storage=False``: only the prefix a plan made now would reuse when it reads
    nothing from storage (best-effort admission, ``reads_storage``): it stops at the
    first block only in storage or still on its way up to host for a prefetch.
    """
    counts = [0, 0, 0]
    for node in manager.match(keys):  # each has a copy (or one landing) on some tier
        state = node.state
        t = 0 if state[0] in _USABLE else 1 if state[1] in _USABLE else 2
        if not reads_storage and (t == 2 or (t == 1 and state[1] == FILLING and (
                node.inflight[1] is None or node.inflight[1].kind is OpKind.PREFETCH))):
            break
        counts[t] += 1
    return counts[0], counts[1], counts[2]


def reads_storage(manager: CacheManager) -> bool:
    """Whether a request admitted now reads its storage hits (``Engine._admit``): not
    under best effort with a host tier, which recomputes what has not reached host
    (at a cluster's usual load a request is admitted on arrival, before any prefetch
    lands), so a router crediting those blocks to the instance credits work it redoes."""
    return not (manager.prefetch_policy.name == "best_effort"
                and manager.has_tier(Tier.HOST))


def prediction(cost: CostModel, profile: GpuProfile, max_batch_tokens: int,
               mean_context: float, batch: int) -> Prediction:
    """What the ``ttft`` router and the approximate views predict with: the cost model."""
    spec = cost.spec
    chunk = max(1, max_batch_tokens)
    per_token = cost.step_time([(chunk, int(mean_context))], []) / chunk

    def prefill_s(tokens: int, context: int) -> float:
        if tokens <= 0:
            return 0.0
        steps = math.ceil(tokens / chunk)
        return cost.step_time([(min(tokens, chunk), context)], []) * steps

    block = spec.bytes_per_block
    return Prediction(
        queue_s_per_token=per_token,
        prefill_s=prefill_s,
        h2d_s_per_block=profile.h2d.latency_s * spec.num_layers + block / profile.h2d.bandwidth_Bps,
        storage_s_per_block=(profile.storage_read.latency_s
                             + block / profile.storage_read.bandwidth_Bps),
        decode_step_s=cost.decode_step_time(max(1, batch), int(mean_context) * max(1, batch)),
    )


class Cluster:
    """The instances of a replay and the router in front of them."""

    def __init__(self, cfg: Any, setup: Any, parts: Sequence[Any],
                 lookup: Callable[[CacheManager, Sequence[Hashable], bool],
                                  tuple[int, int, int]] | None = None) -> None:
        """``lookup``: an instance's cached prefix per tier as the exact view sees it
        (default ``tier_hits``; a shared pool adds what it holds), told whether the
        instance reads storage at admission (``reads_storage``)."""
        everyone = [p.engine for p in parts]
        pd = getattr(cfg, "pd", None)
        if pd is not None:  # the router sends requests to the prefill instances only
            parts = parts[:parse_pd(pd)[0]]
        self.engines: list[Engine] = [p.engine for p in parts]
        spec = setup.spec
        requests = setup.requests
        # (a replay's Requests keeps every length: no second read of the trace)
        lengths = getattr(requests, "input_len", None)
        if lengths is None:
            lengths = [r.input_len for r in requests]
        mean_prompt = (sum(lengths) / len(requests)) if len(requests) else 0.0
        predictions: dict[tuple[int, int], Prediction] = {}

        def predict_for(profile: GpuProfile, tp: int) -> Prediction:
            key = (id(profile), tp)
            if key not in predictions:
                predictions[key] = prediction(CostModel(spec, profile, tp), profile,
                                              cfg.max_batch_tokens, mean_prompt / 2,
                                              min(cfg.max_running, 32))
            return predictions[key]

        specs = setup.instance_specs(len(parts))
        predict = predict_for(specs[0].profile, specs[0].tp)
        mixed = any(s.profile is not specs[0].profile or s.tp != specs[0].tp for s in specs)
        find = lookup or tier_hits
        bt = spec.block_tokens
        views = []
        for i, p in enumerate(parts):
            mgr: CacheManager = p.runtime.manager
            caps = mgr.capacities
            log = p.log
            own = predict_for(specs[i].profile, specs[i].tp)

            def backlog(log: Any = log, own: Prediction = own) -> tuple[float, float]:
                b = log.inflight_blocks
                return (b["h2d"] * own.h2d_s_per_block,
                        b["storage_read"] * own.storage_s_per_block)

            views.append(InstanceView(
                i, bt, caps.device + caps.host,
                lookup=lambda keys, mgr=mgr, s=reads_storage(mgr): find(mgr, keys, s),
                backlog_s=backlog,
                predict=own if mixed else None))
        self.router: Router = make_router(cfg.router, views, cfg.router_view, predict, cfg.seed)
        for i, engine in enumerate(self.engines):
            engine.on_first_token = self._first_token_hook(i, engine.on_first_token)
            engine.on_finish = self._finish_hook(i, engine.on_finish)
        #: Prefill/decode disaggregation (``kvflow.cluster.pd``), where asked for.
        self.pd: Disaggregation | None = None if pd is None else Disaggregation(
            cfg, setup, everyone, len(self.engines), self._released)

    def close(self) -> None:
        """No more arrivals (under PD, decode instances close once prefill is done)."""
        if self.pd is not None:
            self.pd.close()
            return
        for engine in self.engines:
            engine.close()

    def _released(self, i: int, st: RequestState) -> None:
        """Prefill instance ``i`` let go of ``st`` after its KV left (the exact view)."""
        self.router.finished(i, st.req, self._blocks(self.engines[i], st.req), decoded=True)

    def add(self, req: EngineRequest, now: float) -> int:
        """Route ``req`` (arriving at ``now``) and queue it there; returns the instance."""
        i = self.router.route(req, now)
        self.engines[i].add(req)
        return i

    def _blocks(self, engine: Engine, req: EngineRequest) -> int:
        return max(len(req.keys),
                   math.ceil((req.input_len + req.output_len) / engine.config.block_tokens))

    def _first_token_hook(self, i: int, then: Any) -> Any:
        engine = self.engines[i]

        def hook(st: RequestState) -> None:
            self.router.first_token(i, st.req, self._blocks(engine, st.req))
            if then is not None:
                then(st)
        return hook

    def _finish_hook(self, i: int, then: Any) -> Any:
        engine = self.engines[i]

        def hook(st: RequestState) -> None:
            self.router.finished(i, st.req, self._blocks(engine, st.req),
                                 decoded=st.first_token_s is not None)
            if then is not None:
                then(st)
        return hook

    def report(self, sim_time: float) -> dict[str, Any]:
        return self.router.stats()
