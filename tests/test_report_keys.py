"""A report is public JSON: no key of it, at any depth, is private (starts with ``_``).

``full_report`` once handed the queue's first/last-quarter waits to
``assemble_report`` as a body key ``_queue_waits``, popped there: a body from
``replay_in_world`` (the per-world API the GPU world and tools call) still had it.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.replay import ReplayConfig, make_manager, replay_in_world, resolve, run_replay
from kvflow.world import load_world


def _private_keys(d: Any, path: str = "") -> list[str]:
    out: list[str] = []
    if isinstance(d, dict):
        for k, v in d.items():
            if str(k).startswith("_"):
                out.append(f"{path}{k}")
            out += _private_keys(v, f"{path}{k}.")
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += _private_keys(v, f"{path}{i}.")
    return out


@pytest.mark.parametrize("kw", [{}, {"mode": "cache"}, {"instances": 2, "pool_blocks": 3000},
                                {"pd": "1:1"}])
def test_no_report_key_is_private(kw: dict[str, Any]) -> None:
    report = run_replay(ReplayConfig(limit=40, **kw))
    assert _private_keys(report) == []
    assert report["load"]["queue_wait_first_last_s"] is not None or kw.get("mode") == "cache"


def test_a_world_body_has_no_private_key() -> None:
    cfg = ReplayConfig(limit=40)
    world = load_world("sim")
    setup = resolve(cfg, world)
    body = world.run(replay_in_world(cfg, setup, make_manager(cfg, setup.capacities, setup),
                                     world))
    assert _private_keys(body) == []
