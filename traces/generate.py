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
process at ``rate`` per second, or with ``burstiness != 1`` a gamma renewal
process of the same mean rate, exactly as SGLang's ``bench_serving`` draws
them (see :mod:`traces.arrivals`; ``rate = inf`` starts everything at 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from traces.arrivals import arrival_times
from traces.chain import BlockChainer
from traces.schema import DEFAULT_BLOCK_TOKENS, Request
from traces.writer import write_generic

__all__ = [
    "GENERATORS",
    "agentic",
    "arrival_times",
    "generate",
    "multi_turn",
    "shared_prefix",
    "shared_prefix_hit_ratio",
    "tool_agent",
    "write_generic",
]

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

    def arrivals(self, n: int, rate: float, burstiness: float) -> np.ndarray:
        """``n`` start times from ``rng``: see :func:`arrival_times`."""
        return arrival_times(n, rate, burstiness=burstiness, rng=self.rng)

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
    groups: int = 64,
    prompts_per_group: int = 16,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    *,
    rate: float = 2.0,
    burstiness: float = 1.0,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    seed: int = 0,
    with_tokens: bool = False,
    vocab_size: int = 32000,
) -> list[Request]:
    """``groups`` system prompts, each followed by ``prompts_per_group`` distinct questions.

    The defaults are SGLang ``bench_serving``'s ``generated-shared-prefix``
    dataset (``--gsp-num-groups 64 --gsp-prompts-per-group 16
    --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 256``,
    fixed lengths), whose infinite-cache token hit ratio is 15/16 x 2048/2176
    = 0.882 at any block size dividing 2048. Like ``bench_serving`` (unless
    ``--gsp-ordered``), the ``groups * prompts_per_group`` prompts arrive in a
    seeded random order, groups interleaved. ``bench_serving``'s default
    rate is ``inf`` (all at once); pass ``rate=math.inf`` for that. With an
    infinite cache the token hit ratio is :func:`shared_prefix_hit_ratio`.
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
    times = b.arrivals(len(prompts), rate, burstiness)
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
    burstiness: float = 1.0,
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
    starts = b.arrivals(n, rate, burstiness)
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
    burstiness: float = 1.0,
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
    starts = b.arrivals(n, rate, burstiness)
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


#: Mooncake's tool&agent trace: 23,608 requests in one hour (FAST'25, Table 2).
_TOOL_AGENT_SESSIONS = 11_804


def _lengths(rng: np.random.Generator, mean: int, cv: float, n: int) -> list[int]:
    """``n`` token counts of mean ``mean``: lognormal with coefficient of variation ``cv``."""
    if cv == 0 or mean == 0:
        return [mean] * n
    sigma2 = math.log1p(cv * cv)
    draws = rng.lognormal(math.log(mean) - sigma2 / 2, math.sqrt(sigma2), n)
    return np.rint(draws).astype(np.int64).tolist()


def tool_agent(
    sessions: int = _TOOL_AGENT_SESSIONS,
    templates: int = 64,
    system_len: int = 2048,
    task_len: int = 2048,
    call_len: int = 182,
    tool_len: int = 4318,
    *,
    mean_steps: float = 2.0,
    zipf: float = 1.0,
    length_cv: float = 0.5,
    tool_time_s: float = 2.0,
    rate: float = _TOOL_AGENT_SESSIONS / 3600,
    burstiness: float = 1.0,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    seed: int = 0,
    with_tokens: bool = False,
    vocab_size: int = 32000,
) -> list[Request]:
    """Tool and agent calls: popular fixed system prompts, short tool-call loops.

    The shape of Mooncake's tool&agent workload (FAST'25 paper, section 5.2.1
    and Table 2; the trace itself is not in ``../shared/traces``): requests
    carry "pre-designed, often lengthy, system prompts that are fully
    repetitive", were sampled by user session, and total 23,608 in one hour
    with a mean input of 8,596 tokens, a mean output of 182 and a cache ratio
    of 59%. Each of ``templates`` agents has one system prompt (length drawn
    once); sessions (``"s<i>"``) pick an agent by Zipf popularity (rank ``k``
    has weight ``k ** -zipf``) and start at ``rate`` per second. A session
    sends ``system + task``; each answer (``call_len`` tokens: a tool call,
    or the final answer) and the tool's result (``tool_len``) are appended to
    the next request, after an exponential tool latency of mean
    ``tool_time_s``; a session has a geometric number of requests of mean
    ``mean_steps`` (2: the function-calling round trip of call, then answer).
    Every length is lognormal with coefficient of variation ``length_cv``
    around its mean (0: fixed).

    The paper gives only those totals; the split is ours, solved so that the
    defaults reproduce them (``traces/README.md`` shows the arithmetic).
    Defaults give ~23,600 requests over one hour, mean input ~8,600 tokens,
    mean output 182 and an infinite-cache token hit ratio of ~0.59.
    """
    n = _int("sessions", sessions, 1)
    nt = _int("templates", templates, 1)
    s = _int("system_len", system_len, 0)
    task = _int("task_len", task_len, 0)
    call = _int("call_len", call_len, 0)
    tool = _int("tool_len", tool_len, 0)
    steps = _pos("mean_steps", mean_steps)
    if steps < 1:
        raise ValueError(f"mean_steps must be >= 1, got {mean_steps!r}")
    z = _pos("zipf", zipf, allow_zero=True)
    cv = _pos("length_cv", length_cv, allow_zero=True)
    latency = _pos("tool_time_s", tool_time_s, allow_zero=True)
    b = _Builder(block_tokens, seed, with_tokens, vocab_size)
    starts = b.arrivals(n, rate, burstiness)
    rng = b.rng
    weights = np.arange(1, nt + 1, dtype=np.float64) ** -z
    weights /= weights.sum()
    # scaled so that the mean system prompt a session sends is system_len, whatever
    # the draw (a few popular agents would otherwise swing the trace's mean by 30%)
    raw = np.asarray(_lengths(rng, s, cv, nt), dtype=np.float64)
    spread = raw.dot(weights)
    scaled = np.rint(raw * (s / spread)).astype(np.int64) if spread else raw.astype(np.int64)
    systems = [b.segment(int(length)) for length in scaled]
    agents = rng.choice(nt, size=n, p=weights).tolist()
    counts = rng.geometric(1.0 / steps, n).tolist()
    tasks = _lengths(rng, task, cv, n)
    total = int(sum(counts))
    calls = iter(_lengths(rng, call, cv, total))
    tools = iter(_lengths(rng, tool, cv, total))
    gaps = iter(rng.exponential(latency, total).tolist() if latency > 0 else [0.0] * total)
    for i, t0 in enumerate(starts):
        history = [systems[agents[i]], b.segment(tasks[i])]
        t = float(t0)
        for step in range(counts[i]):
            gap = next(gaps)
            if step:
                t += gap
            out = next(calls)
            b.add(t, history, out, f"s{i}")
            history = [*history, b.segment(out), b.segment(next(tools))]
    return b.build()


GENERATORS: dict[str, Callable[..., list[Request]]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "agentic": agentic,
    "tool-agent": tool_agent,
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
