"""GPU profiles (presets, TOML overrides, errors) and the roofline cost model."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.cost import CostModel, gemm_shape
from kvflow.errors import ConfigError
from kvflow.layout import ModelSpec, preset
from kvflow.profile import PROFILES, load_profile
from sim.hierarchy import Hierarchy, Link

H100 = PROFILES["h100"]
LLAMA8B = preset("llama-3-8b")  # 32 layers, 32 heads x 128, 8 kv heads, 8.03e9 params


# ------------------------------------------------------------- hand-checked
def test_prefill_llama8b_h100_is_compute_bound() -> None:
    cm = CostModel(LLAMA8B, H100)
    # Per layer: 8.03e9 / 32 = 250,937,500 params.
    #   weights: 2 * 250,937,500 * 1024 tokens        = 513,920,000,000 FLOPs
    #   attention: 4 * 32 * 128 * 1024 * (0 + 1024/2) =   8,589,934,592 FLOPs
    #   at 989.4e12 * 0.5 = 494.7e12 FLOP/s -> 522,509,934,592 / 494.7e12 s
    #   bytes: 501,875,000 (bf16 weights) + 1024 * 4096 (KV) = 506,069,304
    #   at 3.35e12 B/s -> 1.51e-4 s, so compute wins.
    expected = 522_509_934_592 / 494.7e12
    assert expected == pytest.approx(1.056216e-3, rel=1e-6)
    assert cm.layer_time([(1024, 0)], []) == pytest.approx(expected, rel=1e-12)
    assert cm.step_time([(1024, 0)], []) == pytest.approx(32 * expected + 0.5e-3, rel=1e-12)


def test_decode_llama8b_h100_is_memory_bound() -> None:
    cm = CostModel(LLAMA8B, H100)
    ctx = [4096] * 64
    # FLOPs: 2 * 250,937,500 * 64 + 4 * 32 * 128 * 64 * 4096 = 36,414,967,296 -> 7.36e-5 s
    # bytes: 501,875,000 + 4096 B/token * 64 * 4096 tokens = 1,575,616,824 -> 4.70e-4 s
    expected = 1_575_616_824 / 3.35e12
    assert expected > 36_414_967_296 / 494.7e12  # memory bound
    assert cm.layer_time([], ctx) == pytest.approx(expected, rel=1e-12)
    assert cm.step_time([], ctx) == pytest.approx(32 * expected + 0.5e-3, rel=1e-12)


def test_mixed_batch_with_cached_prefix() -> None:
    cm = CostModel(LLAMA8B, H100)
    # prefill 256 new tokens after 2048 cached + two decodes at 1000 and 3000
    tokens = 256 + 2
    pairs = 256 * (2048 + 128) + 1000 + 3000
    kv = (2048 + 256) + 1000 + 3000
    flops = 2 * 250_937_500 * tokens + 4 * 32 * 128 * pairs
    nbytes = 501_875_000 + 4096 * kv
    expected = max(flops / 494.7e12, nbytes / 3.35e12)
    assert cm.layer_time([(256, 2048)], [1000, 3000]) == pytest.approx(expected, rel=1e-12)
    assert cm.layer_time_totals(tokens, pairs, kv) == pytest.approx(expected, rel=1e-12)


def test_attention_at_its_own_rate_and_host_share_per_sequence() -> None:
    """Calibrated profiles split the compute rate and grow the step's host share with the batch."""
    prof = replace(H100, attention_mfu=0.125, step_overhead_per_seq_s=20e-6,
                   step_overhead_per_prefill_s=0.3e-3)
    cm = CostModel(LLAMA8B, prof)
    # prefill 1024 at 2048 cached: weights at 0.5 of the peak, attention at 0.125
    weights = 2 * 250_937_500 * 1024 / (989.4e12 * 0.5)
    attention = 4 * 32 * 128 * 1024 * (2048 + 512) / (989.4e12 * 0.125)
    assert cm.layer_time([(1024, 2048)], []) == pytest.approx(weights + attention, rel=1e-12)
    # the same batch with attention at mfu's rate costs less, by exactly the ratio
    plain = CostModel(LLAMA8B, H100).layer_time([(1024, 2048)], [])
    assert plain == pytest.approx(weights + attention / 4, rel=1e-12)
    # host share: fixed + per sequence (one prefill + three decodes = 4)
    step = cm.step_time([(1024, 2048)], [10, 20, 30])
    layer = cm.layer_time([(1024, 2048)], [10, 20, 30])
    assert step == pytest.approx(32 * layer + 0.5e-3 + 4 * 20e-6 + 0.3e-3, rel=1e-12)
    decode_only = cm.step_time([], [10, 20, 30])
    assert decode_only == pytest.approx(32 * cm.layer_time([], [10, 20, 30]) + 0.5e-3
                                        + 3 * 20e-6, rel=1e-12)
    assert cm.step_time([], []) == 0.0
    with pytest.raises(ConfigError, match=r"GpuProfile\.attention_mfu"):
        replace(H100, attention_mfu=1.5)
    with pytest.raises(ConfigError, match=r"GpuProfile\.step_overhead_per_seq_s"):
        replace(H100, step_overhead_per_seq_s=-1e-6)


def test_cached_prefix_makes_prefill_slower_than_without() -> None:
    cm = CostModel(LLAMA8B, H100)
    assert cm.layer_time([(512, 8192)], []) > cm.layer_time([(512, 0)], [])


def test_empty_batch_costs_nothing() -> None:
    cm = CostModel(LLAMA8B, H100)
    assert cm.layer_time([], []) == 0.0 and cm.step_time([], []) == 0.0


def test_profiles_scale_as_their_datasheets() -> None:
    """Memory-bound decode scales with HBM bandwidth; compute-bound prefill with FLOP/s."""
    dec = [4096] * 64
    h100, h200, a100 = (CostModel(LLAMA8B, PROFILES[n]) for n in ("h100", "h200", "a100"))
    assert h100.layer_time([], dec) / h200.layer_time([], dec) == pytest.approx(4.8 / 3.35)
    assert a100.layer_time([(4096, 0)], []) / h100.layer_time([(4096, 0)], []) == (
        pytest.approx(989.4 / 312))


def test_mla_model_and_mbu() -> None:
    spec = preset("deepseek-v3")
    cm = CostModel(spec, H100)
    # one latent of 512 + 64 bf16 values per token per layer
    assert cm.kv_bytes_per_token == 576 * 2
    slow = CostModel(spec, replace(H100, mbu=0.5))
    assert slow.layer_time([], [8192] * 32) == pytest.approx(2 * cm.layer_time([], [8192] * 32))


def test_spec_without_params_is_refused() -> None:
    spec = ModelSpec("bare", num_layers=2, num_kv_heads=1, head_dim=64)
    with pytest.raises(ConfigError, match="active_params"):
        CostModel(spec, H100)


# ----------------------------------------------------------------- presets
def test_preset_numbers() -> None:
    assert H100.peak_bf16_flops == 989.4e12 and H100.hbm_bytes_per_s == 3.35e12
    assert H100.h2d == H100.d2h == Link(55e9, 3e-6)
    h200 = PROFILES["h200"]
    assert h200.peak_bf16_flops == H100.peak_bf16_flops and h200.hbm_bytes_per_s == 4.8e12
    assert h200.memory_bytes == 141e9
    a100 = PROFILES["a100"]
    assert a100.peak_bf16_flops == 312e12 and a100.hbm_bytes_per_s == 2.039e12
    assert a100.h2d.bandwidth_Bps == 25e9
    assert H100.storage_read == Link(6e9, 100e-6, overlap_latency=True)
    assert H100.storage_write == Link(3e9, 100e-6, overlap_latency=True)
    assert load_profile("h200") is h200


def test_profile_validates_its_fields() -> None:
    with pytest.raises(ConfigError, match=r"GpuProfile\.mfu"):
        replace(H100, mfu=0.0)
    with pytest.raises(ConfigError, match=r"GpuProfile\.h2d"):
        replace(H100, h2d=55e9)


def test_unknown_profile_name() -> None:
    with pytest.raises(ConfigError, match=r"unknown GPU profile 'b200'.*a100, h100, h200"):
        load_profile("b200")


# -------------------------------------------------------------------- TOML
def write(tmp_path: Path, text: str, name: str = "mygpu.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_toml_overrides_a_base(tmp_path: Path) -> None:
    p = write(tmp_path, """
base = "h200"
mfu = 0.4
step_overhead_s = 0
memory_bytes = 100000000000
[h2d]
bandwidth_Bps = 50e9
[storage_read]
bandwidth_Bps = 12e9
latency_s = 20e-6
""")
    prof = load_profile(str(p))
    h200 = PROFILES["h200"]
    assert prof.name == "mygpu" and prof.mfu == 0.4 and prof.step_overhead_s == 0.0
    assert prof.memory_bytes == 1e11
    assert prof.hbm_bytes_per_s == h200.hbm_bytes_per_s
    assert prof.h2d == Link(50e9, h200.h2d.latency_s)  # latency kept from the base
    assert prof.d2h == h200.d2h
    assert prof.storage_read == Link(12e9, 20e-6, overlap_latency=True)
    assert Hierarchy.default(str(p)).h2d.bandwidth_Bps == 50e9
    assert load_profile(p) == prof  # a Path works too


def test_shipped_example_profile_loads() -> None:
    path = Path(__file__).resolve().parents[1] / "sim" / "profiles" / "h100-example.toml"
    prof = load_profile(str(path))
    assert prof.name == "h100-example"
    assert {k: v for k, v in prof.__dict__.items() if k != "name"} == (
        {k: v for k, v in H100.__dict__.items() if k != "name"})


@pytest.mark.parametrize(("text", "match"), [
    ("mfu = 1.5", r"key 'mfu' must be in \(0, 1\]"),
    ("mfu = 'high'", "key 'mfu' must be a finite number"),
    ("peak_bf16_flops = -1.0", "key 'peak_bf16_flops' must be > 0"),
    ("step_overhead_s = -1e-3", "key 'step_overhead_s' must be >= 0"),
    ("hbm_bytes_per_s = true", "key 'hbm_bytes_per_s' must be a finite number"),
    ("hbm_bytes_per_s = inf", "key 'hbm_bytes_per_s' must be a finite number"),
    ("name = 3", "key 'name' must be a non-empty string"),
    ("tflops = 3", "unknown key 'tflops'"),
    ("base = 'b200'", "key 'base': unknown preset 'b200'"),
    ("[h2d]\nspeed = 1e9", r"unknown key 'h2d\.speed'"),
    ("[h2d]\nbandwidth_Bps = 0", r"key 'h2d\.bandwidth_Bps' must be a finite number > 0"),
    ("[d2h]\nlatency_s = -1", r"key 'd2h\.latency_s' must be a finite number >= 0"),
    ("[storage_read]\noverlap_latency = 1", r"key 'storage_read\.overlap_latency'"),
    ("h2d = 5", "key 'h2d' must be a table"),
    ("mfu = = 2", "not valid TOML"),
])
def test_bad_toml_names_file_and_key(tmp_path: Path, text: str, match: str) -> None:
    p = write(tmp_path, text, "bad.toml")
    with pytest.raises(ConfigError, match=match) as info:
        load_profile(str(p))
    assert str(p) in str(info.value)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 200_000), min_size=1, max_size=64), st.integers(0, 50))
def test_decode_step_time_from_sums_is_bit_identical(contexts: list[int], steps: int) -> None:
    """The fast-forward of decode steps keeps running sums; it must charge exactly
    what step_time over the full context list charges, step after step."""
    prof = replace(H100, attention_mfu=0.2, step_overhead_per_seq_s=13e-6,
                   step_overhead_per_prefill_s=0.3e-3)
    for profile in (H100, prof):
        cm = CostModel(LLAMA8B, profile)
        ctx = list(contexts)
        for _ in range(steps + 1):
            assert cm.decode_step_time(len(ctx), sum(ctx)) == cm.step_time((), ctx)
            ctx = [c + 1 for c in ctx]
    assert CostModel(LLAMA8B, H100).decode_step_time(0, 0) == 0.0


CALIBRATED = Path(__file__).resolve().parents[1] / "sim/profiles/h100-calibrated.toml"


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(0, 300), context_sum=st.integers(0, 10**8),
       max_steps=st.integers(0, 9000),
       budget=st.none() | st.floats(-1.0, 200.0, allow_nan=False),
       tp=st.sampled_from([1, 2, 8]), calibrated=st.booleans(),
       model=st.sampled_from(["llama-3-8b", "llama-3-70b"]))
def test_decode_run_is_the_step_by_step_sum_bit_for_bit(
        batch: int, context_sum: int, max_steps: int, budget: float | None, tp: int,
        calibrated: bool, model: str) -> None:
    """A run of decode steps (the simulated executor's fast-forward) is vectorised
    over chunks; it must stop at the same step with the same total, to the bit, as
    summing ``decode_step_time`` one step at a time (the replay digests pin it too)."""
    profile = load_profile(str(CALIBRATED)) if calibrated else H100
    cm = CostModel(preset(model), profile, tp)
    assert cm.decode_run(batch, context_sum, max_steps, budget) == \
        cm._decode_run_steps(batch, context_sum, max_steps, budget)


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(0, 300), context_sum=st.integers(0, 10**8),
       max_steps=st.integers(0, 300),
       budget=st.none() | st.floats(-1.0, 20.0, allow_nan=False),
       tp=st.sampled_from([1, 2]), calibrated=st.booleans(),
       model=st.sampled_from(["llama-3-8b", "llama-3-70b"]))
def test_decode_run_steps_is_decode_step_time_summed(
        batch: int, context_sum: int, max_steps: int, budget: float | None, tp: int,
        calibrated: bool, model: str) -> None:
    """The step-at-a-time run (decode_run's first steps and its fallback) keeps the
    batch's part of the step time out of its loop; each step must still add exactly
    ``decode_step_time``, and the run stop at the same step."""
    profile = load_profile(str(CALIBRATED)) if calibrated else H100
    cm = CostModel(preset(model), profile, tp)
    ran, total, ctx = 0, 0.0, context_sum
    while ran < max_steps:
        total += cm.decode_step_time(batch, ctx)
        ran += 1
        if budget is not None and total >= budget:
            break
        ctx += batch
    assert cm._decode_run_steps(batch, context_sum, max_steps, budget) == (ran, total)


def test_gemm_efficiency_curve_shapes_the_weight_time(tmp_path: Path) -> None:
    """A calibrated profile's measured GEMM efficiency by rows divides the weight time:
    few rows run far below the rate of a full chunk, which ``mfu`` keeps."""
    curve = ((1.0, 0.001), (64.0, 0.04), (512.0, 0.16), (8192.0, 0.18))
    shape = gemm_shape(curve)
    assert shape is not None and gemm_shape(()) is None
    assert shape(8192) == 1.0 and shape(100_000) == 1.0      # past the last point: its rate
    assert shape(1) == shape(0.5) == pytest.approx(0.001 / 0.18)  # before the first: its rate
    # between points the GEMM's time is linear in rows: 2048 is a fifth of the way
    # from 512 rows (3,200 row-units of time) to 8192 (45,511)
    time_2048 = 512 / 0.16 + (2048 - 512) / (8192 - 512) * (8192 / 0.18 - 512 / 0.16)
    assert shape(2048) == pytest.approx(2048 / time_2048 / 0.18)
    prof = replace(H100, gemm_efficiency=curve)
    cm, plain = CostModel(LLAMA8B, prof), CostModel(LLAMA8B, H100)
    assert cm.layer_time([(8192, 0)], []) == plain.layer_time([(8192, 0)], [])
    weights = 2 * 250_937_500 * 512 / (989.4e12 * 0.5)
    attention = 4 * 32 * 128 * 512 * 256 / (989.4e12 * 0.5)
    assert cm.layer_time([(512, 0)], []) == pytest.approx(weights / (0.16 / 0.18) + attention)
    # a one-sequence decode: its GEMM at 0.1% of the peak outlasts reading the weights
    gemm1 = 2 * 250_937_500 / (989.4e12 * 0.5) / (0.001 / 0.18)
    attn1 = 4 * 32 * 128 * 1000 / (989.4e12 * 0.5)
    memory1 = (501_875_000 + 4096 * 1000) / 3.35e12
    assert gemm1 + attn1 > memory1 == pytest.approx(plain.layer_time([], [1000]), rel=1e-12)
    assert cm.layer_time([], [1000]) == pytest.approx(gemm1 + attn1, rel=1e-12)
    p = write(tmp_path, 'gemm_efficiency = [[1, 0.001], [64, 0.04], [512, 0.16], [8192, 0.18]]')
    assert load_profile(p).gemm_efficiency == curve
    for bad in ("[[64, 0.04], [1, 0.001]]", "[[1, 1.5]]", "[1, 2]", "0.5"):
        with pytest.raises(ConfigError, match=r"gemm_efficiency.*tokens increasing"):
            load_profile(write(tmp_path, f"gemm_efficiency = {bad}", "bad.toml"))


def test_gemm_time_between_measured_rows_never_drops_below_fewer_rows() -> None:
    """A GEMM over a few rows streams its weights in about the same time whatever the
    rows (its rate grows with them), so 2-7 rows take what 1 and 8 take. Interpolating
    the rate in log(rows) instead charged 2-7 rows up to ~30% less time than 1 row:
    decode batches of 2-8 came out 8-16% faster than the GPU ran them
    (``benchmarks/step_residuals.py``)."""
    curve = ((1.0, 0.001), (8.0, 0.008), (64.0, 0.04), (512.0, 0.16), (8192.0, 0.18))
    shape = gemm_shape(curve)
    assert shape is not None

    def time(rows: float) -> float:
        return rows / shape(rows)

    for rows in range(2, 8):
        assert time(rows) == pytest.approx(time(1))
    rows = [0.5, 1, 1.5, *range(2, 70), 100, 300, 511, 512, 513, 4000, 8192, 10_000]
    times = [time(r) for r in rows]
    assert all(a <= b * (1 + 1e-12) for a, b in itertools.pairwise(times))
    cm = CostModel(LLAMA8B, replace(H100, gemm_efficiency=curve))
    one = cm.step_time((), [4096])
    assert all(cm.step_time((), [4096] * b) >= one for b in range(2, 9))
