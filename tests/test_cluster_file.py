"""Mixed clusters from a TOML file (``--cluster``, ``ReplayConfig.cluster``): the settings
and groups it gives, and its errors, each naming the file and the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cli_helpers import AppCli

from cli import app
from kvflow.errors import ConfigError
from kvflow.replay import ReplayConfig, run_replay
from kvflow.replay.cluster_file import InstanceGroup

CLI = AppCli(app, "replay", columns=200)

MIXED = """
router = "least_loaded"
pool_blocks = 3000
pool_gb_per_s = 200

[[group]]
count = 2
host_blocks = 100

[[group]]
count = 1
profile = "h200"
tp = 2
nic_gb_per_s = 25
"""


def write(tmp_path: Path, text: str, name: str = "cluster.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_mixed_cluster_replays_each_group_on_its_hardware(tmp_path):
    cfg = ReplayConfig(cluster=write(tmp_path, MIXED), limit=30)
    assert cfg.router == "least_loaded" and cfg.pool_blocks == 3000 and cfg.instances == 3
    assert cfg.groups == (InstanceGroup(2, host_blocks=100),
                          InstanceGroup(1, profile="h200", tp=2, nic_gb_per_s=25.0))
    r = run_replay(cfg)
    rows = r["instances"]
    assert [(row["group"], row["tp"]) for row in rows] == [(0, 1), (0, 1), (1, 2)]
    assert r["cluster"]["router"] == "least_loaded" and r["pool"]["capacity_blocks"] == 3000
    by_group = r["load"]["capacity_by_group"]
    assert [g["instances"] for g in by_group] == [2, 1]
    # Two H200s (141 GB each) serve more than one H100 and hold more decode batch.
    assert by_group[1]["prefill_tokens_per_s"] > by_group[0]["prefill_tokens_per_s"]
    assert r["config"]["groups"][1]["profile"] == "h200"


def test_the_file_applies_where_the_config_keeps_its_default(tmp_path):
    path = write(tmp_path, 'router = "ttft"\ninstances = 2\n')
    cfg = ReplayConfig(cluster=path, seed=5)
    assert (cfg.router, cfg.instances, cfg.seed) == ("ttft", 2, 5)
    assert ReplayConfig(cluster=path, router="ttft").router == "ttft"  # agreeing is fine
    with pytest.raises(ConfigError, match=re.escape(
            f"{path}: key 'router' = 'ttft', but router='prefix' is given too")):
        ReplayConfig(cluster=path, router="prefix")


def test_groups_fix_the_instance_count(tmp_path):
    path = write(tmp_path, "[[group]]\ncount = 2\n[[group]]\ncount = 3\n")
    assert ReplayConfig(cluster=path).instances == 5
    assert ReplayConfig(cluster=path, instances=5).instances == 5
    with pytest.raises(ConfigError, match="its groups hold 5 instances, but instances=4"):
        ReplayConfig(cluster=path, instances=4)
    with pytest.raises(ConfigError, match="its groups hold 5 instances, but instances='auto'"):
        ReplayConfig(cluster=path, instances="auto")


def test_a_group_profile_beside_the_file(tmp_path):
    (tmp_path / "slow.toml").write_text('base = "h100"\nmfu = 0.25\n')
    sub = tmp_path / "elsewhere"
    sub.mkdir()
    path = write(tmp_path, '[[group]]\ncount = 1\nprofile = "slow.toml"\n')
    cfg = ReplayConfig(cluster=path)
    assert cfg.groups[0].profile == str(tmp_path / "slow.toml")


@pytest.mark.parametrize("text, message", [
    ('routr = "prefix"\n', "unknown key 'routr' (known: group, model,"),
    ('trace = "x.jsonl"\n', "unknown key 'trace'"),
    ("instances = 1.5\n", "key 'instances' must be int or str, got 1.5"),
    ('tp = "two"\n', "key 'tp' must be int, got 'two'"),
    ("rate_scale = -1\n", "rate_scale must be a finite number > 0, got -1.0"),
    ('router = "fastest"\n', "unknown router 'fastest'"),
    ("tp = 0\n", "tp must be an integer >= 1, got 0"),
    ("nic_gb_per_s = 10\n", "nic_gb_per_s need a shared pool"),
    ("group = 3\n", "key 'group' must be a list of tables"),
    ("[[group]]\nprofile = 'h100'\n", "group 1: key 'count' is missing"),
    ("[[group]]\ncount = 1\n[[group]]\ncount = 0\n", "group 2: key 'count' must be >= 1"),
    ("[[group]]\ncount = 1\ncolour = 'red'\n", "group 1: unknown key 'colour'"),
    # A group's values are checked as the config checks its own (the same words).
    ("[[group]]\ncount = 1\ntp = 0\n", "group 1: tp must be an integer >= 1, got 0"),
    ("[[group]]\ncount = 1\nhost_gb = -2\n",
     "group 1: host_gb must be a finite number >= 0, got -2.0"),
    ("[[group]]\ncount = 1\nhost_gb = inf\n",
     "group 1: host_gb must be a finite number >= 0, got inf"),
    ("device_gb = nan\n", "device_gb must be a finite number >= 0, got nan"),
    ("[[group]]\ncount = 1\nhost_gb = 2\nhost_blocks = 9\n",
     "group 1: give host_blocks or host_gb, not both"),
    ("[[group]]\ncount = 1\nnic_gb_per_s = 0\n",
     "group 1: nic_gb_per_s must be a finite number > 0, got 0.0"),
    ("[[group]]\ncount = 1\nprofile = 'b300'\n",
     "group 1: key 'profile': unknown GPU profile 'b300'"),
    ("[[group]]\ncount = true\n", "group 1: key 'count' must be int, got True"),
    ("router = \n", "not valid TOML"),
])
def test_file_errors_name_the_file_and_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        ReplayConfig(cluster=path)
    assert str(info.value).startswith(path), info.value
    assert message in str(info.value), info.value


def test_merged_errors(tmp_path):
    with pytest.raises(ConfigError, match="storage_\\* of group 1 and a shared pool"):
        ReplayConfig(cluster=write(tmp_path, "pool_blocks = 9\n[[group]]\ncount = 1\n"
                                             "storage_blocks = 3\n"))
    with pytest.raises(ConfigError, match="nic_\\* of group 1 need a shared pool"):
        ReplayConfig(cluster=write(tmp_path, "[[group]]\ncount = 1\nnic_latency_s = 0.1\n",
                                   "nic.toml"))
    with pytest.raises(ConfigError, match="cannot read"):
        ReplayConfig(cluster=str(tmp_path / "missing.toml"))


def test_cli_cluster_file(tmp_path):
    path = write(tmp_path, MIXED)
    code, out, err = CLI.run("--limit", "20", "--cluster", path)
    assert code == 0, err
    words = " ".join(out.split())  # (titles wrap at their table's width)
    assert "2 x h100 + 1 x h200 (tp 2)" in words and "shared pool:" in words
    assert "router least_loaded" in words
    line = CLI.user_error("--limit", "20", "--cluster", path, "--router", "prefix")
    assert line == (f"error: --router prefix disagrees with {path}'s router = "
                    "'least_loaded': give it in one place")
    line = CLI.user_error("--limit", "20", "--cluster", write(tmp_path, "tp = -1\n", "b.toml"))
    assert "b.toml: tp must be an integer >= 1" in line


def test_cli_options(tmp_path):
    code, out, err = CLI.run("--limit", "20", "--instances", "2", "--tp", "2",
                             "--pool-blocks", "500", "--pool-gb-per-s", "100",
                             "--nic-gb-per-s", "25", "--nic-latency", "2e-5", "--json")
    assert code == 0, err
    import json

    cfg = json.loads(out)["config"]
    assert (cfg["tp"], cfg["pool_blocks"], cfg["pool_gb_per_s"], cfg["nic_gb_per_s"],
            cfg["nic_latency_s"]) == (2, 500, 100.0, 25.0, 2e-5)
    assert "need a shared pool" in CLI.user_error("--limit", "5", "--nic-gb-per-s", "9")


@pytest.mark.parametrize("name", ["device_gb", "host_gb", "storage_gb"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_tier_sizes_must_be_finite(name, value):
    # NaN and infinity passed the ">= 0" check (NaN compares False, inf is >= 0) and the
    # replay died converting them to blocks (ValueError: cannot convert float NaN).
    with pytest.raises(ConfigError, match=f"{name} must be a finite number >= 0"):
        ReplayConfig(**{name: value})
