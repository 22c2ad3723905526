"""CPU time of one ``CudaBackend.submit`` of a load, and of its parts.

For the overlap question "how long does the CPU take between a load's submission
and the step that waits for it": a swap-in of 16 blocks of llama-3-8b with
512-token blocks (the overlap benchmark's batch case, copy-engine path), with
consecutive and with scattered ids, 1 and 4 layers enqueued at submit. Each
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
PARTS = ("prepare", "launch", "_enqueue_layers", "_take_events")


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
                          eager_layers=eager, host_layout=host_layout)
    make_sink = LazySink if sink_kind == "lazy" else FutureSink
    acc: dict[str, float] = {}
    on = [False]
    for name in PARTS:
        owner = backend.h2d if name in ("prepare", "launch") else backend
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
        if on[0]:
            acc["submit (with its sink)"] = acc.get("submit (with its sink)", 0.0) + (
                time.perf_counter() - t0)
        on[0] = False
        backend.flush()
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
    ap.add_argument("--eager", default="1,4", help="comma-separated eager_layers values")
    ap.add_argument("--copier-table", action="store_true",
                    help="also bench_layouts.py's prepare + launch table (16 blocks)")
    args = ap.parse_args()
    cols = ("submit (with its sink)", *PARTS)
    print(f"mean CPU us per submit ({BLOCKS} blocks, llama-3-8b, {args.sink} sink; "
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
