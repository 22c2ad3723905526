"""``kvflow calibrate`` without a GPU: the fits, the profile it writes, the CLI's errors.

Also the report's per-transfer times (``TransferLog``) and ``--backend`` handling,
which the sim-vs-GPU comparison relies on.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli import app
from kernels import gpu_unavailable_reason
from kernels.calibrate import (
    CEILING_SLACK,
    StepPoint,
    fit_link,
    fit_roofline,
    host_share_fit,
    pcie_duplex,
    render_profile,
    roofline,
    step_point,
    step_terms,
    write_profile,
)
from kvflow.cost import CostModel
from kvflow.errors import ConfigError
from kvflow.layout import preset
from kvflow.profile import PROFILES, load_profile
from kvflow.replay import ReplayConfig, run_replay

ROOT = Path(__file__).resolve().parent.parent
SPEC = preset("llama-3-8b-l4", block_tokens=512)


def test_fit_link_recovers_latency_and_bandwidth() -> None:
    lat, bw, units = 4e-6, 48e9, 4
    rng = np.random.default_rng(0)
    pts = [(b, units * lat + b / bw * (1 + rng.normal(0, 1e-4))) for b in
           (8e6, 16e6, 32e6, 64e6, 128e6)]
    got_lat, got_bw = fit_link(pts, units)
    assert got_bw == pytest.approx(bw, rel=1e-3)
    assert got_lat == pytest.approx(lat, rel=0.1)
    # noise that would make the latency negative: clamped to 0, bandwidth refitted
    lat0, bw0 = fit_link([(1e6, 1e6 / 50e9 - 1e-6), (2e6, 2e6 / 50e9)], units)
    assert lat0 == 0.0 and bw0 == pytest.approx(50e9, rel=0.05)
    with pytest.raises(ValueError):
        fit_link([(1e6, 1e-4)], units)


def test_fit_link_ignores_a_stalled_size_and_respects_the_ceiling() -> None:
    """A size whose ops hit a stall (a shared GPU, a first batch over fresh
    addresses) must not tilt the line; nor may a fit beat the raw ceiling."""
    units, lat, bw = 4, 15e-6, 54e9
    sizes = [k * 8 * 2**20 for k in (1, 2, 3, 4, 6, 8, 16)]
    pts = [(b, units * lat + b / bw) for b in sizes]
    stalled = list(pts)
    stalled[4] = (sizes[4], pts[4][1] + 1.5e-3)   # 6 blocks: +1.5 ms
    got_lat, got_bw = fit_link(stalled, units)
    assert got_bw == pytest.approx(bw, rel=1e-3) and got_lat == pytest.approx(lat, rel=0.02)
    # ops that read far faster than the raw ceiling (timer noise): held near it
    fast = [(b, units * lat + b / 70e9) for b in sizes]
    lat_c, bw_c = fit_link(fast, units, max_bandwidth_Bps=55e9)
    assert bw_c == pytest.approx(CEILING_SLACK * 55e9) and 0.0 <= lat_c < lat
    assert fit_link(fast, units)[1] == pytest.approx(70e9, rel=1e-3)


def test_fit_link_trusts_ops_a_little_faster_than_one_contiguous_copy() -> None:
    """A suite run's device->host replay ops (MiB, ms) sloped at ~53.8 GB/s while one
    contiguous 256 MB memcpy read 50.7: held at 50.7, the latency fell to 0 and
    B's small backups came out 16% short of the GPU's. The fit must keep their
    per-op cost."""
    pts = [(m * 2**20, t * 1e-3) for m, t in (
        (8, 0.2294), (16, 0.382), (24, 0.4745), (32, 0.6317), (40, 0.7952), (48, 1.0044),
        (64, 1.2723), (80, 1.646), (96, 1.9547), (128, 2.5648))]
    lat, bw = fit_link(pts, 4, max_bandwidth_Bps=50.74e9)
    assert 52e9 < bw <= CEILING_SLACK * 50.74e9 and lat > 10e-6
    one_block = 4 * lat + 8 * 2**20 / bw
    assert one_block == pytest.approx(0.2294e-3, rel=0.1)


def test_pcie_duplex_is_the_both_ways_share() -> None:
    links = {"h2d": {"bandwidth_Bps": 54e9}, "d2h": {"bandwidth_Bps": 53e9},
             "both": {"h2d_Bps": 48.6e9, "d2h_Bps": 47.7e9}}
    assert pcie_duplex(links) == pytest.approx(0.9, abs=1e-4)
    assert pcie_duplex({**links, "both": {"h2d_Bps": 60e9, "d2h_Bps": 60e9}}) == 1.0
    assert pcie_duplex({**links, "both": {}}) == 1.0
    assert pcie_duplex({**links, "both": {"h2d_Bps": 5e9, "d2h_Bps": 5e9}}) == 0.5


def test_step_terms_match_the_cost_model() -> None:
    prof = replace(PROFILES["h100"], attention_mfu=0.2, step_overhead_per_seq_s=30e-6)
    cm = CostModel(SPEC, prof)
    batch = ([(2048, 4096), (512, 0)], [1000, 3000])
    f, b = step_terms(SPEC, *batch)
    p = step_point("x", SPEC, *batch, 1.0)
    assert (p.flops, p.nbytes, p.seqs) == (f, b, 4) and 0 < p.attn_flops < f
    assert roofline(p, 1, prof.peak_bf16_flops, prof.hbm_bytes_per_s, prof.mfu, prof.mbu,
                    attention_mfu=0.2) == pytest.approx(cm.layer_time(*batch), rel=1e-12)
    layers = SPEC.num_layers
    assert roofline(p, layers, prof.peak_bf16_flops, prof.hbm_bytes_per_s, prof.mfu, prof.mbu,
                    prof.step_overhead_s, 0.2, 30e-6) == pytest.approx(cm.step_time(*batch),
                                                                        rel=1e-12)


def _synthetic(mfu: float, attn_mfu: float, mbu: float, fixed: float,
               per_seq: float = 0.0) -> list[StepPoint]:
    prof = PROFILES["h100"]
    peak, hbm = prof.peak_bf16_flops, prof.hbm_bytes_per_s
    batches = [([(n, c)], []) for n, c in ((512, 0), (2048, 0), (8192, 0), (2048, 8192),
                                           (1024, 32768), (4096, 16384))]
    batches += [([], [c + 1] * b) for b, c in ((1, 1024), (8, 4096), (32, 8192))]
    batches += [([(2048, 0)], [4097] * 16)]
    pts = []
    for pre, dec in batches:
        p = step_point("", SPEC, pre, dec, 0.0)
        pts.append(replace(p, seconds=roofline(p, 4, peak, hbm, mfu, mbu, fixed, attn_mfu,
                                               per_seq)))
    return pts


def test_fit_roofline_recovers_mfu_attention_mfu_and_mbu() -> None:
    prof = PROFILES["h100"]
    peak, hbm = prof.peak_bf16_flops, prof.hbm_bytes_per_s
    pts = _synthetic(0.21, 0.09, 0.63, 1.5e-3, per_seq=40e-6)
    fit = fit_roofline(pts, 4, peak, hbm, per_seq=40e-6)
    assert fit.mfu == pytest.approx(0.21, rel=0.03) and fit.mbu == pytest.approx(0.63, rel=0.03)
    assert fit.attention_mfu == pytest.approx(0.09, rel=0.05)
    assert fit.overhead == pytest.approx(1.5e-3, rel=0.05) and fit.rms < 0.01
    # one rate for both: a worse fit, as the data has two
    single = fit_roofline(pts, 4, peak, hbm, per_seq=40e-6, split_attention=False)
    assert single.attention_mfu == single.mfu and single.rms > 3 * fit.rms
    # with the fixed term held at 0, the efficiencies absorb it (and fit worse)
    held = fit_roofline(pts, 4, peak, hbm, overheads=[0.0], per_seq=40e-6)
    assert held.overhead == 0.0 and held.rms > fit.rms and held.mbu < 0.63


def test_fit_roofline_with_a_gemm_curve_recovers_the_large_chunk_rate() -> None:
    from kvflow.cost import gemm_shape

    prof = PROFILES["h100"]
    peak, hbm = prof.peak_bf16_flops, prof.hbm_bytes_per_s
    shape = gemm_shape(((1.0, 0.002), (64.0, 0.04), (1024.0, 0.15), (8192.0, 0.18)))
    pts = []
    for pre, dec in ([([(n, c)], []) for n, c in ((256, 0), (1024, 2048), (8192, 0),
                                                  (8192, 8192), (2048, 32768))]
                     + [([], [c + 1] * b) for b, c in ((1, 1024), (8, 4096), (64, 2048))]):
        p = step_point("", SPEC, pre, dec, 0.0)
        assert p.tokens == sum(n for n, _ in pre) + len(dec)
        pts.append(replace(p, seconds=roofline(p, 4, peak, hbm, 0.2, 0.6, 1e-3, 0.1,
                                               gemm_shape=shape)))
    fit = fit_roofline(pts, 4, peak, hbm, gemm_shape=shape)
    assert fit.mfu == pytest.approx(0.2, rel=0.03) and fit.rms < 0.01
    assert fit_roofline(pts, 4, peak, hbm).rms > 3 * fit.rms  # one rate cannot follow it


def test_host_share_fit_recovers_fixed_per_sequence_and_per_prefill() -> None:
    rng = np.random.default_rng(0)
    seqs = rng.integers(1, 25, size=200)
    prefills = np.where(rng.random(200) < 0.2, rng.integers(1, 4, size=200), 0)
    gpu = rng.uniform(2e-3, 9e-3, size=200)
    host = 0.4e-3 + 25e-6 * seqs + 0.3e-3 * prefills + rng.normal(0, 5e-6, size=200)
    host[::40] += 20e-3  # a few pauses: left out
    starts = np.concatenate([[0.0], np.cumsum(gpu + host)[:-1]])
    share = host_share_fit(starts.tolist(), gpu.tolist(), seqs.tolist(), prefills.tolist())
    assert share.fixed == pytest.approx(0.4e-3, rel=0.05)
    assert share.per_seq == pytest.approx(25e-6, rel=0.05)
    assert share.per_prefill == pytest.approx(0.3e-3, rel=0.05)
    assert share.of(10, 1) == pytest.approx(0.4e-3 + 250e-6 + 0.3e-3, rel=0.05)
    # without prefill counts, the per-sequence fit still stands
    no_p = host_share_fit(starts.tolist(), gpu.tolist(), seqs.tolist())
    assert no_p.per_prefill == 0.0 and no_p.per_seq == pytest.approx(25e-6, rel=0.2)
    # one batch size: no slope to fit, the mean is the fixed share
    one = host_share_fit([0.0, 1.0, 2.0, 3.0], [0.9, 0.9, 0.9, 0.9], [4, 4, 4, 4])
    assert one.per_seq == 0.0 and one.fixed == pytest.approx(0.1)
    # a negative slope (noise) is dropped, not reported
    neg = host_share_fit([0.0, 1.0, 2.0, 3.0, 4.0], [0.9] * 5, [1, 2, 3, 4, 5])
    assert neg.per_seq >= 0.0


def test_written_profile_loads_with_the_measured_values(tmp_path: Path) -> None:
    values = {"base": "h100", "name": "h100-calibrated", "peak_bf16_flops": 989.4e12,
              "mfu": 0.1834, "hbm_bytes_per_s": 3.35e12, "mbu": 0.52, "memory_bytes": 85e9,
              "step_overhead_s": 3.2e-4,
              "h2d": {"bandwidth_Bps": 49.7e9, "latency_s": 6.1e-6},
              "d2h": {"bandwidth_Bps": 51.2e9, "latency_s": 0.0}}
    text = render_profile(values, ["measured somewhere", "", "second line"])
    assert text.startswith("# measured somewhere\n#\n# second line\n")
    prof = write_profile(tmp_path / "p.toml", values, ["x"])
    assert prof.name == "h100-calibrated" and prof.mfu == pytest.approx(0.1834)
    assert prof.h2d.bandwidth_Bps == pytest.approx(49.7e9)
    assert prof.h2d.latency_s == pytest.approx(6.1e-6) and prof.d2h.latency_s == 0.0
    assert prof.step_overhead_s == pytest.approx(3.2e-4)
    assert prof.storage_read == PROFILES["h100"].storage_read  # not measured: the base's
    with pytest.raises(ConfigError, match="unknown key"):
        write_profile(tmp_path / "bad.toml", {**values, "typo": 1.0}, [])


def test_shipped_calibrated_profile_loads() -> None:
    path = ROOT / "sim/profiles/h100-calibrated.toml"
    if not path.exists():
        pytest.skip("no calibrated profile shipped yet")
    prof = load_profile(str(path))
    assert prof.name == "h100-calibrated"
    assert 0 < prof.mfu <= 1 and 0 < prof.mbu <= 1
    assert 10e9 < prof.h2d.bandwidth_Bps < 64e9 and 10e9 < prof.d2h.bandwidth_Bps < 64e9


# ----------------------------------------------------------------------- CLI, config
@pytest.mark.skipif(gpu_unavailable_reason() is None, reason="a GPU is present")
@pytest.mark.parametrize("args", [["calibrate", "--out", "{tmp}/x.toml"],
                                  ["replay", "--backend", "cuda", "--limit", "2",
                                   "--storage-blocks", "0"]])
def test_gpu_commands_exit_2_with_one_line_without_a_gpu(args: list[str],
                                                         tmp_path: Path) -> None:
    res = CliRunner().invoke(app, [a.replace("{tmp}", str(tmp_path)) for a in args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "CuPy" in lines[0], res.output


def test_replay_config_backend_is_checked() -> None:
    with pytest.raises(ConfigError, match="unknown backend"):
        ReplayConfig(backend="tpu")
    with pytest.raises(ConfigError, match="full mode only"):
        ReplayConfig(backend="cuda", mode="cache")


def test_sim_report_has_per_transfer_times_from_the_link_model() -> None:
    rep = run_replay(ReplayConfig(model="llama-3-8b-l4", limit=30, device_blocks=200,
                                  host_blocks=400, storage_blocks=0))
    t = rep["transfers"]["backup"]
    prof = PROFILES["h100"]
    per_layer_block = SPEC.bytes_per_layer_block
    # one unit per layer: latency + bytes / bandwidth; per block, latency is shared by the op
    lo = SPEC.num_layers * per_layer_block / prof.d2h.bandwidth_Bps
    hi = lo + SPEC.num_layers * prof.d2h.latency_s
    assert lo <= t["service_per_block_s"] <= hi
    assert t["ops"] == 30 and t["latency_mean_s"] >= t["service_mean_s"] - 1e-12
    assert math.isclose(rep["bytes"]["d2h"], t["blocks"] * SPEC.bytes_per_block)
