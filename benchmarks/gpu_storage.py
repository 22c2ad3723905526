"""The GPU world with a storage tier of real bytes: a short replay, cold and warm.

Each run is ``kvflow replay --backend cuda --executor exact`` in its own process
(a new process is what must rediscover a persistent store) on a synthetic
multi-turn trace whose small device and host pools push each session's history
down to a local directory store between turns, so later turns load it back
storage -> host -> device (prefetched at arrival). Runs:

1. ``resident``: a device pool that keeps everything (no host use, no storage);
2. ``write_through`` cold: an empty store;
3. ``write_through`` warm: a new process over the same store, its index rebuilt
   from the store at start;
4. ``write_back`` cold: another empty store;
5. ``write_through`` cold over the ``grouped:4`` and ``block_major`` host layouts.

The exact executor's outputs are bit-identical whatever the batching, so every
run's ``outputs_digest`` must equal the resident run's. Printed: a table of hit
rates, storage bytes, store counters, TTFT and run time; ``$OUT/gpu_storage.json``
keeps the reports' figures.

Run (repository root, a CUDA GPU and CuPy): ``PYTHONPATH=. python benchmarks/gpu_storage.py``
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = Path(os.environ.get("OUT", ROOT / "out"))
TMP = Path(os.environ.get("GPU_STORAGE_TMP", "/tmp/kvflow_gpu_storage"))
MODEL = "llama-3-8b-l4"
POOLS = ("48", "16", "2000")  # device, host, storage blocks (8 MiB each)


def replay(name: str, trace: Path, extra: list[str]) -> dict[str, Any] | None:
    out = TMP / f"{name}.json"
    cmd = [sys.executable, "cli.py", "replay", str(trace), "--model", MODEL, "--backend",
           "cuda", "--executor", "exact", "--out", str(out), "--force", *extra]
    print(f"$ {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        print(f"[{name}: rc={res.returncode}]\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        return None
    report = json.loads(out.read_text())
    report["process_wall_s"] = wall
    return report


def row(name: str, r: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
    store = r.get("store") or {}
    stats, backend = store.get("stats") or {}, store.get("backend") or {}
    found = store.get("rediscovered") or {}
    b = r["bytes"]
    ttft = r["ttft_s"] or {}
    return {
        "run": name, "requests": r["requests"],
        "hit_device": r["hit_rate"]["device"], "hit_host": r["hit_rate"]["host"],
        "hit_storage": r["hit_rate"]["storage"],
        "storage_read_GB": b.get("storage_read", 0) / 1e9,
        "storage_write_GB": b.get("storage_write", 0) / 1e9,
        "h2d_GB": b.get("h2d", 0) / 1e9, "d2h_GB": b.get("d2h", 0) / 1e9,
        "store_hits": stats.get("hits"), "store_puts": stats.get("put_ok"),
        "store_corrupt": stats.get("corrupt"), "write_skipped": backend.get("write_skipped"),
        "rediscovered": found.get("indexed"),
        "failed_transfers": r["errors"]["failed_transfers"],
        "ttft_p50_s": ttft.get("p50"), "ttft_p99_s": ttft.get("p99"),
        "run_time_s": r["sim_time_s"] if r.get("sim_time_s") is not None else r.get("run_time_s"),
        "process_wall_s": r["process_wall_s"],
        "outputs": r["device"]["outputs"],
        "outputs_equal_resident": (None if ref is None else
                                   r["device"]["outputs_digest"] ==
                                   ref["device"]["outputs_digest"]),
    }


def main() -> int:
    from traces.generate import multi_turn, write_generic

    shutil.rmtree(TMP, ignore_errors=True)
    TMP.mkdir(parents=True)
    OUT.mkdir(parents=True, exist_ok=True)
    trace = TMP / "multi_turn.jsonl"
    reqs = multi_turn(sessions=12, turns=4, system_len=2048, user_len=1024, output_len=16,
                      think_time_s=2.0, rate=4.0, block_tokens=512, seed=1)
    write_generic(reqs, trace, block_tokens=512, force=True)
    small = ["--device-blocks", POOLS[0], "--host-blocks", POOLS[1], "--storage-blocks",
             POOLS[2], "--prefetch-policy", "wait_complete"]
    runs = [
        ("resident", ["--device-blocks", "1200", "--host-blocks", "1", "--storage-blocks", "0"]),
        ("write_through cold", [*small, "--store", f"dir:{TMP / 'store_wt'}"]),
        ("write_through warm", [*small, "--store", f"dir:{TMP / 'store_wt'}"]),
        ("write_back cold", [*small, "--write-policy", "write_back",
                             "--store", f"dir:{TMP / 'store_wb'}"]),
        # the store over the other host layouts (kernels/layout_copy.py): same outputs
        ("write_through cold grouped:4", [*small, "--host-layout", "grouped:4",
                                          "--store", f"dir:{TMP / 'store_g4'}"]),
        ("write_through cold block_major", [*small, "--host-layout", "block_major",
                                            "--store", f"dir:{TMP / 'store_bm'}"]),
    ]
    reports: dict[str, dict[str, Any]] = {}
    rows = []
    for name, extra in runs:
        r = replay(name.replace(" ", "_"), trace, extra)
        if r is None:
            continue
        reports[name] = r
        rows.append(row(name, r, reports.get("resident")))
    device = next(iter(reports.values()))["device"]["name"] if reports else "?"
    print(f"\ndevice: {device}; trace: {len(reqs)} requests (multi_turn 12x4, 512-token "
          f"blocks); model {MODEL}; pools device/host/storage = {'/'.join(POOLS)} blocks")
    if rows:
        keys = list(rows[0])
        print("| " + " | ".join(keys) + " |")
        print("|" + "---|" * len(keys))
        for r in rows:
            print("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v)
                                    for v in r.values()) + " |")
    (OUT / "gpu_storage.json").write_text(json.dumps({"device": device, "rows": rows},
                                                     indent=1))
    ok = len(rows) == len(runs) and all(r["outputs_equal_resident"] in (None, True)
                                        for r in rows)
    print("outputs equal the resident run's in every run:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
