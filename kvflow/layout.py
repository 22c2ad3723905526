"""Model shapes and the byte layout of their KV cache.

Everything that moves or sizes KV blocks — pools, kernels, the simulator's
link model, the cost model — asks this module how many bytes a block holds per
layer and per cache role, so the two worlds can never disagree about sizes.

A layer's cache is a set of *roles*, each its own buffer of
``[num_blocks, role.bytes_per_block]`` bytes:

* MHA / GQA: ``k`` and ``v``;
* MLA (DeepSeek): one ``latent`` (compressed KV plus the rope key);
* fp8 KV adds per-block float32 scales per role (``k_scale`` ...);
* a DSA indexer (DeepSeek-V3.2) adds an fp8 ``indexer`` key cache with one
  float32 scale per token.

Each role's block is padded to 16 bytes so copy kernels can use 16-byte
vector loads on every block.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import cached_property

from kvflow.errors import ConfigError

#: Bytes per element of the KV dtypes kvflow knows.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
#: Alignment of each role's block, in bytes (16-byte vector copies).
ROLE_ALIGN = 16
#: Bytes of one scale factor (float32).
SCALE_BYTES = 4


def _align(n: int) -> int:
    return -(-n // ROLE_ALIGN) * ROLE_ALIGN


@dataclass(frozen=True)
class CacheRole:
    """One buffer of one layer's KV cache."""

    name: str
    bytes_per_block: int


@dataclass(frozen=True)
class KVLayout:
    """Roles of one layer (every layer has the same) and the totals derived from them."""

    num_layers: int
    block_tokens: int
    roles: tuple[CacheRole, ...]

    @property
    def bytes_per_layer_block(self) -> int:
        """Bytes of one block in one layer, all roles together."""
        return sum(r.bytes_per_block for r in self.roles)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers and roles."""
        return self.num_layers * self.bytes_per_layer_block

    def role(self, name: str) -> CacheRole:
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(f"no cache role {name!r}; roles: {', '.join(r.name for r in self.roles)}")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a model as far as its KV cache and its compute cost go.

    ``head_dim`` is the attention head dimension used for the score and value
    products (for MLA, the absorbed form: ``kv_lora_rank + qk_rope_head_dim``).
    ``active_params`` counts parameters touched per token (MoE: active experts
    only); the cost model turns it into FLOPs.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    block_tokens: int = 16
    attention: str = "mha"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    indexer_head_dim: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    intermediate_size: int = 0
    active_params: float = 0.0

    def __post_init__(self) -> None:
        for field in ("num_layers", "block_tokens", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ModelSpec.{field} must be a positive integer, got {value!r}")
        for field in ("kv_lora_rank", "qk_rope_head_dim", "indexer_head_dim", "hidden_size",
                      "num_attention_heads", "intermediate_size", "num_kv_heads"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"ModelSpec.{field} must be an integer >= 0, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"ModelSpec.dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}"
            )
        if self.attention not in ("mha", "mla"):
            raise ConfigError(f"ModelSpec.attention must be 'mha' or 'mla', got {self.attention!r}")
        if self.attention == "mha" and self.num_kv_heads <= 0:
            raise ConfigError("ModelSpec.num_kv_heads must be positive for attention='mha'")
        if self.attention == "mla" and self.kv_lora_rank <= 0:
            raise ConfigError("ModelSpec.kv_lora_rank must be positive for attention='mla'")
        if self.active_params < 0:
            raise ConfigError(f"ModelSpec.active_params must be >= 0, got {self.active_params!r}")

    def replace(self, **changes: object) -> ModelSpec:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @cached_property
    def layout(self) -> KVLayout:
        t = self.block_tokens
        elem = DTYPE_BYTES[self.dtype]
        roles: list[CacheRole] = []
        if self.attention == "mha":
            per_role = t * self.num_kv_heads * self.head_dim * elem
            roles += [CacheRole("k", _align(per_role)), CacheRole("v", _align(per_role))]
            if self.dtype == "fp8":
                scales = _align(self.num_kv_heads * SCALE_BYTES)
                roles += [CacheRole("k_scale", scales), CacheRole("v_scale", scales)]
        else:
            width = self.kv_lora_rank + self.qk_rope_head_dim
            roles.append(CacheRole("latent", _align(t * width * elem)))
            if self.dtype == "fp8":
                roles.append(CacheRole("latent_scale", _align(SCALE_BYTES)))
        if self.indexer_head_dim:
            roles.append(CacheRole("indexer", _align(t * (self.indexer_head_dim + SCALE_BYTES))))
        return KVLayout(self.num_layers, t, tuple(roles))

    @property
    def bytes_per_layer_block(self) -> int:
        return self.layout.bytes_per_layer_block

    @property
    def bytes_per_block(self) -> int:
        return self.layout.bytes_per_block


#: Published shapes (from each model's config.json).
PRESETS: dict[str, ModelSpec] = {
    "llama-3-8b": ModelSpec(
        "llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, hidden_size=4096,
        num_attention_heads=32, intermediate_size=14336, active_params=8.03e9),
    "llama-3-70b": ModelSpec(
        "llama-3-70b", num_layers=80, num_kv_heads=8, head_dim=128, hidden_size=8192,
        num_attention_heads=64, intermediate_size=28672, active_params=70.6e9),
    "qwen2.5-7b": ModelSpec(
        "qwen2.5-7b", num_layers=28, num_kv_heads=4, head_dim=128, hidden_size=3584,
        num_attention_heads=28, intermediate_size=18944, active_params=7.62e9),
    "deepseek-v3": ModelSpec(
        "deepseek-v3", num_layers=61, num_kv_heads=1, head_dim=576, attention="mla",
        kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=7168, num_attention_heads=128,
        intermediate_size=18432, active_params=37.0e9),
    "deepseek-v3.2": ModelSpec(
        "deepseek-v3.2", num_layers=61, num_kv_heads=1, head_dim=576, attention="mla",
        kv_lora_rank=512, qk_rope_head_dim=64, indexer_head_dim=128, dtype="fp8",
        hidden_size=7168, num_attention_heads=128, intermediate_size=18432,
        active_params=37.0e9),
    # Not a published model: a 4-layer GQA model small enough to move real bytes on a
    # CPU and that the GPU executor's kernels run (head_dim 64), with its exact weight
    # count. ``kvflow serve-pd --backend cuda`` runs it by default, and the sim-vs-real
    # PD checks replay it in the simulator under the same name.
    "kvflow-tiny-hd64": ModelSpec(
        "kvflow-tiny-hd64", num_layers=4, num_kv_heads=2, head_dim=64, hidden_size=512,
        num_attention_heads=8, intermediate_size=1024, active_params=8912896.0),
}


def preset(name: str, **changes: object) -> ModelSpec:
    """A preset by name, optionally with fields changed (e.g. ``block_tokens=512``).

    ``NAME-lN`` is preset NAME cut to its first N layers (``layer_slice``): a
    model small enough to replay on one GPU with the per-layer shapes intact.
    """
    match = _SLICE.fullmatch(name)
    try:
        spec = PRESETS[match.group(1) if match else name]
    except KeyError:
        raise ConfigError(
            f"unknown model {name!r}; presets: {', '.join(sorted(PRESETS))} "
            "(NAME-lN: the first N layers of NAME)"
        ) from None
    if match:
        spec = layer_slice(spec, int(match.group(2)))
    return spec.replace(**changes) if changes else spec


_SLICE = re.compile(r"(.+)-l(\d+)")


def layer_slice(spec: ModelSpec, num_layers: int) -> ModelSpec:
    """The first ``num_layers`` layers of an MHA/GQA model, named ``NAME-lN``.

    ``active_params`` becomes exactly those layers' matmul weights (QKV, O,
    gate+up, down), nothing else: the embeddings and LM head a full model's
    count includes are not computed by a layer slice, and the cost model turns
    ``active_params / num_layers`` into per-layer FLOPs.
    """
    if spec.attention != "mha" or not (spec.hidden_size and spec.num_attention_heads
                                       and spec.intermediate_size):
        raise ConfigError(f"model {spec.name!r}: layer slices need an MHA/GQA model with "
                          "hidden_size, num_attention_heads and intermediate_size")
    if not 1 <= num_layers <= spec.num_layers:
        raise ConfigError(f"model {spec.name!r} has {spec.num_layers} layers, "
                          f"cannot slice {num_layers}")
    h, d = spec.hidden_size, spec.head_dim
    per_layer = (h * (spec.num_attention_heads + 2 * spec.num_kv_heads) * d
                 + spec.num_attention_heads * d * h + 3 * h * spec.intermediate_size)
    return spec.replace(name=f"{spec.name}-l{num_layers}", num_layers=num_layers,
                        active_params=float(per_layer * num_layers))
