"""Links per host layout in a GPU profile (issue 23): ``[host_layouts."<layout>".h2d]``
tables, what ``kvflow calibrate --host-layouts`` writes, and a replay in a listed layout
running on them (the simulator models each layout's pieces with its measured links)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_sim_hierarchy import D2H, H2D, SPEC, Sink, op, setup
from typer.testing import CliRunner

from cli import app
from kernels.calibrate import fit_link, render_profile, write_profile
from kernels.calibrate.layouts import (
    host_layout_tables,
    parse_layouts,
    profile_onto,
    strip_host_layouts,
)
from kvflow.errors import ConfigError
from kvflow.host_layout import HostLayout
from kvflow.profile import PROFILES, GpuProfile, Link, load_profile
from kvflow.replay import ReplayConfig, run_replay
from sim.hierarchy import Hierarchy
from sim.world import sim_service_s

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "sim/profiles/h100-fast-calibrated.toml"

TABLES = '''
[h2d]
bandwidth_Bps = 50e9
latency_s = 1e-5

[host_layouts."grouped:4".h2d]
bandwidth_Bps = 40e9

[host_layouts."grouped:4".d2h]
latency_s = 2e-5
piece_s = 1e-6

[host_layouts.block_major.h2d]
bandwidth_Bps = 30e9
latency_s = 0.0
'''


def write(tmp_path: Path, text: str, name: str = "p.toml") -> str:
    path = tmp_path / name
    path.write_text('base = "h100"\n' + text)
    return str(path)


def test_layout_tables_override_the_files_own_links(tmp_path: Path) -> None:
    prof = load_profile(write(tmp_path, TABLES))
    h100 = PROFILES["h100"]
    g4 = prof.for_host_layout("grouped:4")
    # a layout's table overrides the file's [h2d] (which overrides the base's)
    assert g4.h2d == Link(40e9, 1e-5) and g4.d2h == replace(h100.d2h, latency_s=2e-5,
                                                            piece_s=1e-6)
    bm = prof.for_host_layout("block_major")
    assert bm.h2d == Link(30e9, 0.0) and bm.d2h == h100.d2h
    # an unlisted layout, or one spelled otherwise, runs on the profile's own links
    assert prof.for_host_layout("layer_major") is prof
    assert prof.for_host_layout("grouped:8") is prof
    assert prof.for_host_layout(" grouped:04 ").h2d == g4.h2d
    assert [n for n, _, _ in prof.host_layouts] == ["grouped:4", "block_major"]
    assert PROFILES["h100"].for_host_layout("grouped:4") is PROFILES["h100"]


@pytest.mark.parametrize(("text", "match"), [
    ('[host_layouts."grouped:x".h2d]\nlatency_s = 0.0\n',
     r"key host_layouts\.\"grouped:x\": host_layout 'grouped:x'"),
    ('[host_layouts.diagonal.h2d]\nlatency_s = 0.0\n', r"unknown host_layout 'diagonal'"),
    ('[host_layouts."grouped:4".storage_read]\nlatency_s = 0.0\n',
     r"unknown key 'host_layouts\.\"grouped:4\"\.storage_read'"),
    ('[host_layouts."grouped:4".h2d]\nlatncy_s = 0.0\n',
     r"unknown key 'host_layouts\.\"grouped:4\"\.h2d\.latncy_s'"),
    ('[host_layouts."grouped:4".h2d]\nbandwidth_Bps = -1.0\n',
     r"key 'host_layouts\.\"grouped:4\"\.h2d\.bandwidth_Bps' must be a finite number > 0"),
    ('[host_layouts."grouped:4".h2d]\nlatency_s = 0.0\n[host_layouts."grouped:04".h2d]\n'
     'latency_s = 0.0\n', r"the same layout as 'grouped:4'"),
    ('host_layouts = 3\n', r"key 'host_layouts' must be a table of layouts"),
    ('host_layouts = { "grouped:4" = 1 }\n', r"must be a table with h2d and/or d2h"),
])
def test_bad_layout_tables_name_file_and_key(tmp_path: Path, text: str, match: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=match) as err:
        load_profile(path)
    assert str(err.value).startswith(path)


def test_a_profile_built_in_code_is_checked() -> None:
    base = PROFILES["h100"]
    link = base.h2d
    with pytest.raises(ConfigError, match="host_layouts"):
        replace(base, host_layouts=(("grouped:4", link),))
    with pytest.raises(ConfigError, match="twice"):
        replace(base, host_layouts=(("grouped:4", link, link), ("grouped:4", link, link)))
    with pytest.raises(ConfigError, match="write it 'grouped:4'"):
        replace(base, host_layouts=(("grouped:04", link, link),))
    ok = replace(base, host_layouts=(("block_major", Link(1e9, 0.0), link),))
    assert isinstance(ok, GpuProfile) and ok.for_host_layout("block_major").h2d.bandwidth_Bps \
        == 1e9


# ------------------------------------------------------------- what calibrate writes
MEASURED = {
    "layer_major": {"h2d": {"bandwidth_Bps": 53.1e9, "latency_s": 9e-6, "ops": 22},
                    "d2h": {"bandwidth_Bps": 52.0e9, "latency_s": 1.2e-5, "ops": 44},
                    "units_per_op": 16, "block_tokens": 512, "bytes_per_block": 32 << 20},
    "grouped:4": {"h2d": {"bandwidth_Bps": 51.5e9, "latency_s": 4.1e-5, "ops": 22},
                  "units_per_op": 4},  # d2h: too few ops to fit, left out
}


def test_calibrated_tables_render_and_load(tmp_path: Path) -> None:
    tables = host_layout_tables(MEASURED)
    assert list(tables) == ["layer_major", "grouped:4"] and list(tables["grouped:4"]) == ["h2d"]
    values = {"base": "h100", "name": "x", "mfu": 0.6,
              "h2d": {"bandwidth_Bps": 54e9, "latency_s": 1e-5},
              "d2h": {"bandwidth_Bps": 54e9, "latency_s": 1e-5}, "host_layouts": tables}
    text = render_profile(values, ["c"])
    assert 'host_layouts = ' not in text and '[host_layouts."grouped:4".h2d]' in text
    prof = write_profile(tmp_path / "p.toml", values, ["c"])
    assert prof.for_host_layout("layer_major").d2h == Link(52.0e9, 1.2e-5)
    g4 = prof.for_host_layout("grouped:4")
    assert g4.h2d == Link(51.5e9, 4.1e-5) and g4.d2h == prof.d2h  # unfitted: the profile's


def test_profile_onto_replaces_old_layout_tables_and_keeps_the_rest(tmp_path: Path) -> None:
    base = SHIPPED.read_text()
    first = profile_onto(base, host_layout_tables(MEASURED), ["first"])
    again = profile_onto(first, {"block_major": {"h2d": {"bandwidth_Bps": 1e9,
                                                         "latency_s": 0.0}}}, ["second"])
    assert again.startswith(base.rstrip("\n"))  # the base's keys and comments, as they were
    assert "# first" in again  # (comments before the tables stay; the tables do not)
    assert load_profile_text(tmp_path, profile_onto("mfu = 0.5\n[h2d]\nlatency_s = 0.0\n",
                                                    {}, [], name="n")).name == "n"
    path = tmp_path / "p.toml"
    path.write_text(again)
    prof, shipped = load_profile(str(path)), load_profile(str(SHIPPED))
    assert [n for n, _, _ in prof.host_layouts] == ["block_major"]
    assert replace(prof, host_layouts=(), name=shipped.name) == shipped
    with pytest.raises(ConfigError, match="inline"):
        strip_host_layouts('mfu = 0.5\nhost_layouts = { block_major = { h2d = {} } }\n')


def load_profile_text(tmp_path: Path, text: str) -> GpuProfile:
    path = tmp_path / "t.toml"
    path.write_text(text)
    return load_profile(str(path))


def test_parse_layouts() -> None:
    assert parse_layouts("layer_major, grouped:04,block_major") == [
        "layer_major", "grouped:4", "block_major"]
    with pytest.raises(ConfigError, match="twice"):
        parse_layouts("grouped:4,grouped:4")
    with pytest.raises(ConfigError, match="no host layout"):
        parse_layouts(" , ")
    with pytest.raises(ConfigError, match="unknown host_layout"):
        parse_layouts("diagonal")


@pytest.mark.asyncio
@pytest.mark.virtual_time
@pytest.mark.parametrize("route", [H2D, D2H])
@pytest.mark.parametrize("layout", ["layer_major", "grouped:2", "grouped:3", "block_major"])
async def test_calibrations_fit_is_the_simulators_charge(layout: str, route: tuple) -> None:
    """What ``measure_replay_links`` fits (``fit_link`` with the layout's groups as units)
    recovers the link the simulator charged, per layout: the two agree on the model."""
    link = Link(20e9, 3e-5)
    units = len(HostLayout.parse(layout).groups(SPEC.num_layers))
    _, env, be = setup(Hierarchy(link, link, PROFILES["h100"].storage_read,
                                 PROFILES["h100"].storage_write))
    be.set_host_layout(layout)
    pts = []
    for k in (1, 2, 5, 9):
        sink = Sink(env)
        h = be.submit(op(*route, blocks=k), sink, ())
        await sink.finished
        pts.append((k * SPEC.bytes_per_block, sim_service_s(h)))
    lat, bw = fit_link(pts, units)
    assert lat == pytest.approx(link.latency_s, rel=1e-6)
    assert bw == pytest.approx(link.bandwidth_Bps, rel=1e-6)


# ----------------------------------------------------------------------- replays
def _replay(profile: str, layout: str) -> dict:
    return run_replay(ReplayConfig(model="llama-3-8b-l4", limit=40, device_blocks=40,
                                   host_blocks=400, storage_blocks=0, profile=profile,
                                   host_layout=layout))


def test_a_replay_in_a_listed_layout_runs_on_its_links(tmp_path: Path) -> None:
    slow = '[host_layouts."grouped:2".d2h]\nbandwidth_Bps = 5e9\n'
    path = write(tmp_path, slow)
    plain = write(tmp_path, "", "plain.toml")
    # layer_major is not listed: its report is the one without any layout tables
    a, b = _replay(path, "layer_major"), _replay(plain, "layer_major")
    for r in (a, b):
        r["config"].pop("profile")
        r.pop("wall_s")
    assert a == b
    rep = _replay(path, "grouped:2")
    g = rep["transfers"]["backup"]
    g_plain = _replay(plain, "grouped:2")["transfers"]["backup"]
    assert g["blocks"] == g_plain["blocks"] > 0
    # backups (d2h) at 5 GB/s instead of the h100's 55: the wire time per block, +latency
    wire = rep["bytes"]["d2h"] / g["blocks"] / 5e9
    assert wire <= g["service_per_block_s"] <= 1.05 * wire
    assert g_plain["service_per_block_s"] < wire / 5


def test_calibrate_onto_needs_host_layouts_and_a_readable_profile(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["calibrate", "--onto", str(SHIPPED),
                                   "--out", str(tmp_path / "x.toml")])
    assert res.exit_code != 0 and "--host-layouts" in res.output, res.output
    bad = tmp_path / "bad.toml"
    bad.write_text("mfu = 7\n")
    res = CliRunner().invoke(app, ["calibrate", "--onto", str(bad), "--host-layouts",
                                   "grouped:4", "--out", str(tmp_path / "x.toml")])
    assert res.exit_code == 2 and "mfu" in res.output and str(bad) in res.output, res.output
    res = CliRunner().invoke(app, ["calibrate", "--host-layouts", "grouped:4,diagonal",
                                   "--out", str(tmp_path / "y.toml")])
    assert res.exit_code == 2 and "diagonal" in res.output, res.output
    assert not (tmp_path / "x.toml").exists() and not (tmp_path / "y.toml").exists()



def test_calibrate_onto_writes_the_measured_tables_over_the_base(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's file handling past the measurement (which needs a GPU: replaced here by
    what one measured)."""
    import kernels.calibrate.layouts as layouts

    def measured(model: str, block_tokens: int, names: list[str], **_: object
                 ) -> layouts.LayoutCalibration:
        assert names == ["layer_major", "grouped:4"] and block_tokens == 512
        return layouts.LayoutCalibration("H100", model, block_tokens, {}, MEASURED,
                                         host_layout_tables(MEASURED), 1.0)

    monkeypatch.setattr(layouts, "calibrate_layouts", measured)
    out = tmp_path / "p.toml"
    res = CliRunner().invoke(app, ["calibrate", "--onto", str(SHIPPED), "--host-layouts",
                                   "layer_major,grouped:04", "--model", "llama-3-8b-l16",
                                   "--out", str(out), "--json", str(tmp_path / "c.json"),
                                   "--name", "h100-layouts"])
    assert res.exit_code == 0, res.output
    prof = load_profile(str(out))
    assert prof.name == "h100-layouts"
    assert prof.for_host_layout("grouped:4").h2d == Link(51.5e9, 4.1e-5)
    assert prof.mfu == load_profile(str(SHIPPED)).mfu
    text = out.read_text()
    assert "# Command: kvflow calibrate" in text and "grouped:4 (4 units per op)" in text
    assert (tmp_path / "c.json").exists() and not (tmp_path / "p.toml.tmp").exists()


def test_shipped_layouts_profile_is_the_fast_profile_plus_its_layout_links() -> None:
    prof = load_profile(str(ROOT / "sim/profiles/h100-fast-layouts.toml"))
    base = load_profile(str(SHIPPED))
    assert [n for n, _, _ in prof.host_layouts] == ["layer_major", "grouped:4", "grouped:8",
                                                   "block_major"]
    assert replace(prof, host_layouts=(), name=base.name) == base
    for name, h2d, d2h in prof.host_layouts:
        assert 40e9 < h2d.bandwidth_Bps < 64e9 and 40e9 < d2h.bandwidth_Bps < 64e9, name
