"""Failed admission retries skipped (issue 19): a request that does not fit is planned
again at every engine step; a retry is skipped only where it would fail the same way and
change nothing (``kvflow.planning.FailedPlan``), so reports stay what they were.

The unit tests hold the skip to its conditions on a bare manager; the replay tests run
the same traces with the skip and without it (``CacheManager.skip_failed_retries``) and
compare the reports byte for byte, and count the skips so that the comparison is not
vacuous.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.errors import NotEnoughBlocks
from kvflow.manager import CacheManager, Capacities
from kvflow.replay import ReplayConfig, run_replay

CORES = ["python", "native"]


def _manager(core: str, device: int = 6, eviction: str = "lru", **caps: int) -> CacheManager:
    try:
        return CacheManager(Capacities(device, **caps), eviction=eviction, index_core=core)
    except Exception as e:  # the native core is not built here
        pytest.skip(str(e))


def _fails(m: CacheManager, rid: str, keys: list[int]) -> NotEnoughBlocks:
    with pytest.raises(NotEnoughBlocks) as err:
        m.plan(rid, keys)
    return err.value


@pytest.mark.parametrize("core", CORES)
def test_a_retry_with_nothing_changed_is_skipped_until_blocks_come_free(core: str) -> None:
    m = _manager(core, device=4)
    a = m.plan("a", [1, 2, 3, 4])  # the whole device, referenced
    first = _fails(m, "b", [5, 6, 7])
    assert m.skipped_plans == 0
    again = _fails(m, "b", [5, 6, 7])
    assert m.skipped_plans == 1
    assert (again.needed, again.available) == (first.needed, first.available)
    assert m.stats.rejected_plans == 2  # a skipped retry is still a rejected plan
    _fails(m, "b", [5, 6, 7, 8])  # other keys: planned
    assert m.skipped_plans == 1
    m.commit(a)
    m.finish(a)  # its blocks may go now
    plan = m.plan("b", [5, 6, 7])
    assert plan.num_cached == 0 and m.skipped_plans == 1
    m.check_invariants()


@pytest.mark.parametrize("core", CORES)
def test_a_commit_of_the_block_the_match_stopped_at_is_not_skipped(core: str) -> None:
    # b's prefix is being computed by a: its plan stops there and needs all 5 blocks.
    # Once a commits, the prefix is matchable and b fits in the 3 blocks left.
    m = _manager(core, device=6)
    a = m.plan("a", [1, 2, 3])
    other = m.plan("c", [9])
    _fails(m, "b", [1, 2, 3, 4, 5])
    m.commit(other)  # a commit of other blocks leaves the skip armed
    _fails(m, "b", [1, 2, 3, 4, 5])
    assert m.skipped_plans == 1
    m.commit(a)
    plan = m.plan("b", [1, 2, 3, 4, 5])
    assert plan.num_cached == 3 and m.skipped_plans == 1
    m.check_invariants()


@pytest.mark.parametrize("core", CORES)
def test_a_copy_dropped_through_the_index_by_someone_else_is_seen(core: str) -> None:
    # A cluster pool's view drops (``shed``) and re-adds (``recall``) storage copies
    # through the index itself, not the manager's verbs: the skip must see that too.
    m = _manager(core, device=4, storage=8)
    m.found(2, [(50, None), (51, None)])
    m.plan("a", [1, 2, 3, 4])
    _fails(m, "b", [5, 6, 7])
    _fails(m, "b", [5, 6, 7])
    assert m.skipped_plans == 1
    node = m.index.get(51)
    m.pools[2].free([m.index.drop_copy(node, 2)])
    _fails(m, "b", [5, 6, 7])
    assert m.skipped_plans == 1
    _fails(m, "b", [5, 6, 7])  # and once that retry failed the same way, again
    assert m.skipped_plans == 2


@pytest.mark.parametrize("eviction", ["s3fifo", "arc", "length_aware"])
def test_policies_whose_failed_plans_move_blocks_never_skip(eviction: str) -> None:
    m = _manager("python", device=4, eviction=eviction)
    m.plan("a", [1, 2, 3, 4])
    for _ in range(3):
        _fails(m, "b", [5, 6, 7])
    assert m.skipped_plans == 0 and m.stats.rejected_plans == 3


# ------------------------------------------------------------------------- replays
@contextmanager
def _skip(on: bool, core: str | None = None) -> Iterator[None]:
    old_env = os.environ.get("KVFLOW_INDEX_CORE")
    CacheManager.skip_failed_retries = on
    if core is not None:
        os.environ["KVFLOW_INDEX_CORE"] = core
    try:
        yield
    finally:
        CacheManager.skip_failed_retries = True
        if old_env is None:
            os.environ.pop("KVFLOW_INDEX_CORE", None)
        else:
            os.environ["KVFLOW_INDEX_CORE"] = old_env


def _replay(cfg: ReplayConfig, on: bool, core: str | None = None) -> tuple[str, int, int]:
    """The report (``wall_s`` dropped), plans skipped, plans rejected."""
    managers: list[CacheManager] = []
    with _skip(on, core):
        report = run_replay(cfg, inspect=lambda m, rt: managers.append(m))
    report.pop("wall_s", None)
    return (json.dumps(report, sort_keys=True), sum(m.skipped_plans for m in managers),
            sum(m.stats.rejected_plans for m in managers))


@pytest.mark.parametrize("kwargs", [
    {},
    {"eviction": "lfu", "write_policy": "write_back"},
    {"pd": "1:2"},
])
def test_the_sample_reports_the_same_with_retries_skipped(kwargs: dict[str, Any]) -> None:
    cfg = ReplayConfig(limit=300, device_blocks=200, host_blocks=600, storage_blocks=3000,
                       **kwargs)
    with_skip, skipped, rejected = _replay(cfg, True)
    without, none, rejected_all = _replay(cfg, False)
    assert none == 0
    assert skipped > 50, skipped  # the skip happens
    assert rejected == rejected_all  # each skipped retry still counts as a rejected plan
    assert with_skip == without


def _trace(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> str:
    with path.open("w") as f:
        t = 0
        for gap_ms, n_in_blocks, n_out, ids in rows:
            t += gap_ms
            f.write(json.dumps({"timestamp": t, "input_length": n_in_blocks * 512,
                                "output_length": n_out, "hash_ids": ids}) + "\n")
    return str(path)


# Requests over a small key space (shared prefixes: a few chains, cut at random depths).
# A request's own keys are distinct: one that repeats a key can trip ``admit``'s assertion
# on main as well (a known issue, reported apart), which is no business of this test.
_request = st.tuples(
    st.integers(0, 400),                          # ms since the previous arrival
    st.integers(0, 3),                            # which chain
    st.integers(1, 12),                           # prefix depth in it
    st.lists(st.integers(100, 130), max_size=4, unique=True),  # then its own keys
    st.integers(1, 300),                          # output tokens
)


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(_request, min_size=5, max_size=40),
       eviction=st.sampled_from(["lru", "lfu"]),
       write_policy=st.sampled_from(["write_through", "write_back", "write_through_selective"]),
       prefetch=st.sampled_from(["best_effort", "wait_complete", "timeout"]),
       device=st.integers(14, 40), host=st.sampled_from([0, 10, 30]),
       storage=st.sampled_from([0, 20, 200]), core=st.sampled_from(CORES),
       batch=st.sampled_from([1024, 4096]))
def test_random_traces_report_the_same_with_retries_skipped(
        tmp_path: Path, requests: list[Any], eviction: str, write_policy: str, prefetch: str,
        device: int, host: int, storage: int, core: str, batch: int) -> None:
    rows = []
    for gap, chain, depth, own, n_out in requests:
        ids = [chain * 1000 + i for i in range(depth)] + own
        rows.append((gap, len(ids), n_out, ids))
    trace = _trace(tmp_path / "t.jsonl", rows)
    cfg = ReplayConfig(trace=trace, device_blocks=device, host_blocks=host,
                       storage_blocks=storage, eviction=eviction, write_policy=write_policy,
                       prefetch_policy=prefetch, max_batch_tokens=batch, max_running=4)
    if core == "native":
        try:
            CacheManager(Capacities(1), index_core="native")
        except Exception:
            core = "python"
    with_skip, _, rejected = _replay(cfg, True, core)
    without, _, rejected_all = _replay(cfg, False, core)
    assert rejected == rejected_all
    assert with_skip == without
