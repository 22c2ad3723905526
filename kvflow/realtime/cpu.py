"""A CPU "device" for real-time runs without a GPU: real bytes, real threads, real stores.

The simulated world moves sizes in virtual time; the GPU world needs a GPU.
Between them, this world runs the real engine, runtime and store backends on
an ordinary asyncio loop, with numpy arrays standing in for device memory:

* ``HostCopyBackend`` — device <-> host copies (``SWAP_IN``, ``EVICT``,
  ``BACKUP``) as numpy copies, layer by layer, each layer reported as it lands
  and ordered after layer i of the ops it must follow. Optionally paced at a
  link bandwidth so copies take time and overlap compute.
* ``KeyedBlockExecutor`` — the engine's compute. It "computes" a block by
  writing bytes derived from the block's key (a key names the whole prefix, so
  equal keys mean equal KV, exactly as a model would produce), and checks every
  cached block a step reads — through the plan's device block ids — holds the
  bytes its key implies. A wrong byte anywhere (a load that landed in the
  wrong block, a block overwritten while still in use, a stale or corrupt
  storage read that slipped through) shows up as ``stats.corrupt_reads``.

With ``StoreBackend`` for host <-> storage (behind ``RoutedBackend``) this is
the end-to-end test bench for the storage tier and its faults.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvflow.backend import pending_after
from kvflow.errors import ConfigError, InvalidBlockId, TransferError
from kvflow.host_memory import HostArrays
from kvflow.manager import TransferOp
from kvflow.radix import Tier
from kvflow.store_backend import BusyClock

_H2D = (Tier.HOST, Tier.DEVICE)
_D2H = (Tier.DEVICE, Tier.HOST)


# --------------------------------------------------------------------------- copies
class CopyHandle:
    """One device <-> host op of a ``HostCopyBackend``."""

    __slots__ = ("_layer_waiters", "cancelled", "ended_at", "finished", "layers_done", "op", "sink",
                 "started_at", "task")

    def __init__(self, op: TransferOp, sink: Any) -> None:
        self.op = op
        self.sink = sink
        self.task: asyncio.Task[None] | None = None
        self.cancelled = False
        self.finished = False
        self.layers_done = 0
        #: Loop times of the first layer's copy starting and of the end.
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self._layer_waiters: list[tuple[int, asyncio.Future[None]]] = []

    def wait_layer(self, layer: int, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A fresh future resolved once layer ``layer`` has moved or the op has ended."""
        fut = loop.create_future()
        if self.finished or self.layers_done > layer:
            fut.set_result(None)
        else:
            self._layer_waiters.append((layer, fut))
        return fut

    def _wake(self, everyone: bool = False) -> None:
        keep = []
        for layer, fut in self._layer_waiters:
            if everyone or layer < self.layers_done:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((layer, fut))
        self._layer_waiters = keep


class HostCopyBackend:
    """Device KV as ``uint8[num_layers, num_device_blocks, layer_bytes]``; copies to and
    from a ``HostArrays``. Implements ``TransferBackend`` for device <-> host ops.

    ``bytes_per_s`` paces each direction like a link (one layer of one op at a
    time, FIFO, for ``bytes / bytes_per_s`` seconds before it lands); ``None``
    copies at once, yielding to the loop between layers.
    """

    def __init__(self, host: HostArrays, num_device_blocks: int, *,
                 bytes_per_s: float | None = None) -> None:
        if not isinstance(num_device_blocks, int) or num_device_blocks <= 0:
            raise ConfigError(f"num_device_blocks must be a positive integer, "
                              f"got {num_device_blocks!r}")
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ConfigError(f"bytes_per_s must be positive or None, got {bytes_per_s!r}")
        self.host = host
        self.num_layers = host.num_layers
        self.layer_bytes = host.layer_bytes
        self.num_device_blocks = num_device_blocks
        self.bytes_per_s = bytes_per_s
        self.device = np.zeros((host.num_layers, num_device_blocks, host.layer_bytes),
                               dtype=np.uint8)
        self._links: dict[str, asyncio.Lock] = {}
        self._busy: dict[str, BusyClock] = {}
        self._ops: set[CopyHandle] = set()

    def device_layer(self, layer: int) -> np.ndarray:
        """``uint8[num_device_blocks, layer_bytes]`` of one layer (what compute reads/writes)."""
        return self.device[layer]

    # ------------------------------------------------------------------ protocol
    def submit(self, op: TransferOp, sink: Any, after: Sequence[object] = ()) -> CopyHandle:
        pair = (Tier(op.src_tier), Tier(op.dst_tier))
        if pair not in (_H2D, _D2H):
            raise TransferError(
                f"HostCopyBackend moves blocks between device and host only; op {op.op_id} "
                f"({op.kind.value}) goes {pair[0].name.lower()} -> {pair[1].name.lower()}")
        deps = pending_after(op, after, CopyHandle, "HostCopyBackend")
        loop = asyncio.get_running_loop()
        h = CopyHandle(op, sink)
        self._ops.add(h)
        bad = self._bad_ids(op)
        if bad is not None:  # nothing written; report on the loop, never inside submit
            h.task = loop.create_task(self._fail(h, bad))
        else:
            h.task = loop.create_task(self._run(h, deps), name=f"copy-op-{op.op_id}")
        h.task.add_done_callback(lambda t, h=h: self._task_ended(h, t))
        return h

    def _task_ended(self, h: CopyHandle, task: asyncio.Task[None]) -> None:
        """Ends an op whose task stopped early: cancelled, or a bug raised in it."""
        if h.finished:
            return
        exc = None if task.cancelled() else task.exception()
        if exc is None:
            err = TransferError(f"op {h.op.op_id} ({h.op.kind.value}) was cancelled")
        else:
            err = TransferError(f"op {h.op.op_id} ({h.op.kind.value}) failed: {exc!r}")
            err.__cause__ = exc
        self._finish(h, err)

    def cancel(self, handle: object) -> None:
        """Stop after the layer being copied (copies are synchronous: at once)."""
        if not isinstance(handle, CopyHandle):
            raise TypeError(f"cancel: {handle!r} is not a HostCopyBackend handle")
        if handle.finished or handle.cancelled:
            return
        handle.cancelled = True
        if handle.task is not None:
            handle.task.cancel()  # it is parked at an await: between layers, never mid-copy

    # ------------------------------------------------------------------ running
    def _bad_ids(self, op: TransferOp) -> InvalidBlockId | None:
        n_src = self.num_device_blocks if op.src_tier == Tier.DEVICE else self.host.num_blocks
        n_dst = self.num_device_blocks if op.dst_tier == Tier.DEVICE else self.host.num_blocks
        for name, ids, n in (("source", op.src_ids, n_src), ("destination", op.dst_ids, n_dst)):
            for b in ids:
                if not 0 <= b < n:
                    return InvalidBlockId(f"op {op.op_id}: {name} block {b} out of range [0, {n})")
        if len(op.src_ids) != len(op.dst_ids):
            return InvalidBlockId(f"op {op.op_id}: {len(op.src_ids)} sources, "
                                  f"{len(op.dst_ids)} destinations")
        return None

    async def _fail(self, h: CopyHandle, error: BaseException) -> None:
        self._finish(h, error)

    async def _run(self, h: CopyHandle, deps: list[CopyHandle]) -> None:
        loop = asyncio.get_running_loop()
        op = h.op
        h2d = op.dst_tier == Tier.DEVICE
        link = "h2d" if h2d else "d2h"
        src = np.asarray(op.src_ids, dtype=np.intp)
        dst = np.asarray(op.dst_ids, dtype=np.intp)
        host = self.host.array
        lock = self._links.get(link)
        if lock is None:
            lock = self._links[link] = asyncio.Lock()
        clock = self._busy.get(link)
        if clock is None:
            clock = self._busy[link] = BusyClock(loop)
        pace = (None if self.bytes_per_s is None
                else op.num_blocks * self.layer_bytes / self.bytes_per_s)
        clock.enter()
        try:
            for layer in range(self.num_layers):
                for d in deps:
                    if d.layers_done <= layer and not d.finished:
                        await d.wait_layer(layer, loop)
                if pace is None:
                    await asyncio.sleep(0)
                else:
                    async with lock:
                        if h.started_at is None:
                            h.started_at = loop.time()
                        await asyncio.sleep(pace)
                if h.started_at is None:
                    h.started_at = loop.time()
                if h2d:
                    self.device[layer, dst] = host[src, layer]
                else:
                    host[dst, layer] = self.device[layer, src]
                h.layers_done = layer + 1
                h.sink.layer_done(layer)
                h._wake()
        finally:
            clock.exit()
        self._finish(h, None)

    def _finish(self, h: CopyHandle, error: BaseException | None) -> None:
        if h.finished:
            return
        h.finished = True
        h.ended_at = asyncio.get_running_loop().time()
        self._ops.discard(h)
        try:
            h.sink.done(error)
        finally:  # ops waiting on this one must go on even if the sink raised
            h._wake(everyone=True)

    def busy_s(self) -> dict[str, float]:
        """Seconds each direction (``h2d``, ``d2h``) had a copy in flight."""
        return {k: self._busy[k].busy_s if k in self._busy else 0.0 for k in ("h2d", "d2h")}

    @property
    def inflight(self) -> int:
        return len(self._ops)


# --------------------------------------------------------------------------- compute
def block_bytes(key: Hashable, num_layers: int, layer_bytes: int) -> np.ndarray:
    """The KV bytes of the block ``key`` names: ``uint8[num_layers, layer_bytes]``.

    Seeded by the key alone, so every request, every tier and every run that
    holds the block agrees on its content — and a block loaded from the wrong
    place, or a stale one, differs in (almost) every byte.
    """
    seed = xxhash.xxh3_64_intdigest(repr(key).encode())
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(num_layers, layer_bytes), dtype=np.uint8)


@dataclass
class ExecutorStats:
    """What the executor computed and checked. ``corrupt_reads`` must stay 0."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    blocks_written: int = 0
    blocks_verified: int = 0
    corrupt_reads: int = 0
    busy_s: float = 0.0
    #: The first few bad reads: ``(request id, block index, key, first bad layer)``.
    examples: list[tuple[Any, int, Any, int]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["examples"] = [repr(e) for e in self.examples]
        return d


class KeyedBlockExecutor:
    """``ComputeExecutor`` that writes keyed bytes into new blocks and verifies cached ones.

    A prefill chunk of tokens ``[ctx, ctx + n)`` reads every prompt block
    before ``ctx // block_tokens`` (verified) and produces the blocks the chunk
    covers: those the request must compute (new ones, and cached ones whose
    load failed — ``plan.computing``) are written, cached ones it re-covers are
    verified. A decode step verifies every prompt block of its request. Each
    layer starts once layer i of every load the step waits on has landed
    (``TransferError`` if one failed: the engine then rewinds the request).

    ``step_s + token_s * tokens`` is the step's compute time, slept layer by
    layer when loads are pending (so copies overlap compute), else in one go.
    ``strict`` raises ``AssertionError`` at the first wrong byte instead of counting.
    ``verify_decode=False`` skips the decode steps' checks (the prefill already
    checked every cached block; benchmarks skip re-reading them every token).
    Needs ``StepBatch.requests`` (the request of each item).
    """

    def __init__(self, device_layer: Callable[[int], np.ndarray], num_layers: int,
                 layer_bytes: int, block_tokens: int, *, step_s: float = 0.0,
                 token_s: float = 0.0, strict: bool = False, verify_decode: bool = True,
                 cache_blocks: int = 65536) -> None:
        if step_s < 0 or token_s < 0:
            raise ConfigError("step_s and token_s must be >= 0")
        self.device_layer = device_layer
        self.num_layers = num_layers
        self.layer_bytes = layer_bytes
        self.block_tokens = block_tokens
        self.step_s = step_s
        self.token_s = token_s
        self.strict = strict
        self.verify_decode = verify_decode
        self.stats = ExecutorStats()
        #: Called as ``layer_written(batch, layer)`` once a step has written (and spent
        #: the compute time of) layer ``layer``, layers in order; the step then paces its
        #: compute layer by layer. A prefill instance (``kvflow.pd``) sends each layer then.
        self.layer_written: Callable[[Any, int], None] | None = None
        #: When a list: one ``(tokens, None, wall seconds)`` per step (the GPU executor's
        #: step log in the same shape): what a simulator's compute model is fitted to.
        self.step_log: list[tuple[int, None, float]] | None = None
        self._cache: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._cache_blocks = cache_blocks

    def expected(self, key: Hashable) -> np.ndarray:
        """``block_bytes`` of ``key``, memoised (LRU of ``cache_blocks`` blocks)."""
        arr = self._cache.get(key)
        if arr is None:
            arr = block_bytes(key, self.num_layers, self.layer_bytes)
            self._cache[key] = arr
            if len(self._cache) > self._cache_blocks:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return arr

    def _work(self, batch: Any) -> tuple[list[tuple[Any, list[int], np.ndarray, np.ndarray]],
                                         list[tuple[np.ndarray, np.ndarray]]]:
        """(verifies, writes): per request, the block indices, device ids and expected bytes."""
        reqs = getattr(batch, "requests", None)
        nd = len(batch.decode)
        if reqs is None or len(reqs) != nd + len(batch.prefill):
            raise ConfigError("KeyedBlockExecutor needs StepBatch.requests "
                              "(the request of each decode and prefill item)")
        bt = self.block_tokens
        verifies: list[tuple[Any, list[int], np.ndarray, np.ndarray]] = []
        writes: list[tuple[np.ndarray, np.ndarray]] = []

        def add(out: list[Any], st: Any, idx: list[int], with_ids: bool) -> None:
            if not idx:
                return
            plan = st.plan
            ids = np.asarray([plan.device_ids[i] for i in idx], dtype=np.intp)
            exp = np.stack([self.expected(plan.keys[i]) for i in idx])
            out.append((st.req.request_id, idx, ids, exp) if with_ids else (ids, exp))

        for st in reqs[:nd]:
            if self.verify_decode:
                add(verifies, st, list(range(len(st.plan.keys))), True)
            self.stats.decode_tokens += 1
        for st, (n, ctx) in zip(reqs[nd:], batch.prefill, strict=True):
            plan = st.plan
            nk = len(plan.keys)
            cached = plan.num_cached
            position = {id(node): i for i, node in enumerate(plan.nodes[:cached])}
            redo = {position[id(node)] for node in plan.computing if id(node) in position}
            first = min(max(ctx, 0) // bt, nk)
            last = min(nk, math.ceil((ctx + n) / bt))
            read = list(range(first))
            fresh = []
            for i in range(first, last):
                (fresh if i >= cached or i in redo else read).append(i)
            add(verifies, st, read, True)
            add(writes, st, fresh, False)
            self.stats.prefill_tokens += n
        return verifies, writes

    async def run_step(self, batch: Any, waits: Sequence[Any]) -> None:
        verifies, writes = self._work(batch)
        loop = asyncio.get_running_loop()
        pending = [t for t in waits if not t.finished or not t.ok]
        layer_written = self.layer_written
        total = self.step_s + self.token_s * batch.tokens
        per_layer = total / self.num_layers
        bad: dict[tuple[Any, int], int] = {}
        t0 = loop.time()
        w0 = time.perf_counter()
        for layer in range(self.num_layers):
            for t in pending:
                if t.layers_done <= layer:
                    await t.layer(layer)  # raises TransferError if that load failed
            dev = self.device_layer(layer)
            for rid, idx, ids, exp in verifies:
                wrong = (dev[ids] != exp[:, layer]).any(axis=1)
                if wrong.any():
                    for j in np.flatnonzero(wrong).tolist():
                        bad.setdefault((rid, idx[j]), layer)
            for ids, exp in writes:
                dev[ids] = exp[:, layer]
            if (pending or layer_written) and per_layer > 0:
                await asyncio.sleep(per_layer)
            if layer_written is not None:
                layer_written(batch, layer)
        if not (pending or layer_written) or per_layer == 0:
            await asyncio.sleep(total)
        st = self.stats
        st.steps += 1
        st.busy_s += loop.time() - t0
        if self.step_log is not None:
            self.step_log.append((batch.tokens, None, time.perf_counter() - w0))
        st.blocks_verified += sum(len(v[1]) for v in verifies)
        st.blocks_written += sum(len(w[0]) for w in writes)
        if bad:
            st.corrupt_reads += len(bad)
            keys = {(r.req.request_id): r.plan.keys for r in batch.requests}
            for (rid, i), layer in list(bad.items())[:max(0, 8 - len(st.examples))]:
                st.examples.append((rid, i, keys[rid][i], layer))
            if self.strict:
                raise AssertionError(f"{len(bad)} cached blocks read with wrong bytes: "
                                     f"{st.examples}")


__all__ = ["CopyHandle", "ExecutorStats", "HostCopyBackend", "KeyedBlockExecutor",
           "block_bytes"]
