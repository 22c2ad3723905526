"""The per-op link model (``sim.hierarchy`` over ``sim.links``) against the per-unit one it
replaced (``tests/hierarchy_reference.py``, one simpy event per layer): random workloads
of submits, ``after`` chains, cancels and injected failures, with and without the PCIe
duplex share, must give every op the same landing times, end, error and report order,
and every link the same metrics, bit for bit.

Sinks of both kinds are checked: one told every layer, and a ``lazy_layers`` one (the
runtime's) that asks for some layers and reads the rest from the handle.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from hierarchy_reference import RefBackend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.layout import ModelSpec
from kvflow.manager import OpKind, TransferOp
from kvflow.profile import Link
from kvflow.radix import Tier
from sim.hierarchy import Hierarchy, SimBackend
from sim.loop import run_sim

SPEC = ModelSpec("t", num_layers=6, num_kv_heads=8, head_dim=128, block_tokens=256)
ROUTES = [(Tier.HOST, Tier.DEVICE), (Tier.DEVICE, Tier.HOST), (Tier.STORAGE, Tier.HOST),
          (Tier.HOST, Tier.STORAGE), (Tier.STORAGE, Tier.DEVICE), (Tier.DEVICE, Tier.STORAGE)]


def hierarchy(duplex: float, same_pcie: bool) -> Hierarchy:
    # Dyadic numbers make coinciding times (ties) common; "same_pcie" makes the two PCIe
    # directions identical, the structural tie a default profile has.
    h2d = Link(2.0**30, 2.0**-14)
    d2h = h2d if same_pcie else Link(3 * 2.0**28, 2.0**-13)
    return Hierarchy(h2d, d2h, Link(2.0**29, 2.0**-10, True), Link(2.0**28, 2.0**-10, True),
                     duplex)


class EagerSink:
    def __init__(self, log: list[Any], i: int, env: Any) -> None:
        self.log, self.i, self.env = log, i, env

    def layer_done(self, layer: int) -> None:
        self.log.append((self.i, layer, self.env.now))

    def done(self, error: BaseException | None = None) -> None:
        self.log.append((self.i, "done", self.env.now, None if error is None else str(error)))


class LazySink(EagerSink):
    lazy_layers = True

    def __init__(self, log: list[Any], i: int, env: Any) -> None:
        super().__init__(log, i, env)
        self.handle: Any = None

    def done(self, error: BaseException | None = None) -> None:
        h = self.handle
        self.log.append((self.i, "landed", h.land_times, h.layers_reported()))
        super().done(error)


step = st.tuples(
    st.sampled_from([0.0, 0.0, 2.0**-12, 2.0**-10, 3 * 2.0**-11, 1e-4, 7e-4]),  # delay first
    st.sampled_from(["submit", "submit", "submit", "cancel", "watch", "metrics"]),
    st.integers(0, len(ROUTES) - 1),
    st.integers(1, 3),                                     # blocks
    st.lists(st.integers(0, 30), max_size=2),              # after (earlier ops, by offset)
    st.sampled_from([None, None, None, None, 0, 1, 3]),    # injected failure
    st.integers(0, 5),                                     # layer to watch
)


def run(backend_cls: type, hier: Hierarchy, steps: list[Any], lazy: bool) -> list[Any]:
    log: list[Any] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        env = loop.env  # type: ignore[attr-defined]
        fails: dict[int, int | None] = {}
        be = backend_cls(env, SPEC, hier, fail=lambda op: fails[op.op_id])
        handles: list[Any] = []
        for delay, action, route, blocks, after, fail, layer in steps:
            if delay:
                await asyncio.sleep(delay)
            if action == "submit" or not handles:
                i = len(handles)
                src, dst = ROUTES[route]
                ids = list(range(blocks))
                op = TransferOp(i, OpKind.SWAP_IN, src, dst, ids, ids, [])
                fails[i] = fail
                sink = (LazySink if lazy and backend_cls is SimBackend else EagerSink)(
                    log, i, env)
                deps = sorted({handles[i - 1 - a] for a in after if a < i}, key=handles.index)
                h = be.submit(op, sink, deps)
                sink.handle = h
                handles.append(h)
            elif action == "cancel":
                be.cancel(handles[layer * 7 % len(handles)])
            elif action == "watch" and lazy and backend_cls is SimBackend:
                if handles[-1].layers_reported() <= layer:  # as the runtime asks
                    handles[-1].watch(layer)
            elif action == "metrics":
                log.append(("metrics", env.now, be.metrics()))
        while be.inflight:
            await asyncio.sleep(1e-3)
        await asyncio.sleep(1e-3)  # reports of ops that ended last
        log.append(("metrics", env.now, be.metrics()))
        for i, h in enumerate(handles):
            log.append((i, "final", h.land_times, h.finished_at, h.first_unit, h.cancelled))

    run_sim(main())
    return log


def per_op(log: list[Any]) -> tuple[dict[int, list[Any]], list[Any]]:
    """Each op's own reports in order, and the metrics read along the way.

    Reports of different ops at one instant may come in another order than the
    per-unit model's (``sim.links``: simultaneous events); each op's own, its
    times, and every figure must not.
    """
    ops: dict[int, list[Any]] = {}
    metrics = []
    for e in log:
        if e[0] == "metrics":
            metrics.append(e)
        else:
            ops.setdefault(e[0], []).append(e[1:])
    return ops, metrics


@settings(max_examples=int(os.environ.get("KVFLOW_EQUIV_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=1, max_size=40),
       duplex=st.sampled_from([1.0, 0.5, 0.75]), same_pcie=st.booleans())
def test_per_op_model_matches_the_per_unit_model(steps: list[Any], duplex: float,
                                                 same_pcie: bool) -> None:
    hier = hierarchy(duplex, same_pcie)
    ref_ops, ref_metrics = per_op(run(RefBackend, hier, steps, lazy=False))
    ops, metrics = per_op(run(SimBackend, hier, steps, lazy=False))
    assert ops == ref_ops
    assert metrics == ref_metrics
    lazy_ops, lazy_metrics = per_op(run(SimBackend, hier, steps, lazy=True))
    assert lazy_metrics == ref_metrics
    for i, ref in ref_ops.items():
        reported = [e for e in ref if isinstance(e[0], int)]
        got = lazy_ops[i]
        # told only the layers it watched (each at its time), then what the handle says
        told = [e for e in got if isinstance(e[0], int)]
        assert all(e in reported for e in told), (i, told, reported)
        (landed,) = [e for e in got if e[0] == "landed"]
        assert landed[2] == len(reported), (i, landed, reported)
        assert [e for e in got if e[0] in ("done", "final")] == \
            [e for e in ref if e[0] in ("done", "final")]
