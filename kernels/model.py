"""The GPU executor's model without the GPU: shapes, tokens, step metadata, a numpy reference.

The real-data executor (``kernels.compute.GpuExecutor``) runs a transformer
layer over paged KV: RMSNorm, a fused QKV projection, K/V written into each
token's slot of the request's blocks, attention over the blocks read through
the request's block table, an output projection and a gated MLP, each with a
residual. Everything here is pure numpy and shared with it, so that what is
not GPU code is tested on a CPU:

* ``ModelShape`` — the widths a ``ModelSpec`` implies, with the kernels' limits;
* ``prompt_tokens`` — token ids derived from block keys. Traces carry block
  keys (Mooncake hash ids) and lengths, not always tokens; deriving a block's
  tokens from its key makes "same key" mean "same content", which is what the
  cache assumes, and makes wrong or stale KV give different numbers;
* ``build_step`` / ``pack_step`` — one step's metadata (tokens, positions, KV
  slots, attention work items, block tables, rows to emit), exactly what the
  kernels read;
* ``NumpyModel`` — the same math in float64 from that metadata: the reference
  the GPU tests compare against, and (with ``NumpyBackend``/``NumpyExecutor``)
  a CPU world with real data, to check the executor's bookkeeping end to end;
* ``PagedExecutorBase`` — engine batch -> step items, outputs per request.

The shape, the tokens and the step metadata live in ``kernels.model_shape``,
``kernels.tokens`` and ``kernels.step_plan`` and are re-exported here; this module
holds the numpy reference, the executors' shared bookkeeping and the CPU world.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from kernels.model_shape import (  # noqa: F401 (re-exported)
    DECODE_SPLIT,
    GEMM_K,
    GEMM_N,
    HEAD_DIMS,
    MAX_GROUP,
    TILE,
    ModelShape,
)
from kernels.step_plan import (  # noqa: F401 (re-exported)
    PACKED_FIELDS,
    StepItem,
    StepPlan,
    build_step,
    pack_step,
    packed_size,
)
from kernels.tokens import SMALL_TOKEN_RANGE, embed, key_int, prompt_tokens  # noqa: F401
from kvflow.errors import ConfigError, TransferError
from kvflow.manager import TransferOp
from kvflow.radix import Tier


# --------------------------------------------------------------------- numpy reference
def _rms(h: np.ndarray) -> np.ndarray:
    return h / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + 1e-6)


def random_weights(shape: ModelShape, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """float64 weights, N(0, 1/K), one dict per layer (the CPU world's; the GPU draws its own)."""
    rng = np.random.default_rng(seed)
    return [{name: rng.standard_normal((n, k)) / math.sqrt(k)
             for name, (n, k) in shape.weight_shapes().items()}
            for _ in range(shape.num_layers)]


class NumpyModel:
    """The kernels' math in float64, reading a ``StepPlan`` and flat per-layer KV arrays."""

    def __init__(self, shape: ModelShape, weights: list[dict[str, np.ndarray]]) -> None:
        if len(weights) != shape.num_layers:
            raise ValueError(f"{len(weights)} layers of weights for {shape.num_layers} layers")
        self.shape = shape
        self.weights = weights

    def forward(self, plan: StepPlan, kcache: Sequence[np.ndarray],
                vcache: Sequence[np.ndarray]) -> np.ndarray:
        """Run the step; writes K/V into the caches; returns the emitted rows' y (float64)."""
        s = self.shape
        T = plan.num_tokens
        if T == 0:
            return np.zeros((0, s.hidden))
        h = embed(plan.tokens, plan.positions, s.hidden).astype(np.float64)
        cols = np.arange(s.kv_dim)
        kvidx = plan.slots[:, None] + cols[None, :]
        for layer, w in enumerate(self.weights):
            kc, vc = kcache[layer], vcache[layer]
            qkv = _rms(h) @ w["wqkv"].T
            kc[kvidx] = qkv[:, s.q_dim:s.q_dim + s.kv_dim]
            vc[kvidx] = qkv[:, s.q_dim + s.kv_dim:]
            o = np.zeros((T, s.q_dim))
            self._prefill(plan, qkv, kc, vc, o)
            self._decode(plan, qkv, kc, vc, o)
            h = h + o @ w["wo"].T
            gu = _rms(h) @ w["wgu"].T
            g, u = gu[:, :s.intermediate], gu[:, s.intermediate:]
            h = h + (g / (1.0 + np.exp(-g)) * u) @ w["wd"].T
        return _rms(h[plan.emit_rows])

    def _keys(self, plan: StepPlan, cache: np.ndarray, toff: int, k0: int, k1: int,
              kvh: int) -> np.ndarray:
        s = self.shape
        kp = np.arange(k0, k1)
        slot = plan.tables[toff + kp // s.block_tokens].astype(np.int64) * s.block_stride + (
            kp % s.block_tokens) * s.kv_dim + kvh * s.head_dim
        return cache[slot[:, None] + np.arange(s.head_dim)[None, :]]

    def _prefill(self, plan: StepPlan, qkv: np.ndarray, kc: np.ndarray, vc: np.ndarray,
                 o: np.ndarray) -> None:
        s = self.shape
        hd = s.head_dim
        for row0, nrows, qpos0, toff in plan.prefill_work.tolist():
            last = qpos0 + nrows - 1
            mask = np.arange(last + 1)[None, :] > (qpos0 + np.arange(nrows))[:, None]
            for kvh in range(s.kv_heads):
                K = self._keys(plan, kc, toff, 0, last + 1, kvh)
                V = self._keys(plan, vc, toff, 0, last + 1, kvh)
                for h in range(kvh * s.group, (kvh + 1) * s.group):
                    q = qkv[row0:row0 + nrows, h * hd:(h + 1) * hd]
                    sc = np.where(mask, -np.inf, q @ K.T * s.softmax_scale)
                    p = np.exp(sc - sc.max(axis=1, keepdims=True))
                    o[row0:row0 + nrows, h * hd:(h + 1) * hd] = (p @ V) / p.sum(axis=1,
                                                                               keepdims=True)

    def _decode(self, plan: StepPlan, qkv: np.ndarray, kc: np.ndarray, vc: np.ndarray,
                o: np.ndarray) -> None:
        s = self.shape
        hd = s.head_dim
        if not len(plan.combine):
            return
        parts: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for row, k0, k1, toff, pidx in plan.decode_work.tolist():
            q = qkv[row, :s.q_dim].reshape(s.heads, hd)
            ms, ls, os_ = np.empty(s.heads), np.empty(s.heads), np.empty((s.heads, hd))
            for kvh in range(s.kv_heads):
                K = self._keys(plan, kc, toff, k0, k1, kvh)
                V = self._keys(plan, vc, toff, k0, k1, kvh)
                hs = slice(kvh * s.group, (kvh + 1) * s.group)
                sc = q[hs] @ K.T * s.softmax_scale
                m = sc.max(axis=1)
                p = np.exp(sc - m[:, None])
                ms[hs], ls[hs], os_[hs] = m, p.sum(axis=1), p @ V
            parts[pidx] = (ms, ls, os_)
        for row, p0, ns in plan.combine.tolist():
            ms = np.stack([parts[p0 + i][0] for i in range(ns)])
            ls = np.stack([parts[p0 + i][1] for i in range(ns)])
            os_ = np.stack([parts[p0 + i][2] for i in range(ns)])
            w = np.exp(ms - ms.max(axis=0, keepdims=True))
            num = (w[:, :, None] * os_).sum(axis=0)
            o[row] = (num / (w * ls).sum(axis=0)[:, None]).reshape(-1)


# ---------------------------------------------------------------- executor bookkeeping
class PagedExecutorBase:
    """What the real-data executors share: an engine batch as step items, outputs per request.

    ``outputs[request_id]`` lists ``(token, checksum)`` per sampled token, in
    order: the first from the step completing the prompt, then one per decode
    step. The next decode step feeds the last token back in.
    """

    def __init__(self, shape: ModelShape, decode_split: int = DECODE_SPLIT) -> None:
        self.shape = shape
        self.decode_split = decode_split
        self.outputs: dict[Hashable, list[tuple[int, int]]] = {}
        self._last: dict[Hashable, int] = {}
        self._tables: dict[int, tuple[Any, np.ndarray]] = {}

    def items_for(self, batch: Any) -> list[StepItem]:
        """Step items of an engine ``StepBatch`` (needs its ``requests``)."""
        reqs = getattr(batch, "requests", None)
        nd = len(batch.decode)
        if reqs is None or len(reqs) != nd + len(batch.prefill):
            raise ConfigError("this executor computes real data and needs StepBatch.requests "
                              "(the request of each decode and prefill item)")
        bt = self.shape.block_tokens
        items: list[StepItem] = []
        for st, ctx in zip(reqs[:nd], batch.decode, strict=True):
            rid = st.req.request_id
            tok = self._last.get(rid)
            if tok is None:
                raise RuntimeError(f"request {rid!r} decodes before its first token")
            items.append(StepItem(rid, True, np.array([tok], dtype=np.int32), ctx - 1,
                                  self._table(st), True))
        for st, (n, ctx) in zip(reqs[nd:], batch.prefill, strict=True):
            req = st.req
            ctx = max(ctx, 0)
            items.append(StepItem(req.request_id, False,
                                  prompt_tokens(req.keys, req.request_id, bt, ctx, ctx + n),
                                  ctx, self._table(st), ctx + n >= req.input_len))
        return items

    def _table(self, st: Any) -> np.ndarray:
        plan = st.plan
        hit = self._tables.get(id(plan))
        if hit is not None and hit[0] is plan:
            return hit[1]
        if len(self._tables) > 4096:
            self._tables = {k: v for k, v in self._tables.items() if not v[0].finished}
        arr = np.asarray(plan.device_ids + plan.extra_ids, dtype=np.int32)
        self._tables[id(plan)] = (plan, arr)
        return arr

    def record(self, ids: Sequence[Hashable], tokens: Sequence[int],
               sums: Sequence[int]) -> None:
        for rid, tok, s in zip(ids, tokens, sums, strict=True):
            self.outputs.setdefault(rid, []).append((int(tok), int(s)))
            self._last[rid] = int(tok)


# --------------------------------------------------------------------- the CPU world
class NumpyBackend:
    """A ``TransferBackend`` over numpy KV pools: copies at submit, reports on the next tick.

    Device and host pools are flat float64 arrays per layer and role (``[k, v]``),
    ``block_stride`` elements a block. ``fail(op)`` true: the op writes garbage
    into its destination and fails (a failed load must never be read as data).
    """

    def __init__(self, shape: ModelShape, device_blocks: int, host_blocks: int,
                 fail: Callable[[TransferOp], bool] | None = None) -> None:
        self.shape = shape
        self.num_layers = shape.num_layers
        n = shape.block_stride
        self.pools = {
            Tier.DEVICE: [[np.full(device_blocks * n, np.nan) for _ in range(2)]
                          for _ in range(shape.num_layers)],
            Tier.HOST: [[np.full(max(host_blocks, 1) * n, np.nan) for _ in range(2)]
                        for _ in range(shape.num_layers)],
        }
        self.fail = fail
        self.ops = 0

    @property
    def kcache(self) -> list[np.ndarray]:
        return [lay[0] for lay in self.pools[Tier.DEVICE]]

    @property
    def vcache(self) -> list[np.ndarray]:
        return [lay[1] for lay in self.pools[Tier.DEVICE]]

    def submit(self, op: TransferOp, sink: Any, after: Sequence[object] = ()) -> object:
        src, dst = self.pools[Tier(op.src_tier)], self.pools[Tier(op.dst_tier)]
        n = self.shape.block_stride
        bad = self.fail is not None and self.fail(op)
        for layer in range(self.num_layers):
            for role in range(2):
                s, d = src[layer][role], dst[layer][role]
                for a, b in zip(op.src_ids, op.dst_ids, strict=True):
                    d[b * n:(b + 1) * n] = 1e30 if bad else s[a * n:(a + 1) * n]
        self.ops += 1
        handle = {"cancelled": False}

        def report() -> None:
            if bad or handle["cancelled"]:
                sink.done(TransferError(f"op {op.op_id} failed (injected)"))
                return
            for layer in range(self.num_layers):
                sink.layer_done(layer)
            sink.done(None)

        asyncio.get_running_loop().call_soon(report)
        return handle

    def cancel(self, handle: object) -> None:
        handle["cancelled"] = True  # type: ignore[index]


class NumpyExecutor(PagedExecutorBase):
    """``ComputeExecutor`` of the CPU world: the float64 model on a ``NumpyBackend``'s pools.

    ``rows[request_id]`` keeps each sampled token's output row (float64); the
    checksum in ``outputs`` is 0 (float64 rows are compared with a tolerance).
    """

    def __init__(self, backend: NumpyBackend, weights: list[dict[str, np.ndarray]],
                 decode_split: int = DECODE_SPLIT) -> None:
        super().__init__(backend.shape, decode_split)
        self.backend = backend
        self.model = NumpyModel(backend.shape, weights)
        self.rows: dict[Hashable, list[np.ndarray]] = {}
        self.steps = 0

    async def run_step(self, batch: Any, waits: Sequence[Any]) -> None:
        for t in waits:
            await t.wait()  # raises TransferError if a load failed
        plan = build_step(self.items_for(batch), self.shape, self.decode_split)
        y = self.model.forward(plan, self.backend.kcache, self.backend.vcache)
        self.steps += 1
        if not np.isfinite(y).all():
            raise AssertionError("non-finite output: garbage KV was read")
        tokens = np.argmax(y, axis=1) if len(y) else np.zeros(0, dtype=np.int64)
        for rid, row in zip(plan.emit_ids, y, strict=True):
            self.rows.setdefault(rid, []).append(row)
        self.record(plan.emit_ids, tokens.tolist(), [0] * len(tokens))
