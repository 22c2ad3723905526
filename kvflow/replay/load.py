"""Offered load against what a configuration can serve, and service targets.

A replay's latencies mean something only if the configuration keeps up with
the trace: above capacity the queue grows for as long as arrivals come and
"TTFT" is queueing time. So every report carries the offered load (requests,
prompt and output tokens arriving per second), the capacity of one instance
from the cost model (prefill tokens/s in full chunks, decode tokens/s at the
largest batch the device's KV blocks hold), the utilisation that follows
(``offered prompt / (prefill capacity * instances) + offered output / (decode
capacity * instances)``: time the instances would need per second of trace if
prefill and decode ran one after the other, with no cache reuse: an upper
bound), the measured share of time the instances computed, and a plain
verdict. With service targets (``slo_ttft_s``, ``slo_tpot_s``) it adds the
share of requests meeting both (attainment) and their rate (goodput).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from kvflow.cost import CostModel
from kvflow.engine import EngineRequest
from kvflow.layout import ModelSpec
from kvflow.manager import Capacities
from kvflow.profile import GpuProfile
from kvflow.replay.requests import numbers

#: The queue grew: the last quarter of arrivals waited this many times the first quarter's
#: mean wait for admission (and at least ``QUEUE_GROWTH_MIN_S``).
QUEUE_GROWTH = 2.0
QUEUE_GROWTH_MIN_S = 1.0
#: Utilisation ``--instances auto`` aims for (headroom for bursts).
TARGET_UTILIZATION = 0.7


def offered_rates(requests: Sequence[EngineRequest]) -> dict[str, Any]:
    """The report's ``load.offered``: totals over the trace's span (first to last arrival),
    ``n / T``, from the numbers a replay already holds.

    Not ``traces.load.offered_load`` (``kvflow trace load``), which rates per mean
    arrival gap, ``(n - 1) / T``, counts new prompt tokens from the requests' block ids
    (which a replay's requests no longer carry) and is ``inf`` for a burst at one
    instant (not JSON). Using it here would move every report's load figures by
    ``(n - 1) / n`` and its pinned digests with them."""
    n = len(requests)
    if n == 0:
        return {"requests": 0, "span_s": 0.0, "requests_per_s": None,
                "prompt_tokens_per_s": None, "output_tokens_per_s": None}
    arrivals, inputs, outputs = numbers(requests)  # (a streamed trace is not read again)
    first = min(arrivals)
    last = max(arrivals)
    span = last - first
    prompt = sum(inputs)
    output = sum(outputs)
    rate = (lambda x: x / span) if span > 0 else (lambda x: None)
    return {"requests": n, "span_s": span, "requests_per_s": rate(n),
            "prompt_tokens_per_s": rate(prompt), "output_tokens_per_s": rate(output),
            "mean_prompt_tokens": prompt / n, "mean_output_tokens": output / n}


def instance_capacity(spec: ModelSpec, profile: GpuProfile, capacities: Capacities,
                      max_batch_tokens: int, max_running: int,
                      mean_prompt: float, mean_output: float, tp: int = 1) -> dict[str, float]:
    """What one instance serves per second, by the cost model.

    Prefill: full chunks of ``max_batch_tokens`` at half the mean prompt as context.
    Decode: the largest batch that fits (``max_running``, and the device's blocks over a
    request's blocks), each at the mean prompt plus half the mean output as context.
    ``tp``: GPUs the instance spans (tensor parallelism).
    """
    cost = CostModel(spec, profile, tp)
    chunk = max(1, max_batch_tokens)
    prefill_s = cost.step_time([(chunk, int(mean_prompt / 2))], [])
    blocks_per_request = max(1, math.ceil((mean_prompt + mean_output) / spec.block_tokens))
    batch = max(1, min(max_running, capacities.device // blocks_per_request))
    context = int(mean_prompt + mean_output / 2)
    decode_s = cost.decode_step_time(batch, context * batch)
    return {"prefill_tokens_per_s": chunk / prefill_s if prefill_s > 0 else math.inf,
            "decode_tokens_per_s": batch / decode_s if decode_s > 0 else math.inf,
            "decode_batch": batch}


def predicted_utilization(offered: dict[str, Any], capacity: dict[str, float],
                          instances: int) -> float | None:
    """Instance-seconds of work per second of trace, over the instances (no cache reuse)."""
    p, o = offered.get("prompt_tokens_per_s"), offered.get("output_tokens_per_s")
    if p is None or o is None:
        return None
    return (p / capacity["prefill_tokens_per_s"] + o / capacity["decode_tokens_per_s"]) \
        / instances


def instances_for(utilization_one: float | None, target: float = TARGET_UTILIZATION) -> int:
    """The fewest instances that bring a one-instance utilisation down to ``target``."""
    if utilization_one is None or utilization_one <= target:
        return 1
    return math.ceil(utilization_one / target)


def queue_growth(waits: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Mean admission wait of the first and the last quarter of arrivals, from
    ``(arrival, wait)`` pairs (None with fewer than 8)."""
    if len(waits) < 8:
        return None
    ordered = sorted(waits)
    q = len(ordered) // 4
    first = sum(w for _, w in ordered[:q]) / q
    last = sum(w for _, w in ordered[-q:]) / q
    return first, last


def load_section(requests: Sequence[EngineRequest], spec: ModelSpec, profile: GpuProfile,
                 capacities: Capacities, max_batch_tokens: int, max_running: int,
                 instances: int, compute_busy_s: float | None = None,
                 sim_time_s: float | None = None,
                 waits: tuple[float, float] | None = None, tp: int = 1,
                 mix: Sequence[tuple[int, GpuProfile, Capacities, int]] | None = None,
                 ) -> dict[str, Any]:
    """The report's ``load`` section (see the module docstring); ``waits`` is
    ``queue_growth``'s pair, from a full replay. ``tp``: GPUs per instance.

    ``mix``: instances that differ, as ``(count, profile, capacities, tp)`` groups;
    the cluster's capacity is then the sum of theirs (``capacity_by_group``) and
    ``capacity_per_instance`` the first group's."""
    offered = offered_rates(requests)
    mean_prompt = offered.get("mean_prompt_tokens", 0.0)
    mean_output = offered.get("mean_output_tokens", 0.0)
    cap = instance_capacity(spec, profile, capacities, max_batch_tokens, max_running,
                            mean_prompt, mean_output, tp)
    util = predicted_utilization(offered, cap, instances)
    by_group = None
    if mix is not None:
        by_group = [dict(instance_capacity(spec, p, c, max_batch_tokens, max_running,
                                           mean_prompt, mean_output, t), instances=n)
                    for n, p, c, t in mix]
        total = {k: sum(g["instances"] * g[k] for g in by_group)
                 for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}
        util = predicted_utilization(offered, total, 1)
    busy = None
    if compute_busy_s is not None and sim_time_s:
        busy = compute_busy_s / (sim_time_s * instances)
    grew = waits is not None and waits[1] >= max(QUEUE_GROWTH * waits[0], QUEUE_GROWTH_MIN_S)
    overloaded = (util is not None and util > 1.0) or grew
    one = predicted_utilization(offered, cap, 1)
    out = {"offered": offered, "capacity_per_instance": cap, "instances": instances,
            "utilization_predicted": util, "compute_busy_share": busy,
            "queue_wait_first_last_s": list(waits) if waits is not None else None,
            "queue_grew": grew, "overloaded": overloaded,
            "instances_suggested": instances_for(one)}
    if by_group is not None:
        out["capacity_by_group"] = by_group
    return out


def pd_utilization(load: dict[str, Any], prefill: int, decode: int) -> dict[str, Any]:
    """Under prefill/decode disaggregation, each side's predicted utilisation (cost model,
    no cache reuse): offered prompt tokens over the P prefill instances' rate, offered
    output tokens over the D decode instances'; above 1 that side is overloaded."""
    off, cap = load["offered"], load["capacity_per_instance"]
    p, o = off.get("prompt_tokens_per_s"), off.get("output_tokens_per_s")
    if p is None or o is None:
        return {"prefill": None, "decode": None, "overloaded": None}
    up = p / (cap["prefill_tokens_per_s"] * prefill)
    ud = o / (cap["decode_tokens_per_s"] * decode)
    return {"prefill": up, "decode": ud, "overloaded": up > 1.0 or ud > 1.0}


def slo_section(ttft: Sequence[float], tpot: Iterable[float | None], rejected: int,
                span_s: float, slo_ttft_s: float | None,
                slo_tpot_s: float | None) -> dict[str, Any] | None:
    """Share of requests meeting both targets (rejected ones miss), and their rate.

    ``tpot[i]`` is None for a request that generated one token (no TPOT to miss);
    ``tpot`` is read once, beside ``ttft`` (an iterator will do).
    """
    if slo_ttft_s is None and slo_tpot_s is None:
        return None
    met = 0
    for f, p in zip(ttft, tpot, strict=True):
        if slo_ttft_s is not None and f > slo_ttft_s:
            continue
        if slo_tpot_s is not None and p is not None and p > slo_tpot_s:
            continue
        met += 1
    total = len(ttft) + rejected
    return {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s, "met": met, "requests": total,
            "attainment": met / total if total else 0.0,
            "goodput_requests_per_s": met / span_s if span_s > 0 else None}
