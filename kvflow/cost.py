"""The compute cost model: a batch's time on one GPU, as a per-layer roofline.

``CostModel`` turns a batch into time with a per-layer roofline: a layer takes
``max(weight FLOPs / (peak * mfu) + attention FLOPs / (peak * attention_mfu),
bytes / (hbm * mbu))``. Weight FLOPs are the matmuls (``2 * active_params /
num_layers`` per token), attention FLOPs ``4 * heads * head_dim`` per (query,
key) pair (QK^T and PV, 2 FLOPs per multiply-add): two rates, because GEMMs
and attention kernels reach different fractions of the peak (measured: 170-177
against 89-105 TFLOP/s on one H100 executor). Bytes are the layer's bf16
weights, read once per step, plus the KV the batch reads (and, for prefill,
writes). A step adds ``step_overhead_s`` plus ``step_overhead_per_seq_s`` per
sequence in the batch and ``step_overhead_per_prefill_s`` per prefill item: the
host's share grows with the batch it schedules. A calibrated profile may also
carry ``gemm_efficiency``, the measured GEMM efficiency by rows (few rows
stream the weights for little work), which divides the weight time.
It ignores activations and the MoE effect that a large batch touches more
than the active experts.

It is pure arithmetic over a ``GpuProfile`` (``kvflow.profile``), so it lives in
the core: the simulated world sleeps its times (``sim.executor``), calibration
(``kernels.calibrate``) fits a profile to it, and a router can predict with it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from kvflow.errors import ConfigError
from kvflow.layout import ModelSpec
from kvflow.profile import GpuProfile

__all__ = ["WEIGHT_BYTES", "CostModel", "gemm_shape"]

#: Bytes per weight: the cost model assumes bf16 weights.
WEIGHT_BYTES = 2

def gemm_shape(curve: Sequence[tuple[float, float]]) -> Callable[[float], float] | None:
    """GEMM efficiency at ``tokens`` rows relative to the curve's last point, or None.

    ``curve``: measured (tokens, fraction of peak) points. A GEMM over few rows
    streams the weights once for little work (the executor's reach 41 TFLOP/s
    at 64 rows, 177 at 8192), which one ``mfu`` cannot follow: a step's weight
    time is divided by this shape, so ``mfu`` stays the rate of large chunks.

    Between points the GEMM's *time* (tokens / efficiency) is linear in
    tokens; outside, the efficiency is the nearest point's. Time, not rate:
    below ~64 rows the time barely moves while the rate grows with the rows,
    and a rate interpolated between 1 and 8 rows would make 4 rows cheaper
    than 1 (decode batches of 2-8 then ran 8-16% faster than on the GPU).
    """
    if not curve:
        return None
    last = curve[-1][1]
    ts = [float(t) for t, _ in curve]
    times = [t / e for t, e in curve]  # seconds per unit of work, up to a constant
    ys = [e / last for _, e in curve]

    def shape(tokens: float) -> float:
        if tokens <= ts[0]:
            return ys[0]
        if tokens >= ts[-1]:
            return ys[-1]
        i = bisect.bisect_right(ts, tokens)
        f = (tokens - ts[i - 1]) / (ts[i] - ts[i - 1])
        return tokens / (times[i - 1] + f * (times[i] - times[i - 1])) / last

    return shape


class CostModel:
    """Per-layer and per-step time of a batch on one GPU (a roofline).

    ``layer_time(prefill, decode_contexts)``: ``prefill`` items are
    ``(new_tokens, context_tokens_before)``, ``decode_contexts`` the context
    length of each decoding sequence. Constants are precomputed per
    (spec, profile) because a replay calls this ~10^5-10^6 times; inputs are
    not validated on that path.
    """

    def __init__(self, spec: ModelSpec, profile: GpuProfile) -> None:
        if spec.active_params <= 0:
            raise ConfigError(
                f"model {spec.name!r}: ModelSpec.active_params must be > 0 for the cost model"
            )
        self.spec = spec
        self.profile = profile
        self.num_layers = spec.num_layers
        params = spec.active_params / spec.num_layers
        heads = spec.num_attention_heads or spec.num_kv_heads
        #: FLOPs per token of the layer's weight matmuls.
        self.weight_flops_per_token = 2.0 * params
        #: FLOPs per (query token, context token) pair of attention.
        self.attention_flops_per_pair = 4.0 * heads * spec.head_dim
        #: Bytes of the layer's weights, read once per step.
        self.weight_bytes = params * WEIGHT_BYTES
        #: KV bytes of one token in one layer (padding included).
        self.kv_bytes_per_token = spec.bytes_per_layer_block / spec.block_tokens
        attention_mfu = profile.attention_mfu or profile.mfu
        self.gemm_shape = gemm_shape(profile.gemm_efficiency)
        self._shape_cache: dict[float, float] = {}
        #: Seconds per weight-matmul token and per attention pair (FLOPs / achieved rate).
        self._sec_per_token = self.weight_flops_per_token / (profile.peak_bf16_flops * profile.mfu)
        self._sec_per_pair = self.attention_flops_per_pair / (
            profile.peak_bf16_flops * attention_mfu)
        self._sec_per_byte = 1.0 / (profile.hbm_bytes_per_s * profile.mbu)
        self._overhead = profile.step_overhead_s
        self._overhead_per_seq = profile.step_overhead_per_seq_s
        self._overhead_per_prefill = profile.step_overhead_per_prefill_s

    def layer_time_totals(self, tokens: float, attention_pairs: float, kv_tokens: float) -> float:
        """Layer time from batch totals (for callers keeping running sums).

        ``tokens``: tokens computed (new prefill tokens + one per decoding
        sequence); ``attention_pairs``: sum over prefills of ``new * (context
        + new / 2)`` plus the sum of decode contexts; ``kv_tokens``: KV tokens
        read or written (prefill ``context + new``, decode ``context``).
        """
        if tokens <= 0:
            return 0.0
        if self.gemm_shape is None:
            compute = self._sec_per_token * tokens + self._sec_per_pair * attention_pairs
        else:
            shape = self._shape_cache.get(tokens)
            if shape is None:
                shape = self._shape_cache[tokens] = self.gemm_shape(tokens)
            compute = self._sec_per_token * tokens / shape + self._sec_per_pair * attention_pairs
        memory = (self.weight_bytes + self.kv_bytes_per_token * kv_tokens) * self._sec_per_byte
        return compute if compute > memory else memory

    def layer_time(
        self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]
    ) -> float:
        """Time of one layer over the batch: the larger of its compute and memory times."""
        return self.layer_time_sums(prefill, len(decode_contexts), sum(decode_contexts))

    def layer_time_sums(self, prefill: Sequence[tuple[int, int]], decode_count: int,
                        decode_context_sum: int) -> float:
        """``layer_time`` from the decoding sequences' number and context sum, bit for bit
        (an engine keeping running sums does not list every sequence each step)."""
        tokens = decode_count
        pairs = decode_context_sum if tokens else 0
        kv = pairs
        for new, ctx in prefill:
            tokens += new
            pairs += new * (ctx + new * 0.5)
            kv += ctx + new
        return self.layer_time_totals(tokens, pairs, kv)

    def decode_step_time(self, batch: int, context_sum: int) -> float:
        """``step_time((), contexts)`` from ``len(contexts)`` and ``sum(contexts)`` alone,
        bit for bit: a run of decode steps then costs O(1) per step, not O(batch)."""
        t = self.layer_time_totals(batch, context_sum, context_sum)
        if t <= 0:
            return 0.0
        return self.num_layers * t + self._overhead + self._overhead_per_seq * batch

    def step_time(
        self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]
    ) -> float:
        """One engine step: ``num_layers * layer_time`` plus the host's share (0 if empty)."""
        return self.step_time_sums(prefill, len(decode_contexts), sum(decode_contexts))

    def step_time_sums(self, prefill: Sequence[tuple[int, int]], decode_count: int,
                       decode_context_sum: int) -> float:
        """``step_time`` from the decoding sequences' number and context sum, bit for bit."""
        t = self.layer_time_sums(prefill, decode_count, decode_context_sum)
        if t <= 0:
            return 0.0
        seqs = len(prefill) + decode_count
        return (self.num_layers * t + self._overhead + self._overhead_per_seq * seqs
                + self._overhead_per_prefill * len(prefill))
