"""``kvflow calibrate --host-layouts``: the PCIe links of each host layout.

A host layout (``kvflow.host_layout``) decides what one copy moves: a layer of
one role per block (``layer_major``, the swap kernel or the copy engine per
layer), or G layers of a block as one piece (``grouped:G``, ``block_major``:
batched copy-engine calls through a device staging ring, then a D2D scatter).
The per-piece costs differ (the copy engine's ~1 us per descriptor, the ring's
chunks and events, the scatter), and so does what an op's time is made of, so
one link model measured in ``layer_major`` mispredicts the others by 4-13%
(benchmarks/results/host_layouts.md).

So the link is measured per layout, the same way the profile's own links are
(``measure_replay_links``: the transfers of a small GPU replay, run in that
layout), and fitted to what the simulator charges in that layout: an op of
``blocks`` moves the layout's groups one after another, each ``latency_s +
bytes / bandwidth_Bps`` (``sim.links.Server.group_units``), i.e. ``latency_s`` is
per group and ``bandwidth_Bps`` is the rate at that layout's piece size (the
block size calibrated). ``piece_s`` stays 0: at one block size a per-piece cost
is one more term proportional to the bytes, which the bandwidth already holds.

The result goes into the profile as ``[host_layouts."<layout>".h2d]`` /
``.d2h`` tables (``kvflow.profile.GpuProfile.host_layouts``); a replay in a
listed layout runs on its links (``GpuProfile.for_host_layout``).
"""

from __future__ import annotations

import datetime
import gc
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kernels.calibrate.fit import Log, _toml_value, render_host_layouts
from kvflow.errors import ConfigError
from kvflow.host_layout import HostLayout
from kvflow.layout import ModelSpec

__all__ = [
    "LayoutCalibration",
    "calibrate_layouts",
    "host_layout_tables",
    "layout_link_comments",
    "measure_layout_links",
    "parse_layouts",
    "profile_onto",
    "render_host_layouts",
    "strip_host_layouts",
]


#: The layout replays' first wave arrives one prompt this far apart: measured in one burst
#: (all at t=0, as the profile's own links are), a grouped layout's backups met the
#: prefills' kernels holding the SMs their gather needs and came out 1.2-1.6x what a
#: multi-turn replay's took (benchmarks/results/host_layouts.md, call 1).
FIRST_WAVE_GAP_S = 0.04


def parse_layouts(text: str | Sequence[str]) -> list[str]:
    """Canonical layout names from ``"layer_major,grouped:4"`` (or a list), each once."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    for item in items:
        if not item.strip():
            continue
        name = str(HostLayout.parse(item.strip()))
        if name in out:
            raise ConfigError(f"host layout {item.strip()!r} listed twice")
        out.append(name)
    if not out:
        raise ConfigError("no host layout given (as in 'layer_major,grouped:4,block_major')")
    return out


def measure_layout_links(spec: ModelSpec, log: Log, layouts: Sequence[str],
                         ceilings: dict[str, float] | None = None,
                         backend_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``measure_replay_links`` once per layout (its own small GPU replay in that layout)."""
    from kernels.calibrate.links import measure_replay_links

    out: dict[str, Any] = {}
    for name in parse_layouts(layouts):
        out[name] = measure_replay_links(spec, log, ceilings, backend_options,
                                         host_layout=name, first_wave_gap_s=FIRST_WAVE_GAP_S)
        gc.collect()  # on this thread, not inside a CUDA host callback
    return out


def host_layout_tables(measured: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Profile values per layout (``{layout: {"h2d": {...}, "d2h": {...}}}``) from
    ``measure_layout_links``; a direction its replay gave too few ops to fit is left
    out (the profile's own link stands in for it)."""
    tables: dict[str, dict[str, dict[str, float]]] = {}
    for name, m in measured.items():
        links = {d: {"bandwidth_Bps": float(m[d]["bandwidth_Bps"]),
                     "latency_s": float(m[d]["latency_s"])}
                 for d in ("h2d", "d2h") if m.get(d)}
        if links:
            tables[str(HostLayout.parse(name))] = links
    return tables


_TABLE = re.compile(r"^\s*\[\s*\"?host_layouts\b")
_HEADER = re.compile(r"^\s*\[")


def strip_host_layouts(text: str) -> str:
    """A profile TOML's text without its ``host_layouts`` tables (to be measured anew);
    a ``host_layouts`` key outside such tables (an inline table) is refused."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        if _HEADER.match(line):
            skipping = bool(_TABLE.match(line))
        if not skipping:
            out.append(line)
    kept = "\n".join(out).rstrip("\n") + "\n"
    if re.search(r"^\s*\"?host_layouts\"?\s*=", kept, re.M):
        raise ConfigError("the profile sets host_layouts inline; write it as "
                          "[host_layouts.\"<layout>\".h2d] tables (or drop it) to recalibrate")
    return kept


def layout_link_comments(measured: dict[str, Any], model: str, command: str,
                         device: str, options: dict[str, Any] | None = None) -> list[str]:
    """The comment block above the tables: where, when, how, and each fit's ops."""
    first = next(iter(measured.values()), {})
    bt, per_block = first.get("block_tokens", 0), first.get("bytes_per_block", 0)
    lines = [
        f"Host layouts: links measured per layout by `kvflow calibrate` on {device}, "
        f"{datetime.date.today().isoformat()}.",
        f"Command: {command}",
        f"Each layout's links are fitted to the transfers of a small GPU replay in that layout "
        f"({model},",
        f"{bt}-token blocks of {per_block / 2**20:.1f} MiB): "
        "latency_s per group of layers (layer_major: per layer),",
        "bandwidth_Bps at the layout's piece size; a replay in a listed layout runs on its "
        "links (GpuProfile.for_host_layout).",
        f"Backend options (KVFLOW_* variables; replay with the same): {options or 'defaults'}.",
    ]
    for name, m in measured.items():
        parts = [f"{d} {m[d]['bandwidth_Bps'] / 1e9:.2f} GB/s + {m[d]['latency_s'] * 1e6:.1f} us"
                 f" ({m[d]['ops']} ops)" for d in ("h2d", "d2h") if m.get(d)]
        units = m.get("units_per_op", "?")
        lines.append(f"  {name} ({units} unit{'' if units == 1 else 's'} per op): "
                     + ("; ".join(parts) or "too few ops to fit"))
    return lines


@dataclass
class LayoutCalibration:
    """What ``calibrate_layouts`` measured (``to_json`` for ``--json``)."""

    device: str
    model: str
    block_tokens: int
    raw_link: dict[str, Any]
    measured: dict[str, Any]
    tables: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    seconds: float = 0.0
    #: The backend options the replays ran with (``KVFLOW_*``: a profile holds for them).
    backend_options: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "model": self.model, "block_tokens": self.block_tokens,
                "raw_link": self.raw_link, "host_layouts": self.measured,
                "tables": self.tables, "seconds": self.seconds,
                "backend_options": self.backend_options}


def calibrate_layouts(model: str, block_tokens: int, layouts: Sequence[str],
                      stream_priority: int | None = None, dma: str | None = None,
                      log: Log = print) -> LayoutCalibration:
    """Measure only the links, per layout (``--onto``: the rest of a profile is kept)."""
    from kernels._cuda import cupy_module, gpu_unavailable_reason
    from kernels.calibrate.links import measure_raw_link
    from kvflow.layout import preset

    reason = gpu_unavailable_reason()
    if reason is not None:
        raise ConfigError(f"kvflow calibrate needs a CUDA GPU and CuPy: {reason}")
    names = parse_layouts(layouts)
    t0 = time.perf_counter()
    from kernels.world import env_backend_options

    # as the GPU replay will run the backend (KVFLOW_* variables; arguments over them)
    opts = env_backend_options()
    opts.update({k: v for k, v in (("stream_priority", stream_priority), ("dma", dma))
                 if v is not None})
    cp = cupy_module()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    dname = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    spec = preset(model, block_tokens=block_tokens)
    raw = measure_raw_link(log, reps=3)
    gc.collect()
    measured = measure_layout_links(spec, log, names, raw, opts)
    return LayoutCalibration(dname, spec.name, block_tokens, raw, measured,
                             host_layout_tables(measured), time.perf_counter() - t0,
                             {k: "all" if v is None else v for k, v in opts.items()})


def profile_onto(base_text: str, tables: dict[str, dict[str, dict[str, float]]],
                 comments: Sequence[str], name: str | None = None) -> str:
    """``base_text`` (a profile TOML) with its host_layouts replaced by ``tables`` and,
    given ``name``, its top-level ``name`` key set to it."""
    body = strip_host_layouts(base_text)
    if name is not None:
        body = _set_name(body, name)
    head = "\n".join(f"# {c}" if c else "#" for c in comments)
    return body + "\n" + head + "\n" + render_host_layouts(tables)


def _set_name(text: str, name: str) -> str:
    """``text`` with its top-level ``name = ...`` line replaced (or one added before the
    first table)."""
    lines = text.splitlines()
    line = f"name = {_toml_value(name)}"
    first_table = next((i for i, ln in enumerate(lines) if _HEADER.match(ln)), len(lines))
    for i in range(first_table):
        if re.match(r"^\s*name\s*=", lines[i]):
            lines[i] = line
            break
    else:
        lines.insert(first_table, line)
    return "\n".join(lines) + "\n"
