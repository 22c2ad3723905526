"""Tensor parallelism 1 and no shared pool change no number a replay reports.

Each case replays the first 200 requests of the bundled sample and compares a
SHA-256 of the report with the digest recorded on main before tensor
parallelism, the shared pool and mixed clusters were added (e7db1de). The
report is canonical JSON with sorted keys, less ``wall_s``, the ``config``
section (it gained fields: ``tp``, ``pool_*``, ``nic_*``, ``cluster``,
``groups``, ``headroom``), the per-instance ``tp`` and ``group`` it gained and
the ``headroom`` section (the offline optimum, added since: ``kvflow.headroom``);
every other number is in. A change meant to move results records new digests and says why:
three_ttft_small_tiers moved when recomputed blocks indexed below the device became
device copies instead of being freed (its storage hits are recomputed under best_effort),
and again when the router's exact view stopped crediting an instance with storage hits it
does not read at admission (best_effort with a host tier: ``instances.reads_storage``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from kvflow.replay import ReplayConfig, run_replay

CASES: dict[str, tuple[dict[str, Any], str]] = {
    "one": ({}, "afa3f18721467a9d76633575319e0a0f3dec72f70bbf10fbd2ecb8d0181bef52"),
    "two_round_robin": ({"instances": 2},
                        "29c518ff1167881682eef35588c4b800954ba74deb4fac32ee1aa00d68749a79"),
    "two_prefix_tp1": ({"instances": 2, "router": "prefix", "tp": 1},
                       "61313c7872f863835cec19dc30e7687ecc997f4e6153b158342264c66c965b18"),
    "three_ttft_small_tiers": (
        {"instances": 3, "router": "ttft", "device_blocks": 200, "host_blocks": 600,
         "storage_blocks": 3000},
        "f6be8105738dfe1f4baebde1f05575f52999d47c740dd54e3299eb1bb4170970"),  # reads_storage
    "two_approx_write_back": (
        {"instances": 2, "router": "prefix", "router_view": "approx",
         "write_policy": "write_back", "device_blocks": 300, "host_blocks": 400,
         "storage_blocks": 2000, "prefetch_policy": "wait_complete"},
        "a0f1b649d86718c910e05b97d18af8fcb14737234aa1b6ea4202208414012afa"),
    "cache": ({"mode": "cache"},
              "486f0238eb27b34d54ec22da6a886543858317e1ee085843d19ba4a71ba63cb1"),
}


def digest(report: dict[str, Any]) -> str:
    r = dict(report)
    r.pop("wall_s", None)
    r.pop("config", None)
    r.pop("headroom", None)
    if "instances" in r:
        r["instances"] = [{k: v for k, v in row.items() if k not in ("tp", "group")}
                          for row in r["instances"]]
    return hashlib.sha256(json.dumps(r, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()


@pytest.mark.parametrize("case", list(CASES))
def test_report_numbers_unchanged(case: str) -> None:
    kwargs, want = CASES[case]
    report = run_replay(ReplayConfig(limit=200, seed=0, **kwargs))
    assert digest(report) == want, json.dumps({k: report[k] for k in ("hit_rate", "ttft_s")})


def test_the_digest_sees_a_change() -> None:
    """The same case with two GPUs per instance is another report."""
    kwargs, want = CASES["two_round_robin"]
    assert digest(run_replay(ReplayConfig(limit=200, tp=2, **kwargs))) != want
