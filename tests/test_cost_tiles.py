"""Tile quantisation in the cost model and its calibration, and the admission delay.

The fast executor's prefill attention runs one CTA per (128-row work item, query
head), so 1,056 new tokens cost two waves where 1,024 cost one (measured on an
H100: +0.9 ms a 4-layer step for 3% more pairs), and cuBLAS pads a GEMM's rows to
its tile. These tests pin the arithmetic (``kvflow.cost.prefill_wave_pairs``,
``padded_rows``), that the keys are off by default (reports of existing profiles
stay bit-identical: ``tests/test_replay_digest.py``), that calibration's pure half
picks the tiling synthetic steps were made with, and the clock matching of
``admission_delays``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.calibrate import (
    Tiles,
    admission_delays,
    choose_tiles,
    retile,
    roofline,
    step_point,
    tile_candidates,
)
from kvflow.cost import CostModel, padded_rows, prefill_wave_pairs
from kvflow.errors import ConfigError
from kvflow.layout import preset
from kvflow.profile import PROFILES, load_profile

SPEC = preset("llama-3-8b-l4", block_tokens=512)
TILED = replace(PROFILES["h100"], gemm_row_tile=128.0, attention_tile_rows=128.0,
                attention_ctas=132.0, attention_mfu=0.3)


def test_padded_rows() -> None:
    assert padded_rows(1056, 128) == 1152 and padded_rows(1024, 128) == 1024
    assert padded_rows(100, 128) == 100  # below one tile: the efficiency curve's business
    assert padded_rows(1056, 0) == 1056


def test_wave_pairs_one_wave_past_the_slots_costs_a_whole_wave() -> None:
    plain = 1056 * (3072 + 528)
    # 32 heads x 9 items = 288 CTAs over 132 slots: 3 rounds where 2.18 would do
    assert prefill_wave_pairs([(1056, 3072)], 32, 128, 132) == pytest.approx(
        plain * 3 * 132 / 288)
    # 1024 rows: 256 CTAs, 2 rounds for 1.94: ~3% more than the plain count
    p1024 = prefill_wave_pairs([(1024, 3072)], 32, 128, 132)
    assert p1024 == pytest.approx(1024 * 3584 * 264 / 256)
    # few items: the longest (causal: the last 128 rows) sets the time
    short = prefill_wave_pairs([(256, 4096)], 32, 128, 132)
    assert short == pytest.approx(256 * 4224 * 132 * (128 * (4096 + 256 - 64)) / (32 * 256 * 4224))
    assert prefill_wave_pairs([], 32, 128, 132) == 0.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9000), st.integers(0, 40000)), min_size=1,
                max_size=6))
def test_wave_pairs_never_fewer_than_the_plain_count(prefill: list[tuple[int, int]]) -> None:
    plain = sum(n * (c + n * 0.5) for n, c in prefill)
    assert prefill_wave_pairs(prefill, 32, 128, 132) >= plain * (1 - 1e-12)


def test_tiles_are_off_by_default_and_change_only_what_they_model() -> None:
    base = PROFILES["h100"]
    assert (base.gemm_row_tile, base.attention_tile_rows, base.attention_ctas) == (0, 0, 0)
    off = CostModel(SPEC, replace(base, attention_mfu=0.3))
    on = CostModel(SPEC, TILED)
    # decode-only steps: no prefill work items, fewer rows than a tile: unchanged
    assert on.step_time([], [4097] * 8) == off.step_time([], [4097] * 8)
    assert on.decode_step_time(8, 8 * 4097) == off.decode_step_time(8, 8 * 4097)
    # just past 1,024 rows the tiled model jumps; the untiled one grows by ~3%
    jump_on = on.step_time([(1056, 3072)], []) - on.step_time([(1024, 3072)], [])
    jump_off = off.step_time([(1056, 3072)], []) - off.step_time([(1024, 3072)], [])
    assert jump_on > 3 * jump_off > 0


def test_tile_keys_load_from_toml_and_are_validated(tmp_path: Path) -> None:
    p = tmp_path / "t.toml"
    p.write_text('base = "h100"\ngemm_row_tile = 128\nattention_tile_rows = 128\n'
                 "attention_ctas = 264\n")
    prof = load_profile(p)
    assert (prof.gemm_row_tile, prof.attention_tile_rows, prof.attention_ctas) == (128, 128, 264)
    p.write_text('base = "h100"\nattention_ctas = -1\n')
    with pytest.raises(ConfigError, match="attention_ctas"):
        load_profile(p)


def test_step_point_matches_the_tiled_cost_model() -> None:
    cm = CostModel(SPEC, TILED)
    tiles = Tiles(128, 128, 132)
    for batch in (([(1056, 3072)], []), ([(1056, 3072), (300, 0)], [2000] * 3),
                  ([], [4097] * 200)):
        p = step_point("x", SPEC, *batch, 1.0, tiles)
        assert roofline(p, SPEC.num_layers, TILED.peak_bf16_flops, TILED.hbm_bytes_per_s,
                        TILED.mfu, TILED.mbu, TILED.step_overhead_s, 0.3) == pytest.approx(
            cm.step_time(*batch), rel=1e-12)
        assert retile([p], SPEC, Tiles())[0] == step_point("x", SPEC, *batch, 1.0)


def test_choose_tiles_finds_the_tiling_the_steps_were_made_with() -> None:
    peak, hbm = TILED.peak_bf16_flops, TILED.hbm_bytes_per_s
    made_with = Tiles(128, 128, 132)
    batches = [([(n, c)], []) for n, c in ((512, 0), (2048, 0), (8192, 0), (1024, 2048),
                                           (1056, 3072), (1088, 4096), (1152, 4096),
                                           (1280, 4096), (960, 4096), (2048, 32768),
                                           (256, 4096), (4096, 16384))]
    batches += [([], [c + 1] * b) for b, c in ((1, 1024), (8, 4096), (32, 8192))]
    pts = []
    for pre, dec in batches:
        p = step_point("", SPEC, pre, dec, 0.0, made_with)
        pts.append(replace(p, seconds=roofline(p, 4, peak, hbm, 0.6, 0.7, 8e-4, 0.3)))
    cands = tile_candidates(128, 132)
    assert cands[0] == Tiles() and made_with in cands and len(cands) == 9
    assert tile_candidates(0, 132) == [Tiles(), Tiles(128), Tiles(256)]
    # (four of the nine: each candidate is a whole fit, ~1 s)
    few = [Tiles(), Tiles(128), Tiles(0, 128, 264), made_with]
    tiles, rms = choose_tiles(pts, SPEC, peak, hbm, few)
    assert tiles == made_with and rms < 0.01
    # steps made without tiles keep them off (ties go to "off", listed first)
    plain = [replace(p, seconds=roofline(p, 4, peak, hbm, 0.6, 0.7, 8e-4, 0.3))
             for p in retile(pts, SPEC, Tiles())]
    assert choose_tiles(plain, SPEC, peak, hbm, [Tiles(), made_with])[0] == Tiles()


def test_admission_delays_match_first_tokens_to_their_steps() -> None:
    # perf_counter clock = replay clock + 100 s; steps (prefill, decode, gpu, wall, start)
    steps = [([(1024, 0)], [], 3e-3, 4e-3, 100.0007), ([], [1025], 1e-3, 1.5e-3, 100.0048),
             ([(1024, 0)], [], 3e-3, 4e-3, 100.0306), ([], [1025], 1e-3, 1.5e-3, 100.0347)]
    arrivals = [0.0, 0.03]
    first = [0.0007 + 4e-3, 0.0306 + 4e-3]
    assert admission_delays(arrivals, first, steps) == pytest.approx([7e-4, 6e-4])
    with pytest.raises(ValueError, match="prefill steps"):
        admission_delays([0.0], [0.0047], steps)


def test_gpu_suite_replays_one_instance_in_both_worlds() -> None:
    # The CLI's default is --instances auto: the simulator chose 2 instances for the
    # suite's slice A while the GPU world runs 1, and its TTFT p50 came out 84% short.
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_suite

    for cuda in (False, True):
        cmd = gpu_suite.replay_cmd(Path("t.jsonl"), (60, 1024), Path("o.json"), cuda).split()
        assert cmd[cmd.index("--instances") + 1] == "1"


def test_robust_fit_leaves_out_steps_disturbed_by_one_time_costs() -> None:
    from kernels.calibrate import fit_roofline, robust_fit_roofline

    peak, hbm = TILED.peak_bf16_flops, TILED.hbm_bytes_per_s
    batches = [([(n, c)], []) for n, c in ((512, 0), (2048, 0), (8192, 0), (1024, 2048),
                                           (2048, 8192), (4096, 16384), (1024, 32768))]
    batches += [([], [c + 1] * b) for b in (1, 2, 4, 8, 16, 24, 32) for c in (1024, 4096)]
    pts = []
    for i, (pre, dec) in enumerate(batches):
        p = step_point("", SPEC, pre, dec, 0.0)
        t = roofline(p, 4, peak, hbm, 0.6, 0.7, 8e-4, 0.3)
        pts.append(replace(p, seconds=t * (4.0 if i % 7 == 3 else 1.0)))  # 3 stalled steps
    plain = fit_roofline(pts, 4, peak, hbm)
    fit, kept = robust_fit_roofline(pts, 4, peak, hbm)
    assert kept.count(False) == 3 and not any(k for i, k in enumerate(kept) if i % 7 == 3)
    assert fit.mbu == pytest.approx(0.7, rel=0.03) and fit.mfu == pytest.approx(0.6, rel=0.03)
    assert fit.rms < 0.01 < plain.rms


def test_load_submit_delays_only_the_steps_that_wait_for_a_load(tmp_path: Path) -> None:
    import csv

    from kvflow.replay import ReplayConfig, run_replay
    from traces.generate import multi_turn, write_generic

    trace = tmp_path / "mt.jsonl"
    write_generic(multi_turn(sessions=6, turns=3, system_len=1024, user_len=1024,
                             output_len=8, think_time_s=2.0, rate=2.0, block_tokens=512,
                             seed=1), trace, block_tokens=512, force=True)
    prof = tmp_path / "p.toml"
    ttft = {}
    for submit in (0.0, 2e-3):
        prof.write_text(f'base = "h100"\nload_submit_s = {submit}\n')
        out = tmp_path / f"r{submit}.csv"
        run_replay(ReplayConfig(trace=str(trace), model="llama-3-8b-l4", profile=str(prof),
                                device_blocks=12, host_blocks=256, storage_blocks=0),
                   requests_csv=out)
        with out.open() as f:
            ttft[submit] = {r["request_id"]: (float(r["ttft_s"]), int(r["hits_host"]))
                            for r in csv.DictReader(f)}
    loaded = [k for k, (_, hh) in ttft[0.0].items() if hh]
    assert loaded and len(loaded) < len(ttft[0.0])
    for k, (t, hh) in ttft[0.0].items():
        extra = ttft[2e-3][k][0] - t
        # one load op per request with host hits (the engine idle at arrival): its step
        # starts 2 ms later, less what the load's own layers would have stalled it
        if hh:
            assert 1e-3 < extra <= 2e-3 + 1e-9, (k, extra)
        else:
            assert extra == pytest.approx(0.0, abs=1e-9), (k, extra)
