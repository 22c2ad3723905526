"""Issue 20, item 7: a process that runs replay after replay (a sweep worker) keeps
nothing of them.

Measured with tracemalloc (what Python allocated and still holds), not RSS (which
the allocator keeps at its high-water mark). After two warm-up runs (imports, the
interpreter's caches), six more runs of varied configurations -- full and cache
mode, a cluster with a pool, prefill/decode, another trace -- may leave a few KB
(CPython's bounded type-attribute cache holds names made at run time), never the
~1 MB a run that the issue saw. A report, a request's keys or a transfer log kept
by any module-level cache, registry or handler fails this.
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path
from typing import Any

from kvflow.replay import ReplayConfig, run_replay

AZURE = str(Path(__file__).resolve().parents[1] / "traces/samples/azure_code_500.csv")

VARIANTS: list[dict[str, Any]] = [
    {}, {"mode": "cache"}, {"instances": 2, "pool_blocks": 3000}, {"pd": "1:1"},
    {"write_policy": "write_back", "prefetch_policy": "timeout"}, {"trace": AZURE},
]


def _run(i: int) -> None:
    # A new configuration each run, as a sweep's points are.
    run_replay(ReplayConfig(limit=40, seed=i, device_blocks=1500 + 10 * i,
                            **VARIANTS[i % len(VARIANTS)]))


def test_repeated_replays_retain_nothing() -> None:
    tracemalloc.start()
    try:
        for i in range(2):
            _run(i)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(2, 2 + len(VARIANTS)):
            _run(i)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 64 * 1024, f"{kept} bytes kept over {len(VARIANTS)} replays"
