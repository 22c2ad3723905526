"""``benchmarks/pd_fidelity.py``: the simulator's PD mode replayed on a serve-pd run's
slice and settings. What must hold whatever the machine's load: the simulator moves
exactly the bytes the real pair moved (same blocks, same layout), and the profile it is
given computes a step in exactly the time it was told."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvflow.cost import CostModel
from kvflow.layout import preset
from kvflow.profile import load_profile
from kvflow.realtime.pd_instance import InstanceConfig
from kvflow.realtime.pd_serve import ServeConfig, serve_pd

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "pd_fidelity.py"
_spec = importlib.util.spec_from_file_location("pd_fidelity", _PATH)
assert _spec is not None and _spec.loader is not None
fid = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fid)


@pytest.mark.parametrize("step_s,token_s", [(0.002, 2e-6), (0.0013, 2.6e-6), (0.0, 1e-5)])
def test_the_pacing_profile_steps_in_the_time_it_was_given(tmp_path: Path, step_s: float,
                                                           token_s: float) -> None:
    spec = preset("kvflow-tiny-hd64", block_tokens=512)
    path = tmp_path / "p.toml"
    fid.pacing_profile(spec, step_s, token_s, path)
    cm = CostModel(spec, load_profile(str(path)))
    for prefill, decode in (([(2048, 30000)], []), ([], [9000] * 16), ([(7, 0)], [100])):
        tokens = sum(n for n, _ in prefill) + len(decode)
        want = step_s + token_s * tokens
        assert abs(cm.step_time(prefill, decode) - want) <= 1e-3 * want


def test_fit_steps_recovers_a_line() -> None:
    steps = [[n, None, 0.0015 + 3e-6 * n] for n in (1, 4, 16, 512, 2048)]
    step_s, token_s = fid.fit_steps(steps)
    assert abs(step_s - 0.0015) < 1e-9 and abs(token_s - 3e-6) < 1e-12


def test_the_simulator_moves_the_bytes_the_pair_moved(tmp_path: Path) -> None:
    inst = InstanceConfig(step_s=0.0005, token_s=1e-6, verify_decode=False)
    real = serve_pd(ServeConfig(start=480, limit=4, time_scale=0.05, prefill=inst,
                                decode=InstanceConfig(**{**inst.__dict__})))
    spec = fid.cpu_tiny_registered(real)
    sim, _ = fid.sim_run(real, spec, 0.0005, 1e-6, 0.6, 1e-4, tmp_path)
    assert sim["requests"] == real["requests"] == 4
    assert sim["pd"]["bytes"] == real["transfer"]["bytes"] > 0
    assert sim["pd"]["transfers"] == real["transfer"]["ok"]
    assert "TTFT" in fid.table(real, sim)
