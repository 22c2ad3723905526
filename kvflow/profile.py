"""GPU profiles: what the simulator needs to know about one GPU and its node.

A ``GpuProfile`` holds compute peak and the fraction of it a serving engine
reaches (MFU), HBM bandwidth, memory, the four links of the hierarchy
(``Link``: bandwidth and per-unit latency) and a per-step host overhead.
Presets come from datasheets (sources cited at each number); ``load_profile``
reads a TOML file whose keys override a preset.

The profile lives in the core, not in the simulated world, because it is the
contract between the two worlds: ``kvflow calibrate`` (``kernels``) measures a
GPU into one, the simulator (``sim``) and the cost model (``kvflow.cost``) read
it, and the cluster router predicts time to first token from it. Neither world
imports the other to share it.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from kvflow.errors import ConfigError
from kvflow.host_layout import HostLayout

__all__ = ["LINKS", "PROFILES", "GpuProfile", "Link", "load_profile", "tensor_parallel_links"]

#: The link names of a node, in ``GpuProfile`` field order (also ``sim`` metrics keys).
LINKS = ("h2d", "d2h", "storage_read", "storage_write")


@dataclass(frozen=True)
class Link:
    """One direction of one path: bandwidth (bytes/s) and per-unit latency (s).

    ``overlap_latency``: whether one request's latency overlaps the previous
    one's data (deep-queue storage) or occupies the link (a DMA stream); see
    the module docstring. ``piece_s``: link time per contiguous piece a unit moves
    (a copy engine's per-descriptor cost): host layouts with fewer, larger pieces
    pay it fewer times (``kvflow.host_layout``; 0 in the presets: unmeasured).
    """

    bandwidth_Bps: float
    latency_s: float
    overlap_latency: bool = False
    piece_s: float = 0.0

    def __post_init__(self) -> None:
        bw, lat = self.bandwidth_Bps, self.latency_s
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0 or bw == _INF:
            raise ConfigError(f"Link.bandwidth_Bps must be a finite number > 0, got {bw!r}")
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not 0 <= lat < _INF:
            raise ConfigError(f"Link.latency_s must be a finite number >= 0, got {lat!r}")
        p = self.piece_s
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < _INF:
            raise ConfigError(f"Link.piece_s must be a finite number >= 0, got {p!r}")
        if not isinstance(self.overlap_latency, bool):
            raise ConfigError(
                f"Link.overlap_latency must be true or false, got {self.overlap_latency!r}"
            )

    def unit_time(self, nbytes: float) -> float:
        """Service time of one unit of ``nbytes`` on an idle link: latency + bytes / bandwidth."""
        return self.latency_s + nbytes / self.bandwidth_Bps


_INF = float("inf")



@dataclass(frozen=True)
class GpuProfile:
    """One GPU and its node, as the simulator sees them.

    ``peak_bf16_flops`` is the dense (no sparsity) bf16 tensor peak; ``mfu``
    the fraction of it reached; ``hbm_bytes_per_s`` the datasheet HBM
    bandwidth and ``mbu`` the fraction of it reached (1.0 in the presets: the
    plain datasheet roofline; calibration lowers it). ``step_overhead_s`` is
    host-side time per engine step (scheduling, sampling, launches) that does
    not overlap the GPU work, ``step_overhead_per_seq_s`` its growth per
    sequence in the step and ``step_overhead_per_prefill_s`` the extra for each
    prefill item (admission, plan, loads, uploads). ``attention_mfu`` is the
    fraction of the peak that attention reaches; 0 means "same as ``mfu``"
    (the presets). ``pcie_duplex``: the share of each PCIe direction's
    bandwidth left while the other also carries data (``sim.hierarchy``).
    ``gemm_efficiency``: measured (tokens, fraction of peak) points of the
    weight GEMMs; empty in the presets (one rate, ``mfu``), see ``gemm_shape``.
    ``nvlink_bytes_per_s`` is one GPU's NVLink bandwidth per direction and
    ``nvlink_latency_s`` the latency of one step of a ring all-reduce over it:
    what tensor parallelism's all-reduces cost (``kvflow.cost.allreduce_s``).
    """

    name: str
    peak_bf16_flops: float
    mfu: float
    hbm_bytes_per_s: float
    memory_bytes: float
    h2d: Link
    d2h: Link
    storage_read: Link
    storage_write: Link
    step_overhead_s: float
    mbu: float = 1.0
    attention_mfu: float = 0.0
    step_overhead_per_seq_s: float = 0.0
    step_overhead_per_prefill_s: float = 0.0
    pcie_duplex: float = 1.0
    gemm_efficiency: tuple[tuple[float, float], ...] = ()
    #: Tile quantisation of the executor's kernels (0: off, the presets). ``gemm_row_tile``:
    #: a weight GEMM over more rows than this costs as over the next multiple of it (the
    #: GEMM library's row tiles). ``attention_tile_rows``: query rows of a prefill
    #: attention work item (one CTA per item and query head); ``attention_ctas``: work
    #: items the GPU runs at once (SMs x CTAs per SM). With both set, prefill attention
    #: costs whole waves of items (``kvflow.cost.prefill_wave_pairs``).
    gemm_row_tile: float = 0.0
    attention_tile_rows: float = 0.0
    attention_ctas: float = 0.0
    #: Host time to submit one load (a swap-in op) before the step that waits for it
    #: (0: none, the presets): a request loading its prefix from host starts its prefill
    #: this much later (``sim.executor``).
    load_submit_s: float = 0.0
    # NVIDIA H100 SXM5 datasheet: NVLink 900 GB/s per GPU, both directions together,
    # i.e. 450 GB/s each way (H200 SXM: the same).
    nvlink_bytes_per_s: float = 450e9
    # One ring step's latency (a hop and a kernel's share of its launch): an assumption
    # of the order nccl-tests reports for small all-reduces inside one node (~10-20 us
    # for 8 GPUs, 14 steps); calibrate it.
    nvlink_latency_s: float = 1e-6
    #: PCIe links measured per host layout (``kvflow.host_layout``): ``(layout, h2d, d2h)``,
    #: the layout's canonical name. A layout moves its own pieces (a layer of one role
    #: per block, or G layers of a block), so its per-unit latency and bandwidth differ;
    #: ``for_host_layout`` puts a listed layout's links in place of ``h2d`` / ``d2h``.
    #: Empty in the presets (every layout runs on ``h2d`` / ``d2h``); ``kvflow calibrate
    #: --host-layouts`` measures them.
    host_layouts: tuple[tuple[str, Link, Link], ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            problem = _problem(f.name, getattr(self, f.name))
            if problem:
                raise ConfigError(f"GpuProfile.{f.name} {problem}")

    def for_host_layout(self, layout: str) -> GpuProfile:
        """This profile as a run in host layout ``layout`` sees it: the layout's measured
        links as ``h2d`` / ``d2h`` where ``host_layouts`` lists it, else unchanged."""
        name = str(HostLayout.parse(layout))
        for lay, h2d, d2h in self.host_layouts:
            if lay == name:
                return replace(self, h2d=h2d, d2h=d2h)
        return self


def _problem(key: str, value: Any) -> str | None:
    """Why ``value`` is no good for profile field ``key`` (None if it is fine)."""
    if key == "gemm_efficiency":
        return _curve_problem(value)
    if key == "name":
        if isinstance(value, str) and value:
            return None
        return f"must be a non-empty string, got {value!r}"
    if key in LINKS:
        return None if isinstance(value, Link) else f"must be a Link, got {value!r}"
    if key == "host_layouts":
        return _host_layouts_problem(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if key in ("mfu", "mbu", "pcie_duplex"):
        return None if 0 < value <= 1 else f"must be in (0, 1], got {value!r}"
    if key == "attention_mfu":
        return None if 0 <= value <= 1 else f"must be in [0, 1] (0: same as mfu), got {value!r}"
    if key in ("step_overhead_s", "step_overhead_per_seq_s", "step_overhead_per_prefill_s",
               "nvlink_latency_s", "gemm_row_tile", "attention_tile_rows", "attention_ctas",
               "load_submit_s"):
        return None if value >= 0 else f"must be >= 0, got {value!r}"
    return None if value > 0 else f"must be > 0, got {value!r}"


def _host_layouts_problem(value: Any) -> str | None:
    """``host_layouts``: (layout, h2d Link, d2h Link) triples, each layout once, by its
    canonical name."""
    what = "must be a tuple of (layout name, h2d Link, d2h Link), each layout once"
    if not isinstance(value, tuple):
        return f"{what}; got {value!r}"
    seen: set[str] = set()
    for entry in value:
        if (not isinstance(entry, tuple) or len(entry) != 3 or not isinstance(entry[0], str)
                or not all(isinstance(x, Link) for x in entry[1:])):
            return f"{what}; got {entry!r}"
        try:
            name = str(HostLayout.parse(entry[0]))
        except ConfigError as exc:
            return str(exc)
        if name != entry[0] or name in seen:
            return f"{what}; got {entry[0]!r}" + (" twice" if name in seen else
                                                   f" (write it {name!r})")
        seen.add(name)
    return None


def _curve_problem(value: Any) -> str | None:
    """``gemm_efficiency``: (tokens, fraction of peak) pairs, tokens increasing."""
    what = "must be a list of [tokens, efficiency] pairs, tokens increasing, efficiency in (0, 1]"
    if not isinstance(value, (list, tuple)):
        return f"{what}; got {value!r}"
    last = 0.0
    for pair in value:
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in pair)):
            return f"{what}; got {pair!r}"
        tokens, eff = pair
        if not (tokens > last and 0 < eff <= 1 and math.isfinite(tokens)):
            return f"{what}; got {pair!r}"
        last = tokens
    return None


# Per-op latency of a PCIe copy: DESIGN.md measured one cudaMemcpyAsync per
# 16 KiB block at 4.8 GB/s on an H100, i.e. 16384 B / 4.8e9 B/s = 3.4 us per
# copy, of which 16384 / 55e9 = 0.3 us is wire time: ~3 us of per-copy cost.
_PCIE_LATENCY_S = 3e-6

# Local NVMe, PCIe Gen4 x4 datacenter drive. Sequential ceilings of current
# drives are ~6.5-7.4 GB/s read and ~3-4 GB/s write (e.g. Solidigm D5-P5336:
# 7400 MB/s read, 3200 MB/s write; D7-P5810: 6400 / 4000 MB/s, vendor
# figures); we take a conservative 6 GB/s read and 3 GB/s sustained write.
# TLC NAND reads take ~50-100 us at queue depth 1; 100 us, overlapped across
# queued requests (deep NVMe queues), see sim.hierarchy.
_NVME_READ = Link(6e9, 100e-6, overlap_latency=True)
_NVME_WRITE = Link(3e9, 100e-6, overlap_latency=True)

# Host-side time per engine step: an assumption of the order a CUDA-graph
# serving engine spends on scheduling, sampling and launches; calibrate it.
_STEP_OVERHEAD_S = 0.5e-3

#: Preset profiles by name.
#:
#: What is measured and what is a guess (checked 2026-11-25 against ``kvflow calibrate``
#: of the fast executor on a lent NVIDIA H100 80GB HBM3, SXM, 132 SMs; that profile is
#: ``sim/profiles/h100-fast-calibrated.toml``, the exact executor's ``h100-calibrated``):
#:
#: * datasheet, kept: ``peak_bf16_flops``, ``hbm_bytes_per_s``, ``memory_bytes`` (the
#:   H100 reported 79.2 GiB usable), NVLink bandwidth;
#: * measured: the H100's PCIe ceiling, 55 GB/s each way (DESIGN.md; calibrations read
#:   53-55 GB/s one way per layer unit, 0.88-0.91 of it with both ways busy: the
#:   presets' ``pcie_duplex`` 1.0 is optimistic by that much);
#: * guesses, kept so that every report and pinned digest stays as it was: ``mfu`` 0.5
#:   (measured for kvflow's fast executor on the H100: weight GEMMs 0.62-0.66 of the
#:   peak, cuBLAS, 1k-8k rows; prefill attention 0.30-0.31, its own ``attention_mfu``;
#:   a serving engine on FlashAttention-3 reaches more), ``mbu`` 1.0 (measured: 0.71),
#:   ``step_overhead_s`` 0.5 ms (measured for kvflow's Python executor: 0.9 ms a step
#:   + 18 us a sequence + 0.87 ms a prefill item with its admission; a CUDA-graph
#:   engine spends less), the 3 us per-copy latency (measured 14-18 us per layer unit
#:   of the executor's batched copies), NVMe figures (vendor sheets; no storage tier
#:   was measured) and the NVLink step latency;
#: * h200 and a100: datasheet peaks and links; every efficiency and overhead is the
#:   h100's guess, not measured (no H200 or A100 calibration yet).
#:
#: For the fast executor's measured numbers, pass ``--profile
#: sim/profiles/h100-fast-calibrated.toml``.
PROFILES: dict[str, GpuProfile] = {
    # NVIDIA H100 SXM5 80GB datasheet: BF16 tensor 1,979 TFLOPS *with sparsity*,
    # i.e. 989.4 TFLOP/s dense; HBM3 3.35 TB/s; 80 GB. PCIe Gen5 x16: DESIGN.md's
    # measured contiguous pinned copy ceiling, 55 GB/s each way.
    "h100": GpuProfile(
        name="h100", peak_bf16_flops=989.4e12, mfu=0.5, hbm_bytes_per_s=3.35e12,
        memory_bytes=80e9, h2d=Link(55e9, _PCIE_LATENCY_S), d2h=Link(55e9, _PCIE_LATENCY_S),
        storage_read=_NVME_READ, storage_write=_NVME_WRITE, step_overhead_s=_STEP_OVERHEAD_S),
    # NVIDIA H200 SXM 141GB datasheet: same compute as H100 (989.4 TFLOP/s dense
    # BF16), HBM3e 4.8 TB/s, 141 GB; same PCIe Gen5 x16 host link.
    "h200": GpuProfile(
        name="h200", peak_bf16_flops=989.4e12, mfu=0.5, hbm_bytes_per_s=4.8e12,
        memory_bytes=141e9, h2d=Link(55e9, _PCIE_LATENCY_S), d2h=Link(55e9, _PCIE_LATENCY_S),
        storage_read=_NVME_READ, storage_write=_NVME_WRITE, step_overhead_s=_STEP_OVERHEAD_S),
    # NVIDIA A100 SXM4 80GB datasheet: BF16 tensor 312 TFLOP/s dense, HBM2e
    # 2,039 GB/s, 80 GB. PCIe Gen4 x16 (32 GB/s raw per direction): pinned
    # copies reach ~25 GB/s each way in cuda-samples' bandwidthTest. NVLink 600 GB/s
    # per GPU (both directions), 300 GB/s each way.
    "a100": GpuProfile(
        name="a100", peak_bf16_flops=312e12, mfu=0.5, hbm_bytes_per_s=2.039e12,
        memory_bytes=80e9, h2d=Link(25e9, _PCIE_LATENCY_S), d2h=Link(25e9, _PCIE_LATENCY_S),
        storage_read=_NVME_READ, storage_write=_NVME_WRITE, step_overhead_s=_STEP_OVERHEAD_S,
        nvlink_bytes_per_s=300e9),
}

_LINK_KEYS = {f.name for f in fields(Link)}


def tensor_parallel_links(profile: GpuProfile, tp: int) -> GpuProfile:
    """The node links of an instance spanning ``tp`` GPUs: each GPU has its own PCIe
    link and copies its 1/tp of every block over it, all at once, so the instance's
    host <-> device bandwidth is ``tp`` times one GPU's (latency unchanged: the GPUs'
    copies run side by side). Storage stays the node's. ``tp`` 1: ``profile`` itself."""
    if tp == 1:
        return profile
    return replace(profile,
                   h2d=replace(profile.h2d, bandwidth_Bps=profile.h2d.bandwidth_Bps * tp),
                   d2h=replace(profile.d2h, bandwidth_Bps=profile.d2h.bandwidth_Bps * tp))


def load_profile(name_or_path: str | os.PathLike[str]) -> GpuProfile:
    """A preset by name (``h100``, ``h200``, ``a100``) or a profile TOML file.

    The file's top-level keys override those of ``base`` (a preset name,
    default ``h100``); a link is a table whose keys override the base's link::

        base = "h100"
        name = "h100-measured"     # default: the file's stem
        mfu = 0.42
        [h2d]
        bandwidth_Bps = 52.1e9
        latency_s = 4e-6

    Unknown keys, bad values and unreadable files raise ``ConfigError``
    naming the file and the key.
    """
    key = os.fspath(name_or_path)
    if key in PROFILES:
        return PROFILES[key]
    if not os.path.isfile(key):
        raise ConfigError(
            f"unknown GPU profile {key!r}: not a preset ({', '.join(sorted(PROFILES))}) "
            "and no such file"
        )
    return _profile_from_toml(key)


def _toml_load(path: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError(
                f"{path}: reading TOML on Python 3.10 needs the 'tomli' package"
            ) from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def _profile_from_toml(path: str) -> GpuProfile:
    data = _toml_load(path)
    base_name = data.pop("base", "h100")
    if base_name not in PROFILES:
        raise ConfigError(
            f"{path}: key 'base': unknown preset {base_name!r} "
            f"(presets: {', '.join(sorted(PROFILES))})"
        )
    base = PROFILES[base_name]
    known = [f.name for f in fields(GpuProfile)]
    changes: dict[str, Any] = {"name": os.path.splitext(os.path.basename(path))[0]}
    for k, v in data.items():
        if k not in known:
            raise ConfigError(
                f"{path}: unknown key {k!r} (known: base, {', '.join(known)})"
            )
        if k in LINKS:
            changes[k] = _link_from_toml(path, k, v, getattr(base, k))
            continue
        if k == "host_layouts":
            continue  # below: a layout's links override this file's own
        if isinstance(v, int) and not isinstance(v, bool):
            v = float(v) if k != "name" else v
        problem = _problem(k, v)
        if problem:
            raise ConfigError(f"{path}: key {k!r} {problem}")
        if k == "gemm_efficiency":
            v = tuple((float(t), float(e)) for t, e in v)
        changes[k] = v
    if "host_layouts" in data:
        changes["host_layouts"] = _host_layouts_from_toml(
            path, data["host_layouts"], changes.get("h2d", base.h2d), changes.get("d2h", base.d2h))
    return replace(base, **changes)


def _host_layouts_from_toml(path: str, table: Any, h2d: Link, d2h: Link
                            ) -> tuple[tuple[str, Link, Link], ...]:
    """``[host_layouts."grouped:4".h2d]`` tables: per layout, links over the file's own."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"{path}: key 'host_layouts' must be a table of layouts "
                          f"(as in [host_layouts.\"grouped:4\".h2d]), got {table!r}")
    out: list[tuple[str, Link, Link]] = []
    seen: dict[str, str] = {}
    for name, links in table.items():
        where = f'host_layouts."{name}"'
        try:
            canon = str(HostLayout.parse(name))
        except ConfigError as exc:
            raise ConfigError(f"{path}: key {where}: {exc}") from None
        if canon in seen:
            raise ConfigError(f"{path}: key {where}: the same layout as {seen[canon]!r}")
        seen[canon] = name
        if not isinstance(links, Mapping) or not links:
            raise ConfigError(f"{path}: key {where} must be a table with h2d and/or d2h "
                              f"link tables, got {links!r}")
        for k in links:
            if k not in ("h2d", "d2h"):
                raise ConfigError(f"{path}: unknown key '{where}.{k}' (known: d2h, h2d)")
        out.append((canon,
                    _link_from_toml(path, f"{where}.h2d", links["h2d"], h2d)
                    if "h2d" in links else h2d,
                    _link_from_toml(path, f"{where}.d2h", links["d2h"], d2h)
                    if "d2h" in links else d2h))
    return tuple(out)


def _link_from_toml(path: str, key: str, table: Any, base: Link) -> Link:
    if not isinstance(table, Mapping):
        raise ConfigError(
            f"{path}: key {key!r} must be a table with {', '.join(sorted(_LINK_KEYS))}, "
            f"got {table!r}"
        )
    for k in table:
        if k not in _LINK_KEYS:
            raise ConfigError(
                f"{path}: unknown key '{key}.{k}' (known: {', '.join(sorted(_LINK_KEYS))})"
            )
    try:
        return replace(base, **table)
    except ConfigError as exc:
        field = next((k for k in table if f"Link.{k} " in str(exc)), "?")
        detail = str(exc).split(" ", 1)[1]
        raise ConfigError(f"{path}: key '{key}.{field}' {detail}") from None
