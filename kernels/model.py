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
"""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.errors import ConfigError, TransferError
from kvflow.layout import ModelSpec
from kvflow.manager import TransferOp
from kvflow.radix import Tier

#: Query rows per prefill attention tile and keys per key tile (the kernels' mma M / K).
TILE = 16
#: Keys per decode attention split (flash-decoding); a multiple of ``TILE``.
DECODE_SPLIT = 1024
#: GEMM tile widths: N must be a multiple of 64 and K of 32.
GEMM_N, GEMM_K = 64, 32
#: Most query heads per KV head (one warp each in the prefill kernel's CTA).
MAX_GROUP = 8
HEAD_DIMS = (64, 128)
_ALIGN = 16
_M64 = (1 << 64) - 1


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


# ----------------------------------------------------------------------------- tokens
def key_int(key: Hashable) -> int:
    """A 64-bit integer for a block key, the same in every process."""
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return int(key) & _M64
    if isinstance(key, (bytes, bytearray)):
        return int.from_bytes(bytes(key[:8]).ljust(8, b"\0"), "little")
    raw = repr(key).encode()
    return zlib.crc32(raw) | (zlib.adler32(raw) << 32)


def _mix(k: np.ndarray, j: np.ndarray) -> np.ndarray:
    """splitmix64 of (k, j) -> token ids in [0, 2^31)."""
    with np.errstate(over="ignore"):
        z = k * np.uint64(_MUL1) + j + np.uint64(1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MUL2)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MUL3)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(33)).astype(np.int32)


#: Longest range ``prompt_tokens`` computes in plain Python: each numpy call costs
#: microseconds (~7 us on some GPU hosts) and a step's items are built between its
#: loads' submission and its first kernel; a few tokens are cheaper one by one.
SMALL_TOKEN_RANGE = 32
_MUL1, _MUL2, _MUL3 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def prompt_tokens(keys: Sequence[Hashable], request_id: Hashable, block_tokens: int,
                  start: int, stop: int, *, vectorised: bool = False) -> np.ndarray:
    """Token ids of prompt positions ``[start, stop)``: a function of the block's key.

    Positions past the last key (a tail that hashing left without one) are a
    function of the request instead: nobody else can match them anyway.
    Ranges up to ``SMALL_TOKEN_RANGE`` are mixed in plain Python (the same
    splitmix64 bit for bit) unless ``vectorised``.
    """
    if stop <= start:
        return np.zeros(0, dtype=np.int32)

    def key_of(b: int) -> int:
        return key_int(keys[b]) if b < len(keys) else key_int(("tail", repr(request_id), b))

    if not vectorised and stop - start <= SMALL_TOKEN_RANGE:
        out = []
        b_prev, k = -1, 0
        for p in range(start, stop):
            b = p // block_tokens
            if b != b_prev:
                b_prev, k = b, key_of(b)
            out.append(_mix_one(k, p % block_tokens))
        return np.array(out, dtype=np.int32)
    pos = np.arange(start, stop, dtype=np.int64)
    blocks = pos // block_tokens
    b0, b1 = int(blocks[0]), int(blocks[-1])
    k = np.array([key_of(b) for b in range(b0, b1 + 1)], dtype=np.uint64)[blocks - b0]
    return _mix(k, (pos % block_tokens).astype(np.uint64))


def _mix_one(k: int, j: int) -> int:
    """``_mix`` of one (k, j), on Python ints."""
    z = (k * _MUL1 + j + 1) & _M64
    z = ((z ^ (z >> 30)) * _MUL2) & _M64
    z = ((z ^ (z >> 27)) * _MUL3) & _M64
    z ^= z >> 31
    return z >> 33


def _hash32(x: np.ndarray) -> np.ndarray:
    """lowbias32 on uint32 arrays (as the embedding kernel)."""
    x = x.astype(np.uint32)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return x


def _unit(h: np.ndarray) -> np.ndarray:
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 8388608.0) - np.float32(1.0)


def embed(tokens: np.ndarray, positions: np.ndarray, hidden: int) -> np.ndarray:
    """The embedding kernel's values (float32, bit for bit): hashes of (token, d), (pos, d)."""
    tok = tokens.astype(np.uint32)[:, None]
    pos = positions.astype(np.uint32)[:, None]
    d = np.arange(hidden, dtype=np.uint32)[None, :]
    with np.errstate(over="ignore"):
        a = _unit(_hash32(tok * np.uint32(0x9E3779B1) + d * np.uint32(0x85EBCA77)))
        b = _unit(_hash32(((pos + np.uint32(0x632BE5AB)) * np.uint32(0xC2B2AE3D))
                          ^ (d * np.uint32(0x27D4EB2F))))
    return a + np.float32(0.25) * b


# ------------------------------------------------------------------------ step metadata
@dataclass(frozen=True)
class StepItem:
    """One request's part of a step.

    ``tokens`` sit at positions ``pos0 ..``; ``table`` maps the request's
    logical blocks to device blocks and must cover ``pos0 + len(tokens)``.
    ``decode`` items are one token and go through split-K attention; ``emit``:
    the last token's output is a sampled token (prefill completing, or decode).
    """

    request_id: Hashable
    decode: bool
    tokens: np.ndarray
    pos0: int
    table: np.ndarray
    emit: bool


@dataclass
class StepPlan:
    """Everything the kernels of one step read (see ``compute.cu``)."""

    tokens: np.ndarray          # int32 [T]
    positions: np.ndarray       # int32 [T]
    slots: np.ndarray           # int64 [T]: element offset of the token's K (and V) in a layer
    prefill_work: np.ndarray    # int32 [Wp, 4]: row0, rows, first position, table offset
    decode_work: np.ndarray     # int32 [Wd, 5]: row, key begin, key end, table offset, partial
    combine: np.ndarray         # int32 [Nd, 3]: row, first partial, splits
    tables: np.ndarray          # int32: block tables, concatenated
    emit_rows: np.ndarray       # int32 [E]
    emit_ids: list[Hashable]
    prefill_pairs: float = 0.0  # attention (query, key) pairs, for accounting
    decode_keys: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_partials(self) -> int:
        return len(self.decode_work)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(start, start + count)`` for each pair, without a Python loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    offsets = np.repeat(ends - counts, counts)
    return np.repeat(starts, counts) + (np.arange(total, dtype=np.int64) - offsets)


def build_step(items: Sequence[StepItem], shape: ModelShape,
               decode_split: int = DECODE_SPLIT, prefill_tile: int = TILE) -> StepPlan:
    """Lay one step out for the kernels; raises ``ValueError`` on an inconsistent item.

    ``prefill_tile``: query rows per prefill work item (the exact kernels take
    ``TILE``; the fast executor's take a CTA's worth, ``kernels.fast``).
    Vectorised over items (numpy, no per-token Python): it runs on the host
    every step, with one item per running request.
    """
    if decode_split <= 0 or decode_split % TILE:
        raise ValueError(f"decode_split must be a positive multiple of {TILE}")
    if prefill_tile <= 0 or prefill_tile % TILE:
        raise ValueError(f"prefill_tile must be a positive multiple of {TILE}")
    bt, kv_dim, stride = shape.block_tokens, shape.kv_dim, shape.block_stride
    items = [it for it in items if len(it.tokens)]
    k = len(items)
    lens = np.fromiter((len(it.tokens) for it in items), dtype=np.int64, count=k)
    pos0 = np.fromiter((it.pos0 for it in items), dtype=np.int64, count=k)
    dec = np.fromiter((it.decode for it in items), dtype=bool, count=k)
    emit = np.fromiter((it.emit for it in items), dtype=bool, count=k)
    tlen = np.fromiter((len(it.table) for it in items), dtype=np.int64, count=k)
    ends = pos0 + lens
    need = -(-ends // bt)
    bad = np.flatnonzero((pos0 < 0) | (tlen < need) | (dec & (lens != 1)))
    if len(bad):
        it = items[int(bad[0])]
        if it.decode and len(it.tokens) != 1:
            raise ValueError(f"request {it.request_id!r}: a decode item has one token")
        b = int(bad[0])
        raise ValueError(f"request {it.request_id!r}: positions [{it.pos0}, {int(ends[b])}) "
                         f"need {int(need[b])} blocks, its table has {int(tlen[b])}")
    row0 = np.cumsum(lens) - lens
    toff = np.cumsum(need) - need
    if k:
        tokens = np.concatenate([it.tokens for it in items]).astype(np.int32, copy=False)
        tables = np.concatenate([it.table[:n] for it, n in zip(items, need.tolist(),
                                                                 strict=True)]
                                ).astype(np.int32, copy=False)
    else:
        tokens = np.zeros(0, dtype=np.int32)
        tables = np.zeros(0, dtype=np.int32)
    positions = _ranges(pos0, lens)
    tab_of_token = np.repeat(toff, lens) + positions // bt
    slots = tables[tab_of_token].astype(np.int64) * stride + (positions % bt) * kv_dim

    p = ~dec  # prefill items: work items of prefill_tile query rows
    qcount = -(-lens[p] // prefill_tile)
    q = _ranges(np.zeros(int(p.sum()), dtype=np.int64), qcount) * prefill_tile  # offset in item
    prefill_work = np.empty((len(q), 4), dtype=np.int32)
    prefill_work[:, 0] = np.repeat(row0[p], qcount) + q
    prefill_work[:, 1] = np.minimum(prefill_tile, np.repeat(lens[p], qcount) - q)
    prefill_work[:, 2] = np.repeat(pos0[p], qcount) + q
    prefill_work[:, 3] = np.repeat(toff[p], qcount)

    ns = -(-ends[dec] // decode_split)  # decode items: one split per decode_split keys
    starts = _ranges(np.zeros(int(dec.sum()), dtype=np.int64), ns) * decode_split
    first = np.cumsum(ns) - ns
    decode_work = np.empty((len(starts), 5), dtype=np.int32)
    decode_work[:, 0] = np.repeat(row0[dec], ns)
    decode_work[:, 1] = starts
    decode_work[:, 2] = np.minimum(starts + decode_split, np.repeat(ends[dec], ns))
    decode_work[:, 3] = np.repeat(toff[dec], ns)
    decode_work[:, 4] = np.arange(len(starts))
    combine = np.stack([row0[dec], first, ns], axis=1).astype(np.int32).reshape(-1, 3)

    emit_rows = (row0 + lens - 1)[emit].astype(np.int32)
    pairs = float((lens[p] * (pos0[p] + (lens[p] + 1) / 2)).sum())
    return StepPlan(
        tokens=tokens, positions=positions.astype(np.int32), slots=slots,
        prefill_work=prefill_work, decode_work=decode_work, combine=combine, tables=tables,
        emit_rows=emit_rows, emit_ids=[it.request_id for it in items if it.emit],
        prefill_pairs=pairs, decode_keys=int(ends[dec].sum()))


#: The arrays of a ``StepPlan`` that travel to the GPU, in buffer order (int64 first).
PACKED_FIELDS = ("slots", "tokens", "positions", "prefill_work", "decode_work", "combine",
                 "tables", "emit_rows")


def pack_step(plan: StepPlan, out: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, int]]:
    """All of the step's arrays in one byte buffer (16-byte aligned pieces) and their offsets.

    One host -> device copy per step instead of eight. ``out`` (uint8, large
    enough: see ``packed_size``) is filled in place when given.
    """
    offsets: dict[str, int] = {}
    at = 0
    for name in PACKED_FIELDS:
        offsets[name] = at
        at += -(-getattr(plan, name).nbytes // _ALIGN) * _ALIGN
    buf = np.zeros(max(at, _ALIGN), dtype=np.uint8) if out is None else out
    if len(buf) < at:
        raise ValueError(f"pack buffer holds {len(buf)} bytes, the step needs {at}")
    for name in PACKED_FIELDS:
        a = np.ascontiguousarray(getattr(plan, name))
        buf[offsets[name]:offsets[name] + a.nbytes] = a.view(np.uint8).reshape(-1)
    offsets["_size"] = at
    return buf, offsets


def packed_size(plan: StepPlan) -> int:
    return sum(-(-getattr(plan, n).nbytes // _ALIGN) * _ALIGN for n in PACKED_FIELDS)


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
