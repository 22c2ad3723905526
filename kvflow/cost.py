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
stream the weights for little work), which divides the weight time, and tile
quantisation (``gemm_row_tile``, ``attention_tile_rows``, ``attention_ctas``: a GEMM's
rows padded to its tile, prefill attention in whole waves of work items; see
``padded_rows`` and ``prefill_wave_pairs``).
It ignores activations and the MoE effect that a large batch touches more
than the active experts.

**Tensor parallelism** (``tp`` = K > 1): an instance spans K GPUs, each
holding 1/K of every layer's weights and of its attention heads and KV
(Megatron-LM's split, Shoeybi et al. 2019, "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", section 3):
every GPU computes the whole batch against its share, so a layer's roofline
time is divided by K; and each transformer layer then all-reduces its
activations twice (after the attention block's output projection and after
the MLP's second GEMM: the paper's "g" operators, two all-reduces per layer in
the forward pass), which the GPUs wait for: ``2 * allreduce_s(tokens *
hidden_size * 2 bytes)`` per layer, added to the roofline. KV heads fewer than
K (replicated in practice) are still counted as split.

``BlockCosts`` is the same model per block: what one block costs to get back onto
the device, recomputed or loaded from a lower tier (the cost-aware eviction policy,
``kvflow.ranked.CostAware``, weighs it).

It is pure arithmetic over a ``GpuProfile`` (``kvflow.profile``), so it lives in
the core: the simulated world sleeps its times (``sim.executor``), calibration
(``kernels.calibrate``) fits a profile to it, and a router can predict with it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvflow.errors import ConfigError
from kvflow.layout import ModelSpec
from kvflow.profile import GpuProfile

__all__ = ["ACTIVATION_BYTES", "WEIGHT_BYTES", "CostModel", "allreduce_s", "gemm_shape",
           "padded_rows", "prefill_wave_pairs"]

#: Bytes per weight: the cost model assumes bf16 weights.
WEIGHT_BYTES = 2
#: Bytes per activation element (bf16), what a tensor-parallel all-reduce moves.
ACTIVATION_BYTES = 2


def allreduce_s(nbytes: float, k: int, bytes_per_s: float, step_latency_s: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``k`` GPUs (0 for one GPU).

    A ring all-reduce is a reduce-scatter then an all-gather, each ``k - 1``
    steps moving ``nbytes / k`` per GPU: ``2 (k-1)/k * nbytes / bandwidth`` of
    data plus ``2 (k-1)`` step latencies (the alpha-beta cost of the ring
    algorithm, Thakur, Rabenseifner and Gropp 2005, "Optimization of
    Collective Communication Operations in MPICH"). The data term is NCCL's
    definition of bus bandwidth read backwards: nccl-tests (doc/PERFORMANCE.md)
    reports ``busbw = algbw * 2 (n-1)/n`` for all-reduce so that busbw is the
    per-GPU link speed; here ``bytes_per_s`` is that link (NVLink, one direction).
    """
    if k <= 1:
        return 0.0
    return 2 * (k - 1) / k * nbytes / bytes_per_s + 2 * (k - 1) * step_latency_s

def padded_rows(tokens: float, tile: int) -> float:
    """Rows a weight GEMM over ``tokens`` rows costs as: the next multiple of ``tile``
    past one tile (0: ``tokens``). Below one tile the measured efficiency curve
    (``gemm_shape``) already says what few rows cost; past it, a 1,056-row GEMM runs
    a ninth 128-row tile for 32 rows (measured on an H100: ~+0.1 ms a 4-layer step)."""
    if tile <= 0 or tokens <= tile:
        return tokens
    return -(-tokens // tile) * tile


def prefill_wave_pairs(prefill: Sequence[tuple[int, int]], heads: int, rows: int,
                       ctas: int) -> float:
    """Attention pairs of a step's prefill items as a tiled kernel spends them.

    The kernel runs one CTA per (work item of ``rows`` query rows, query head),
    ``ctas`` at once; a step of more items than fill the GPU costs whole waves
    (on an H100, 1,056 new tokens at 3k context make 288 CTAs of 128 rows for
    264 slots: two waves, +0.8 ms a 4-layer step over 1,024 tokens, where the
    pair count grows 3%), and a step of few items costs at least its longest
    item (causal: the last rows see the most keys). Returns the plain pair
    count ``sum(new * (ctx + new / 2))`` times ``max(ceil(C / ctas) * ctas / C,
    ctas * longest / (heads * pairs))`` for C = heads x items; ~1 for large
    steps, so attention's rate is still fitted on them.
    """
    pairs = 0.0
    items = 0
    longest = 0.0
    for new, ctx in prefill:
        if new <= 0:
            continue
        pairs += new * (ctx + new * 0.5)
        items += -(-new // rows)
        r = min(new, rows)
        w = r * (ctx + new - r * 0.5)
        if w > longest:
            longest = w
    if not items:
        return pairs
    c = heads * items
    return pairs * max(-(-c // ctas) * ctas / c, ctas * longest / (heads * pairs))


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


#: Steps of a decode run summed one by one before the rest go vectorised (``decode_run``).
_DECODE_HEAD = 32


class CostModel:
    """Per-layer and per-step time of a batch on one GPU (a roofline).

    ``layer_time(prefill, decode_contexts)``: ``prefill`` items are
    ``(new_tokens, context_tokens_before)``, ``decode_contexts`` the context
    length of each decoding sequence. Constants are precomputed per
    (spec, profile) because a replay calls this ~10^5-10^6 times; inputs are
    not validated on that path. ``tp``: GPUs the instance spans (tensor
    parallelism, see the module docstring); 1 computes exactly what it did before
    tensor parallelism existed, bit for bit.
    """

    def __init__(self, spec: ModelSpec, profile: GpuProfile, tp: int = 1) -> None:
        if spec.active_params <= 0:
            raise ConfigError(
                f"model {spec.name!r}: ModelSpec.active_params must be > 0 for the cost model"
            )
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor parallelism must be an integer >= 1, got {tp!r}")
        hidden = spec.hidden_size or spec.num_attention_heads * spec.head_dim
        if tp > 1 and hidden <= 0:
            raise ConfigError(f"model {spec.name!r}: tensor parallelism needs its hidden size "
                              "(ModelSpec.hidden_size) for the all-reduces")
        self.spec = spec
        self.profile = profile
        self.tp = tp
        #: Seconds of a layer's two all-reduces: fixed part, and per token computed.
        self.allreduce_fixed_s = 2 * allreduce_s(0.0, tp, profile.nvlink_bytes_per_s,
                                                 profile.nvlink_latency_s)
        self.allreduce_s_per_token = 2 * (
            allreduce_s(hidden * ACTIVATION_BYTES, tp, profile.nvlink_bytes_per_s, 0.0))
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
        #: Tile quantisation (profile keys; 0 = off): GEMM row tile, and prefill attention
        #: work items of ``_attn_rows`` rows, ``_attn_ctas`` at once, over the query heads
        #: one GPU holds.
        self._gemm_tile = int(profile.gemm_row_tile)
        self._attn_rows = int(profile.attention_tile_rows)
        self._attn_ctas = int(profile.attention_ctas)
        self._attn_waves = self._attn_rows > 0 and self._attn_ctas > 0
        self._heads_per_gpu = max(1, heads // tp)

    def layer_time_totals(self, tokens: float, attention_pairs: float, kv_tokens: float) -> float:
        """Layer time from batch totals (for callers keeping running sums).

        ``tokens``: tokens computed (new prefill tokens + one per decoding
        sequence); ``attention_pairs``: sum over prefills of ``new * (context
        + new / 2)`` plus the sum of decode contexts; ``kv_tokens``: KV tokens
        read or written (prefill ``context + new``, decode ``context``).
        """
        if tokens <= 0:
            return 0.0
        rows = padded_rows(tokens, self._gemm_tile) if self._gemm_tile else tokens
        if self.gemm_shape is None:
            compute = self._sec_per_token * rows + self._sec_per_pair * attention_pairs
        else:
            shape = self._shape_cache.get(rows)
            if shape is None:
                shape = self._shape_cache[rows] = self.gemm_shape(rows)
            compute = self._sec_per_token * rows / shape + self._sec_per_pair * attention_pairs
        memory = (self.weight_bytes + self.kv_bytes_per_token * kv_tokens) * self._sec_per_byte
        t = compute if compute > memory else memory
        if self.tp == 1:
            return t
        return t / self.tp + self.allreduce_fixed_s + self.allreduce_s_per_token * tokens

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
        if self._attn_waves and prefill:
            pairs += prefill_wave_pairs(prefill, self._heads_per_gpu, self._attn_rows,
                                        self._attn_ctas) - sum(
                new * (ctx + new * 0.5) for new, ctx in prefill)
        return self.layer_time_totals(tokens, pairs, kv)

    def decode_step_time(self, batch: int, context_sum: int) -> float:
        """``step_time((), contexts)`` from ``len(contexts)`` and ``sum(contexts)`` alone,
        bit for bit: a run of decode steps then costs O(1) per step, not O(batch)."""
        t = self.layer_time_totals(batch, context_sum, context_sum)
        if t <= 0:
            return 0.0
        return self.num_layers * t + self._overhead + self._overhead_per_seq * batch

    def decode_run(self, batch: int, context_sum: int, max_steps: int,
                   budget: float | None) -> tuple[int, float]:
        """Up to ``max_steps`` decode steps of ``batch`` sequences whose contexts start at
        ``context_sum`` and grow by one token a step: how many run, stopping after the
        step whose running total of ``decode_step_time`` reaches ``budget`` (None: no
        bound), and that total.

        Bit for bit the step-by-step sum (a replay's decode runs are a fifth of its
        CPU when each step is a Python call): each step's time is the same IEEE
        operations in the same order, vectorised over a chunk of steps, and the
        running total is a sequential ``cumsum`` (``np.add.accumulate``, not a pairwise
        sum) carried from chunk to chunk.
        """
        # Most runs are short (a single instance's average ~16 steps): numpy's per-call
        # cost beats the Python loop only past a few dozen steps, so those go first.
        head = max_steps if batch <= 0 else min(max_steps, _DECODE_HEAD)
        ran, total = self._decode_run_steps(batch, context_sum, head, budget)
        if ran == max_steps or (budget is not None and total >= budget):
            return ran, total
        tokens = batch
        if self.gemm_shape is None:
            weights = self._sec_per_token * tokens
        else:
            shape = self._shape_cache.get(tokens)
            if shape is None:
                shape = self._shape_cache[tokens] = self.gemm_shape(tokens)
            weights = self._sec_per_token * tokens / shape
        chunk = 64
        while ran < max_steps:
            k = min(chunk, max_steps - ran)
            ctx = (np.arange(k, dtype=np.float64) * batch + (context_sum + ran * batch))
            if context_sum + (ran + k) * batch >= 2 ** 53:  # floats no longer exact ints
                r, t0 = self._decode_run_steps(batch, context_sum + ran * batch,
                                               max_steps - ran, budget, total)
                return ran + r, t0
            compute = weights + self._sec_per_pair * ctx
            memory = (self.weight_bytes + self.kv_bytes_per_token * ctx) * self._sec_per_byte
            t = np.where(compute > memory, compute, memory)
            if self.tp != 1:
                t = t / self.tp + self.allreduce_fixed_s + self.allreduce_s_per_token * tokens
            if not (t > 0).all():
                r, t2 = self._decode_run_steps(batch, context_sum + ran * batch,
                                               max_steps - ran, budget, total)
                return ran + r, t2
            step = self.num_layers * t + self._overhead + self._overhead_per_seq * batch
            step[0] = total + step[0]
            sums = np.cumsum(step)
            if budget is not None and sums[-1] >= budget:
                i = int(np.argmax(sums >= budget))
                return ran + i + 1, float(sums[i])
            ran += k
            total = float(sums[-1])
            chunk = min(chunk * 2, 4096)
        return ran, total

    def _decode_run_steps(self, batch: int, context_sum: int, max_steps: int,
                          budget: float | None, total: float = 0.0) -> tuple[int, float]:
        """``decode_run`` one Python step at a time (its reference, and its fallback)."""
        ran = 0
        if batch > 0 and self.tp == 1:
            # ``decode_step_time`` with what does not change over the run (the batch,
            # so the weights' compute) taken out of the loop: the same operations on
            # the same values, in the same order, without two calls a step.
            rows = padded_rows(batch, self._gemm_tile) if self._gemm_tile else batch
            if self.gemm_shape is None:
                weights = self._sec_per_token * rows
            else:
                shape = self._shape_cache.get(rows)
                if shape is None:
                    shape = self._shape_cache[rows] = self.gemm_shape(rows)
                weights = self._sec_per_token * rows / shape
            per_pair, base = self._sec_per_pair, self.weight_bytes
            per_kv, per_byte = self.kv_bytes_per_token, self._sec_per_byte
            layers, fixed, per_seq = self.num_layers, self._overhead, self._overhead_per_seq * batch
            while ran < max_steps:
                compute = weights + per_pair * context_sum
                memory = (base + per_kv * context_sum) * per_byte
                t = compute if compute > memory else memory
                total += 0.0 if t <= 0 else layers * t + fixed + per_seq
                ran += 1
                if budget is not None and total >= budget:
                    break
                context_sum += batch
            return ran, total
        step_time = self.decode_step_time
        while ran < max_steps:
            total += step_time(batch, context_sum)
            ran += 1
            if budget is not None and total >= budget:
                break
            context_sum += batch  # every context grows by the token just decoded
        return ran, total

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


@dataclass(frozen=True)
class BlockCosts:
    """What it costs to get one block back onto the device, by route.

    ``recompute_s + recompute_per_depth_s * depth``: a prefill of the block
    after ``depth`` cached blocks (weight GEMMs, plus attention over the prefix
    that grows with it); ``load_s[t]``: reading it from tier ``t`` into the
    device (``load_s[0]`` is 0); ``block_bytes``: what it occupies.
    """

    recompute_s: float
    recompute_per_depth_s: float
    load_s: tuple[float, float, float]
    block_bytes: int = 1

    def __post_init__(self) -> None:
        values = (self.recompute_s, self.recompute_per_depth_s, *self.load_s)
        if len(self.load_s) != 3 or any(not v >= 0 for v in values):
            raise ConfigError(f"BlockCosts: times must be 3 loads and all >= 0, got {self}")
        if self.block_bytes <= 0:
            raise ConfigError(f"BlockCosts.block_bytes must be > 0, got {self.block_bytes}")

    @classmethod
    def from_spec(cls, spec: ModelSpec, *, flops: float = 989.4e12 * 0.5,
                  attention_flops: float | None = None, host_Bps: float = 55e9,
                  storage_Bps: float = 6e9) -> BlockCosts:
        """Costs from a model's shape and a machine's rates: a compute-bound
        prefill (``2 * active_params`` FLOPs per token, ``4 * heads * head_dim`` per
        (query, key) pair and layer) and loads at link bandwidth, storage staged
        through host. The defaults are the simulator's ``h100`` preset (dense bf16
        peak at 0.5 MFU, 55 GB/s PCIe, a 6 GB/s NVMe read); a replay passes its own."""
        bt = spec.block_tokens
        heads = spec.num_attention_heads or spec.num_kv_heads
        per_pair = 4.0 * heads * spec.head_dim * spec.num_layers
        attn = attention_flops or flops
        base = (2.0 * spec.active_params * bt) / flops + per_pair * bt * bt * 0.5 / attn
        per_depth = per_pair * bt * bt / attn
        nbytes = spec.bytes_per_block
        host = nbytes / host_Bps
        return cls(base, per_depth, (0.0, host, host + nbytes / storage_Bps), nbytes)

    @classmethod
    def from_profile(cls, spec: ModelSpec, profile: GpuProfile) -> BlockCosts:
        """Costs under a replay's cost model and links (``kvflow.cost.CostModel`` on a
        ``kvflow.profile.GpuProfile``): a prefill of the block alone, after 0 and
        after 1 cached block (the model is linear in depth past that), and one unit
        over the host -> device link (storage: the read, then that)."""
        cm = CostModel(spec, profile)
        bt = spec.block_tokens
        at0 = spec.num_layers * cm.layer_time([(bt, 0)], [])
        at1 = spec.num_layers * cm.layer_time([(bt, bt)], [])
        nbytes = spec.bytes_per_block
        host = profile.h2d.unit_time(nbytes)
        storage = profile.storage_read.unit_time(nbytes) + host
        return cls(at0, max(at1 - at0, 0.0), (0.0, host, storage), nbytes)

    def recompute(self, depth: int) -> float:
        return self.recompute_s + self.recompute_per_depth_s * depth


#: Costs of a 512-token block of Llama-3-8B on the h100 preset: the cost-aware
#: eviction policy's default where nobody passes a cost model (tests, benchmarks).
DEFAULT_COSTS = BlockCosts.from_spec(
    ModelSpec("llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=512,
              hidden_size=4096, num_attention_heads=32, intermediate_size=14336,
              active_params=8.03e9))
