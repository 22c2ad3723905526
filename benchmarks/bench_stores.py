"""Read and write throughput of the block stores, batched (issue 7).

Writes then reads ``--blocks`` blocks of ``--block-kb`` KiB (random bytes,
sha256-like keys) in batches of ``--batch``, through:

* ``local``       LocalDirStore in a temporary directory, page cache as it comes
                  (writes land in the page cache; reads are warm);
* ``local+fsync`` LocalDirStore with ``fsync=True`` (durable writes); its reads
                  are cold: each file's pages are dropped (posix_fadvise
                  DONTNEED) before the timed read;
* ``redis``       RedisStore against a redis-server this script starts on a free
                  loopback port (persistence off) and stops at exit;

each op once with one caller (batches one after another) and once through
``AsyncStore`` with 4 workers and 4 batches in flight, and reads once more with
``get_many_into`` into reused buffers (the real world's pinned host blocks:
no fresh 512 KiB allocation, so no page faults, per block). Every read
verifies the checksum, as in service. Best of ``--repeat`` runs; MB = 10^6 bytes.

    python benchmarks/bench_stores.py [--blocks 256] [--batch 16] [--block-kb 512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence

import xxhash

from kvflow.stores import AsyncStore, BlockStore, LocalDirStore, Namespace, RedisStore
from kvflow.stores.redis_server import LocalRedisServer, find_redis_server


def batches(seq: Sequence, size: int) -> list[Sequence]:
    return [seq[i:i + size] for i in range(0, len(seq), size)]


def time_sync(fn: Callable[[Sequence], list], work: list[Sequence]) -> float:
    t0 = time.perf_counter()
    for b in work:
        fn(b)
    return time.perf_counter() - t0


def time_async(store: BlockStore, op: str, work: list[Sequence], workers: int) -> float:
    async def run() -> float:
        async with AsyncStore(store, max_workers=workers) as a:
            call = a.get_many if op == "read" else a.put_many
            t0 = time.perf_counter()
            await asyncio.gather(*(call(b) for b in work))
            return time.perf_counter() - t0

    return asyncio.run(run())


def drop_page_cache(store: LocalDirStore) -> None:
    """Evict the store's files from the page cache so the next read hits the disk."""
    for dirpath, _, files in os.walk(store.dir):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def bench_store(
    label: str,
    store: BlockStore,
    items: list[tuple[bytes, bytes]],
    batch: int,
    repeat: int,
    workers: int,
    before_read: Callable[[], None] | None = None,
    clear: Callable[[], object] | None = None,
) -> list[dict]:
    keys = [k for k, _ in items]
    wbatches = batches(items, batch)
    rbatches = batches(keys, batch)
    nbytes = sum(len(v) for _, v in items)
    rows = []
    modes: list[tuple[str, Callable[[str], float]]] = [
        ("1 caller", lambda op: time_sync(
            store.put_many if op == "write" else store.get_many,
            wbatches if op == "write" else rbatches)),
        (f"async x{workers}", lambda op: time_async(
            store, op, wbatches if op == "write" else rbatches, workers)),
    ]
    bufs = [bytearray(len(items[0][1])) for _ in range(batch)]  # reused, like host blocks
    modes.append(("into buf", lambda op: time_sync(
        lambda b: store.get_many_into(b, bufs[:len(b)]), rbatches)))
    for mode, run in modes:
        for op in ("write", "read"):
            if mode == "into buf" and op == "write":
                continue
            best = float("inf")
            for _ in range(repeat):
                if op == "write" and clear is not None:
                    clear()
                if op == "read" and before_read is not None:
                    before_read()
                best = min(best, run(op))
            rows.append(dict(store=label, op=op, mode=mode, blocks=len(items),
                             seconds=best, blocks_s=len(items) / best, mb_s=nbytes / best / 1e6))
    st = store.stats
    assert st.corrupt == 0 and st.errors == 0 and st.put_failed == 0, st
    assert st.misses == 0, f"{label}: {st.misses} misses"
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block-kb", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--json", action="store_true", help="print rows as JSON too")
    args = ap.parse_args()

    block = args.block_kb * 1024
    distinct = [os.urandom(block) for _ in range(min(args.blocks, 32))]
    items = [(xxhash.xxh3_128_digest(i.to_bytes(8, "little")) * 2, distinct[i % len(distinct)])
             for i in range(args.blocks)]
    ns = Namespace("bench-model", f"raw:{block}", block_bytes=block)
    nbytes = block * args.blocks
    t0 = time.perf_counter()
    rows: list[dict] = []

    # the checksum alone, for scale: every put and get pays it once
    t = time.perf_counter()
    for _ in range(args.repeat):
        for _, v in items:
            xxhash.xxh3_64_intdigest(v)
    t = (time.perf_counter() - t) / args.repeat
    rows.append(dict(store="xxh3_64 only", op="hash", mode="1 caller", blocks=args.blocks,
                     seconds=t, blocks_s=args.blocks / t, mb_s=nbytes / t / 1e6))

    with tempfile.TemporaryDirectory(prefix="kvflow-bench-") as root:
        s = LocalDirStore(root, ns)
        rows += bench_store("local", s, items, args.batch, args.repeat, args.workers,
                            clear=s.clear)
        s.close()
        s = LocalDirStore(os.path.join(root, "fsync"), ns, fsync=True)
        rows += bench_store("local+fsync", s, items, args.batch, args.repeat, args.workers,
                            before_read=lambda: drop_page_cache(s), clear=s.clear)
        s.close()

    if args.no_redis:
        pass
    elif find_redis_server() is None:
        print("redis-server not found: skipping the Redis rows (apt-get install redis-server)")
    else:
        with LocalRedisServer() as srv:
            # blocks with their MAC (a throwaway deployment key), and plain for the MAC's cost
            r = RedisStore(ns, srv.url, socket_timeout=10.0, mac_key=os.urandom(32))
            rows += bench_store("redis", r, items, args.batch, args.repeat, args.workers,
                                clear=r.clear)
            r.close()
            r = RedisStore(ns, srv.url, socket_timeout=10.0, authenticate=False)
            rows += bench_store("redis-no-mac", r, items, args.batch, args.repeat, args.workers,
                                clear=r.clear)
            r.close()

    total = time.perf_counter() - t0
    print(f"{args.blocks} blocks x {args.block_kb} KiB, batches of {args.batch}, "
          f"best of {args.repeat}; {platform.node()} ({os.cpu_count()} CPUs), "
          f"python {platform.python_version()}")
    hdr = f"| {'store':<13}| {'op':<6}| {'mode':<9}| {'blocks/s':>9} | {'MB/s':>7} |"
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for r_ in rows:
        print(f"| {r_['store']:<13}| {r_['op']:<6}| {r_['mode']:<9}| "
              f"{r_['blocks_s']:>9,.0f} | {r_['mb_s']:>7,.0f} |")
    print(f"(total {total:.1f} s)")
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
