"""CPU time of one ``CudaBackend.submit`` of a load, and of its parts.

For the overlap question "how long does the CPU take between a load's submission
and the step that waits for it": a swap-in of 16 blocks of llama-3-8b with
512-token blocks (the overlap benchmark's batch case, copy-engine path), with
consecutive and with scattered ids, 1 and 4 layers enqueued at submit ("whole op" adds
the deferred layers' enqueue, ``CudaBackend.flush``, timed right after). Each
part (``prepare``: validate, split runs, build descriptors; ``launch``: the
batched driver calls; the per-layer events and host callbacks around them) is
timed by wrapping it with ``perf_counter``, no profiler; the table gives the
mean per submit over the timed ones.

``--block-tokens`` sets the block size (a comma list repeats the table): 512 is the
overlap benchmark's, 16 vLLM's (a 32 KiB piece per layer and role, on the swap
kernel). ``--sink`` chooses what receives the layer reports: ``lazy`` (default) is
a sink like the runtime's tasks (``lazy_layers``: layers are read from the handle,
and reported only where something waits), ``future`` the test helper
``FutureSink`` (a report and an asyncio future per layer). ``--copier-table`` adds
``bench_layouts.py``'s table (``prepare`` + the copier's launches, no backend).

``--host-layouts`` repeats it per host layout (``kvflow.host_layout``): the same
16 blocks are 1,024 pieces in ``layer_major`` (16 x 32 layers x K, V), 16 x 32/G
in ``grouped:G`` (each moved through the device staging ring and a D2D scatter)
and 16 in ``block_major``; ``bench_layouts.py`` gives the same at 1,024 pieces in
every layout.

Run (repository root, on a GPU): PYTHONPATH=. python benchmarks/submit_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels.backend import CudaBackend, FutureSink
from kvflow.layout import preset
from kvflow.manager import OpKind, TransferOp
from kvflow.radix import Tier

BLOCKS, POOL = 16, 40
PARTS = ("prepare", "launch", "launch_signal", "_enqueue_layers", "_take_events")


def timed(obj: Any, name: str, acc: dict[str, float], on: list[bool]) -> None:
    """Wrap ``obj.name`` to add its wall time to ``acc[name]`` while ``on[0]``."""
    fn: Callable[..., Any] = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if on[0]:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0

    setattr(obj, name, wrapper)


class LazySink:
    """What the runtime's ``TransferTask`` is to a backend: a lazy layer sink."""

    lazy_layers = True

    def __init__(self, num_layers: int, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.finished: asyncio.Future[None] = (loop or asyncio.get_running_loop()).create_future()
        self.last = -1

    def layer_done(self, layer: int) -> None:
        self.last = layer

    def done(self, error: BaseException | None = None) -> None:
        if error is None:
            self.finished.set_result(None)
        else:
            self.finished.set_exception(error)


async def measure(eager: int, scattered: bool, warm: int, timed_ops: int,
                  host_layout: str = "layer_major", block_tokens: int = 512,
                  sink_kind: str = "lazy") -> dict[str, float]:
    backend = CudaBackend(preset("llama-3-8b", block_tokens=block_tokens), POOL, POOL,
                          eager_layers=eager or None, host_layout=host_layout)
    make_sink = LazySink if sink_kind == "lazy" else FutureSink
    acc: dict[str, float] = {}
    on = [False]
    for name in PARTS:
        owner = backend.h2d if name in ("prepare", "launch", "launch_signal") else backend
        if hasattr(owner, name):
            timed(owner, name, acc, on)
    rnd = random.Random(0)
    for i in range(warm + timed_ops):
        ids = rnd.sample(range(POOL), BLOCKS) if scattered else list(range(BLOCKS))
        op = TransferOp(i, OpKind.SWAP_IN, Tier.HOST, Tier.DEVICE, ids, ids, [])
        on[0] = i >= warm
        t0 = time.perf_counter()
        sink = make_sink(backend.num_layers)
        backend.submit(op, sink)
        t1 = time.perf_counter()
        backend.flush()  # the deferred layers (``eager_layers``): the op's whole enqueue
        if on[0]:
            acc["submit (with its sink)"] = acc.get("submit (with its sink)", 0.0) + t1 - t0
            acc["whole op"] = acc.get("whole op", 0.0) + time.perf_counter() - t0
        on[0] = False
        await sink.finished
    backend.synchronize()
    return {k: v / timed_ops for k, v in acc.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=40, help="timed submits per case")
    ap.add_argument("--host-layouts", default="layer_major",
                    help="comma-separated host layouts (layer_major, grouped:G, block_major)")
    ap.add_argument("--block-tokens", default="512", help="comma-separated block sizes")
    ap.add_argument("--sink", choices=("lazy", "future"), default="lazy")
    ap.add_argument("--eager", default="1,4",
                    help="comma-separated eager_layers values (0: every layer at submit)")
    ap.add_argument("--bandwidth", type=int, default=0, metavar="MIB",
                    help="also: GPU time of MIB of scattered 16-token layer_major blocks, one "
                         "signalling launch per op against a launch per layer")
    ap.add_argument("--launch", default="op", choices=("op", "layer"),
                    help="kernel-path ops: one signalling launch (CudaBackend one_launch, "
                         "set as the process default) or a launch per layer")
    ap.add_argument("--copier-table", action="store_true",
                    help="also bench_layouts.py's prepare + launch table (16 blocks)")
    args = ap.parse_args()
    CudaBackend.ONE_LAUNCH_DEFAULT = args.launch == "op"  # (bench_layouts' backends too)
    cols = ("submit (with its sink)", "whole op", *PARTS)
    print(f"mean CPU us per submit ({BLOCKS} blocks, llama-3-8b, {args.sink} sink, "
          f"{args.launch} launches; "
          "parts overlap: _enqueue_layers holds launch)")
    print(f"| host layout | block tokens | eager layers | ids | {' | '.join(cols)} |")
    print("|---" * (len(cols) + 4) + "|")
    for bt in (int(x) for x in args.block_tokens.split(",")):
        for layout in args.host_layouts.split(","):
            for eager in (int(x) for x in args.eager.split(",")):
                for scattered in (False, True):
                    r = asyncio.run(measure(eager, scattered, 20, args.ops, layout, bt,
                                            args.sink))
                    print(f"| {layout} | {bt} | {eager} | "
                          f"{'scattered' if scattered else 'consecutive'} | "
                          + " | ".join(f"{r.get(c, 0.0) * 1e6:.0f}" for c in cols) + " |",
                          flush=True)
    if args.copier_table:
        copier_table(args.host_layouts, "16")
    if args.bandwidth:
        bandwidth(args.bandwidth)


def bandwidth(mib: int, reps: int = 5) -> None:
    """One signalling launch against per-layer launches, the same op, the same process:
    GPU time each way and both ways at once (CUDA events, median of ``reps``)."""
    import statistics

    import numpy as np

    from kernels._cuda import cupy_module

    cp = cupy_module()
    spec = preset("llama-3-8b", block_tokens=16)
    n = (mib << 20) // spec.bytes_per_block
    be = CudaBackend(spec, 2 * n, 2 * n, eager_layers=None)
    rng = np.random.default_rng(0)
    s_in, d_in = rng.permutation(2 * n)[:n].tolist(), rng.permutation(2 * n)[:n].tolist()
    free_dev = sorted(set(range(2 * n)) - set(d_in))
    free_host = sorted(set(range(2 * n)) - set(s_in))
    s_out = rng.permutation(free_dev)[:n].tolist()
    d_out = rng.permutation(free_host)[:n].tolist()
    p_in, p_out = be.h2d.prepare(s_in, d_in), be.d2h.prepare(s_out, d_out)
    assert be.h2d.signals(p_in) and be.d2h.signals(p_out)
    L = be.num_layers
    ways = {"h2d": ((be.h2d, p_in, be.load_stream),),
            "d2h": ((be.d2h, p_out, be.store_stream),),
            "both": ((be.h2d, p_in, be.load_stream), (be.d2h, p_out, be.store_stream))}
    print(f"\n{n} scattered 16-token blocks of llama-3-8b ({mib} MiB, 32 KiB pieces), GPU ms "
          f"(median of {reps}) and CPU us per op, by launch mode")
    print("| way | per-layer launches ms | one launch ms | ratio | CPU per-layer us | "
          "CPU one us |\n|---|---|---|---|---|---|")
    for way, parts in ways.items():
        row = {}
        for mode in ("layer", "op"):
            gpu, cpu = [], []
            for _ in range(reps + 1):
                be.synchronize()
                ev0 = [cp.cuda.Event() for _ in parts]
                for e, (_, _, st) in zip(ev0, parts, strict=True):
                    e.record(st)
                t0 = time.perf_counter()
                for c, prep, st in parts:
                    if mode == "op":
                        c.launch_signal(prep, st, c.progress.take())
                    else:
                        for layer in range(L):
                            c.launch(prep, st, layer, 1)
                cpu.append(time.perf_counter() - t0)
                ev1 = [cp.cuda.Event() for _ in parts]
                for e, (_, _, st) in zip(ev1, parts, strict=True):
                    e.record(st)
                for e in ev1:
                    e.synchronize()
                gpu.append(max(cp.cuda.get_elapsed_time(ev0[0], e) for e in ev1))
            row[mode] = (statistics.median(gpu[1:]), statistics.median(cpu[1:]) * 1e6)
        print(f"| {way} | {row['layer'][0]:.2f} | {row['op'][0]:.2f} | "
              f"{row['layer'][0] / row['op'][0]:.3f} | {row['layer'][1]:.0f} | "
              f"{row['op'][1]:.0f} |", flush=True)
    # when each layer lands: a probe stream waits on layer i (word or event), records
    probe = cp.cuda.Stream(non_blocking=True)
    marks = (0, 3, 7, 11, 15, 19, 23, 27, 31)
    print(f"\nh2d, when layer i lands, as a fraction of the op's GPU time (median of {reps}; "
          "a probe stream waits on the layer's word / event and records: what a compute "
          "stream's wait_layer sees); last column: the largest gap to the per-layer row "
          "over all layers")
    print("| launch | " + " | ".join(f"layer {i}" for i in marks) + " | max gap |\n|---"
          + "|---" * (len(marks) + 1) + "|")
    c, prep, st = ways["h2d"][0]
    per_mode: dict[str, list[float]] = {}
    for mode in ("layer", "op"):
        fr: list[list[float]] = []
        for _ in range(reps + 1):
            be.synchronize()
            probe.synchronize()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(st)
            evs = []
            if mode == "op":
                seq = c.progress.take()
                c.launch_signal(prep, st, seq)
                for i in range(L):
                    c.progress.wait(probe.ptr, i, seq)
                    evs.append(cp.cuda.Event())
                    evs[-1].record(probe)
            else:  # the same probe: waits on each layer's event from another stream
                for i in range(L):
                    c.launch(prep, st, i, 1)
                    done = cp.cuda.Event(disable_timing=True)
                    done.record(st)
                    probe.wait_event(done)
                    evs.append(cp.cuda.Event())
                    evs[-1].record(probe)
            end.record(st)
            end.synchronize()
            probe.synchronize()
            total = cp.cuda.get_elapsed_time(start, end)
            fr.append([cp.cuda.get_elapsed_time(start, e) / total for e in evs])
        per_mode[mode] = [statistics.median(f[i] for f in fr[1:]) for i in range(L)]
        gap = max(abs(a - b) for a, b in zip(per_mode[mode], per_mode["layer"], strict=True))
        print(f"| {'per layer' if mode == 'layer' else 'one (words)'} | "
              + " | ".join(f"{per_mode[mode][i]:.3f}" for i in marks if i < L)
              + f" | {gap:.3f} |", flush=True)
    be.synchronize()


def copier_table(layouts: str, block_tokens: str) -> None:
    """``bench_layouts.py``'s submit table (16 blocks), without its bandwidth sweep."""
    from benchmarks.bench_layouts import submit_cost

    print("\n| layout | block tokens | pieces | chunks | prepare us | launch us | submit us "
          "| GPU us |\n|---|---|---|---|---|---|---|---|")
    for bt in (int(x) for x in block_tokens.split(",")):
        for entry in layouts.split(","):
            layout, _, mode = entry.partition("/")
            r = submit_cost(layout, "always" if mode == "ce" else "auto", bt, None, 20)
            if r is not None:
                print(f"| {entry} | {bt} | {r['pieces']} | {r['chunks']} | "
                      f"{r['prepare_us']:.0f} | {r['launch_us']:.0f} | {r['submit_us']:.0f} | "
                      f"{r['gpu_us']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
