"""Soak: the real-bytes stack under random cancellation, store faults and corruption.

Not a speed benchmark and not in CI: it runs the reference engine, the
manager and the runtime on the CPU "device" (``kvflow.realtime.cpu``: numpy device and
host arrays, copies of real bytes) with a real block store behind
``StoreBackend``, and a compute (``KeyedBlockExecutor``) that writes
key-derived bytes into every block it computes and checks every cached block
it reads. Meanwhile it

* cancels a random transfer in flight now and then (any kind: swap-in,
  eviction, backup, prefetch, store write);
* makes the store fail calls (``OSError``), answer past its deadline, lose
  blocks behind the manager's back, and corrupts stored blobs in place (a
  flipped byte on disk; in Redis, a flipped byte or a forged blob with a
  correct checksum but no MAC).

An *operation* is one transfer the runtime ran to its end (landed, failed or
cancelled); the run stops after ``--ops`` of them. It prints the operations,
the requests served, the faults injected by kind, the **wrong bytes returned**
(cached blocks the compute found with bytes their key does not imply; must be
0), whether **every pool is back to full** after the drain (must be true), and
the RSS at start and end, with wall and CPU time.

    python benchmarks/soak.py --ops 1000000                 # local directory store
    python benchmarks/soak.py --ops 100000 --store redis    # needs redis-server
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import resource
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvflow.backends import RoutedBackend
from kvflow.engine import Engine, EngineConfig, EngineRequest
from kvflow.host_memory import HostArrays
from kvflow.layout import ModelSpec
from kvflow.manager import CacheManager, Capacities
from kvflow.policy import PrefetchPolicy, WritePolicy
from kvflow.radix import ABSENT, Tier
from kvflow.realtime.cpu import HostCopyBackend, KeyedBlockExecutor
from kvflow.runtime import Runtime
from kvflow.store_backend import StoreBackend, store_key
from kvflow.stores import AsyncStore, BlockStore, LocalDirStore, Namespace
from kvflow.stores.base import encode_blob, encode_key

BLOCK_TOKENS = 16


def tiny_spec() -> ModelSpec:
    """4 layers of K and V, 2 heads of 16: a block is 4 KiB of real bytes."""
    return ModelSpec("kvflow-soak", num_layers=4, num_kv_heads=2, head_dim=16, dtype="bf16",
                     block_tokens=BLOCK_TOKENS, hidden_size=128, num_attention_heads=8,
                     intermediate_size=256, active_params=1e6)


class SoakExecutor(KeyedBlockExecutor):
    """``KeyedBlockExecutor`` with a cheaper content per key: its 16-byte xxh3_128 digest
    tiled over the block (a numpy generator per key dominated the soak's CPU time).
    A block holding another key's bytes, a stale or a torn one, still differs from
    what its key implies in every 16 bytes of every layer it got wrong."""

    def expected(self, key: Hashable) -> np.ndarray:
        reps = self.num_layers * self.layer_bytes // 16
        tile = xxhash.xxh3_128_digest(repr(key).encode())
        return np.frombuffer(tile * reps, dtype=np.uint8).reshape(self.num_layers,
                                                                  self.layer_bytes)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class ChaosStore(BlockStore):
    """A real store with faults injected into its calls and its stored blobs.

    ``fail`` makes a call raise ``OSError`` (a dead disk or a reset connection);
    ``slow`` makes a read sleep past the backend's deadline; ``lose`` deletes a
    recently written block behind the manager's back; ``corrupt`` damages a
    recently written blob where it is stored (the store's checksum or MAC must
    catch it). Each is a probability per call; ``injected`` counts them.
    """

    def __init__(self, inner: BlockStore, rng: random.Random, *, fail: float, slow: float,
                 slow_s: float, lose: float, corrupt: float, lie: float,
                 damage: Any) -> None:
        super().__init__(inner.namespace)
        self.inner = inner
        self.rng = rng
        self.p = {"fail": fail, "slow": slow, "lose": lose, "corrupt": corrupt, "lie": lie}
        self.slow_s = slow_s
        self.damage = damage  # (store, key, rng) -> None: corrupt one stored blob
        self.injected: Counter[str] = Counter()
        self._recent: deque[Hashable] = deque(maxlen=512)
        self._lock = threading.Lock()

    def _roll(self, kind: str) -> bool:
        with self._lock:
            hit = self.rng.random() < self.p[kind]
            if hit:
                self.injected[kind] += 1
            return hit

    def _victim(self) -> Hashable | None:
        with self._lock:
            return self.rng.choice(self._recent) if self._recent else None

    def _chaos_before_read(self) -> None:
        if self._roll("fail"):
            raise OSError(5, "injected I/O error")
        if self._roll("lose") and (k := self._victim()) is not None:
            self.inner.delete(k)
        if self._roll("corrupt") and (k := self._victim()) is not None:
            self.damage(self.inner, k, self.rng)
        if self._roll("slow"):
            time.sleep(self.slow_s)

    def get_many(self, keys: Sequence[Hashable]) -> list[bytes | None]:
        self._chaos_before_read()
        return self.inner.get_many(keys)

    def get_many_into(self, keys: Sequence[Hashable], buffers: Sequence[object]) -> list[bool]:
        self._chaos_before_read()
        out = self.inner.get_many_into(keys, buffers)
        if any(out) and self._roll("lie"):  # a store bug: wrong bytes reported as a hit
            i = out.index(True)
            view = memoryview(buffers[i]).cast("B")  # type: ignore[arg-type]
            view[:] = os.urandom(view.nbytes)
        return out

    def put_many(self, items: Sequence[tuple[Hashable, bytes]]) -> list[bool]:
        if self._roll("fail"):
            raise OSError(28, "injected: no space left on device")
        out = self.inner.put_many(items)
        with self._lock:
            self._recent.extend(k for (k, _), ok in zip(items, out, strict=True) if ok)
        return out

    def contains_many(self, keys: Sequence[Hashable]) -> list[bool]:
        return self.inner.contains_many(keys)

    def delete(self, key: Hashable) -> bool:
        return self.inner.delete(key)

    @property
    def stats(self) -> Any:
        return self.inner.stats

    def close(self) -> None:
        self.inner.close()
        super().close()


def damage_local(store: BlockStore, key: Hashable, rng: random.Random) -> None:
    """Flip one byte of a block's file, somewhere in its header or payload."""
    assert isinstance(store, LocalDirStore)
    path = store.path_for(key)  # the store's own file for the key
    try:
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            if size:
                at = rng.randrange(size)
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 0xFF]))
    except OSError:
        pass  # gone already (evicted, lost): nothing to damage


def make_damage_redis(server_url: str) -> Any:
    import redis

    raw = redis.Redis.from_url(server_url)

    def damage(store: BlockStore, key: Hashable, rng: random.Random) -> None:
        name = store._rkey(encode_key(key))  # type: ignore[attr-defined]
        blob = raw.get(name)
        if blob is None:
            return
        if rng.random() < 0.5:  # a flipped byte
            at = rng.randrange(len(blob))
            blob = blob[:at] + bytes([blob[at] ^ 0xFF]) + blob[at + 1:]
        else:  # a forgery: another payload, a correct checksum, no MAC
            ns = store.namespace
            blob = encode_blob(ns.layout, encode_key(key), os.urandom(ns.block_bytes or 16))
        raw.set(name, blob)

    return damage


class Prompts:
    """Prompts with the reuse a chat service sees: a few system prompts, sessions whose
    turns extend the previous turn, and one-off requests; keys chain the prefix."""

    def __init__(self, rng: random.Random, sessions: int = 64) -> None:
        self.rng = rng
        self.sessions: list[tuple[Hashable, ...]] = [() for _ in range(sessions)]
        self.next_id = 0

    def next(self) -> tuple[tuple[Hashable, ...], int, int]:
        rng = self.rng
        self.next_id += 1
        n = self.next_id
        r = rng.random()
        if r < 0.6:  # a session's next turn: its whole history plus a few new blocks
            s = rng.randrange(len(self.sessions))
            keys = self.sessions[s]
            if not keys or len(keys) > 24 or rng.random() < 0.05:  # new session
                keys = tuple(("sys", rng.randrange(4), i) for i in range(rng.randint(1, 4)))
            keys = keys + tuple((n, i) for i in range(rng.randint(1, 4)))
            self.sessions[s] = keys
        elif r < 0.85:  # a system prompt and a fresh question
            keys = tuple(("sys", rng.randrange(4), i) for i in range(rng.randint(1, 4)))
            keys = keys + tuple((n, i) for i in range(rng.randint(1, 3)))
        else:  # a one-off
            keys = tuple((n, i) for i in range(rng.randint(1, 6)))
        tokens = len(keys) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS)
        return tuple(map(store_key, keys)), tokens, rng.randint(1, 4)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    loop = asyncio.get_running_loop()
    spec = tiny_spec()
    ns = Namespace.for_model(spec)
    tmp = tempfile.mkdtemp(prefix="kvflow-soak-")
    server = None
    if args.store == "redis":
        from kvflow.stores import RedisStore
        from kvflow.stores.redis_server import LocalRedisServer

        server = LocalRedisServer(extra_args=["--maxmemory", "256mb",
                                              "--maxmemory-policy", "allkeys-lru"]).start()
        inner: BlockStore = RedisStore(ns, server.url, mac_key=os.urandom(32),
                                       retry_interval_s=0.01)
        damage = make_damage_redis(server.url)
    else:
        inner = LocalDirStore(tmp, ns, capacity_bytes=args.storage_blocks * 5000)
        damage = damage_local
    store = ChaosStore(inner, random.Random(args.seed + 1), fail=args.p_fail,
                       slow=args.p_slow, slow_s=0.03, lose=args.p_lose,
                       corrupt=args.p_corrupt, lie=args.p_lie, damage=damage)
    caps = Capacities(args.device_blocks, args.host_blocks, args.storage_blocks)
    manager = CacheManager(caps, eviction=args.eviction,
                           write_policy=WritePolicy(args.write_policy),
                           prefetch_policy=PrefetchPolicy(args.prefetch_policy))
    layout = spec.layout
    host = HostArrays.for_layout(layout, args.host_blocks)
    copies = HostCopyBackend(host, args.device_blocks)
    astore = AsyncStore(store, max_workers=4)
    storage = StoreBackend(astore, host, layout.num_layers, read_timeout_s=0.02,
                           write_timeout_s=0.05)
    backend = RoutedBackend({(Tier.HOST, Tier.DEVICE): copies, (Tier.DEVICE, Tier.HOST): copies,
                             (Tier.STORAGE, Tier.HOST): storage,
                             (Tier.HOST, Tier.STORAGE): storage})
    runtime = Runtime(manager, backend, spec.bytes_per_block, loop)
    executor = SoakExecutor(copies.device_layer, layout.num_layers,
                            layout.bytes_per_layer_block, BLOCK_TOKENS, verify_decode=False)
    prompts = Prompts(rng)
    cancels = Counter[str]()
    served = rejected = 0
    rss0, cpu0, t0 = rss_mib(), time.process_time(), time.perf_counter()
    m = runtime.metrics

    def ops_done() -> int:
        return sum(m.ops.values()) - len(runtime.tasks)

    last_report = 0
    stop_at = t0 + 60 * args.max_minutes if args.max_minutes else float("inf")
    while ops_done() < args.ops and time.perf_counter() < stop_at:
        # One engine per pass (as a server restarts its loop): the manager, runtime,
        # pools and store carry over; the engine's per-request records do not.
        engine = Engine(manager, runtime, executor,
                        EngineConfig(BLOCK_TOKENS, max_batch_tokens=1024,
                                     max_running=args.max_running))
        room = asyncio.Event()
        engine.on_finish = lambda _st, room=room: room.set()
        run = loop.create_task(engine.run())
        for _ in range(args.pass_requests):
            while engine.queue_len + len(engine.running) >= args.queue:  # bounded
                room.clear()
                waiter = loop.create_task(room.wait())
                await asyncio.wait([waiter, run], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if run.done():
                    run.result()
            keys, n_in, n_out = prompts.next()
            engine.add(EngineRequest(prompts.next_id, loop.time(), keys, n_in, n_out))
            if rng.random() < args.p_cancel and runtime.tasks:
                task = rng.choice(list(runtime.tasks.values()))
                if not task.finished:
                    cancels[task.kind.value] += 1
                    task.cancel("soak: random cancel")
            if ops_done() >= args.ops or time.perf_counter() >= stop_at:
                break
        engine.close()
        await run
        served += engine.stats.finished
        rejected += engine.stats.rejected
        done = ops_done()
        if args.trace_memory:
            import tracemalloc

            if not tracemalloc.is_tracing():
                tracemalloc.start(8)
                snap = None
            elif snap is None:
                snap = tracemalloc.take_snapshot()
            else:
                grown = tracemalloc.take_snapshot().compare_to(snap, "traceback")
                for stat in grown[:6]:
                    print(stat, *stat.traceback.format()[-6:], sep="\n    ")
        if done - last_report >= args.ops // 20 or done >= args.ops or (
                time.perf_counter() >= stop_at):
            last_report = done
            print(f"  {done:>10,} ops  {served:>9,} requests  wrong bytes "
                  f"{executor.stats.corrupt_reads}  rss {rss_mib():.0f} MiB  "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    await runtime.drain()
    await storage.drain()
    await runtime.drain()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    manager.check_invariants()
    idle = (not runtime.tasks and not manager.inflight and storage.inflight == 0
            and all(n.ref == 0 for n in manager.index))
    owned = all(manager.pools[t].num_used == sum(1 for n in manager.index
                                                 if n.state[t] != ABSENT) for t in (0, 1, 2))
    manager.drop_all()
    full = all(p.num_used == 0 for p in manager.pools)
    astore.close(wait=True)
    st = store.stats
    store.close()
    if server is not None:
        server.close()
    return {
        "operations": ops_done(), "transfers": dict(m.ops), "requests": served,
        "rejected": rejected, "wall_s": wall, "cpu_s": cpu,
        "cancelled": dict(cancels), "store_faults": dict(store.injected),
        "failed_transfers": m.failed, "cancelled_transfers": m.cancelled,
        "dependency_failures": m.dependency_failures,
        "recomputed_blocks": manager.stats.recomputed_blocks,
        "lost_copies": manager.stats.lost_copies,
        "store": {"hits": st.hits, "misses": st.misses, "corrupt": st.corrupt,
                  "forged": st.forged, "errors": st.errors, "put_ok": st.put_ok},
        "blocks_verified": executor.stats.blocks_verified,
        "blocks_written": executor.stats.blocks_written,
        "wrong_bytes": executor.stats.corrupt_reads,
        "examples": executor.stats.examples,
        "idle_after_drain": idle, "pools_owned": owned, "pools_full_after_drain": full,
        "rss_start_mib": rss0, "rss_end_mib": rss_mib(),
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=100_000, help="transfers to run to their end")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="stop sooner, after this much wall time (the count reached is printed)")
    ap.add_argument("--store", choices=["local", "redis"], default="local")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device-blocks", type=int, default=48)
    ap.add_argument("--host-blocks", type=int, default=24)
    ap.add_argument("--storage-blocks", type=int, default=4096)
    ap.add_argument("--eviction", default="lru")
    ap.add_argument("--write-policy", default="write_through")
    ap.add_argument("--prefetch-policy", default="wait_complete")
    ap.add_argument("--max-running", type=int, default=16, help="requests in a batch")
    ap.add_argument("--queue", type=int, default=32, help="requests waiting or running")
    ap.add_argument("--pass-requests", type=int, default=2000,
                    help="requests per engine pass")
    ap.add_argument("--p-cancel", type=float, default=0.05,
                    help="chance per request of cancelling a random transfer in flight")
    ap.add_argument("--p-fail", type=float, default=0.002, help="per store call")
    ap.add_argument("--p-slow", type=float, default=0.0005, help="per store read")
    ap.add_argument("--p-lose", type=float, default=0.002, help="per store read")
    ap.add_argument("--p-corrupt", type=float, default=0.002, help="per store read")
    ap.add_argument("--p-lie", type=float, default=0.0,
                    help="per store read: the store hands back wrong bytes as a hit (a store "
                         "bug nothing below the compute can see: shows the check can fail)")
    ap.add_argument("--trace-memory", action="store_true",
                    help="print what grew between passes (tracemalloc; slow)")
    args = ap.parse_args()
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    print(f"soak: {args.ops:,} operations, {args.store} store, seed {args.seed}; "
          f"{platform.node()} ({os.cpu_count()} CPUs), python {platform.python_version()}",
          flush=True)
    r = runner(soak(args))
    kinds = ", ".join(f"{k} {v:,}" for k, v in r["transfers"].items() if v)
    print(f"operations          {r['operations']:,} transfers ({kinds})")
    print(f"requests            {r['requests']:,} served, {r['rejected']:,} rejected")
    print(f"wall / CPU          {r['wall_s']:.1f} s / {r['cpu_s']:.1f} s "
          f"({r['operations'] / r['wall_s']:,.0f} ops/s wall)")
    faults = {**{f"cancel {k}": v for k, v in r["cancelled"].items()}, **r["store_faults"]}
    print(f"faults injected     {sum(faults.values()):,}: "
          + ", ".join(f"{k} {v:,}" for k, v in sorted(faults.items())))
    print(f"failures seen       {r['failed_transfers']:,} failed / "
          f"{r['cancelled_transfers']:,} cancelled transfers, "
          f"{r['dependency_failures']:,} readers of those failed, "
          f"{r['recomputed_blocks']:,} blocks recomputed, {r['lost_copies']:,} copies lost")
    s = r["store"]
    print(f"store               {s['hits']:,} hits, {s['misses']:,} misses ({s['corrupt']:,} "
          f"corrupt, {s['forged']:,} forged), {s['errors']:,} errors, {s['put_ok']:,} puts")
    print(f"blocks checked      {r['blocks_verified']:,} read and verified, "
          f"{r['blocks_written']:,} computed")
    seen = f"  {r['examples'][:3]!r}" if r["examples"] else ""
    print(f"wrong bytes returned {r['wrong_bytes']} cached blocks read with bytes their key "
          f"does not imply (must be 0){seen}")
    print(f"pools full after drain {r['pools_full_after_drain']} (must be True; idle "
          f"{r['idle_after_drain']}, every used block owned {r['pools_owned']})")
    print(f"RSS                 {r['rss_start_mib']:.0f} MiB at start, "
          f"{r['rss_end_mib']:.0f} MiB at end (max {r['max_rss_mib']:.0f} MiB)")
    if r["wrong_bytes"] or not r["pools_full_after_drain"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
