"""The report's headroom over a compact access log (``kvflow.headroom.AccessLog``).

The log keeps a trace's accesses as int ids (the native one: int32 arrays, ~4
bytes an access) instead of every request's keys, and runs Belady's MIN over
them. Its figures must be those of the implementation it replaced, which ran
``traces.optimum.optimum_hits`` over a list of every request's keys, once per
tier (``traces.optimum.tier_optimum_hits``): on the bundled sample, on
random traces (repeated keys within a request, mixed key types, tiny
capacities), native and Python logs alike.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.headroom import (
    PyAccessLog,
    _native_log,
    optimum_hit_rates,
    record_accesses,
    tier_hits,
)
from traces import open_trace, sample_path
from traces.optimum import optimum_hits, tier_optimum_hits

NATIVE = _native_log()
KINDS = [False] + ([True] if NATIVE is not None else [])


def reference_rates(requests, capacities):
    blocks = sum(len(r) for r in requests)
    hits = tier_optimum_hits(requests, capacities)
    d = {n: h / blocks for n, h in zip(("device", "host", "storage"), hits, strict=True)}
    d["total"] = sum(hits) / blocks
    return d


@pytest.fixture(scope="module")
def sample() -> list[list[int]]:
    return [list(r.block_hashes or ()) for r in open_trace(sample_path("conversation_1k.jsonl"))]


@pytest.mark.parametrize("native", KINDS)
@pytest.mark.parametrize("caps", [(8, 0, 0), (64, 256, 0), (200, 1000, 8000), (833, 4096, 32768),
                                  (5, 0, 40)])
def test_sample_figures_equal_the_list_implementation(sample, caps, native):
    log = record_accesses(iter(sample), caps[0], native=native)
    assert tier_hits(log, caps) == tier_optimum_hits(sample, caps)
    assert log.blocks == sum(map(len, sample))


def test_rates_from_a_generator_equal_the_list_implementation(sample):
    caps = (100, 400, 3000)
    assert optimum_hit_rates((r for r in sample), caps) == reference_rates(sample, caps)


# Keys of every kind a replay makes: trace ids (ints, some past int64), a tenant's
# (tenant, id) tuples, a hasher's bytes; few distinct ones, so they repeat (within a
# request too) and the cache is under pressure.
keys_ = st.one_of(st.integers(0, 12), st.sampled_from([2**63 - 1, -(2**63), 2**64 + 3, -1]),
                  st.tuples(st.sampled_from("ab"), st.integers(0, 3)),
                  st.sampled_from([b"x", b"y"]))
requests_ = st.lists(st.lists(keys_, max_size=7), max_size=25)


@pytest.mark.parametrize("native", KINDS)
@settings(max_examples=150, deadline=None)
@given(requests_, st.integers(0, 9), st.integers(0, 6), st.integers(0, 30))
def test_random_traces_give_the_same_hits(native, reqs, dev, host, storage):
    caps = (dev, host, storage)
    log = record_accesses(reqs, dev, native=native)
    assert tier_hits(log, caps) == tier_optimum_hits(reqs, caps)
    for c in range(max(dev, 0), dev + 6):
        assert log.hits(c) == optimum_hits(reqs, c, truncate=dev)


@pytest.mark.skipif(NATIVE is None, reason="kvflow._index_core not built")
def test_native_log_stays_a_few_bytes_an_access(sample):
    log = NATIVE(833)
    for r in sample * 4:
        log.add(r)
    recording = log.nbytes()
    log.finish()
    n, reqs = log.accesses, log.requests
    # ids and next uses (4 bytes each), offsets (8 a request), arrays grown by doubling
    assert log.nbytes() <= 2 * (4 * n + 8 * reqs) + 4 * n
    assert recording < log.nbytes() + 64 * log.keys  # the key table, freed by finish
    assert (log.accesses, log.keys) == (sum(len(r[:833]) for r in sample) * 4,
                                        len({k for r in sample for k in r[:833]}))


@pytest.mark.skipif(NATIVE is None, reason="kvflow._index_core not built")
def test_native_log_refuses_misuse():
    log = NATIVE(4)
    log.add([1, 2])
    with pytest.raises(RuntimeError, match="before finish"):
        log.hits(4)
    log.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        log.add([3])
    with pytest.raises(TypeError):
        NATIVE(4).add(5)
    bad = NATIVE(4)
    with pytest.raises(TypeError, match="unhashable"):
        bad.add([1, [2]])
    assert bad.requests == 0 and bad.accesses == 0  # nothing half-recorded
    assert log.hits(0) == 0


def test_python_log_refuses_a_capacity_below_its_cut():
    log = PyAccessLog(4)
    log.add([1, 2, 3, 4, 5])
    log.finish()
    with pytest.raises(ValueError, match="below the cut"):
        log.hits(3)
