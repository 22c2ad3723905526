"""Host layouts on a llama-3-8b-shaped cache: bandwidth against the contiguous ceiling.

For every host layout (``kvflow.host_layout``) and piece size (the bytes of one
contiguous host piece: one role of one layer of a block in ``layer_major``,
G layers x (K, V) of a block in ``grouped:G``, all 32 layers in
``block_major``; the block size is chosen so that the layout's piece has that
size), scattered blocks move host -> device, device -> host and both ways at
once, the way ``CudaBackend`` runs them: one launch per layer (``layer_major``)
or per group (the others, through the device staging ring and the D2D scatter
of ``kernels.layout_copy``). Each is given as a fraction of the contiguous
pinned ceiling measured in the same run (``bench_kernels.ceilings``: one
cudaMemcpyAsync of the whole volume, best of many), with the SMs it takes
(CTAs of 1024 threads: one SM each; the copy engine takes none).

``layer_major`` runs twice: with the backend's default path for the size
(the swap kernel below 128 KiB pieces, the batched copy engine from there) and
with every piece on the batched copy engine (``layer_major/ce``).

Also the host CPU time of one op's submission (``prepare`` + every launch) at
1,024 pieces per op, per layout, beside the GPU time of the op, and a bit-exact
spot check of every configuration. GPU time: CUDA events, median of ``--reps``.

Run: PYTHONPATH=. python benchmarks/bench_layouts.py [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import Buffers, ceilings, gpu_time

from kernels._cuda import cupy_module
from kernels.backend import CudaBackend
from kernels.dma import batch_memcpy_unavailable_reason
from kvflow.host_layout import HostLayout
from kvflow.layout import preset

LAYOUTS = "layer_major,layer_major/ce,grouped:2,grouped:4,grouped:8,block_major"
SIZES_KB = "4,16,64,256,1024,2048"
VARIANTS = ("grouped:4@1024:copy_only,block_major@1024:copy_only,grouped:4@1024:scatter_ctas=16,"
            "grouped:4@1024:staging_mb=256,grouped:4@1024:slots=2,block_major@2048:staging_mb=256")


def piece_per_token(spec: Any, layout: HostLayout) -> int:
    """Bytes of a layout's piece per token of block (llama-3-8b: 2 KiB per role and layer)."""
    one = preset(spec.name, block_tokens=1)
    role = one.layout.roles[0].bytes_per_block
    if layout.kind == "layer_major":
        return role
    return layout.group_size(one.num_layers) * one.layout.bytes_per_layer_block


def backend_for(spec: Any, layout: str, dma: str, blocks: int, **kw: Any) -> CudaBackend:
    return CudaBackend(spec, blocks, blocks, host_layout=layout, dma=dma, eager_layers=None,
                       **kw)


def streams(copier: Any, default: Any) -> tuple[Any, tuple[Any, ...]]:
    """Where a copier's launches go (its head) and the other stream it uses (its tail)."""
    head = getattr(copier, "head", default)
    tail = getattr(copier, "tail", None)
    return head, (() if tail is None or tail is head else (tail,))


def fill(be: CudaBackend, rng: np.random.Generator) -> None:
    cp = cupy_module()
    be._host_flat[...] = np.frombuffer(rng.bytes(be._host_flat.size), dtype=np.uint8)
    for layer in range(be.num_layers):
        for role in be.roles:
            d = be.device_kv(layer, role)
            d[...] = cp.random.randint(0, 256, size=d.shape, dtype=np.uint8)
    cp.cuda.Device().synchronize()


def sms(be: CudaBackend, direction: str) -> int:
    """SMs a direction's copies take: the kernel's CTAs (one SM each), 0 for the copy engine."""
    c = be.h2d if direction == "h2d" else be.d2h
    if hasattr(c, "tail"):
        return int(c.ctas)
    return 0 if c.use_dma else int(c.ctas)


def measure(spec: Any, layout: str, dma: str, total: int, reps: int,
            rng: np.random.Generator, ceil: dict, copy_only: bool = False,
            **kw: Any) -> dict:
    cp = cupy_module()
    n = max(2, total // spec.bytes_per_block)
    cap = 2 * n
    be = backend_for(spec, layout, dma, cap, **kw)
    if copy_only:
        be.h2d.skip_kernel = be.d2h.skip_kernel = True
    fill(be, rng)
    src_in, dst_in = rng.permutation(cap)[:n], rng.permutation(cap)[:n]
    # the backup reads device blocks the load does not write
    free_dev = np.setdiff1d(np.arange(cap), dst_in)
    src_out = rng.permutation(free_dev)[:n]
    # ... and writes host blocks the load does not read
    free_host = np.setdiff1d(np.arange(cap), src_in)
    dst_out = rng.permutation(free_host)[:n]
    t0 = time.perf_counter()
    p_in = be.h2d.prepare(src_in, dst_in, be.load_stream)
    prep_s = time.perf_counter() - t0
    p_out = be.d2h.prepare(src_out, dst_out, be.store_stream)
    groups = be.host_layout.groups(be.num_layers)
    s_in, tail_in = streams(be.h2d, be.load_stream)
    s_out, tail_out = streams(be.d2h, be.store_stream)

    def h2d() -> None:
        for a, c in groups:
            be.h2d.launch(p_in, s_in, a, c)

    def d2h() -> None:
        for a, c in groups:
            be.d2h.launch(p_out, s_out, a, c)

    def both() -> None:
        for a, c in groups:
            be.h2d.launch(p_in, s_in, a, c)
            be.d2h.launch(p_out, s_out, a, c)

    moved = n * spec.bytes_per_block
    t_launch = []
    for _ in range(3):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        h2d()
        t_launch.append(time.perf_counter() - t0)
    out = {"layout": layout, "dma": dma, "block_tokens": spec.block_tokens,
           "blocks": n, "bytes": moved, "pieces_per_op": pieces(be, n),
           "sms_h2d": sms(be, "h2d"), "sms_d2h": sms(be, "d2h"),
           "cpu_prepare_us": prep_s * 1e6, "cpu_launch_us": statistics.median(t_launch) * 1e6}
    out["h2d"] = moved / gpu_time(h2d, s_in, reps, tail_in) / ceil["h2d"]
    out["d2h"] = moved / gpu_time(d2h, s_out, reps, tail_out) / ceil["d2h"]
    out["both"] = 2 * moved / gpu_time(both, s_in, reps, (s_out, *tail_in, *tail_out)
                                       ) / ceil["both"]
    be.synchronize()
    if not copy_only:
        check(be, src_in, dst_in, src_out, dst_out, rng)
    p_in.release()
    p_out.release()
    return out  # (the caller frees the memory once this frame is gone)


def free_memory() -> None:
    gc.collect()
    cp = cupy_module()
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()


def pieces(be: CudaBackend, n: int) -> int:
    if be.host_layout.block_contiguous:
        return n * len(be.host_layout.groups(be.num_layers))
    return n * be.num_layers * len(be.roles)


def check(be: CudaBackend, src_in: np.ndarray, dst_in: np.ndarray, src_out: np.ndarray,
          dst_out: np.ndarray, rng: np.random.Generator) -> None:
    """The last copies each way landed bit-exact (the device side of the backup was not
    written by the load, so it still holds what was copied)."""
    for layer in (0, be.num_layers // 2, be.num_layers - 1):
        for role in be.roles:
            d = be.device_kv(layer, role)
            h = be.host_kv(layer, role)
            for j in rng.integers(0, src_in.size, size=8).tolist():
                got = cupy_module().asnumpy(d[int(dst_in[j])])
                if not np.array_equal(got, h[int(src_in[j])]):
                    raise SystemExit(f"MISMATCH h2d {be.host_layout} layer {layer} {role} "
                                     f"pair {j}")
                got = cupy_module().asnumpy(d[int(src_out[j])])
                if not np.array_equal(got, h[int(dst_out[j])]):
                    raise SystemExit(f"MISMATCH d2h {be.host_layout} layer {layer} {role} "
                                     f"pair {j}")


def submit_cost(layout: str, dma: str, block_tokens: int, pieces_per_op: int | None,
                reps: int, max_op_bytes: int = 5 << 29, blocks: int = 16) -> dict | None:
    """CPU time of ``prepare`` + every launch of one load of ``pieces_per_op`` pieces
    (``None``: of ``blocks`` blocks, whatever their pieces)."""
    cp = cupy_module()
    spec = preset("llama-3-8b", block_tokens=block_tokens)
    lay = HostLayout.parse(layout)
    per_block = (spec.num_layers * len(spec.layout.roles) if not lay.block_contiguous
                 else len(lay.groups(spec.num_layers)))
    n = blocks if pieces_per_op is None else max(1, pieces_per_op // per_block)
    if n * spec.bytes_per_block > max_op_bytes:
        return None
    cap = n + n // 8 + 1
    be = backend_for(spec, layout, dma, cap)
    rng = np.random.default_rng(0)
    groups = be.host_layout.groups(be.num_layers)
    head, _ = streams(be.h2d, be.load_stream)
    prep_t, launch_t, gpu_t = [], [], []
    for i in range(reps + 3):
        src, dst = rng.permutation(cap)[:n].tolist(), rng.permutation(cap)[:n].tolist()
        t0 = time.perf_counter()
        prep = be.h2d.prepare(src, dst, be.load_stream)
        t1 = time.perf_counter()
        start = cp.cuda.Event()
        start.record(head)
        t2 = time.perf_counter()
        if be.one_launch and be.h2d.signals(prep):  # one signalling launch, as the backend
            be.h2d.launch_signal(prep, head, be.h2d.progress.take())
        else:
            for a, c in groups:
                be.h2d.launch(prep, head, a, c)
        t3 = time.perf_counter()
        end = cp.cuda.Event()
        end.record(getattr(be.h2d, "tail", be.load_stream))
        end.synchronize()
        prep.release()
        if i >= 3:
            prep_t.append(t1 - t0)
            launch_t.append(t3 - t2)
            gpu_t.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    out = {"layout": layout, "dma": dma, "block_tokens": block_tokens, "blocks": n,
           "pieces": n * per_block,
           "launch_calls": 1 if be.one_launch and be.h2d.signals(prep) else len(groups),
           "chunks": len(prep.chunks) if hasattr(prep, "chunks") else 1,
           "prepare_us": statistics.median(prep_t) * 1e6,
           "launch_us": statistics.median(launch_t) * 1e6,
           "submit_us": statistics.median([a + b for a, b in zip(prep_t, launch_t,
                                                                  strict=True)]) * 1e6,
           "gpu_us": statistics.median(gpu_t) * 1e6}
    be.synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=LAYOUTS)
    ap.add_argument("--sizes", default=SIZES_KB, help="piece sizes in KiB")
    ap.add_argument("--total-mb", type=int, default=256, help="bytes moved per measurement")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--submit-block-tokens", default="16,64",
                    help="block sizes of the submit-cost section (0: skip it)")
    ap.add_argument("--variants", default=VARIANTS,
                    help="extra rows LAYOUT@KIB[:key=value] with key scatter_ctas, "
                         "staging_mb, slots or copy_only (diagnostic: no D2D step)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0, c0 = time.perf_counter(), time.process_time()
    cp = cupy_module()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"device: {name}, {props['multiProcessorCount']} SMs; cupy {cp.__version__}; "
          f"batched memcpy: {batch_memcpy_unavailable_reason() or 'yes'}")
    total = args.total_mb << 20
    buf = Buffers(total)
    ceil = ceilings(buf, 3 * args.reps)
    del buf
    free_memory()
    print("ceiling (one contiguous cudaMemcpyAsync, GB/s): "
          + "  ".join(f"{d} {v / 1e9:.1f}" for d, v in ceil.items()))
    rng = np.random.default_rng(1)
    base = preset("llama-3-8b")
    rows = []
    for entry in args.layouts.split(","):
        layout, _, mode = entry.partition("/")
        dma = "always" if mode == "ce" else "auto"
        lay = HostLayout.parse(layout)
        per_tok = piece_per_token(base, lay)
        for kb in (int(x) for x in args.sizes.split(",")):
            bt, rem = divmod(kb << 10, per_tok)
            if bt < 1 or rem:
                continue
            spec = preset("llama-3-8b", block_tokens=bt)
            r = measure(spec, layout, dma, total, args.reps, rng, ceil)
            free_memory()
            r["label"], r["piece_kb"] = entry, kb
            rows.append(r)
            print(f"  {entry:16s} piece {kb:5d} KiB ({bt:4d}-token blocks, {r['blocks']} blocks):"
                  f" h2d {r['h2d']:.3f}  d2h {r['d2h']:.3f}  both {r['both']:.3f}  SMs "
                  f"{r['sms_h2d']}/{r['sms_d2h']}  CPU launch {r['cpu_launch_us']:.0f} us",
                  flush=True)
    for v in (x for x in args.variants.split(",") if x):
        layout, _, rest = v.partition("@")
        kb_s, _, opt = rest.partition(":")
        kb = int(kb_s)
        kw: dict[str, Any] = {}
        copy_only = False
        key, _, val = opt.partition("=")
        if key == "copy_only":
            copy_only = True
        elif key == "scatter_ctas":
            kw["scatter_ctas"] = int(val)
        elif key == "staging_mb":
            kw["device_staging_bytes"] = int(val) << 20
        elif key == "slots":
            kw["staging_slots"] = int(val)
        elif key:
            raise SystemExit(f"--variants: unknown key {key!r} in {v!r}")
        lay = HostLayout.parse(layout)
        bt, rem = divmod(kb << 10, piece_per_token(base, lay))
        if bt < 1 or rem:
            continue
        spec = preset("llama-3-8b", block_tokens=bt)
        r = measure(spec, layout, "auto", total, args.reps, rng, ceil, copy_only, **kw)
        free_memory()
        r["label"], r["piece_kb"] = f"{layout} [{opt}]", kb
        rows.append(r)
        print(f"  {r['label']:28s} piece {kb:5d} KiB: h2d {r['h2d']:.3f}  d2h {r['d2h']:.3f}  "
              f"both {r['both']:.3f}", flush=True)
    subs = []
    for bt in (int(x) for x in args.submit_block_tokens.split(",") if int(x)):
        for pieces_op in (None, 1024):
            for entry in args.layouts.split(","):
                layout, _, mode = entry.partition("/")
                dma = "always" if mode == "ce" else "auto"
                r = submit_cost(layout, dma, bt, pieces_op, args.reps * 4)
                free_memory()
                if r is not None:
                    r["label"] = entry
                    r["op"] = "16 blocks" if pieces_op is None else "1,024 pieces"
                    subs.append(r)
    print(f"\n### Fraction of the contiguous ceiling (h2d {ceil['h2d'] / 1e9:.1f}, d2h "
          f"{ceil['d2h'] / 1e9:.1f}, both {ceil['both'] / 1e9:.1f} GB/s), llama-3-8b, "
          f"{args.total_mb} MiB of scattered blocks per measurement")
    print("| layout | piece KiB | block tokens | h2d | d2h | both | SMs h2d/d2h | "
          "CPU launch us/op |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['piece_kb']} | {r['block_tokens']} | {r['h2d']:.3f} | "
              f"{r['d2h']:.3f} | {r['both']:.3f} | {r['sms_h2d']}/{r['sms_d2h']} | "
              f"{r['cpu_launch_us']:.0f} |")
    if rows:
        # the row furthest past its targets (each way 0.95, both ways 0.90), diagnostics aside
        best = max((r for r in rows if "[" not in r["label"]),
                   key=lambda r: min(r["h2d"] / 0.95, r["d2h"] / 0.95, r["both"] / 0.90))
        print(f"best: {best['label']} at {best['piece_kb']} KiB: h2d {best['h2d']:.3f}, "
              f"d2h {best['d2h']:.3f}, both {best['both']:.3f} (targets 0.95 / 0.95 / 0.90)")
    if subs:
        print("\n### Host CPU time of one load's submission (prepare + launches, median): "
              "an op of 16 blocks, and one of 1,024 pieces")
        print("| op | layout | block tokens | blocks | pieces | launch calls | chunks | "
              "prepare us | launch us | submit us | GPU us |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in subs:
            print(f"| {r['op']} | {r['label']} | {r['block_tokens']} | {r['blocks']} | "
                  f"{r['pieces']} | "
                  f"{r['launch_calls']} | {r['chunks']} | {r['prepare_us']:.0f} | "
                  f"{r['launch_us']:.0f} | {r['submit_us']:.0f} | {r['gpu_us']:.0f} |")
    print(f"wall {time.perf_counter() - t0:.1f} s, CPU {time.process_time() - c0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "ceiling": ceil, "rows": rows, "submit": subs}, f,
                      indent=1)


if __name__ == "__main__":
    main()
