"""Pinned reports: speed work on the simulator must not change what a replay reports.

Each case replays the first 300 requests of the bundled sample and compares a
SHA-256 of the canonical report (``wall_s`` dropped, paths reduced to their
file names) with the digest recorded before the simulator was reworked for
speed (issue 19: events per op, O(changes) engine steps, streaming
aggregates). A change that moves any number in a report, by one ulp or one
request, fails here; if the change is meant to alter results, record the new
digests in the same commit and say why in its message.

The cases between them take the paths a speed-up could get wrong: the default
tiers in both modes; a calibrated profile (PCIe slowed while both ways are
busy) with small tiers, ``write_back`` and the ``timeout`` prefetch policy
(cancelled prefetches, recomputes); and injected transfer failures.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvflow.replay import ReplayConfig, run_replay

CALIBRATED = str(Path(__file__).resolve().parents[1] / "sim/profiles/h100-calibrated.toml")


def _fail_some(backend: Any) -> None:
    # Every 7th op fails after 3 layers, every 11th before it moves anything.
    backend.inject_failure(lambda op: 3 if op.op_id % 7 == 0 else
                           (0 if op.op_id % 11 == 0 else None))


CASES: dict[str, tuple[dict[str, Any], Any, str]] = {
    "full": ({"mode": "full"}, None,
             "c8f5d781acef00209a645d5e08ddbf5d64e5d5cac288458636ebfe4989e114e9"),
    "cache": ({"mode": "cache"}, None,
              "7179d82cf9d17d7a7f7f5a58ebe61c549da1ecb3134ce4838c36f8e4000cc1aa"),
    "duplex_timeout_write_back": (
        {"profile": CALIBRATED, "prefetch_policy": "timeout", "device_blocks": 200,
         "host_blocks": 600, "storage_blocks": 3000, "write_policy": "write_back",
         "max_batch_tokens": 2048}, None,
        "a169e226d782237aa945e5b6fd4c6812a7c6e7e1dd0fc9ddfe97f788a19cd7f1"),
    "injected_failures": (
        {"device_blocks": 400, "host_blocks": 1500, "storage_blocks": 6000,
         "prefetch_policy": "wait_complete"}, _fail_some,
        "4e4b299ad9c7d9468bc7033b816cb2fc73b73109ab81d5dade11675c06f6a6f7"),
}


def canonical(report: dict[str, Any]) -> str:
    """The report as compact JSON with sorted keys, ``wall_s`` dropped, paths as file names."""
    r = dict(report)
    r.pop("wall_s", None)
    config = dict(r["config"])
    for key in ("trace", "profile"):
        config[key] = os.path.basename(config[key])
    r["config"] = config
    return json.dumps(r, sort_keys=True, separators=(",", ":"))


@pytest.mark.parametrize("case", list(CASES))
def test_report_digest_is_pinned(case: str) -> None:
    kwargs, configure, digest = CASES[case]
    report = run_replay(ReplayConfig(limit=300, seed=0, **kwargs), configure_backend=configure)
    got = hashlib.sha256(canonical(report).encode()).hexdigest()
    summary = {k: report[k] for k in ("requests", "hit_rate", "ttft_s", "errors", "prefetch")}
    assert got == digest, f"report of {case!r} changed: {json.dumps(summary)}"
