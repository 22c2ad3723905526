"""Draw docs/img/architecture.png: one request's flow across driver, core and world.

Drawn once with matplotlib (``python docs/img/architecture.py``); the boxes
name the modules that own each step, as ``docs/architecture.md`` describes.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

OUT = Path(__file__).with_name("architecture.png")
LAYER_COLORS = {"cli": "#eeeeee", "driver": "#dbe9f6", "core": "#fdebd3", "world": "#dcefdc",
                "reports": "#efe3f3"}


def box(ax, x, y, w, h, title, lines=(), color="#ffffff", size=9):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                fc=color, ec="#555555", lw=1))
    ax.text(x + w / 2, y + h - 0.22, title, ha="center", va="top", fontsize=size + 1,
            fontweight="bold")
    for i, line in enumerate(lines):
        ax.text(x + w / 2, y + h - 0.55 - i * 0.3, line, ha="center", va="top", fontsize=size,
                family="monospace")


def arrow(ax, a, b, label="", color="#333333", style="-|>", rad=0.0):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=12, color=color, lw=1.3,
                                 connectionstyle=f"arc3,rad={rad}"))
    if label:
        ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + 0.12, label, ha="center", fontsize=8,
                color=color)


def label(ax, x, y, text, color="#333333"):
    ax.text(x, y, text, ha="left", va="center", fontsize=8, color=color,
            bbox={"fc": "white", "ec": "none", "pad": 1.5, "alpha": 0.9})


def main() -> None:
    fig = Figure(figsize=(13, 8.2))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 13)
    ax.set_ylim(0, 8.2)
    ax.axis("off")

    bands = ((7.45, 0.6, "cli", "cli.py: replay | sweep | report | compare | trace | calibrate"),
             (5.75, 1.5, "driver", "driver (kvflow/replay/) and views (kvflow/reports/)"),
             (2.55, 3.0, "core", "core (kvflow/): the same objects in every world; "
                                 "imports neither world"),
             (0.15, 2.2, "world", "a world (kvflow/world.py: loop, TransferBackend, "
                                  "ComputeExecutor, clock); sim and cuda are loaded by name"))
    for y, h, name, text in bands:
        ax.add_patch(FancyBboxPatch((0.15, y), 12.7, h,
                                    boxstyle="round,pad=0.0,rounding_size=0.1",
                                    fc=LAYER_COLORS[name], ec="none"))
        ax.text(0.3, y + h - 0.1, text, fontsize=9, va="top", style="italic", color="#444444")
    arrow(ax, (6.5, 7.45), (6.5, 6.95))
    label(ax, 6.6, 7.2, "kvflow replay --backend sim | cuda")

    box(ax, 0.5, 5.9, 3.6, 0.95, "trace -> requests", ["replay/config.py  traces/"])
    box(ax, 4.6, 5.9, 3.8, 0.95, "run the engine in a World", ["replay/driver.py"])
    box(ax, 8.9, 5.9, 3.7, 0.95, "report dict -> views", ["replay/report.py -> reports/"])
    arrow(ax, (4.1, 6.35), (4.6, 6.35))
    arrow(ax, (8.4, 6.35), (8.9, 6.35))

    steps = (("1 match", ["manager.plan", "radix.py, index_core"]),
             ("2 plan", ["-> Plan of TransferOps", "policy.py, blocks.py"]),
             ("3 submit", ["runtime.submit", "-> TransferTask"]),
             ("4 compute", ["await task.layer(i)", "executor.run_step"]),
             ("5 commit/finish", ["manager.commit", "manager.finish"]))
    xs = [0.45 + i * 2.5 for i in range(5)]
    for x, (title, lines) in zip(xs, steps, strict=True):
        box(ax, x, 3.75, 2.2, 1.3, title, lines)
    for a, b in itertools.pairwise(xs):
        arrow(ax, (a + 2.2, 4.4), (b, 4.4))
    box(ax, 0.45, 2.7, 4.7, 0.72, "engine.py drives steps 1-5", ["continuous batching, prefetch"],
        size=8)
    arrow(ax, (6.5, 5.9), (6.5, 5.05))
    label(ax, 6.6, 5.45, "Engine.add(request)")

    box(ax, 0.5, 0.3, 3.9, 1.65, "sim/  (simulated)",
        ["loop.py: virtual time", "hierarchy.py: SimBackend", "executor.py: cost model"])
    box(ax, 4.6, 0.3, 3.9, 1.65, "kernels/  (CUDA)",
        ["backend.py: CudaBackend", "compute.py: GpuExecutor", "calibrate/ -> profile"])
    box(ax, 8.7, 0.3, 3.9, 1.65, "kvflow/realtime/  (CPU, own bench driver)",
        ["cpu.py: host copies", "store_backend.py, stores/", "KeyedBlockExecutor"])
    arrow(ax, (6.0, 3.75), (6.0, 2.35), color="#1f5f9f")
    label(ax, 5.3, 3.1, "backend.submit(op)", "#1f5f9f")
    arrow(ax, (7.0, 2.35), (7.0, 3.75), color="#2e7d32")
    label(ax, 7.1, 2.95, "layer_done(i): task.layer(i) resolves", "#2e7d32")
    arrow(ax, (9.3, 3.75), (9.3, 2.35), color="#1f5f9f")
    label(ax, 9.4, 3.4, "executor.run_step(batch, waits)", "#1f5f9f")
    fig.savefig(OUT, dpi=110)


if __name__ == "__main__":
    main()
