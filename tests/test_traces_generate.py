"""Generators: determinism, arrival processes, the shared-prefix closed form, structure."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces import BlockChainer, Request, open_trace
from traces.generate import (
    GENERATORS,
    agentic,
    arrival_times,
    generate,
    multi_turn,
    shared_prefix,
    shared_prefix_hit_ratio,
    tool_agent,
    write_generic,
)
from traces.stats import trace_stats

# Sizes that keep the parametrized tests fast (the defaults are full benchmark workloads).
SMALL = {
    "shared-prefix": {"groups": 4, "prompts_per_group": 8},
    "tool-agent": {"sessions": 40, "templates": 6},
}


def small(kind: str, **params: object) -> list[Request]:
    return generate(kind, **{**SMALL.get(kind, {}), **params})


def well_formed(reqs: list[Request], bt: int) -> None:
    assert [r.index for r in reqs] == list(range(len(reqs)))
    assert reqs[0].arrival_s == 0.0
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals)
    seen = -1
    for r in reqs:
        assert r.block_hashes is not None and len(r.block_hashes) == r.num_blocks(bt)
        assert all(h >= 0 for h in r.block_hashes)
        for h in r.block_hashes:  # dense ids, handed out in arrival order
            assert h <= seen + 1
            seen = max(seen, h)


@pytest.mark.parametrize("kind", sorted(GENERATORS))
@pytest.mark.parametrize("bt", [16, 512])
def test_deterministic_and_well_formed(kind: str, bt: int) -> None:
    a = small(kind, seed=7, block_tokens=bt)
    assert a == small(kind, seed=7, block_tokens=bt)
    assert a != small(kind, seed=8, block_tokens=bt)
    well_formed(a, bt)


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_tokens_agree_with_block_ids(kind: str) -> None:
    bt = 32
    reqs = small(kind, seed=3, block_tokens=bt, with_tokens=True)
    assert reqs == small(kind, seed=3, block_tokens=bt, with_tokens=True)
    chainer = BlockChainer()
    mapping: dict[int, int] = {}
    for r in reqs:
        assert r.token_ids is not None and len(r.token_ids) == r.input_len
        assert all(0 <= t < 32000 for t in r.token_ids[:100])
        from_tokens = chainer.chain_tokens(r.token_ids, bt)
        for a, b in zip(r.block_hashes, from_tokens, strict=True):
            assert mapping.setdefault(a, b) == b  # one-to-one: same sharing either way
    assert len(set(mapping.values())) == len(mapping)


@settings(max_examples=60, deadline=None)
@given(
    groups=st.integers(1, 4),
    prompts=st.integers(1, 6),
    system_len=st.integers(0, 200),
    question_len=st.integers(0, 50),
    bt=st.sampled_from([1, 4, 16, 64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_shared_prefix_closed_form(
    groups: int, prompts: int, system_len: int, question_len: int, bt: int, seed: int
) -> None:
    reqs = shared_prefix(
        groups, prompts, system_len, question_len, 8, block_tokens=bt, seed=seed, rate=10.0
    )
    assert len(reqs) == groups * prompts
    assert all(r.input_len == system_len + question_len for r in reqs)
    s = trace_stats(reqs, block_tokens=bt, reuse=False)
    want = shared_prefix_hit_ratio(prompts, system_len, question_len, bt)
    assert s.token_hit_ceiling == pytest.approx(want, abs=1e-12)
    # and in blocks: the P-1 repeats hit floor(S/B) of ceil((S+Q)/B) blocks each
    n = -(-(system_len + question_len) // bt)
    h = n if question_len == 0 else system_len // bt
    assert s.block_hit_ceiling == pytest.approx((prompts - 1) * h / (prompts * n) if n else 0.0)


def test_closed_form_examples() -> None:
    # 32 prompts, a 2048-token system prompt and 128-token questions at 512-token blocks
    assert shared_prefix_hit_ratio(32, 2048, 128, 512) == pytest.approx(31 * 2048 / (32 * 2176))
    # a system prompt that ends mid-block: only its full blocks are reusable
    assert shared_prefix_hit_ratio(2, 1000, 24, 512) == pytest.approx(512 / (2 * 1024))
    assert shared_prefix_hit_ratio(4, 100, 0, 512) == 0.75  # identical prompts
    assert shared_prefix_hit_ratio(1, 4096, 10, 512) == 0.0


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_generators_arrive_as_bench_serving(burstiness: float) -> None:
    reqs = shared_prefix(100, 100, 16, 16, 1, rate=5.0, burstiness=burstiness, block_tokens=16)
    s = trace_stats(reqs, reuse=False, block_tokens=16)
    assert s.arrival_rate == pytest.approx(5.0, rel=0.1)
    assert s.interarrival_cv == pytest.approx(burstiness**-0.5, rel=0.15)
    # the arrivals are the process's own draws (after the prompt order), to the microsecond
    rng = np.random.default_rng(0)
    rng.permutation(100 * 100)
    want = np.round(arrival_times(100 * 100, 5.0, burstiness=burstiness, rng=rng), 6)
    assert [r.arrival_s for r in reqs] == want.tolist()


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_rate_inf_sends_everything_at_once(kind: str) -> None:
    reqs = small(kind, rate=math.inf)
    firsts = {}
    for r in reqs:
        firsts.setdefault((r.session_id or "").split("/")[0], r.arrival_s)
    assert set(firsts.values()) == {0.0}  # every prompt, session or workflow starts at 0


def test_shared_prefix_defaults_are_bench_serving() -> None:
    # sglang bench_serving --dataset-name generated-shared-prefix, default --gsp-* options
    reqs = shared_prefix()
    assert len(reqs) == 64 * 16
    assert {(r.input_len, r.output_len) for r in reqs} == {(2048 + 128, 256)}
    assert len({r.block_hashes[:4] for r in reqs}) == 64
    for bt in (512, 16):  # any block size dividing 2048: the ceiling bench_serving's docs give
        s = trace_stats(shared_prefix(block_tokens=bt), block_tokens=bt, reuse=False)
        assert s.token_hit_ceiling == pytest.approx(15 / 16 * 2048 / 2176, abs=1e-12)
        assert round(s.token_hit_ceiling, 3) == 0.882


def by_session(reqs: list[Request]) -> dict[str, list[Request]]:
    out: dict[str, list[Request]] = defaultdict(list)
    for r in reqs:
        out[r.session_id].append(r)
    return out


def full_prefix(r: Request, bt: int) -> tuple[int, ...]:
    return r.block_hashes[: r.input_len // bt]


def test_multi_turn_history() -> None:
    bt, s, u, o = 64, 100, 30, 50
    reqs = multi_turn(5, 6, s, u, o, think_time_s=10.0, block_tokens=bt, seed=2)
    sessions = by_session(reqs)
    assert sorted(sessions) == [f"s{i}" for i in range(5)]
    for turns in sessions.values():
        assert len(turns) == 6
        for k, r in enumerate(turns):
            assert r.input_len == s + (k + 1) * u + k * o and r.output_len == o
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.arrival_s > prev.arrival_s
            assert nxt.block_hashes[: len(full_prefix(prev, bt))] == full_prefix(prev, bt)
    # a shared system prompt: every first turn starts with the same block
    firsts = {t[0].block_hashes[0] for t in sessions.values()}
    assert len(firsts) == 1
    alone = by_session(multi_turn(5, 2, s, u, o, shared_system=False, block_tokens=bt))
    assert len({t[0].block_hashes[0] for t in alone.values()}) == 5
    # no think time: all turns of a session arrive together
    burst = by_session(multi_turn(3, 4, think_time_s=0.0))
    assert all(len({r.arrival_s for r in t}) == 1 for t in burst.values())


def test_agentic_structure() -> None:
    bt = 64
    reqs = agentic(3, 3, 1000, 40, 20, 100, branches=2, branch_steps=2, block_tokens=bt, seed=5)
    sessions = by_session(reqs)
    assert len(reqs) == 3 * (3 + 2 * 2)
    ctx_blocks = 1000 // bt
    heads = {r.block_hashes[:ctx_blocks] for r in reqs}
    assert len(heads) == 1  # one shared context for every workflow
    for i in range(3):
        trunk = sessions[f"wf{i}"]
        assert [r.input_len for r in trunk] == [1040, 1160, 1280]
        for prev, nxt in itertools.pairwise(trunk):
            assert nxt.block_hashes[: len(full_prefix(prev, bt))] == full_prefix(prev, bt)
        last = trunk[-1]
        for j in range(2):
            branch = sessions[f"wf{i}/b{j}"]
            assert [r.input_len for r in branch] == [1400, 1520]
            assert branch[0].arrival_s >= last.arrival_s
            assert branch[0].block_hashes[: len(full_prefix(last, bt))] == full_prefix(last, bt)
        # the two branches share the trunk, then diverge
        b0, b1 = sessions[f"wf{i}/b0"][1], sessions[f"wf{i}/b1"][1]
        assert b0.block_hashes[:21] == b1.block_hashes[:21]
        assert b0.block_hashes[-1] != b1.block_hashes[-1]
    solo = agentic(2, 1, 1000, 40, 20, 100, branches=0, shared_context=False, block_tokens=bt)
    assert len(solo) == 2 and solo[0].block_hashes[0] != solo[1].block_hashes[0]
    # infinite-cache ceiling: shared context and histories make agents cache-friendly
    assert trace_stats(reqs, block_tokens=bt).token_hit_ceiling > 0.8


def test_tool_agent_structure() -> None:
    bt, s, task, call, tool = 64, 300, 50, 20, 100
    reqs = tool_agent(
        60, 3, s, task, call, tool, mean_steps=2.5, zipf=1.0, length_cv=0.0, block_tokens=bt,
        seed=4,
    )  # fmt: skip
    sessions = by_session(reqs)
    assert len(sessions) == 60 and len(reqs) > 60  # some sessions loop through tools
    heads = defaultdict(set)
    for turns in sessions.values():
        for k, r in enumerate(turns):  # fixed lengths: each step appends a call and a result
            assert r.input_len == s + task + k * (call + tool) and r.output_len == call
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.arrival_s >= prev.arrival_s
            assert nxt.block_hashes[: len(full_prefix(prev, bt))] == full_prefix(prev, bt)
        heads[turns[0].block_hashes[: s // bt]].add(turns[0].session_id)
    assert len(heads) == 3  # three agents, each one system prompt shared by its sessions
    counts = sorted((len(v) for v in heads.values()), reverse=True)
    assert counts[0] > 2 * counts[-1]  # Zipf weights 1, 1/2, 1/3: popularity is skewed
    flat = by_session(tool_agent(60, 3, s, task, zipf=0.0, length_cv=0.0, mean_steps=1.0))
    assert all(len(t) == 1 for t in flat.values())


def test_tool_agent_lengths_vary_around_their_means() -> None:
    reqs = tool_agent(400, 8, 1000, 500, 100, 800, mean_steps=1.0, length_cv=0.5, seed=1)
    inputs = np.array([r.input_len for r in reqs])
    outputs = np.array([r.output_len for r in reqs])
    assert inputs.mean() == pytest.approx(1500, rel=0.05)  # system prompts scaled to 1000
    assert outputs.mean() == pytest.approx(100, rel=0.06)
    assert outputs.std() / outputs.mean() == pytest.approx(0.5, rel=0.2)


def test_tool_agent_defaults_match_mooncake_table_2() -> None:
    # FAST'25 Table 2, tool&agent: 23,608 requests in one hour, mean input 8,596 and output
    # 182 tokens, cache ratio 59% (which is the infinite-cache token hit ratio: the same
    # measure gives 37% and 65% for the conversation and synthetic traces, listed at 40%, 66%)
    reqs = tool_agent()
    s = trace_stats(reqs, reuse=False)
    assert len(reqs) == pytest.approx(23_608, rel=0.02)
    assert s.duration_s == pytest.approx(3600, rel=0.03)
    assert s.input_len.mean == pytest.approx(8_596, rel=0.03)
    assert s.output_len.mean == pytest.approx(182, rel=0.02)
    assert s.token_hit_ceiling == pytest.approx(0.59, abs=0.015)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: generate("fractal"), "unknown generator kind 'fractal'"),
        (lambda: shared_prefix(groups=0), "groups must be an integer >= 1"),
        (lambda: shared_prefix(system_len=-1), "system_len"),
        (lambda: shared_prefix(rate=0), "rate must be a number > 0"),
        (lambda: shared_prefix(rate=float("nan")), "rate must be a number > 0"),
        (lambda: shared_prefix(burstiness=0), "burstiness must be a finite number > 0"),
        (lambda: multi_turn(burstiness=math.inf), "burstiness must be a finite number > 0"),
        (lambda: tool_agent(mean_steps=0.5), "mean_steps must be >= 1"),
        (lambda: tool_agent(templates=0), "templates must be an integer >= 1"),
        (lambda: tool_agent(zipf=-1), "zipf must be a finite number >= 0"),
        (lambda: tool_agent(length_cv=math.nan), "length_cv"),
        (lambda: shared_prefix(block_tokens=0), "block_tokens"),
        (lambda: multi_turn(think_time_s=-1), "think_time_s must be a finite number >= 0"),
        (lambda: multi_turn(turns=2.5), "turns must be an integer"),
        (lambda: agentic(steps=0), "steps must be an integer >= 1"),
        (lambda: agentic(tool_time_s=float("nan")), "tool_time_s"),
    ],
)
def test_bad_parameters(call: Callable[[], object], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        call()


def test_write_and_reload(tmp_path: Path) -> None:
    reqs = multi_turn(4, 3, block_tokens=128, with_tokens=True, seed=9)
    out = tmp_path / "mt.jsonl"
    write_generic(reqs, out, block_tokens=128, generator="multi-turn")
    tr = open_trace(out)
    assert tr.block_tokens == 128 and tr.header["generator"] == "multi-turn"
    assert list(tr) == reqs
