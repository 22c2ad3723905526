"""The offline optimum in replays, reports and sweeps (``kvflow.headroom``).

A replay's report carries the optimum's hit rates at its capacities
(``headroom``); every view shows them beside the policy's, tier by tier down
the hierarchy; a sweep draws them as the upper line.
"""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from kvflow.errors import ConfigError
from kvflow.headroom import optimum_hit_rates
from kvflow.replay import ReplayConfig, run_replay
from kvflow.replay.config import resolve
from kvflow.reports import sweep_plots as SP
from kvflow.reports.render import METRIC_BY_KEY, flatten, headroom_rows, sections

CACHE = dict(mode="cache", limit=300, device_blocks=200, host_blocks=600, storage_blocks=0)


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    return {ev: run_replay(ReplayConfig(eviction=ev, **CACHE)) for ev in ("lru", "belady")}


def test_the_report_carries_the_optimum_at_its_capacities(reports):
    cfg = ReplayConfig(eviction="lru", **CACHE)
    setup = resolve(cfg)
    want = optimum_hit_rates([r.keys for r in setup.requests], (200, 600, 0))
    head = reports["lru"]["headroom"]
    assert head["optimum"] == pytest.approx(want) and head["eviction"] == "lru"
    assert "Belady" in head["method"] and "offline" in head["method"]
    assert reports["belady"]["headroom"]["eviction"] == "belady (offline)"
    # Belady runs per tier here (write_through, two tiers): it reaches the bound on the
    # device, and never passes it on device and host together.
    best = reports["belady"]
    assert best["hit_rate"]["device"] == pytest.approx(want["device"])
    assert best["hit_rate"]["total"] <= want["total"] + 1e-12
    lru = reports["lru"]["hit_rate"]
    assert lru["device"] <= want["device"] and lru["total"] <= want["total"]


def test_views_show_the_policy_beside_the_optimum(reports):
    cols, rows, note = headroom_rows(reports["lru"])
    assert cols == ("tiers", "blocks", "lru", "offline optimum", "of optimum")
    assert [r[:2] for r in rows] == [("device", "200"), ("device + host", "800")]
    assert "Belady" in note
    assert any(s.title == "headroom" for s in sections(reports["lru"]))
    flat = flatten(reports["lru"])
    assert flat["headroom.optimum.total"] == reports["lru"]["headroom"]["optimum"]["total"]
    assert METRIC_BY_KEY["headroom.optimum.device"].better == 1
    old = {k: v for k, v in reports["lru"].items() if k != "headroom"}
    assert headroom_rows(old) is None  # a report from before: no section, no error


def test_headroom_can_be_left_out_and_is_not_claimed_for_a_cluster():
    r = run_replay(ReplayConfig(eviction="lru", headroom=False, **CACHE))
    assert "headroom" not in r
    from kvflow.headroom import headroom_section

    head = headroom_section([[1, 2]], (4, 0, 0), "lru", instances=2)
    assert head["optimum"] is None and "cluster" in head["note"]


def test_an_unknown_policy_fails_at_construction():
    with pytest.raises(ConfigError, match=r"unknown eviction policy 'mru'.*belady"):
        ReplayConfig(eviction="mru")


def test_belady_and_cost_aware_replay_in_full_mode():
    for ev in ("belady", "cost_aware"):
        r = run_replay(ReplayConfig(eviction=ev, limit=60, device_blocks=300, host_blocks=300,
                                    storage_blocks=0, instances=1))
        assert r["requests"] == 60 and r["headroom"]["optimum"]["total"] > 0


def test_sweep_draws_the_optimum_once_per_distinct_curve():
    fig = Figure()
    ax = fig.add_subplot()
    pts = [(float(x), {"headroom.optimum.total": 0.1 * x}) for x in (1, 2, 3)]
    SP._optimum_lines(ax, {"eviction=lru": pts, "eviction=arc": list(pts)})
    labels = [ln.get_label() for ln in ax.get_lines()]
    assert labels == ["offline optimum (Belady)"]
    other = [(x, {"headroom.optimum.total": 0.05 * x}) for x, _ in pts]
    SP._optimum_lines(ax, {"device_blocks=1": pts, "device_blocks=2": other})
    assert len(ax.get_lines()) == 3
    SP._optimum_lines(ax, {"x": [(1.0, {"headroom.optimum.total": None})]})  # none: no line
    assert len(ax.get_lines()) == 3
    assert SP._offline("eviction", "belady") == " (offline)"
    assert SP._offline("eviction", "lru") == ""


@pytest.mark.parametrize("eviction", ["arc", "length_aware", "cost_aware", "belady"])
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_full_replay_with_the_new_policies_drains_clean(eviction, write_policy):
    from test_replay import SAMPLE, check_drained

    cfg = ReplayConfig(trace=SAMPLE, limit=120, device_blocks=300, host_blocks=200,
                       storage_blocks=600, eviction=eviction, write_policy=write_policy,
                       instances=1)
    r = run_replay(cfg, inspect=check_drained)
    assert r["requests"] == 120 and r["rejected"] == 0
    assert r["evictions"]["device"] > 0 and r["hit_rate"]["total"] > 0
