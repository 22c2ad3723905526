"""The native index core: built where kvflow is installed, warning-free, no leaks, and its
nodes behave as the Python ones do where Python code touches them.

That it gives the same results as the Python reference is
``test_index_core_equivalence.py``'s job; the other index tests run on both cores.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import shutil
import subprocess
import sysconfig
import tracemalloc
from pathlib import Path

import pytest

from kvflow import index_core
from kvflow.errors import ConfigError, NotEnoughBlocks
from kvflow.manager import CacheManager, Capacities
from kvflow.radix import ABSENT, COMPUTING, FILLING, NATIVE_CORE, READY, PrefixIndex, Tier
from traces import sample_path

SOURCE = Path(__file__).resolve().parents[1] / "kvflow" / "_index_core.c"
native = pytest.mark.skipif(NATIVE_CORE is None, reason="kvflow._index_core is not built "
                            "(kvflow run from a source tree without pip install)")


def _installed() -> bool:
    try:
        importlib.metadata.distribution("kvflow")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _installed(), reason="kvflow is not installed (run from a source tree)")
def test_an_installed_kvflow_has_the_native_core():
    """``pip install`` compiles the extension; an install without it would silently run
    the index 3-5x slower."""
    assert NATIVE_CORE is not None, "kvflow is installed but kvflow._index_core did not build"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not on PATH")
def test_the_c_source_compiles_without_warnings():
    include = sysconfig.get_paths()["include"]
    proc = subprocess.run(
        ["gcc", "-fsyntax-only", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
         "-Werror", f"-I{include}", str(SOURCE)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_every_part_of_the_c_source_is_built_and_rebuilds_it():
    """_index_core.c is one translation unit that #includes its parts in kvflow/csrc/: a
    part it does not include is never compiled, and one missing from the extension's
    ``depends`` in pyproject does not trigger a rebuild when it changes."""
    tomllib = pytest.importorskip("tomllib")
    root = SOURCE.parents[1]
    parts = sorted(p.relative_to(root).as_posix() for p in (root / "kvflow" / "csrc").iterdir())
    with open(root / "pyproject.toml", "rb") as f:
        (ext,) = tomllib.load(f)["tool"]["setuptools"]["ext-modules"]
    assert ext["sources"] == ["kvflow/_index_core.c"]
    assert sorted(ext["depends"]) == parts
    included = {line.split('"')[1] for line in SOURCE.read_text().splitlines()
                if line.startswith("#include \"")}
    assert included == {p.removeprefix("kvflow/") for p in parts}


def test_an_unknown_or_missing_core_is_a_clear_error(monkeypatch):
    with pytest.raises(ConfigError, match="unknown index core 'fast'; valid: auto, native"):
        PrefixIndex([4, 0, 0], core="fast")
    monkeypatch.setenv("KVFLOW_INDEX_CORE", "python")
    assert not PrefixIndex([4, 0, 0]).native
    monkeypatch.setattr("kvflow.radix.NATIVE_CORE", None)
    with pytest.raises(ConfigError, match="not built here"):
        PrefixIndex([4, 0, 0], core="native")
    monkeypatch.setenv("KVFLOW_INDEX_CORE", "auto")
    assert not PrefixIndex([4, 0, 0]).native


def _replay(core: str, capacity: int = 64) -> CacheManager:
    with open(sample_path("conversation_1k.jsonl")) as f:
        requests = [json.loads(line)["hash_ids"] for line in f][:300]
    m = CacheManager(Capacities(capacity, 32, 64), eviction="lru",
                     write_policy="write_back", index_core=core)
    def land(ops):
        while ops:
            ops += m.complete(ops.pop(0), True)

    for i, ids in enumerate(requests):
        while True:  # as the engine: a refused plan fits once its copy-outs landed
            try:
                p = m.plan(i, ids[:capacity])
                break
            except NotEnoughBlocks:
                assert m.detached_ops
                land(m.detached_ops)
        land(list(p.ops))
        m.commit(p)
        land(m.finish(p))
    return m


def _live_native_nodes() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is NATIVE_CORE.Node)


@native
def test_nodes_go_with_their_index():
    before = _live_native_nodes()  # other tests' objects may hold some
    m = _replay("native")
    assert len(m.index) > 0
    assert _live_native_nodes() >= before + len(m.index)
    del m
    assert _live_native_nodes() == before


@native
def test_a_cycle_through_an_op_in_flight_is_collected():
    before = _live_native_nodes()
    m = CacheManager(Capacities(4, 4), index_core="native")
    p = m.plan(0, ["a", "b"])
    m.commit(p)
    ops = m.finish(p)  # a backup in flight: node.inflight -> op -> op.nodes -> node
    assert ops and ops[0].nodes[0].inflight[Tier.HOST] is ops[0]
    del m, p, ops
    assert _live_native_nodes() == before


@native
def test_no_memory_is_left_behind_per_request():
    _replay("native")  # warm: caches, interned ints, code objects
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(3):
            _replay("native")
            gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 3 x 300 requests x ~20 blocks: a node, or a list, leaked per block would be >> 64 KiB.
    assert after - before < 64 * 1024, after - before


@native
def test_a_native_node_reads_and_writes_like_the_python_one():
    n = NATIVE_CORE.Node("k")
    p = index_core.Node("k")
    for node in (n, p):
        node.state[Tier.HOST] = FILLING
        node.loc[Tier.HOST] = 7
        node.ref = 2
    assert n.state == p.state == [ABSENT, FILLING, ABSENT] and n.loc == p.loc == [-1, 7, -1]
    assert n.state == (ABSENT, FILLING, ABSENT) and n.state != [ABSENT, READY, ABSENT]
    assert list(n.state) == [0, 2, 0] and FILLING in n.state and len(n.loc) == 3
    assert repr(n) == repr(p) == "Node('k', depth=0, ref=2, host:7:filling)"
    assert repr(n.state) == "[0, 2, 0]"
    assert n.matchable == p.matchable and n.best_tier() == p.best_tier() == Tier.HOST
    n.state = [COMPUTING, READY, ABSENT]
    assert not n.matchable and n.best_tier() == -1
    assert n.inflight is index_core.NO_INFLIGHT
    child = NATIVE_CORE.Node("c", n, 3, READY)
    assert child.parent is n and child.depth == 1 and child.loc[0] == 3 and child.matchable


@native
def test_a_native_node_refuses_what_would_corrupt_it():
    n = NATIVE_CORE.Node("k")
    with pytest.raises(ValueError, match=r"copy state must be 0\.\.3"):
        n.state[0] = 9
    with pytest.raises(IndexError):
        n.loc[3] = 1
    with pytest.raises(ValueError, match="3 ints"):
        n.loc = [1, 2]
    with pytest.raises(ValueError, match=r"copy state must be 0\.\.3"):
        n.state = [READY, READY, 7]
    assert n.state == [ABSENT] * 3  # all or nothing
    with pytest.raises(TypeError, match="native index Node"):
        NATIVE_CORE.Node("c", parent=index_core.Node("p"))
    with pytest.raises(TypeError, match="unhashable"):
        NATIVE_CORE.Node(["not", "hashable"])


@native
def test_the_native_core_refuses_python_nodes():
    index = PrefixIndex([4, 0, 0], core="native")
    with pytest.raises(TypeError, match="native index Node"):
        index.ref_all([index_core.Node("k")])
    assert index.unreferenced == [0, 0, 0]


@native
def test_linked_lru_keeps_one_order_per_tier():
    lru0, lru1 = NATIVE_CORE.LinkedLRU(0), NATIVE_CORE.LinkedLRU(1)
    a, b = NATIVE_CORE.Node("a"), NATIVE_CORE.Node("b")
    for n in (a, b):
        lru0.unref(n)
    lru1.unref(b)
    lru1.unref(a)
    assert list(lru0) == [a, b] and list(lru1) == [b, a]
    assert lru0.pop_front(1) == [a] and list(lru0) == [b] and lru1.holds(a)
    lru0.push_front([a])
    lru0.move_to_end(a)
    assert list(lru0) == [b, a] and len(lru0) == 2 and lru0.tracked() == {a, b}
    with pytest.raises(KeyError):
        NATIVE_CORE.LinkedLRU(2).ref(a)
    with pytest.raises(ValueError, match=r"tier must be 0\.\.2"):
        NATIVE_CORE.LinkedLRU(3)


@native
def test_the_native_core_owns_its_policies():
    """The core takes each tier's policy at construction: were the index's policy list
    changed, its orders must stay alive (it held a borrowed pointer, which then dangled)."""
    index = PrefixIndex([4, 0, 0], core="native")
    nodes = index.add_computing(None, "ab", [0, 1], now=1)
    index.mark_computed(nodes)
    index.release(nodes[::-1])
    index.policies[0] = None  # nothing does this; the core must not crash for it
    del index.policies[1:]
    gc.collect()
    assert index.drop_front(Tier.DEVICE, 1) == [1]
    index.ref_all([nodes[0]])
    assert index.unreferenced == [0, 0, 0]


def test_kvflow_runs_without_the_extension() -> None:
    """A source tree used without ``pip install`` (the GPU suite runs so) has no
    ``kvflow._index_core``: everything must import and replay on the Python core."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent('''
        import importlib.abc, sys, warnings
        class NoExtension(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "kvflow._index_core":
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, NoExtension())
        warnings.simplefilter("ignore")
        from kvflow.policy import NATIVE_CORE
        assert NATIVE_CORE is None
        from kvflow.replay import ReplayConfig, run_replay
        r = run_replay(ReplayConfig(limit=40))
        assert r["requests"] == 40, r["requests"]
        print("ok")
    ''')
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
