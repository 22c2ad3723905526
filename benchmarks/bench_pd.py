"""PD transport throughput on loopback: kvflow's TCP transport against a plain socket copy.

Two processes, as in ``kvflow serve-pd``: this one is the prefill side (a
``SendPort`` serving pulls from its device memory), a child is the decode side
(a ``ReceivePort`` writing every layer into its own device memory). Each of
``--requests`` requests moves ``--blocks`` blocks of every layer, one LAYER frame
per layer (the frame a prefill chunk of that many blocks sends), scattered source
and destination ids; the decode side checks the bytes of the last request.

The baseline, in the same run: the same bytes in the same frame sizes through a
plain blocking socket between two processes (``sendall`` of one contiguous
buffer, ``recv_into`` a preallocated one: no framing, no checksums, no gather or
scatter). Wall time is the receiver's, first byte asked for to last byte in;
CPU time is both processes' user + system time over the same span.

Run (repository root): python benchmarks/bench_pd.py [--model llama-3-8b --blocks 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvflow.layout import preset
from kvflow.pd.memory import ArrayMemory
from kvflow.pd.ports import prompt_digest
from kvflow.pd.transports import tcp_receive_port, tcp_send_port


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _memory(layers: int, blocks: int, layer_bytes: int, seed: int | None) -> ArrayMemory:
    if seed is None:
        return ArrayMemory(np.zeros((layers, blocks, layer_bytes), np.uint8))
    rng = np.random.default_rng(seed)
    return ArrayMemory(rng.integers(0, 256, (layers, blocks, layer_bytes), np.uint8))


def _ids(blocks: int, pool: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(pool)[:blocks]


# --------------------------------------------------------------------------- kvflow TCP
def _decode_side(args: dict[str, Any], port: int, conn: Any) -> None:
    spec = preset(args["model"])
    lay = spec.layout
    mem = _memory(lay.num_layers, args["pool"], lay.bytes_per_layer_block, None)
    recv = tcp_receive_port(spec, mem, "127.0.0.1", port)
    _run(args, _decode(args, recv, lay.num_layers, conn, mem))


def _run(args: dict[str, Any], coro: Any) -> Any:
    """On uvloop (what serve-pd runs on) or asyncio's own loop, as ``--loop`` says."""
    if args["loop"] == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


async def _decode(args: dict[str, Any], recv: Any, layers: int, conn: Any,
                  mem: ArrayMemory) -> None:
    keys = list(range(args["blocks"]))
    digest = prompt_digest(keys, 0, len(keys))
    dst = _ids(args["blocks"], args["pool"], 2)
    await recv._get_link()  # connect (and shake hands) before the clock starts
    conn.send("ready")
    conn.recv()
    c0, t0 = cpu_s(), time.perf_counter()
    for i in range(args["requests"]):
        done = asyncio.get_running_loop().create_future()
        await recv.expect(f"r{i}", 0, dst, digest, lambda layer: None,
                          lambda err, done=done: done.set_result(err))
        err = await done
        if err is not None:
            raise err
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    conn.send({"wall_s": wall, "cpu_s": cpu, "bytes": recv.stats.bytes,
               "sample": mem.array[:, dst].tobytes()[:: 4099]})
    await recv.close()


async def kvflow_tcp(args: dict[str, Any]) -> dict[str, Any]:
    spec = preset(args["model"])
    lay = spec.layout
    mem = _memory(lay.num_layers, args["pool"], lay.bytes_per_layer_block, 1)
    send, server = await tcp_send_port(spec, mem)
    src = _ids(args["blocks"], args["pool"], 1)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_decode_side, args=(args, server.port, child_conn))
    child.start()
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, conn.recv) == "ready"
    c0 = cpu_s()
    conn.send("go")
    for i in range(args["requests"]):
        pull = await send.pull(f"r{i}")
        for layer in range(lay.num_layers):
            await send.put(pull, layer, 0, src)
    res = await loop.run_in_executor(None, conn.recv)
    cpu = cpu_s() - c0
    child.join()
    await server.close()
    want = mem.array[:, src].tobytes()[:: 4099]
    assert res["sample"] == want, "the decode side's bytes differ from the prefill side's"
    return {"wall_s": res["wall_s"], "cpu_s": res["cpu_s"] + cpu, "bytes": res["bytes"]}


# --------------------------------------------------------------------------- plain socket
def _plain_receiver(port: int, frame: int, frames: int, conn: Any) -> None:
    buf = bytearray(frame)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as s:
        conn.send("ready")
        conn.recv()
        c0, t0 = cpu_s(), time.perf_counter()
        s.sendall(b"g")
        for _ in range(frames):
            got = 0
            while got < frame:
                n = s.recv_into(view[got:])
                if n == 0:
                    raise ConnectionError("sender closed early")
                got += n
        conn.send({"wall_s": time.perf_counter() - t0, "cpu_s": cpu_s() - c0,
                   "bytes": frame * frames})


def plain_socket(frame: int, frames: int) -> dict[str, Any]:
    data = np.random.default_rng(3).integers(0, 256, frame, np.uint8).tobytes()
    ctx = mp.get_context("spawn")
    with socket.create_server(("127.0.0.1", 0)) as srv:
        conn, child_conn = ctx.Pipe()
        child = ctx.Process(target=_plain_receiver,
                            args=(srv.getsockname()[1], frame, frames, child_conn))
        child.start()
        s, _ = srv.accept()
        with s:
            assert conn.recv() == "ready"
            c0 = cpu_s()
            conn.send("go")
            s.recv(1)
            for _ in range(frames):
                s.sendall(data)
            res = conn.recv()
            cpu = cpu_s() - c0
        child.join()
    return {"wall_s": res["wall_s"], "cpu_s": res["cpu_s"] + cpu, "bytes": res["bytes"]}


def in_process(args: dict[str, Any]) -> dict[str, Any]:
    """One layer of the blocks copied between two numpy pools (the in-process transport)."""
    spec = preset(args["model"])
    lay = spec.layout
    a = _memory(lay.num_layers, args["pool"], lay.bytes_per_layer_block, 1)
    b = _memory(lay.num_layers, args["pool"], lay.bytes_per_layer_block, None)
    src, dst = _ids(args["blocks"], args["pool"], 1), _ids(args["blocks"], args["pool"], 2)
    c0, t0 = cpu_s(), time.perf_counter()
    for _ in range(args["requests"]):
        for layer in range(lay.num_layers):
            b.copy_from(a, layer, src, dst)
    wall = time.perf_counter() - t0
    n = args["requests"] * lay.num_layers * len(src) * lay.bytes_per_layer_block
    return {"wall_s": wall, "cpu_s": cpu_s() - c0, "bytes": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--blocks", type=int, default=32, help="blocks per request (per frame)")
    ap.add_argument("--pool", type=int, default=96, help="device blocks of each side")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each; the best is kept")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="event loop of both kvflow processes")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    args = vars(a)
    spec = preset(a.model)
    frame = a.blocks * spec.layout.bytes_per_layer_block
    frames = a.requests * spec.num_layers
    runs: dict[str, list[dict[str, Any]]] = {"kvflow_tcp": [], "plain_socket": [],
                                             "in_process": []}
    for _ in range(a.repeat):  # interleaved, so both see the same machine
        runs["plain_socket"].append(plain_socket(frame, frames))
        runs["kvflow_tcp"].append(_run(args, kvflow_tcp(args)))
        runs["in_process"].append(in_process(args))
    best = {k: min(v, key=lambda r: r["wall_s"]) for k, v in runs.items()}
    for r in best.values():
        r["GB_per_s"] = r["bytes"] / r["wall_s"] / 1e9
        r["cpu_per_GB_s"] = r["cpu_s"] / (r["bytes"] / 1e9)
    out = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} "
        f"({os.cpu_count()} CPUs, {platform.processor() or platform.machine()})",
        "command": "python benchmarks/bench_pd.py " + " ".join(sys.argv[1:]),
        "model": a.model, "loop": a.loop, "frame_bytes": frame, "frames": frames,
        "bytes_per_run": frame * frames, "best_of": a.repeat, "runs": runs, "best": best,
        "tcp_share_of_plain_socket": best["kvflow_tcp"]["GB_per_s"]
        / best["plain_socket"]["GB_per_s"],
    }
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{out['date']}, {out['machine']}: {a.model}, {a.blocks} blocks x "
          f"{spec.layout.bytes_per_layer_block // 1024} KiB per frame ({frame / 2**20:.1f} MiB), "
          f"{frames} frames = {frame * frames / 1e9:.2f} GB per run, best of {a.repeat}, "
          f"{a.loop}")
    for k in ("plain_socket", "kvflow_tcp", "in_process"):
        r = best[k]
        print(f"  {k:13s} {r['GB_per_s']:6.2f} GB/s  wall {r['wall_s']:.3f} s  "
              f"cpu {r['cpu_s']:.3f} s ({r['cpu_per_GB_s']:.2f} cpu-s/GB)")
    print(f"  kvflow TCP = {out['tcp_share_of_plain_socket']:.1%} of the plain socket copy")


if __name__ == "__main__":
    main()
