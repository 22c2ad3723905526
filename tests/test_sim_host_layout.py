"""The simulator's host layouts: pieces of G layers land a group at a time, with the
link's latency once per group and its per-piece cost once per block and piece."""

from __future__ import annotations

import asyncio

import pytest
from test_sim_hierarchy import D2H, DISK, H2D, SPEC, GiB, MiB, Sink, op, setup

from kvflow.errors import ConfigError
from kvflow.replay import ReplayConfig
from sim.hierarchy import Hierarchy, Link, SimBackend

pytestmark = pytest.mark.virtual_time

LAT, PIECE = 2**-14, 2**-16  # dyadic: sums are exact
PCIE = Link(GiB, LAT, piece_s=PIECE)
HIER = Hierarchy(h2d=PCIE, d2h=PCIE, storage_read=DISK, storage_write=DISK)
LAYER = MiB / GiB  # one block's layer on the wire (SPEC: 1 MiB, k + v)


async def lands(layout: str, blocks: int, hier: Hierarchy = HIER, route: tuple = H2D
                ) -> list[float]:
    _, env, be = setup(hier)
    be.set_host_layout(layout)
    sink = Sink(env)
    t0 = env.now
    be.submit(op(*route, blocks=blocks), sink, ())
    await sink.finished
    assert sink.error is None
    return [t - t0 for t in sink.layers]


@pytest.mark.asyncio
async def test_layer_major_pays_a_piece_per_block_and_role() -> None:
    got = await lands("layer_major", 3)
    unit = LAT + 3 * LAYER + 3 * 2 * PIECE  # 3 blocks x (k, v) pieces each layer
    assert got == pytest.approx([(i + 1) * unit for i in range(4)], rel=1e-12)


@pytest.mark.asyncio
@pytest.mark.parametrize("route", [H2D, D2H])
async def test_grouped_layers_land_together_at_the_groups_end(route: tuple) -> None:
    got = await lands("grouped:2", 3, route=route)
    group = LAT + 2 * 3 * LAYER + 3 * PIECE  # one piece of 2 layers per block
    assert got == pytest.approx([group, group, 2 * group, 2 * group], rel=1e-12)


@pytest.mark.asyncio
async def test_a_short_last_group() -> None:
    got = await lands("grouped:3", 2)
    g3, g1 = LAT + 3 * 2 * LAYER + 2 * PIECE, LAT + 2 * LAYER + 2 * PIECE
    assert got == pytest.approx([g3] * 3 + [g3 + g1], rel=1e-12)


@pytest.mark.asyncio
async def test_block_major_is_one_group() -> None:
    got = await lands("block_major", 5)
    whole = LAT + 4 * 5 * LAYER + 5 * PIECE
    assert got == pytest.approx([whole] * 4, rel=1e-12)


@pytest.mark.asyncio
async def test_fewer_pieces_finish_sooner_with_a_piece_cost() -> None:
    ends = {lay: (await lands(lay, 8))[-1]
            for lay in ("layer_major", "grouped:2", "block_major")}
    assert ends["block_major"] < ends["grouped:2"] < ends["layer_major"]


@pytest.mark.asyncio
async def test_busy_time_and_bytes_count_each_group_once() -> None:
    _, env, be = setup(HIER)
    be.set_host_layout("grouped:2")
    sink = Sink(env)
    be.submit(op(*H2D, blocks=3), sink, ())
    await sink.finished
    m = be.metrics()["h2d"]
    assert m["bytes"] == 4 * 3 * MiB
    assert m["busy_s"] == pytest.approx(2 * (LAT + 2 * 3 * LAYER + 3 * PIECE), rel=1e-12)
    assert m["busy_s"] == pytest.approx(sink.done_at, rel=1e-12)


@pytest.mark.asyncio
async def test_duplex_slows_a_group_started_beside_the_other_way() -> None:
    hier = Hierarchy(h2d=PCIE, d2h=PCIE, storage_read=DISK, storage_write=DISK, duplex=0.5)
    _, env, be = setup(hier)
    be.set_host_layout("block_major")
    a, b = Sink(env), Sink(env)
    be.submit(op(*H2D, blocks=1), a, ())
    be.submit(op(*D2H, blocks=1), b, ())
    await asyncio.gather(a.finished, b.finished)
    # a unit's pace is set when it starts: the load started alone, the backup beside it
    alone, both = LAT + 4 * LAYER + PIECE, LAT + 4 * LAYER / 0.5 + PIECE
    assert a.layers == pytest.approx([alone] * 4, rel=1e-12)
    assert b.layers == pytest.approx([both] * 4, rel=1e-12)


def test_piece_s_is_validated() -> None:
    with pytest.raises(ConfigError, match="piece_s"):
        Link(GiB, LAT, piece_s=-1.0)


def test_set_host_layout_rejects_a_bad_name() -> None:
    import simpy

    be = SimBackend(simpy.Environment(), SPEC, HIER)
    with pytest.raises(ConfigError, match="host_layout"):
        be.set_host_layout("grouped:0")


@pytest.mark.parametrize("bad", ["row_major", "grouped:0", "grouped"])
def test_replay_config_names_a_bad_layout(bad: str) -> None:
    with pytest.raises(ConfigError, match="host_layout"):
        ReplayConfig(host_layout=bad)


def test_replay_config_normalizes_the_layout() -> None:
    assert ReplayConfig(host_layout=" grouped:4").host_layout == "grouped:4"


def test_a_replay_runs_in_each_layout_and_reports_it() -> None:
    from kvflow.replay import run_replay

    reports = {lay: run_replay(ReplayConfig(limit=40, host_layout=lay, headroom=False))
               for lay in ("layer_major", "grouped:8", "block_major")}
    assert "host_layout" not in reports["layer_major"]["config"]  # default: as before
    assert reports["grouped:8"]["config"]["host_layout"] == "grouped:8"
    assert reports["block_major"]["config"]["host_layout"] == "block_major"
    for r in reports.values():
        assert r["requests"] == 40


def test_cli_names_a_bad_host_layout() -> None:
    from cli_helpers import AppCli

    from cli import app

    code, _, err = AppCli(app, "replay").run("--limit", "5", "--host-layout", "grouped:0")
    assert code == 2
    assert err.strip().startswith("error:") and "host_layout 'grouped:0'" in err
    assert len(err.strip().splitlines()) == 1
