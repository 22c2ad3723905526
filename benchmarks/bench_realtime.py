"""End-to-end real-time replay through real block stores on the CPU world (issue 7).

Replays a multi-turn chat trace twice on one ``kvflow.realtime.RealtimeStack``
(engine, manager, runtime; numpy "device" and host; ``StoreBackend`` over a
real store): pass 1 starts cold and writes what it computes through
(write_through), pass 2 finds the prefixes it needs in storage and reads them
back through host. Compute is free (``step_s = token_s = 0``): the numbers are
what kvflow's scheduling, the copies, the store calls and the byte checks cost,
the ceiling a real model's compute would sit on. Every cached block a prefill
reads is verified (``corrupt_reads`` must be 0); decode steps are not
re-checked (``verify_decode=False``).

    python benchmarks/bench_realtime.py [--stores memory,local,redis] [--sessions 48]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from typing import Any

from kvflow.realtime import RealtimeConfig, engine_requests, run_realtime, tiny_spec
from kvflow.stores import BlockStore, LocalDirStore, MemoryStore, Namespace, RedisStore
from kvflow.stores.redis_server import LocalRedisServer, find_redis_server
from traces.generate import multi_turn


def open_store(kind: str, ns: Namespace, tmp: str,
               servers: list[LocalRedisServer]) -> BlockStore | None:
    if kind == "memory":
        return MemoryStore(ns)
    if kind == "local":
        return LocalDirStore(tmp, ns)
    if kind == "redis":
        if find_redis_server() is None:
            print("redis: skipped (redis-server not on PATH)")
            return None
        srv = LocalRedisServer().start()
        servers.append(srv)
        return RedisStore(ns, srv.url, mac_key=os.urandom(32))  # a throwaway deployment key
    raise SystemExit(f"unknown store {kind!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stores", default="memory,local,redis")
    ap.add_argument("--sessions", type=int, default=48)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--device-blocks", type=int, default=96)
    ap.add_argument("--host-blocks", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print the full reports as JSON")
    args = ap.parse_args()

    spec = tiny_spec(block_tokens=16, num_layers=args.layers, num_kv_heads=args.kv_heads,
                     head_dim=args.head_dim)
    reqs = engine_requests(multi_turn(sessions=args.sessions, turns=args.turns,
                                      system_len=512, user_len=128, output_len=8,
                                      think_time_s=0.5, rate=20, block_tokens=16, seed=0),
                           time_scale=0.05)
    cfg = RealtimeConfig(device_blocks=args.device_blocks, host_blocks=args.host_blocks,
                         storage_blocks=1 << 16, prefetch_policy="wait_complete",
                         max_batch_tokens=2048, max_running=16, step_s=0.0, token_s=0.0,
                         verify_decode=False, read_timeout_s=None, write_timeout_s=None)
    blocks = sum(len(r.keys) for r in reqs)
    print(f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, python "
          f"{platform.python_version()}, load {os.getloadavg()[0]:.2f}")
    print(f"trace: {len(reqs)} requests, {blocks} prompt blocks of "
          f"{spec.bytes_per_block // 1024} KiB; tiers device {cfg.device_blocks}, host "
          f"{cfg.host_blocks}, storage {cfg.storage_blocks}; compute free")
    head = (f"{'store':7} {'pass':>4} {'run s':>6} {'req/s':>7} {'prompt tok/s':>12} "
            f"{'hit dev':>7} {'hit sto':>7} {'rd blk':>6} {'wr blk':>6} {'rd MB/s':>7} "
            f"{'wr MB/s':>7} {'skip':>5} {'fail':>4} {'corrupt':>7}")
    print(head)
    servers: list[LocalRedisServer] = []
    out: dict[str, Any] = {}
    try:
        for kind in args.stores.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                store = open_store(kind, Namespace.for_model(spec), tmp, servers)
                if store is None:
                    continue
                try:
                    reports = run_realtime(reqs, cfg, store, spec, passes=2)
                finally:
                    store.close()
            out[kind] = reports
            for i, r in enumerate(reports):
                b = r["store"]["backend"]
                t = r["run_time_s"]
                mb = spec.bytes_per_block / 1e6
                print(f"{kind:7} {i + 1:>4} {t:6.2f} {r['throughput']['requests_per_s']:7.1f} "
                      f"{r['throughput']['prompt_tokens_per_s']:12,.0f} "
                      f"{r['hit_rate']['device']:7.1%} {r['hit_rate']['storage']:7.1%} "
                      f"{b['blocks_read']:6d} {b['blocks_written']:6d} "
                      f"{b['blocks_read'] * mb / t:7.1f} {b['blocks_written'] * mb / t:7.1f} "
                      f"{b['write_skipped']:5d} {r['errors']['failed_transfers']:4d} "
                      f"{r['errors']['corrupt_reads']:7d}")
    finally:
        for srv in servers:
            srv.close()
    if args.json:
        print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
