"""``ModelShape``: the widths of one transformer layer that a ``ModelSpec`` implies,
checked against the limits of the compute kernels (tile sizes, head dims, GQA group).

Plain arithmetic, so the GPU executor's shape checks are tested on a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvflow.errors import ConfigError
from kvflow.layout import ModelSpec

#: Query rows per prefill attention tile and keys per key tile (the kernels' mma M / K).
TILE = 16
#: Keys per decode attention split (flash-decoding); a multiple of ``TILE``.
DECODE_SPLIT = 1024
#: GEMM tile widths: N must be a multiple of 64 and K of 32.
GEMM_N, GEMM_K = 64, 32
#: Most query heads per KV head (one warp each in the prefill kernel's CTA).
MAX_GROUP = 8
HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class ModelShape:
    """The widths of one layer, from a ``ModelSpec`` (MHA/GQA, 2-byte KV)."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    block_tokens: int

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ModelShape:
        """Check that the kernels can run ``spec``; the error names what does not fit."""
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(f"model {spec.name!r}: the GPU executor needs {what}")

        need(spec.attention == "mha", "attention='mha' (MHA or GQA)")
        need(spec.dtype in ("bf16", "fp16"), "a 2-byte KV dtype (bf16)")
        need(spec.hidden_size > 0 and spec.num_attention_heads > 0
             and spec.intermediate_size > 0,
             "hidden_size, num_attention_heads and intermediate_size")
        need(spec.head_dim in HEAD_DIMS, f"head_dim in {HEAD_DIMS}, got {spec.head_dim}")
        need(spec.num_attention_heads % spec.num_kv_heads == 0,
             "num_attention_heads to be a multiple of num_kv_heads")
        group = spec.num_attention_heads // spec.num_kv_heads
        need(group <= MAX_GROUP, f"at most {MAX_GROUP} query heads per KV head, got {group}")
        need(spec.hidden_size % GEMM_N == 0, f"hidden_size % {GEMM_N} == 0")
        need(spec.intermediate_size % GEMM_N == 0, f"intermediate_size % {GEMM_N} == 0")
        need(spec.block_tokens % TILE == 0, f"block_tokens % {TILE} == 0")
        shape = cls(spec.num_layers, spec.hidden_size, spec.num_attention_heads,
                    spec.num_kv_heads, spec.head_dim, spec.intermediate_size, spec.block_tokens)
        roles = {r.name: r.bytes_per_block for r in spec.layout.roles}
        need(set(roles) == {"k", "v"}, "K and V cache roles only")
        need(roles["k"] == shape.block_stride * 2, "unpadded K/V blocks")
        return shape

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        return self.q_dim + 2 * self.kv_dim

    @property
    def block_stride(self) -> int:
        """Elements of one block of one layer and role: [block_tokens, kv_heads, head_dim]."""
        return self.block_tokens * self.kv_dim

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def weight_shapes(self) -> dict[str, tuple[int, int]]:
        """[N, K] of each weight of a layer (the GEMMs compute x . W^T)."""
        return {"wqkv": (self.qkv_dim, self.hidden), "wo": (self.hidden, self.q_dim),
                "wgu": (2 * self.intermediate, self.hidden),
                "wd": (self.hidden, self.intermediate)}

    @property
    def params_per_layer(self) -> int:
        return sum(n * k for n, k in self.weight_shapes().values())
