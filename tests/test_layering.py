"""The layering DESIGN.md describes, checked: import-linter contracts and no import cycles.

The contracts live in pyproject.toml (``[tool.importlinter]``): the core imports
neither world (nor simpy, nor CuPy); ``sim`` and ``kernels`` never import each
other; ``traces`` imports nothing of ours; the engine and its scheduler know
nothing of the driver, the reports or the real-time world above them. Each
check is also run against a copy of the tree with a planted violation, so a
contract that cannot fail would show here.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="import-linter (a dev dependency) is not installed")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvflow", "sim", "kernels", "traces")
#: kvflow modules above the engine: they may import the core, never the other way round.
UPPER = {"kvflow.replay", "kvflow.reports", "kvflow.realtime", "kvflow.cluster"}


def _load_pyproject() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the tree at ``root`` (its own pyproject.toml), in a subprocess."""
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import "
                           "lint_imports_command; sys.exit(lint_imports_command())"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def _copy_tree(dst: Path) -> Path:
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dst / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "samples"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def import_cycles(graph: object, modules: Iterable[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.find_modules_directly_imported_by(v)):  # type: ignore[attr-defined]
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return cycles


def test_contracts_hold() -> None:
    res = _lint(ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout


def test_contracts_catch_planted_imports(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    with open(root / "kvflow" / "engine.py", "a") as f:
        f.write("\nimport sim.loop  # planted\nimport kvflow.reports.render  # planted\n")
    with open(root / "sim" / "executor.py", "a") as f:
        f.write("\nimport kernels.plan  # planted\n")
    with open(root / "traces" / "stats.py", "a") as f:
        f.write("\nimport kvflow.errors  # planted\n")
    res = _lint(root)
    assert res.returncode != 0
    out = " ".join(res.stdout.split())
    for name in ("The core imports neither world", "never import each other",
                 "traces imports nothing of ours", "know nothing of the driver"):
        verdict = re.search(re.escape(name) + r".*? (KEPT|BROKEN)", out)
        assert verdict is not None and verdict.group(1) == "BROKEN", (name, out[-3000:])


def test_no_import_cycles() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    assert import_cycles(graph, graph.modules) == []


def test_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.e", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert import_cycles(graph, graph.modules) == [["p.a", "p.b", "p.c"]]


def test_every_kvflow_module_is_placed_in_a_layer() -> None:
    """A new kvflow module must be named in the contracts: below the driver, or above it."""
    contracts = _load_pyproject()["tool"]["importlinter"]["contracts"]
    core = set(next(c for c in contracts if c["id"] == "core-below-driver")["source_modules"])
    children = {f"kvflow.{p.stem}" for p in (ROOT / "kvflow").glob("*.py")
                if p.stem != "__init__"}
    children |= {f"kvflow.{p.parent.name}" for p in (ROOT / "kvflow").glob("*/__init__.py")}
    unplaced = sorted(children - core - UPPER)
    assert not unplaced, f"add these to a contract in pyproject.toml: {unplaced}"


def test_nothing_imports_the_cli() -> None:
    """cli.py is the top: no package module imports it (grimp cannot see a lone module)."""
    offenders = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n == "cli" or n.startswith("cli.") for n in names):
                    offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
