"""Seeded synthetic traces with known reuse structure.

Real traces say what happened; synthetic ones say *why*: each generator here
builds prompts from content segments whose sharing is known exactly, so a
cache's hit ratio can be checked against a closed form (shared-prefix groups)
or a structural property (multi-turn histories, agent branches).

Every generator is deterministic in its ``seed``, returns a list of
:class:`~traces.schema.Request` sorted by arrival (first at 0 s, times rounded
to the microsecond), with Mooncake-style prefix-chained block ids (dense,
non-negative, assigned in arrival order). ``with_tokens=True`` also fills
``token_ids`` with seeded random tokens consistent with those ids, for
consumers that hash tokens themselves. Write them out with :func:`write_generic`.

Arrivals (sessions/workflows starting, or single prompts) follow a Poisson
process at ``rate`` per second, or a gamma renewal process with coefficient
of variation ``cv`` (``cv > 1`` is burstier than Poisson, ``cv < 1`` smoother;
``cv = 1`` is Poisson again).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from traces.chain import BlockChainer
from traces.schema import DEFAULT_BLOCK_TOKENS, Request
from traces.writer import write_generic

__all__ = [
    "ARRIVALS",
    "GENERATORS",
    "agentic",
    "arrival_times",
    "generate",
    "multi_turn",
    "shared_prefix",
    "shared_prefix_hit_ratio",
    "write_generic",
]

ARRIVALS = ("poisson", "gamma")

Segment = tuple[int, int]  # (segment id, length in tokens): content shared iff same id


def _int(name: str, value: Any, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _pos(name: str, value: Any, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        what = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def arrival_times(
    n: int,
    rate: float,
    *,
    process: str = "poisson",
    cv: float = 1.0,
    rng: np.random.Generator | int | None = 0,
) -> np.ndarray:
    """``n`` arrival times (seconds, first at 0) of a renewal process with mean rate ``rate``.

    ``poisson``: exponential gaps. ``gamma``: gamma gaps with shape ``1/cv**2``
    and the same mean ``1/rate``, the usual knob for burstiness in serving
    benchmarks.
    """
    _int("n", n, 0)
    rate = _pos("rate", rate)
    if process not in ARRIVALS:
        raise ValueError(f"arrival process must be one of {', '.join(ARRIVALS)}, got {process!r}")
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    if n == 0:
        return np.zeros(0)
    if process == "poisson":
        gaps = gen.exponential(1.0 / rate, n - 1)
    else:
        cv = _pos("cv", cv)
        shape = 1.0 / (cv * cv)
        gaps = gen.gamma(shape, 1.0 / (rate * shape), n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


class _Builder:
    """Collects prompts as segment lists, then emits Requests sorted by arrival.

    Ids are chained only at the end, in arrival order, so they grow through the
    trace like Mooncake's. ``rng`` is the generator's one seeded stream (arrivals,
    order, think and tool times), drawn in the generator's order; segment tokens
    come from streams of their own, so they do not depend on that order.
    """

    def __init__(self, block_tokens: int, seed: int, with_tokens: bool, vocab_size: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.block_tokens = _int("block_tokens", block_tokens, 1)
        self.seed = seed
        self.with_tokens = with_tokens
        self.vocab_size = _int("vocab_size", vocab_size, 2)
        self._next_seg = 0
        self._pending: list[tuple[float, int, tuple[Segment, ...], int, str | None]] = []
        self._tokens: dict[int, np.ndarray] = {}

    def arrivals(self, n: int, rate: float, process: str, cv: float) -> np.ndarray:
        """``n`` start times from ``rng``: see :func:`arrival_times`."""
        return arrival_times(n, rate, process=process, cv=cv, rng=self.rng)

    def segment(self, length: int) -> Segment:
        """A fresh piece of content, shared with nothing unless reused on purpose."""
        sid = self._next_seg
        self._next_seg += 1
        return (sid, length)

    def add(
        self, arrival: float, segments: Sequence[Segment], output_len: int, session: str | None
    ) -> None:
        order = len(self._pending)
        self._pending.append(
            (round(float(arrival), 6), order, tuple(segments), output_len, session)
        )

    def _segment_tokens(self, seg: Segment) -> np.ndarray:
        sid, length = seg
        toks = self._tokens.get(sid)
        if toks is None:
            rng = np.random.default_rng([self.seed, sid])
            toks = rng.integers(0, self.vocab_size, length, dtype=np.int64)
            self._tokens[sid] = toks
        return toks

    def build(self) -> list[Request]:
        self._pending.sort(key=lambda p: (p[0], p[1]))
        chainer = BlockChainer()
        out = []
        for index, (arrival, _, segs, n_out, session) in enumerate(self._pending):
            n_in = sum(length for _, length in segs)
            ids = chainer.chain_segments(segs, self.block_tokens)
            toks = None
            if self.with_tokens:
                parts = [self._segment_tokens(s) for s in segs if s[1]]
                toks = tuple(np.concatenate(parts).tolist()) if parts else ()
            out.append(Request(index, arrival, n_in, n_out, ids, toks, session, None))
        return out


def shared_prefix(
    groups: int = 4,
    prompts_per_group: int = 32,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 128,
    *,
    rate: float = 2.0,
    arrival: str = "poisson",
    cv: float = 1.0,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    seed: int = 0,
    with_tokens: bool = False,
    vocab_size: int = 32000,
) -> list[Request]:
    """``groups`` system prompts, each followed by ``prompts_per_group`` distinct questions.

    The ``groups * prompts_per_group`` prompts arrive in a seeded random order
    (groups interleave, as tenants of one server would). With an infinite
    cache the token hit ratio is :func:`shared_prefix_hit_ratio`.
    """
    g = _int("groups", groups, 1)
    p = _int("prompts_per_group", prompts_per_group, 1)
    s = _int("system_len", system_len, 0)
    q = _int("question_len", question_len, 0)
    o = _int("output_len", output_len, 0)
    b = _Builder(block_tokens, seed, with_tokens, vocab_size)
    systems = [b.segment(s) for _ in range(g)]
    prompts = [(gi, b.segment(q)) for gi in range(g) for _ in range(p)]
    order = b.rng.permutation(len(prompts))
    times = b.arrivals(len(prompts), rate, arrival, cv)
    for t, k in zip(times, order, strict=True):
        gi, question = prompts[k]
        b.add(t, [systems[gi], question], o, None)
    return b.build()


def shared_prefix_hit_ratio(
    prompts_per_group: int, system_len: int, question_len: int, block_tokens: int
) -> float:
    """Ideal (infinite-cache) token hit ratio of :func:`shared_prefix`; independent of groups.

    Per group the first prompt misses everything; each of the other ``P - 1``
    hits the system prompt's full blocks, ``floor(S / B) * B`` tokens (the
    block holding the end of the system prompt also holds question tokens, so
    it is new), or all ``S`` tokens when there is no question at all::

        hit = (P - 1) * H / (P * (S + Q)),  H = S if Q == 0 else floor(S / B) * B
    """
    p, s, q, bt = prompts_per_group, system_len, question_len, block_tokens
    if p <= 0 or s + q == 0:
        return 0.0
    h = s if q == 0 else (s // bt) * bt
    return (p - 1) * h / (p * (s + q))


def multi_turn(
    sessions: int = 16,
    turns: int = 4,
    system_len: int = 1024,
    user_len: int = 128,
    output_len: int = 256,
    *,
    think_time_s: float = 30.0,
    shared_system: bool = True,
    rate: float = 0.5,
    arrival: str = "poisson",
    cv: float = 1.0,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    seed: int = 0,
    with_tokens: bool = False,
    vocab_size: int = 32000,
) -> list[Request]:
    """Chat sessions: turn ``t`` re-sends the system prompt, all earlier turns and answers.

    Sessions start at ``rate`` per second; turns of one session are spaced by
    an exponential think time of mean ``think_time_s`` (a trace cannot know
    the serving latency, so the gap is think time alone; a closed-loop replay
    can sequence turns by ``session_id``, ``"s<i>"``). The system prompt is
    one shared segment when ``shared_system``, else one per session.
    """
    n = _int("sessions", sessions, 1)
    k = _int("turns", turns, 1)
    s = _int("system_len", system_len, 0)
    u = _int("user_len", user_len, 0)
    o = _int("output_len", output_len, 0)
    think = _pos("think_time_s", think_time_s, allow_zero=True)
    b = _Builder(block_tokens, seed, with_tokens, vocab_size)
    starts = b.arrivals(n, rate, arrival, cv)
    common = b.segment(s)
    for i, t0 in enumerate(starts):
        history = [common if shared_system else b.segment(s)]
        gaps = b.rng.exponential(think, k - 1) if think > 0 else np.zeros(k - 1)
        t = float(t0)
        for turn in range(k):
            if turn:
                t += float(gaps[turn - 1])
            history.append(b.segment(u))
            b.add(t, history, o, f"s{i}")
            history = [*history, b.segment(o)]  # the answer, sent back next turn
    return b.build()


def agentic(
    workflows: int = 8,
    steps: int = 4,
    context_len: int = 16384,
    task_len: int = 256,
    call_len: int = 64,
    tool_len: int = 1024,
    *,
    branches: int = 2,
    branch_steps: int = 2,
    shared_context: bool = True,
    tool_time_s: float = 2.0,
    rate: float = 0.2,
    arrival: str = "poisson",
    cv: float = 1.0,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    seed: int = 0,
    with_tokens: bool = False,
    vocab_size: int = 32000,
) -> list[Request]:
    """Agent workflows: a long context, tool calls that append, then parallel branches.

    Each workflow (``session_id`` ``"wf<i>"``) sends ``context + task`` and
    then ``steps`` requests, each answering with a tool call of ``call_len``
    tokens whose result (``tool_len`` tokens) is appended to the next prompt,
    after an exponential tool latency of mean ``tool_time_s``. Then it forks
    into ``branches`` sub-agents (``"wf<i>/b<j>"``), each continuing from the
    whole trunk history for ``branch_steps`` steps of its own. The context is
    one segment for all workflows when ``shared_context`` (a code base, a
    document set), else one per workflow.
    """
    n = _int("workflows", workflows, 1)
    k = _int("steps", steps, 1)
    c = _int("context_len", context_len, 0)
    task = _int("task_len", task_len, 0)
    call = _int("call_len", call_len, 0)
    tool = _int("tool_len", tool_len, 0)
    nb = _int("branches", branches, 0)
    bk = _int("branch_steps", branch_steps, 0 if nb == 0 else 1)
    latency = _pos("tool_time_s", tool_time_s, allow_zero=True)
    b = _Builder(block_tokens, seed, with_tokens, vocab_size)
    starts = b.arrivals(n, rate, arrival, cv)
    common = b.segment(c)

    def lat() -> float:
        return float(b.rng.exponential(latency)) if latency > 0 else 0.0

    def run(
        history: list[Segment], t: float, count: int, session: str
    ) -> tuple[list[Segment], float]:
        for step in range(count):
            if step:
                t += lat()
            b.add(t, history, call, session)
            history = [*history, b.segment(call), b.segment(tool)]
        return history, t

    for i, t0 in enumerate(starts):
        base = [common if shared_context else b.segment(c), b.segment(task)]
        trunk, t_end = run(base, float(t0), k, f"wf{i}")
        for j in range(nb):
            run(trunk, t_end + lat(), bk, f"wf{i}/b{j}")
    return b.build()


GENERATORS: dict[str, Callable[..., list[Request]]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "agentic": agentic,
}


def generate(kind: str, **params: Any) -> list[Request]:
    """Run the generator named ``kind`` (a key of :data:`GENERATORS`) with ``params``."""
    try:
        fn = GENERATORS[kind]
    except KeyError:
        raise ValueError(
            f"unknown generator kind {kind!r}; expected one of {', '.join(GENERATORS)}"
        ) from None
    return fn(**params)
