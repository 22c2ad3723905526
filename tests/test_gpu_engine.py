"""The engine computing real data: step metadata, the numpy reference world, and the GPU.

CPU tests run the whole engine (manager, runtime, engine, executor bookkeeping)
on a numpy world with real KV (``kernels.model.NumpyBackend``/``NumpyExecutor``):
a multi-turn trace gives the same outputs with a device pool that keeps
everything as with a small one that swaps to host, evicts and recomputes, and
with loads that fail and leave garbage behind. GPU tests (skipped without CuPy
or a GPU) check the same bit for bit on the GPU, the GPU against the float64
reference, and that compute waits for a load on the GPU while the CPU moves on.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kernels import gpu_unavailable_reason
from kernels.model import (
    DECODE_SPLIT,
    SMALL_TOKEN_RANGE,
    TILE,
    ModelShape,
    NumpyBackend,
    NumpyExecutor,
    NumpyModel,
    StepItem,
    StepPlan,
    build_step,
    embed,
    pack_step,
    prompt_tokens,
    random_weights,
)
from kvflow.engine import Engine, EngineConfig, EngineRequest
from kvflow.errors import ConfigError
from kvflow.layout import ModelSpec, preset
from kvflow.manager import CacheManager, Capacities, OpKind
from kvflow.radix import Tier
from kvflow.replay import request_keys
from kvflow.runtime import Runtime
from kvflow.world import new_loop
from traces.generate import multi_turn

BT = 16
SPEC = ModelSpec("tiny", num_layers=3, num_kv_heads=2, head_dim=64, hidden_size=256,
                 num_attention_heads=4, intermediate_size=512, block_tokens=BT)
SHAPE = ModelShape.from_spec(SPEC)
#: The CPU world's model: narrow enough that numpy's BLAS stays single-threaded (fast).
CPU_SPEC = SPEC.replace(name="tiny-cpu", hidden_size=128, num_attention_heads=2,
                        num_kv_heads=1, intermediate_size=128)
CPU_SHAPE = ModelShape.from_spec(CPU_SPEC)

_GPU = gpu_unavailable_reason()
gpu = pytest.mark.skipif(_GPU is not None, reason=f"needs a CUDA GPU and CuPy: {_GPU}")


# ---------------------------------------------------------------------- pure parts
def test_model_shape_from_specs() -> None:
    assert SHAPE.group == 2 and SHAPE.qkv_dim == 512 and SHAPE.block_stride == BT * 128
    s = ModelShape.from_spec(preset("llama-3-8b-l4", block_tokens=512))
    assert (s.num_layers, s.hidden, s.heads, s.kv_heads, s.intermediate) == (4, 4096, 32, 8,
                                                                              14336)
    assert s.params_per_layer * 4 == preset("llama-3-8b-l4").active_params
    for bad, what in ((SPEC.replace(head_dim=80), "head_dim"),
                      (preset("deepseek-v3"), "mha"),
                      (SPEC.replace(num_attention_heads=40, num_kv_heads=2), "query heads"),
                      (SPEC.replace(block_tokens=8), "block_tokens"),
                      (SPEC.replace(dtype="fp8"), "2-byte")):
        with pytest.raises(ConfigError, match=what):
            ModelShape.from_spec(bad)


def test_layer_slice_preset() -> None:
    s = preset("llama-3-8b-l4", block_tokens=512)
    assert s.name == "llama-3-8b-l4" and s.num_layers == 4 and s.block_tokens == 512
    assert s.active_params == 4 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
    with pytest.raises(ConfigError, match="cannot slice"):
        preset("llama-3-8b-l33")
    with pytest.raises(ConfigError, match="unknown model"):
        preset("nope-l2")


def test_prompt_tokens_follow_keys() -> None:
    a = prompt_tokens([10, 11, 12], "r1", BT, 0, 40)
    b = prompt_tokens([10, 11, 99], "r2", BT, 0, 40)
    assert a.dtype == np.int32 and len(a) == 40 and (a >= 0).all()
    np.testing.assert_array_equal(a[:32], b[:32])           # same keys, same tokens
    assert (a[32:] != b[32:]).any()                          # another key, other tokens
    np.testing.assert_array_equal(prompt_tokens([10, 11, 12], "x", BT, 5, 37), a[5:37])
    tail1 = prompt_tokens([(b"\x01" * 16)], "r1", BT, 0, 20)  # bytes keys; a tail with no key
    tail2 = prompt_tokens([(b"\x01" * 16)], "r2", BT, 0, 20)
    np.testing.assert_array_equal(tail1[:16], tail2[:16])
    assert (tail1[16:] != tail2[16:]).any()
    assert len(prompt_tokens([1], "r", BT, 3, 3)) == 0


def test_prompt_tokens_of_a_few_positions_match_the_vectorised_path() -> None:
    """Short ranges (a chunk's last tokens, a swap-in's next ones) take a plain-Python
    path, since they sit between a load's submission and the step that waits for it;
    it must give the numpy path's token ids bit for bit, across block boundaries and
    into a tail with no key."""
    rng = np.random.default_rng(5)
    keys = [int(k) for k in rng.integers(0, 2**63, 6)] + [b"\x07" * 16, ("t", 3)]
    for _ in range(300):
        start = int(rng.integers(0, (len(keys) + 1) * BT))
        stop = start + int(rng.integers(1, SMALL_TOKEN_RANGE + 1))
        got = prompt_tokens(keys, "req", BT, start, stop)
        want = prompt_tokens(keys, "req", BT, start, stop, vectorised=True)
        assert got.dtype == want.dtype == np.int32
        np.testing.assert_array_equal(got, want)


def test_embedding_is_deterministic_and_position_aware() -> None:
    e = embed(np.array([5, 5, 7]), np.array([0, 1, 0]), 64)
    assert e.dtype == np.float32 and e.shape == (3, 64)
    assert np.abs(e).max() < 1.3 and not np.array_equal(e[0], e[1])
    np.testing.assert_array_equal(e, embed(np.array([5, 5, 7]), np.array([0, 1, 0]), 64))


def test_build_step_layout() -> None:
    table_a = np.array([7, 3, 9], dtype=np.int32)
    table_b = np.array([4, 2], dtype=np.int32)
    items = [
        StepItem("b", True, np.array([123], dtype=np.int32), 20, table_b, True),
        StepItem("a", False, np.arange(20, dtype=np.int32), 10, table_a, False),
    ]
    plan = build_step(items, SHAPE, decode_split=16)
    assert plan.num_tokens == 21
    np.testing.assert_array_equal(plan.positions, [20, *range(10, 30)])
    stride, kv = SHAPE.block_stride, SHAPE.kv_dim
    assert plan.slots[0] == 2 * stride + 4 * kv                      # b: pos 20 -> block 1 -> 2
    assert plan.slots[1] == 7 * stride + 10 * kv                     # a: pos 10 -> block 0 -> 7
    assert plan.slots[-1] == 3 * stride + 13 * kv                    # a: pos 29 -> block 1 -> 3
    np.testing.assert_array_equal(plan.tables, [4, 2, 7, 3])         # only blocks in use
    np.testing.assert_array_equal(plan.decode_work, [[0, 0, 16, 0, 0], [0, 16, 21, 0, 1]])
    np.testing.assert_array_equal(plan.combine, [[0, 0, 2]])
    np.testing.assert_array_equal(plan.prefill_work, [[1, 16, 10, 2], [17, 4, 26, 2]])
    np.testing.assert_array_equal(plan.emit_rows, [0])
    assert plan.emit_ids == ["b"]
    buf, off = pack_step(plan)
    got = buf[off["prefill_work"]:off["prefill_work"] + plan.prefill_work.nbytes]
    np.testing.assert_array_equal(got.view(np.int32).reshape(-1, 4), plan.prefill_work)
    assert all(v % 16 == 0 for v in off.values())
    with pytest.raises(ValueError, match="need 2 blocks"):
        build_step([StepItem("c", False, np.arange(20, dtype=np.int32), 0, table_b[:1], True)],
                   SHAPE)


def test_build_step_slot_of_last_token() -> None:
    plan = build_step([StepItem("a", False, np.arange(20, dtype=np.int32), 10,
                                np.array([7, 3], dtype=np.int32), True)], SHAPE)
    assert plan.slots[-1] == 3 * SHAPE.block_stride + 13 * SHAPE.kv_dim
    np.testing.assert_array_equal(plan.emit_rows, [19])


def _reference_build_step(items: list[StepItem], shape: ModelShape,
                          decode_split: int = DECODE_SPLIT) -> StepPlan:
    """The first, item-by-item ``build_step``: the oracle for the vectorised one."""
    if decode_split <= 0 or decode_split % TILE:
        raise ValueError(f"decode_split must be a positive multiple of {TILE}")
    bt, kv_dim, stride = shape.block_tokens, shape.kv_dim, shape.block_stride
    toks: list[np.ndarray] = []
    poss: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    tabs: list[np.ndarray] = []
    pwork: list[tuple[int, int, int, int]] = []
    dwork: list[np.ndarray] = []
    comb: list[tuple[int, int, int]] = []
    emit_rows: list[int] = []
    emit_ids: list[Any] = []
    rows = toff = parts = 0
    pairs = 0.0
    dkeys = 0
    for it in items:
        n = len(it.tokens)
        if n == 0:
            continue
        end = it.pos0 + n
        need = -(-end // bt)
        if it.pos0 < 0 or len(it.table) < need:
            raise ValueError(f"request {it.request_id!r}: positions [{it.pos0}, {end}) need "
                             f"{need} blocks, its table has {len(it.table)}")
        tab = np.asarray(it.table[:need], dtype=np.int32)
        pos = np.arange(it.pos0, end, dtype=np.int64)
        slots.append(tab[pos // bt].astype(np.int64) * stride + (pos % bt) * kv_dim)
        toks.append(np.asarray(it.tokens, dtype=np.int32))
        poss.append(pos.astype(np.int32))
        tabs.append(tab)
        if it.decode:
            if n != 1:
                raise ValueError(f"request {it.request_id!r}: a decode item has one token")
            starts = np.arange(0, end, decode_split, dtype=np.int32)
            ns = len(starts)
            w = np.empty((ns, 5), dtype=np.int32)
            w[:, 0] = rows
            w[:, 1] = starts
            w[:, 2] = np.minimum(starts + decode_split, end)
            w[:, 3] = toff
            w[:, 4] = np.arange(parts, parts + ns, dtype=np.int32)
            dwork.append(w)
            comb.append((rows, parts, ns))
            parts += ns
            dkeys += end
        else:
            for q in range(0, n, TILE):
                pwork.append((rows + q, min(TILE, n - q), it.pos0 + q, toff))
            pairs += n * (it.pos0 + (n + 1) / 2)
        if it.emit:
            emit_rows.append(rows + n - 1)
            emit_ids.append(it.request_id)
        rows += n
        toff += need

    def cat(parts_: list[np.ndarray], dtype: Any, width: int | None = None) -> np.ndarray:
        if parts_:
            return np.concatenate(parts_).astype(dtype, copy=False)
        return np.zeros((0,) if width is None else (0, width), dtype=dtype)

    return StepPlan(
        tokens=cat(toks, np.int32), positions=cat(poss, np.int32), slots=cat(slots, np.int64),
        prefill_work=np.array(pwork, dtype=np.int32).reshape(-1, 4),
        decode_work=cat(dwork, np.int32, 5), combine=np.array(comb, dtype=np.int32).reshape(-1, 3),
        tables=cat(tabs, np.int32), emit_rows=np.array(emit_rows, dtype=np.int32),
        emit_ids=emit_ids, prefill_pairs=pairs, decode_keys=dkeys)


def test_build_step_matches_the_item_by_item_oracle() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        items = []
        for r in range(int(rng.integers(0, 7))):
            decode = bool(rng.integers(0, 2))
            n = 1 if decode else int(rng.integers(1, 70))
            pos0 = int(rng.integers(0, 90))
            need = -(-(pos0 + n) // BT)
            table = rng.permutation(64)[:need + int(rng.integers(0, 3))].astype(np.int32)
            items.append(StepItem(r, decode, rng.integers(0, 1000, n).astype(np.int32), pos0,
                                  table, bool(rng.integers(0, 2))))
        split = int(rng.choice([16, 32, 1024]))
        got, want = build_step(items, SHAPE, split), _reference_build_step(items, SHAPE, split)
        for name in ("tokens", "positions", "slots", "prefill_work", "decode_work", "combine",
                     "tables", "emit_rows"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a, b, err_msg=name)
        assert got.emit_ids == want.emit_ids
        assert got.prefill_pairs == pytest.approx(want.prefill_pairs)
        assert got.decode_keys == want.decode_keys


def _pools(blocks: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    n = blocks * SHAPE.block_stride
    return ([np.full(n, np.nan) for _ in range(SHAPE.num_layers)],
            [np.full(n, np.nan) for _ in range(SHAPE.num_layers)])


def test_numpy_model_is_chunk_and_batch_invariant() -> None:
    """A prompt computed in one step, in chunks, or next to another request: same rows, same KV."""
    model = NumpyModel(SHAPE, random_weights(SHAPE, 1))
    toks = prompt_tokens([1, 2, 3, 4], "r", BT, 0, 60)
    table = np.arange(4, dtype=np.int32)
    k1, v1 = _pools(8)
    y1 = model.forward(build_step([StepItem("r", False, toks, 0, table, True)], SHAPE), k1, v1)
    k2, v2 = _pools(8)
    for a, b in ((0, 17), (17, 40), (40, 60)):
        other = StepItem("o", False, toks[:a + 3], 0, np.arange(4, 8, dtype=np.int32), False)
        y2 = model.forward(build_step([other, StepItem("r", False, toks[a:b], a, table, b == 60)],
                                      SHAPE), k2, v2)
    np.testing.assert_allclose(y2, y1, rtol=1e-10, atol=1e-12)
    used = slice(0, 60 * SHAPE.kv_dim)  # blocks 0..3, positions < 60
    for layer in range(SHAPE.num_layers):
        np.testing.assert_allclose(k2[layer][used], k1[layer][used], rtol=1e-10, atol=1e-12)
    # decode: split-K over 16-key splits equals one split
    dec = [StepItem("r", True, np.array([5], dtype=np.int32), 60, table, True)]
    ya = model.forward(build_step(dec, SHAPE, decode_split=16), k1, v1)
    yb = model.forward(build_step(dec, SHAPE, decode_split=DECODE_SPLIT), k2, v2)
    np.testing.assert_allclose(ya, yb, rtol=1e-10, atol=1e-12)
    assert np.isfinite(ya).all()


# --------------------------------------------------------------------- engine runs
def waves(block_tokens: int = BT, sessions: int = 6, turns: int = 4, system_len: int = 40,
          user_len: int = 20, output_len: int = 6, seed: int = 3) -> list[list[EngineRequest]]:
    """A multi-turn trace as waves: turn t of every session, once turn t-1 has finished."""
    reqs = multi_turn(sessions=sessions, turns=turns, system_len=system_len, user_len=user_len,
                      output_len=output_len, think_time_s=1.0, rate=4.0,
                      block_tokens=block_tokens, seed=seed)
    seen: dict[str | None, int] = {}
    out: list[list[EngineRequest]] = [[] for _ in range(turns)]
    for r in reqs:
        t = seen.get(r.session_id, 0)
        seen[r.session_id] = t + 1
        out[t].append(EngineRequest(r.index, r.arrival_s, request_keys(r, None), r.input_len,
                                    r.output_len))
    return out


async def run_waves(make_backend: Callable[[Capacities], Any],
                    make_executor: Callable[[Any], Any], caps: Capacities, write_policy: str,
                    trace: list[list[EngineRequest]], bytes_per_block: int,
                    max_batch_tokens: int = 48, deadline_s: float = 120.0,
                    ) -> tuple[Any, CacheManager, Engine, Runtime]:
    """Run ``trace`` wave by wave through a fresh engine.

    Returns (executor, manager, engine, runtime). A wave not done within
    ``deadline_s`` (wall seconds for the whole trace) fails the run: a stalled
    engine must fail a test, not hang it.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    manager = CacheManager(caps, write_policy=write_policy)
    backend = make_backend(caps)
    runtime = Runtime(manager, backend, bytes_per_block, loop)
    executor = make_executor(backend)
    engine = Engine(manager, runtime, executor,
                    EngineConfig(BT, max_batch_tokens=max_batch_tokens, max_running=4))
    run = asyncio.ensure_future(engine.run())
    total = 0
    for wave in trace:
        for req in wave:
            engine.add(req)
        total += len(wave)
        while len(engine.done) < total:
            if run.done():
                run.result()  # raises what killed the engine
            if loop.time() > deadline:
                run.cancel()
                raise AssertionError(
                    f"engine stalled: {len(engine.done)}/{total} done, running="
                    f"{len(engine.running)}, waiting={len(engine.waiting)}, "
                    f"in flight={len(runtime.tasks)}")
            await asyncio.sleep(0.0005)
    engine.close()
    await run
    manager.check_invariants()
    assert [(st.req.request_id, st.error) for st in engine.done if st.error] == []
    return executor, manager, engine, runtime


def _numpy_run(caps: Capacities, write_policy: str, fail: Callable[[Any], bool] | None = None,
               deadline_s: float = 120.0,
               ) -> tuple[NumpyExecutor, CacheManager, Engine, Runtime]:
    weights = random_weights(CPU_SHAPE, 0)
    return asyncio.run(run_waves(
        lambda c: NumpyBackend(CPU_SHAPE, c.device, c.host, fail=fail),
        lambda b: NumpyExecutor(b, weights, decode_split=32), caps, write_policy, waves(),
        CPU_SPEC.bytes_per_block, deadline_s=deadline_s))


@functools.cache
def _numpy_reference() -> NumpyExecutor:
    """The multi-turn trace with a device pool that keeps everything (computed once)."""
    return _numpy_run(Capacities(512), "write_through")[0]


def _assert_same_outputs(ex: NumpyExecutor, ref: NumpyExecutor, what: object) -> None:
    assert ex.outputs.keys() == ref.outputs.keys(), what
    for rid, toks in ref.outputs.items():
        assert [t for t, _ in ex.outputs[rid]] == [t for t, _ in toks], (what, rid)
        np.testing.assert_allclose(np.array(ex.rows[rid]), np.array(ref.rows[rid]),
                                   rtol=1e-9, atol=1e-11)


def test_cpu_world_outputs_do_not_depend_on_the_pools() -> None:
    ref = _numpy_reference()
    assert len(ref.outputs) == 24 and all(len(v) == 6 for v in ref.outputs.values())
    fails = {"n": 0}

    def fail(op: Any) -> bool:  # every third swap-in fails and leaves garbage behind
        if op.kind is OpKind.SWAP_IN:
            fails["n"] += 1
            return fails["n"] % 3 == 0
        return False

    # (host tiers of every size: test_cpu_world_small_host_tiers_complete_and_match.)
    for policy, host, f in (("write_through", 16, None), ("write_back", 32, None),
                            ("write_through", 16, fail)):
        ex, manager, _, runtime = _numpy_run(Capacities(12, host), policy, f)
        st = manager.stats
        assert st.hits[Tier.HOST] > 0, "no host hit: the small pool did not swap"
        assert st.evictions[Tier.DEVICE] > 0 and st.evictions[Tier.HOST] > 0
        assert runtime.metrics.ops[OpKind.SWAP_IN.value] > 0
        if f is not None:
            assert st.recomputed_blocks > 0 and runtime.metrics.failed > 0
        _assert_same_outputs(ex, ref, policy)


@pytest.mark.parametrize("host", [2, 4, 6, 8, 12, 16, 20, 24, 32, 40])
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_cpu_world_small_host_tiers_complete_and_match(policy: str, host: int) -> None:
    """Whatever the host tier's size, the trace completes (none refused, no stall) with
    the big pool's outputs. With write_back and 2-6 host blocks the head request used to
    be refused while its blocks were only held by copy-outs still in flight (device
    parents pinned by children whose host copies were still filling)."""
    ex, manager, engine, runtime = _numpy_run(Capacities(12, host), policy, deadline_s=20.0)
    assert engine.stats.rejected == 0 and engine.stats.finished == 24
    assert not runtime.tasks and not manager.inflight
    _assert_same_outputs(ex, _numpy_reference(), (policy, host))


def test_executor_needs_request_states() -> None:
    from kvflow.engine import StepBatch

    ex = NumpyExecutor(NumpyBackend(SHAPE, 4, 1), random_weights(SHAPE, 0))
    with pytest.raises(ConfigError, match=r"StepBatch\.requests"):
        asyncio.run(ex.run_step(StepBatch(prefill=[(4, 0)]), []))


# ----------------------------------------------------------------------------- GPU
def _gpu_run(caps: Capacities, write_policy: str, trace: list[list[EngineRequest]],
             spec: ModelSpec = SPEC, record_rows: bool = False) -> tuple[Any, CacheManager,
                                                                           Engine, Runtime]:
    from kernels.backend import CudaBackend
    from kernels.compute import GpuExecutor

    async def go() -> tuple[Any, CacheManager, Engine, Runtime]:
        return await run_waves(
            lambda c: CudaBackend(spec, c.device, max(c.host, 1)),
            lambda b: GpuExecutor(b, seed=0, max_tokens=64, decode_split=32,
                                  record_rows=record_rows),
            caps, write_policy, trace, spec.bytes_per_block)

    return _run_uvloop(go)


def _run_uvloop(coro_fn: Callable[[], Any]) -> Any:
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(coro_fn())


@gpu
@pytest.mark.gpu
def test_gpu_outputs_bit_identical_across_pools() -> None:
    """Swapped to host and back, evicted and recomputed: the very same tokens and checksums."""
    trace = waves()
    ref, *_ = _gpu_run(Capacities(512), "write_through", trace)
    assert len(ref.outputs) == 24 and all(len(v) == 6 for v in ref.outputs.values())
    for policy, host in (("write_through", 16), ("write_back", 32)):
        ex, manager, _, runtime = _gpu_run(Capacities(12, host), policy, trace)
        assert manager.stats.hits[Tier.HOST] > 0 and manager.stats.evictions[Tier.HOST] > 0
        assert runtime.metrics.ops[OpKind.SWAP_IN.value] > 0
        assert ex.outputs == ref.outputs, policy


@gpu
@pytest.mark.gpu
def test_gpu_matches_numpy_reference() -> None:
    """One prefill (chunked, two requests) and a decode step: GPU (bf16) vs float64 numpy."""
    from kernels.backend import CudaBackend
    from kernels.compute import GpuExecutor

    async def go() -> None:
        be = CudaBackend(SPEC, 16, 1)
        ex = GpuExecutor(be, seed=5, max_tokens=16, decode_split=32, record_rows=True)
        model = NumpyModel(SHAPE, ex.weights_numpy())
        kc, vc = _pools(16)
        ta, tb = np.arange(0, 5, dtype=np.int32), np.arange(5, 10, dtype=np.int32)
        toks_a = prompt_tokens([1, 2, 3, 4, 5], "a", BT, 0, 70)
        toks_b = prompt_tokens([9, 8, 7], "b", BT, 0, 40)
        steps = [
            [StepItem("a", False, toks_a[:30], 0, ta, False),
             StepItem("b", False, toks_b, 0, tb, True)],
            [StepItem("a", False, toks_a[30:], 30, ta, True),
             StepItem("b", True, np.array([3], dtype=np.int32), 40, tb, True)],
            [StepItem("a", True, np.array([11], dtype=np.int32), 70, ta, True),
             StepItem("b", True, np.array([4], dtype=np.int32), 41, tb, True)],
        ]
        for items in steps:
            await ex.run_items(items)
            y = model.forward(build_step(items, SHAPE, 32), kc, vc)
            got = np.array([ex.rows[rid][-1] for rid in (it.request_id for it in items
                                                          if it.emit)])
            err = np.linalg.norm(got - y) / np.linalg.norm(y)
            assert err < 3e-2, err
        for layer in range(SHAPE.num_layers):  # the KV the GPU wrote, against the reference
            dev = be.device_kv(layer, "k").view(np.uint16).get().astype(np.uint32) << 16
            gk = dev.view(np.float32).reshape(-1)[:10 * SHAPE.block_stride]
            rk = kc[layer][:10 * SHAPE.block_stride]
            ok = np.isfinite(rk)
            err = np.linalg.norm(gk[ok] - rk[ok]) / np.linalg.norm(rk[ok])
            assert err < 3e-2, (layer, err)

    _run_uvloop(go)


@gpu
@pytest.mark.gpu
def test_gpu_compute_waits_for_the_load_on_the_device() -> None:
    """A load held back on the GPU (spin): compute waits for it there, the CPU does not."""
    import cupy as cp

    from kernels.backend import CudaBackend
    from kernels.compute import BackendTask, GpuExecutor
    from kernels.testing import spin
    from kvflow.manager import TransferOp

    async def go() -> None:
        be = CudaBackend(SPEC, 8, 8)
        ex = GpuExecutor(be, seed=1, max_tokens=64)
        await ex.warm_up(block=7)
        toks = prompt_tokens([1, 2, 3], "r", BT, 0, 48)
        table = np.array([0, 1, 2], dtype=np.int32)
        # compute the prompt, copy its KV to host blocks 4..6, then poison the device copy
        await ex.run_items([StepItem("r", False, toks[:40], 0, table, False)])
        await BackendTask(be, TransferOp(1, OpKind.EVICT, Tier.DEVICE, Tier.HOST, [0, 1, 2],
                                         [4, 5, 6], [])).wait()
        await ex.run_items([StepItem("r", False, toks[40:], 40, table, True)])
        want = ex.outputs.pop("r")
        for layer in range(be.num_layers):
            for role in ("k", "v"):
                be.device_kv(layer, role)[:3] = 0xFF  # NaN bf16: any read shows
        cp.cuda.runtime.deviceSynchronize()  # (the default stream: not ordered with ours)
        # load it back behind a 0.3 s spin on the load stream; compute must wait on the GPU
        spin(be.load_stream, 0.3)
        load = BackendTask(be, TransferOp(2, OpKind.SWAP_IN, Tier.HOST, Tier.DEVICE, [4, 5, 6],
                                          [0, 1, 2], []))
        step = asyncio.ensure_future(
            ex.run_items([StepItem("r", False, toks[40:], 40, table, True)], [load]))
        for _ in range(20):
            await asyncio.sleep(0.001)
        assert not load.finished and not step.done()
        assert ex.last_enqueue_s < 0.1, "the CPU waited for the load"
        await step
        assert ex.outputs["r"] == want

    _run_uvloop(go)


@gpu
@pytest.mark.gpu
def test_gpu_gemm_rows_bit_identical_across_kernels() -> None:
    """The skinny, 64-row and 128-row GEMMs give a row the very same bits (and the right ones)."""
    import cupy as cp

    from kernels.backend import CudaBackend
    from kernels.compute import GpuExecutor, to_bf16

    ex = GpuExecutor(CudaBackend(SPEC, 4, 1), seed=3, max_tokens=16)
    w = ex.weights[0]["wgu"]
    n, k = w.shape
    rows = to_bf16(cp.random.standard_normal((700, k), dtype=cp.float32))
    outs = {}
    for m in (20, 100, 700):  # skinny, bm64, bm128
        for mode in (0, 1):
            out = cp.zeros((m, n), cp.uint16 if mode == 0 else cp.float32)
            cp.cuda.runtime.deviceSynchronize()
            ex._gemm(np.uint64(rows.data.ptr), w, np.uint64(out.data.ptr), m, n, k, mode)
            ex.stream.synchronize()
            outs[m, mode] = out[:20].get()
    for mode in (0, 1):
        for m in (100, 700):
            np.testing.assert_array_equal(outs[m, mode].view(np.uint32 if mode else np.uint16),
                                          outs[20, mode].view(np.uint32 if mode else np.uint16))
    a = (rows[:20].get().astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    b = (w.get().astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    ref = a @ b.T
    got = outs[20, 1].astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5


def test_gpu_tests_skip_cleanly_without_a_gpu() -> None:
    if _GPU is None:
        pytest.skip("a GPU is present")
    assert "CuPy" in _GPU or "CUDA" in _GPU or "device" in _GPU
    assert math.isfinite(0.0)
