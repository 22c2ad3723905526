"""A storage tier under a computing engine: outputs bit-identical to an all-resident run.

The engine computes real KV (``kernels.model``: the float64 numpy world on the
CPU, the batch-invariant kernels on a GPU) over a device pool too small to keep
it, a host tier, and a real block store (a local directory, a real
``redis-server``). Blocks go device -> host -> store and come back store ->
host -> device (prefetched at arrival, then swapped in) for every write and
prefetch policy; the sampled tokens and their checksums must equal those of a
run whose device pool keeps everything. A second engine over the same store,
its index rebuilt from it at start, must produce them too.

The numpy world runs in CI (the store path is the same ``StoreBackend`` the GPU
world uses, over another host pool); the GPU tests skip, saying why, without
CuPy and a GPU. Also here: how ``--store`` is checked and sized.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels import gpu_unavailable_reason
from kernels.model import ModelShape, NumpyBackend, NumpyExecutor, random_weights
from kvflow.backends import RoutedBackend
from kvflow.engine import Engine, EngineConfig, EngineRequest
from kvflow.errors import ConfigError, InvalidBlockId
from kvflow.layout import ModelSpec
from kvflow.manager import CacheManager, Capacities, OpKind
from kvflow.radix import Tier
from kvflow.replay import ReplayConfig, request_keys
from kvflow.runtime import Runtime
from kvflow.store_backend import StoreBackend
from kvflow.store_index import rediscover
from kvflow.stores import BlockStore, LocalDirStore, Namespace
from kvflow.stores.spec import open_store, parse_store
from kvflow.world import TierRequest, new_loop
from traces.generate import multi_turn

BT = 16
SPEC = ModelSpec("tiny", num_layers=3, num_kv_heads=2, head_dim=64, hidden_size=256,
                 num_attention_heads=4, intermediate_size=512, block_tokens=BT)
CPU_SPEC = SPEC.replace(name="tiny-cpu", hidden_size=128, num_attention_heads=2,
                        num_kv_heads=1, intermediate_size=128)
CPU_SHAPE = ModelShape.from_spec(CPU_SPEC)
#: (write policy, prefetch policy) pairs: every write policy, every prefetch policy.
#: (best_effort cancels a prefetch not landed at admission, timeout one not landed by its
#: deadline: only wait_complete is sure to read the store in these waves.)
POLICIES = [("write_through", "wait_complete"), ("write_back", "timeout"),
            ("write_through_selective", "best_effort")]

_GPU = gpu_unavailable_reason()
gpu = pytest.mark.skipif(_GPU is not None, reason=f"needs a CUDA GPU and CuPy: {_GPU}")


def waves(sessions: int = 4, turns: int = 3) -> list[list[EngineRequest]]:
    """A multi-turn trace as waves: turn t of every session, once turn t-1 is done."""
    reqs = multi_turn(sessions=sessions, turns=turns, system_len=40, user_len=20,
                      output_len=6, think_time_s=1.0, rate=4.0, block_tokens=BT, seed=3)
    seen: dict[Any, int] = {}
    out: list[list[EngineRequest]] = [[] for _ in range(turns)]
    for r in reqs:
        t = seen.get(r.session_id, 0)
        seen[r.session_id] = t + 1
        out[t].append(EngineRequest(r.index, r.arrival_s, request_keys(r, None), r.input_len,
                                    r.output_len))
    return out


async def run_waves(make_backend: Callable[[Capacities], tuple[Any, Any]],
                    make_executor: Callable[[Any], Any], caps: Capacities, write_policy: str,
                    prefetch_policy: str, trace: list[list[EngineRequest]],
                    bytes_per_block: int, store: BlockStore | None = None,
                    deadline_s: float = 120.0) -> tuple[Any, CacheManager, Runtime]:
    """The trace wave by wave through a fresh engine; ``make_backend`` returns (the
    backend the runtime drives, the compute backend). With ``store``, the manager's
    index is rebuilt from it first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    manager = CacheManager(caps, write_policy=write_policy, prefetch_policy=prefetch_policy,
                           eviction="lru")
    if store is not None:
        rediscover(manager, store)
    backend, compute = make_backend(caps)
    runtime = Runtime(manager, backend, bytes_per_block, loop)
    executor = make_executor(compute)
    engine = Engine(manager, runtime, executor, EngineConfig(BT, max_batch_tokens=48,
                                                             max_running=4))
    run = asyncio.ensure_future(engine.run())
    total = 0
    for wave in trace:
        for req in wave:
            engine.add(req)
        total += len(wave)
        while len(engine.done) < total:
            if run.done():
                run.result()
            if loop.time() > deadline:
                run.cancel()
                raise AssertionError(f"engine stalled: {len(engine.done)}/{total} done")
            await asyncio.sleep(0.0005)
    engine.close()
    await run
    await runtime.drain()
    for be in getattr(backend, "backends", ()):
        if isinstance(be, StoreBackend):
            await be.drain()
            await runtime.drain()
    manager.check_invariants()
    assert [(st.req.request_id, st.error) for st in engine.done if st.error] == []
    return executor, manager, runtime


# ------------------------------------------------------------------ the numpy world (CI)
class NumpyHostBlocks:
    """``HostMemory`` over a ``NumpyBackend``'s host pools: a block's float64 rows of every
    layer and role, as the bytes a store keeps (gathered and scattered: not contiguous)."""

    def __init__(self, backend: NumpyBackend) -> None:
        self.pools = backend.pools[Tier.HOST]
        self.n = backend.shape.block_stride
        self.num_blocks = len(self.pools[0][0]) // self.n
        self.rows = [arr for layer in self.pools for arr in layer]
        self.bytes_per_block = len(self.rows) * self.n * 8

    def block_view(self, block_id: int) -> None:
        return None

    def _rows(self, block_id: int) -> Iterator[np.ndarray]:
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockId(f"host block {block_id} out of range [0, {self.num_blocks})")
        for arr in self.rows:
            yield arr[block_id * self.n:(block_id + 1) * self.n]

    def gather(self, block_id: int, out: np.ndarray) -> None:
        out.view(np.float64).reshape(len(self.rows), self.n)[:] = list(self._rows(block_id))

    def scatter(self, block_id: int, src: np.ndarray) -> None:
        rows = src.view(np.float64).reshape(len(self.rows), self.n)
        for dst, row in zip(self._rows(block_id), rows, strict=True):
            dst[:] = row


def numpy_namespace() -> Namespace:
    return Namespace("tiny-cpu-f64", f"numpy-f64;L={CPU_SHAPE.num_layers};"
                     f"stride={CPU_SHAPE.block_stride}",
                     block_bytes=CPU_SHAPE.num_layers * 2 * CPU_SHAPE.block_stride * 8)


def numpy_world(store: BlockStore | None) -> Callable[[Capacities], tuple[Any, Any]]:
    def make(caps: Capacities) -> tuple[Any, Any]:
        be = NumpyBackend(CPU_SHAPE, caps.device, caps.host)
        if store is None:
            return be, be
        storage = StoreBackend(store, NumpyHostBlocks(be), CPU_SHAPE.num_layers)
        return RoutedBackend({(Tier.HOST, Tier.DEVICE): be, (Tier.DEVICE, Tier.HOST): be,
                              (Tier.STORAGE, Tier.HOST): storage,
                              (Tier.HOST, Tier.STORAGE): storage}), be
    return make


def numpy_run(caps: Capacities, write: str, prefetch: str,
              store: BlockStore | None = None) -> tuple[Any, CacheManager, Runtime]:
    weights = random_weights(CPU_SHAPE, 0)
    return asyncio.run(run_waves(numpy_world(store),
                                 lambda b: NumpyExecutor(b, weights, decode_split=32), caps,
                                 write, prefetch, waves(), CPU_SPEC.bytes_per_block, store))


@functools.cache
def numpy_reference() -> dict[Any, list[tuple[int, int]]]:
    """Tokens of the trace with a device pool that keeps everything (computed once)."""
    return numpy_run(Capacities(512), "write_through", "best_effort")[0].outputs


def tokens(outputs: dict[Any, list[tuple[int, int]]]) -> dict[Any, list[int]]:
    return {rid: [t for t, _ in toks] for rid, toks in outputs.items()}


@contextlib.contextmanager
def persistent_store(kind: str, tmp_path: Path) -> Iterator[Callable[[Namespace], BlockStore]]:
    """Opens the one persistent store (a directory, or a real redis-server) anew."""
    if kind == "dir":
        yield lambda ns: LocalDirStore(tmp_path, ns)
        return
    from kvflow.stores.redis_server import LocalRedisServer, find_redis_server

    if find_redis_server() is None:
        pytest.skip("redis-server binary not found on PATH: apt-get install -y redis-server")
    pytest.importorskip("redis", reason="redis-py not installed: pip install 'kvflow[redis]'")
    from kvflow.stores import RedisStore

    with LocalRedisServer() as server:
        server.start()
        yield lambda ns: RedisStore(ns, server.url, mac_key=b"d" * 32)


@pytest.mark.parametrize(("kind", "write", "prefetch"),
                         [("dir", *p) for p in POLICIES] + [("redis", *POLICIES[0])])
def test_numpy_world_through_a_real_store_matches_all_resident(
        tmp_path: Path, kind: str, write: str, prefetch: str) -> None:
    """Computed float64 KV through device -> host -> store -> host -> device: the same
    tokens as all-resident; then a new engine over the same store, warm, the same again."""
    ref = numpy_reference()
    caps = Capacities(12, 4, 256)  # a host tier too small to hold a session's history
    with persistent_store(kind, tmp_path) as reopen:
        for attempt in ("cold", "warm"):
            store = reopen(numpy_namespace())
            try:
                ex, manager, runtime = numpy_run(caps, write, prefetch, store)
                stats = store.stats
            finally:
                store.close()
            assert stats.corrupt == 0 and manager.stats.recomputed_blocks == 0
            # write_back stores only what host evicts, whose parents stayed above: such
            # blocks cannot be matched without them (prefix closure), so none is indexed
            warm = attempt == "warm" and write != "write_back"
            assert (manager.stats.found_copies > 0) == warm, manager.stats
            if attempt == "cold":  # (whether a cold run reads storage depends on timing)
                assert stats.put_ok > 0
            elif warm and prefetch == "wait_complete":  # (the others may cancel a prefetch)
                # every turn's history is on storage only: read at arrival, then swapped in
                assert runtime.metrics.ops[OpKind.PREFETCH.value] > 0
                assert stats.hits > 0 and manager.stats.failed_ops == 0, stats
            assert tokens(ex.outputs) == tokens(ref), (attempt, write, prefetch)


def test_numpy_host_blocks_round_trip_the_float64_rows() -> None:
    be = NumpyBackend(CPU_SHAPE, 2, 3)
    for layer in be.pools[Tier.HOST]:
        for arr in layer:
            arr[:] = np.random.default_rng(1).standard_normal(arr.shape)
    hb = NumpyHostBlocks(be)
    buf = np.empty(hb.bytes_per_block, dtype=np.uint8)
    hb.gather(2, buf)
    hb.scatter(0, buf)
    n = CPU_SHAPE.block_stride
    for layer in be.pools[Tier.HOST]:
        for arr in layer:
            assert np.array_equal(arr[:n], arr[2 * n:3 * n])
    with pytest.raises(InvalidBlockId):
        hb.gather(3, buf)


# ------------------------------------------------------------------ --store, checked
def test_store_specs_are_checked_at_config_time(tmp_path: Path) -> None:
    assert parse_store(f"dir:{tmp_path}") == ("dir", str(tmp_path))
    assert parse_store("file:///var/kv") == ("dir", "/var/kv")
    assert parse_store("redis://u:pw@h:1/0") == ("redis", "redis://u:pw@h:1/0")
    for bad in ("", "dir:", "/plain/path", "s3://bucket", "http://x"):
        with pytest.raises(ConfigError, match=r"dir:PATH|store must be"):
            parse_store(bad)
    with pytest.raises(ConfigError, match="backend 'cuda'"):
        ReplayConfig(store=f"dir:{tmp_path}")  # the simulated world moves sizes only
    with pytest.raises(ConfigError, match="through the host tier"):
        ReplayConfig(backend="cuda", store=f"dir:{tmp_path}", host_blocks=0)
    with pytest.raises(ConfigError, match="0 blocks"):
        ReplayConfig(backend="cuda", store=f"dir:{tmp_path}", storage_blocks=0)
    ReplayConfig(backend="cuda", store="redis://h:1/0", storage_blocks=8)


def test_storage_tier_sizes_and_refusals() -> None:
    from kernels.world import storage_capacity

    want = TierRequest(storage_blocks=300)
    assert storage_capacity(SPEC, want, "dir:/tmp") == 300
    gb = TierRequest(storage_gb=1.0)
    assert storage_capacity(SPEC, gb, "redis://h:1/0") == (1 << 30) // SPEC.bytes_per_block
    assert storage_capacity(SPEC, TierRequest(), "dir:/tmp/not/yet/made") > 0
    with pytest.raises(ConfigError, match="give --storage-blocks"):
        storage_capacity(SPEC, TierRequest(), "redis://u:secret@h:1/0")
    try:
        storage_capacity(SPEC, TierRequest(), "redis://u:secret@h:1/0")
    except ConfigError as exc:
        assert "secret" not in str(exc)


def test_a_directory_store_is_bounded_to_the_tier(tmp_path: Path) -> None:
    ns = Namespace.for_model(SPEC)
    store = open_store(f"dir:{tmp_path}", ns, blocks=10)
    try:
        assert isinstance(store, LocalDirStore)
        payload = bytes(SPEC.bytes_per_block)
        assert all(store.put_many([(k, payload) for k in range(12)]))
        assert len(store) == 10 and store.stats.evictions == 2
    finally:
        store.close()


# ---------------------------------------------------------------------------------- GPU
def gpu_world(store: BlockStore | None) -> Callable[[Capacities], tuple[Any, Any]]:
    from kernels.backend import CudaBackend
    from kernels.host_blocks import CudaHostBlocks

    def make(caps: Capacities) -> tuple[Any, Any]:
        be = CudaBackend(SPEC, caps.device, max(caps.host, 1))
        if store is None:
            return be, be
        storage = StoreBackend(store, CudaHostBlocks(be), SPEC.num_layers)
        return RoutedBackend({(Tier.HOST, Tier.DEVICE): be, (Tier.DEVICE, Tier.HOST): be,
                              (Tier.STORAGE, Tier.HOST): storage,
                              (Tier.HOST, Tier.STORAGE): storage}), be
    return make


def gpu_run(caps: Capacities, write: str, prefetch: str,
            store: BlockStore | None = None) -> tuple[Any, CacheManager, Runtime]:
    from kernels.compute import GpuExecutor

    async def go() -> tuple[Any, CacheManager, Runtime]:
        return await run_waves(gpu_world(store),
                               lambda b: GpuExecutor(b, seed=0, max_tokens=64, decode_split=32),
                               caps, write, prefetch, waves(), SPEC.bytes_per_block, store)

    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(go())


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("write", "prefetch"), POLICIES)
def test_gpu_through_a_store_is_bit_identical_to_all_resident(tmp_path: Path, write: str,
                                                              prefetch: str) -> None:
    """device -> host -> store -> host -> device on the GPU, the same tokens and checksums;
    then a new engine over the same directory, its index rebuilt from it, the same again."""
    ref, *_ = gpu_run(Capacities(512), "write_through", "best_effort")
    caps = Capacities(12, 4, 256)
    ns = Namespace.for_model(SPEC)
    for attempt in ("cold", "warm"):
        store = LocalDirStore(tmp_path, ns)
        try:
            ex, manager, runtime = gpu_run(caps, write, prefetch, store)
        finally:
            store.close()
        warm = attempt == "warm" and write != "write_back"  # (see the numpy world's test)
        assert (manager.stats.found_copies > 0) == warm
        if warm and prefetch == "wait_complete":
            assert runtime.metrics.ops[OpKind.PREFETCH.value] > 0
            assert manager.stats.failed_ops == 0
        assert ex.outputs == ref.outputs, (attempt, write, prefetch)


@gpu
@pytest.mark.gpu
def test_gpu_replay_with_a_store_outputs_equal_an_all_resident_replay(tmp_path: Path) -> None:
    """``kvflow replay --backend cuda --store dir:...`` on a multi-turn slice: the same
    outputs digest as all-resident, storage hits, and a second run starting warm."""
    from kernels.world import run_gpu_replay
    from traces.generate import write_generic

    trace = tmp_path / "mt.jsonl"
    reqs = multi_turn(sessions=6, turns=3, system_len=1024, user_len=512, output_len=8,
                      think_time_s=1.0, rate=4.0, block_tokens=512, seed=2)
    write_generic(reqs, trace, block_tokens=512, force=True)
    base = dict(trace=str(trace), model="llama-3-8b-l4", backend="cuda", executor="exact",
                headroom=False)
    ref = run_gpu_replay(ReplayConfig(**base, device_blocks=512, host_blocks=1,
                                      storage_blocks=0))
    store = f"dir:{tmp_path / 'store'}"
    runs = [run_gpu_replay(ReplayConfig(**base, device_blocks=12, host_blocks=4,
                                        storage_blocks=400, store=store,
                                        prefetch_policy="wait_complete"))
            for _ in range(2)]
    for i, r in enumerate(runs):
        assert r["requests"] == len(reqs) and r["rejected"] == 0
        assert r["device"]["outputs_digest"] == ref["device"]["outputs_digest"], i
        assert r["store"]["stats"]["corrupt"] == 0 and r["errors"]["failed_transfers"] == 0
    cold, warm = runs
    assert cold["bytes"]["storage_write"] > 0  # device -> host -> store
    assert cold["store"]["rediscovered"]["indexed"] == 0
    assert warm["store"]["rediscovered"]["indexed"] > 0
    # store -> host -> device: the warm run reads what the cold one wrote
    assert warm["hit_rate"]["storage"] > cold["hit_rate"]["storage"], warm["hit_rate"]
    assert warm["bytes"]["storage_read"] > 0 and warm["store"]["stats"]["hits"] > 0
    assert math.isclose(warm["config"]["storage_blocks"], 400)


def test_the_executor_finds_the_cuda_task_behind_a_routed_handle() -> None:
    """Found writing this: behind a ``RoutedBackend`` the executor's device-side waits got
    a ``RoutedHandle`` (``CudaBackend.wait_layer`` raises TypeError on it)."""
    from kernels.backend import CudaTask
    from kernels.compute import cuda_task
    from kvflow.backends import RoutedHandle

    task = CudaTask.__new__(CudaTask)  # (its fields need a GPU; only its type matters here)
    routed = RoutedHandle(object(), None, None)  # type: ignore[arg-type]
    assert cuda_task(task) is task
    assert cuda_task(routed) is None  # not on the GPU yet: the executor awaits the op
    routed.inner = task
    assert cuda_task(routed) is task
    assert cuda_task(object()) is None
