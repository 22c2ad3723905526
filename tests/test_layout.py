import pytest

from kvflow.errors import ConfigError
from kvflow.layout import PRESETS, ModelSpec, preset


def test_llama3_8b_bytes():
    s = preset("llama-3-8b")
    # K and V: 16 tokens x 8 kv heads x 128 dims x 2 bytes each.
    assert [r.name for r in s.layout.roles] == ["k", "v"]
    assert s.bytes_per_layer_block == 2 * 16 * 8 * 128 * 2
    assert s.bytes_per_block == 32 * s.bytes_per_layer_block


def test_block_tokens_change_scales_bytes():
    s = preset("llama-3-70b", block_tokens=512)
    assert s.bytes_per_layer_block == 2 * 512 * 8 * 128 * 2
    assert s.bytes_per_block == 80 * s.bytes_per_layer_block


def test_mla_is_latent_only():
    s = preset("deepseek-v3")
    assert [r.name for r in s.layout.roles] == ["latent"]
    assert s.bytes_per_layer_block == 16 * (512 + 64) * 2


def test_fp8_adds_scales_and_indexer():
    s = preset("deepseek-v3.2")
    names = [r.name for r in s.layout.roles]
    assert names == ["latent", "latent_scale", "indexer"]
    assert s.layout.role("latent").bytes_per_block == 16 * 576
    assert s.layout.role("latent_scale").bytes_per_block == 16  # one fp32, padded
    assert s.layout.role("indexer").bytes_per_block == 16 * (128 + 4)


def test_fp8_mha_scales_per_head():
    s = preset("llama-3-8b", dtype="fp8")
    assert [r.name for r in s.layout.roles] == ["k", "v", "k_scale", "v_scale"]
    assert s.layout.role("k_scale").bytes_per_block == 8 * 4


def test_every_role_is_16_byte_aligned():
    for name in PRESETS:
        for bt in (1, 3, 16, 512):
            for r in preset(name, block_tokens=bt).layout.roles:
                assert r.bytes_per_block % 16 == 0, (name, bt, r)


@pytest.mark.parametrize(
    "field,value",
    [("num_layers", 0), ("block_tokens", -1), ("head_dim", 0), ("dtype", "int3"),
     ("attention", "gqa"), ("num_kv_heads", -2), ("kv_lora_rank", -1)],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        preset("llama-3-8b", **{field: value})


def test_mla_needs_rank():
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        ModelSpec("x", num_layers=2, num_kv_heads=1, head_dim=64, attention="mla")


def test_unknown_preset_lists_valid():
    with pytest.raises(ConfigError, match="llama-3-8b"):
        preset("gpt-5")
