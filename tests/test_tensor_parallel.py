"""Tensor parallelism (``tp`` = K): the cost model's split and all-reduces, the device tier
and the PCIe links of an instance spanning K GPUs."""

from __future__ import annotations

import pytest

from kvflow.cost import ACTIVATION_BYTES, CostModel, allreduce_s
from kvflow.errors import ConfigError
from kvflow.layout import preset
from kvflow.profile import load_profile, tensor_parallel_links
from kvflow.replay import ReplayConfig, run_replay
from kvflow.world import GPU_MEMORY_UTILIZATION, default_device_blocks, weight_bytes

SPEC = preset("llama-3-8b")
H100 = load_profile("h100")


def test_allreduce_is_the_ring_formula():
    assert allreduce_s(1e9, 1, 450e9, 1e-6) == 0.0
    for k in (2, 4, 8):
        want = 2 * (k - 1) / k * 1e9 / 450e9 + 2 * (k - 1) * 1e-6
        assert allreduce_s(1e9, k, 450e9, 1e-6) == pytest.approx(want, rel=1e-15)
    # Bus bandwidth (nccl-tests): algbw * 2(k-1)/k equals the link when latency is nil.
    k, n = 8, 3e9
    algbw = n / allreduce_s(n, k, 450e9, 0.0)
    assert algbw * 2 * (k - 1) / k == pytest.approx(450e9)


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("batch", [([(8192, 0)], []), ([(512, 3000)], [4000] * 16),
                                   ([], [1000] * 64)])
def test_layer_time_is_the_split_roofline_plus_two_allreduces(k, batch):
    one = CostModel(SPEC, H100)
    tp = CostModel(SPEC, H100, k)
    prefill, decode = batch
    tokens = sum(n for n, _ in prefill) + len(decode)
    ar = allreduce_s(tokens * SPEC.hidden_size * ACTIVATION_BYTES, k,
                     H100.nvlink_bytes_per_s, H100.nvlink_latency_s)
    assert tp.layer_time(prefill, decode) == pytest.approx(
        one.layer_time(prefill, decode) / k + 2 * ar, rel=1e-12)
    # Decode steps from totals agree with step_time, bit for bit, as for one GPU.
    if not prefill:
        assert tp.decode_step_time(len(decode), sum(decode)) == tp.step_time([], decode)


def test_tp_one_is_the_plain_cost_model():
    for batch in (([(8192, 0)], []), ([(100, 7)], [5, 9])):
        assert CostModel(SPEC, H100, 1).step_time(*batch) == CostModel(SPEC, H100).step_time(
            *batch)


def test_cost_model_tp_errors():
    with pytest.raises(ConfigError, match="integer >= 1"):
        CostModel(SPEC, H100, 0)
    from dataclasses import replace

    bare = replace(SPEC, hidden_size=0, num_attention_heads=0)
    with pytest.raises(ConfigError, match="hidden size"):
        CostModel(bare, H100, 2)
    CostModel(bare, H100, 1)  # one GPU needs no all-reduce


def test_device_tier_and_links_of_k_gpus():
    one = default_device_blocks(SPEC, H100)
    two = default_device_blocks(SPEC, H100, 2)
    assert two == int((2 * H100.memory_bytes * GPU_MEMORY_UTILIZATION - weight_bytes(SPEC))
                      // SPEC.bytes_per_block)
    assert two > 2 * one  # the weights are held once between them
    assert tensor_parallel_links(H100, 1) is H100
    links = tensor_parallel_links(H100, 4)
    assert links.h2d.bandwidth_Bps == 4 * H100.h2d.bandwidth_Bps
    assert links.d2h.bandwidth_Bps == 4 * H100.d2h.bandwidth_Bps
    assert links.h2d.latency_s == H100.h2d.latency_s
    assert links.storage_read == H100.storage_read and links.memory_bytes == H100.memory_bytes


def test_replay_with_tp():
    base = run_replay(ReplayConfig(limit=60))
    tp2 = run_replay(ReplayConfig(limit=60, tp=2))
    assert tp2["config"]["device_blocks"] == default_device_blocks(
        preset("llama-3-8b", block_tokens=512), H100, 2)
    assert tp2["ttft_s"]["mean"] < base["ttft_s"]["mean"]
    assert tp2["load"]["capacity_per_instance"]["prefill_tokens_per_s"] > \
        base["load"]["capacity_per_instance"]["prefill_tokens_per_s"]


@pytest.mark.parametrize("kw, msg", [
    ({"tp": 0}, "tp must be an integer >= 1"),
    ({"tp": True}, "tp must be an integer >= 1"),
    ({"tp": 2, "backend": "cuda"}, "simulated world only"),
])
def test_tp_config_errors(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        ReplayConfig(**kw)
