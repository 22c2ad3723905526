"""One step's metadata for the compute kernels: ``StepItem`` (a request's part),
``StepPlan`` (tokens, positions, KV slots, attention work items, block tables, rows
to emit) built by ``build_step``, and ``pack_step``, its one-buffer upload.

Exactly what the kernels read, laid out on the host every step; pure numpy so it
is tested on a CPU.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from kernels.model_shape import DECODE_SPLIT, TILE, ModelShape

_ALIGN = 16


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
