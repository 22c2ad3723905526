"""``kvflow serve-pd --backend cuda``: a prefill and a decode engine as two processes on
one GPU, TCP between them through pinned host staging, and every request's tokens
against a colocated run of the same requests (the exact executor is batch-invariant,
so they must be equal). Skipped, saying why, without CuPy and a GPU.

Plain tests (no pytest-asyncio): ``serve_pd`` runs its own loop and processes.
"""

from __future__ import annotations

import pytest

from kernels import gpu_unavailable_reason
from kvflow.realtime.pd_instance import InstanceConfig
from kvflow.realtime.pd_serve import ServeConfig, serve_pd

_REASON = gpu_unavailable_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_REASON is not None, reason=f"needs a CUDA GPU and CuPy: {_REASON}"),
]


def test_pd_pair_on_one_gpu_decodes_the_colocated_tokens() -> None:
    cfg = ServeConfig(start=480, limit=6, time_scale=0.05, backend="cuda", check_tokens=True)
    r = serve_pd(cfg)
    assert r["world"] == "cuda" and r["config"]["model"] == "kvflow-tiny-hd64"
    assert r["requests"] == 6 and r["failed"] == []
    x = r["transfer"]
    assert x["transfers"] == x["ok"] > 0 and x["failed"] == 0 and x["recomputed"] == 0
    assert x["bytes"] > 0 and x["bytes"] % r["config"]["bytes_per_block"] == 0
    t = r["tokens"]
    assert t["colocated_errors"] == {}
    assert (t["equal"], t["mismatched"]) == (6, 0), t["examples"]
    for pools in r["pools_after_drain"].values():
        assert all(free == cap for free, cap in pools.values())


def test_a_decode_side_too_small_for_a_request_fails_it_and_drains() -> None:
    """The decode instance rejects what it cannot hold; the prefill side's send stops,
    the others still decode the colocated tokens, and both GPUs' pools drain."""
    cfg = ServeConfig(start=480, limit=3, time_scale=0.05, backend="cuda", check_tokens=True,
                      decode=InstanceConfig(device_blocks=20, host_blocks=20))
    r = serve_pd(cfg)
    assert r["failed"] and all("device blocks" in f for f in r["failed"])
    t = r["tokens"]
    assert t["equal"] == 3 - len(r["failed"])
    for pools in r["pools_after_drain"].values():
        assert all(free == cap for free, cap in pools.values())
