"""The native index core (``kvflow._index_core``) behaves exactly as the Python reference
(``kvflow.index_core``), seen from both of its callers.

* ``TestManagerLockstep``: two ``CacheManager``s, identical but for ``index_core``
  ("python" / "native"), driven by one random sequence of the verbs the engine and
  runtime use (plan, prefetch, release, commit, finish, complete, lost, drop_all), as
  ``test_manager_stateful.py`` drives one. Every returned value (plans, ops, follow-up
  ops, reservations, counts, exceptions) and, after every step, a canonical snapshot of
  each manager (every node's fields, the index's counts, each tier's eviction order and
  the policies' internals, the pools' free lists, the stats, the ops in flight) must be
  equal.
* ``test_core_calls_match``: random call sequences straight on the two cores, through a
  ``PrefixIndex`` of each kind, including calls the manager never makes (misuse that
  raises: both must raise the same error and leave the same state), and the per-op
  loops (``land``, ``backups``, ``fill``, ``columns``, ``set_inflight_all``, ``admit``)
  on nodes in any state.

``KVFLOW_EQUIV_EXAMPLES`` / ``KVFLOW_EQUIV_STEPS`` scale the examples and steps (for
fuzzing well past the committed settings, with ``--hypothesis-seed``).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from test_manager_stateful import prompts  # the same prompt shapes as the stateful test

from kvflow.arc import ARC, LinkedARC
from kvflow.index_core import NO_INFLIGHT
from kvflow.manager import CacheManager, Capacities
from kvflow.policy import (
    LFU,
    LRU,
    S3FIFO,
    LinkedLengthAware,
    LinkedLFU,
    LinkedLRU,
    LinkedS3FIFO,
    PrefetchPolicy,
    WritePolicy,
)
from kvflow.radix import (
    ABSENT,
    COMPUTING,
    FILLING,
    NATIVE_CORE,
    READY,
    PrefixIndex,
    Tier,
    set_inflight,
)
from kvflow.ranked import CostAware, LengthAware, LinkedCostAware

pytestmark = pytest.mark.skipif(
    NATIVE_CORE is None,
    reason="kvflow._index_core is not built (kvflow run from a source tree without "
           "pip install): nothing to compare the Python core with")

SIDES = ("python", "native")
#: Policies compared: the native core links each through its nodes (``NATIVE_ORDERS``),
#: the Python core runs their Python classes.
EVICTIONS = ["lru", "lfu", "s3fifo", "length_aware", "arc", "cost_aware"]
EXAMPLES = float(os.environ.get("KVFLOW_EQUIV_EXAMPLES", "1"))
STEPS = float(os.environ.get("KVFLOW_EQUIV_STEPS", "1"))


def _n(base: int, scale: float) -> int:
    return max(1, int(base * scale))


# ------------------------------------------------------------------ comparison helpers

def _outcome(f):
    """(value, None) or (None, the exception) of ``f()``."""
    try:
        return f(), None
    except Exception as e:  # compared below: both sides must raise the same
        return None, e


def _same_error(ep, en):
    assert (type(ep), str(ep)) == (type(en), str(en)), (ep, en)


def _lfu_order(policy):
    """LFU's order, lowest bucket first: the Python class keeps buckets of hit counts
    (ranks stay with the node while ordered), the native one links them (``LinkedLFU``)."""
    if isinstance(policy, LFU):
        return [n for f in sorted(policy._buckets) for n in policy._buckets[f]]
    return list(policy)


def _policy_desc(policy, index):
    """Everything observable about one tier's eviction order."""
    nodes = index.nodes
    def k(n):
        return (n.key, nodes.get(n.key) is n)
    tracked = sorted((k(n) for n in policy.tracked()), key=repr)
    if isinstance(policy, LRU) or (LinkedLRU is not None and isinstance(policy, LinkedLRU)):
        first = policy.first()
        return ("lru", [k(n) for n in policy], tracked, None if first is None else k(first))
    if isinstance(policy, LengthAware) or (
            LinkedLengthAware is not None and isinstance(policy, LinkedLengthAware)):
        first = policy.first()
        return ("length_aware", [k(n) for n in policy], tracked,
                None if first is None else k(first))
    if isinstance(policy, LFU) or (LinkedLFU is not None and isinstance(policy, LinkedLFU)):
        return ("lfu", [(k(n), n.hits) for n in _lfu_order(policy)], tracked)
    if isinstance(policy, ARC | LinkedARC):  # type: ignore[operator]
        return (*_arc_desc(policy, nodes.values(), k), tracked)
    if isinstance(policy, CostAware | LinkedCostAware):  # type: ignore[operator]
        return (*_cost_desc(policy, k), tracked)
    assert isinstance(policy, S3FIFO | LinkedS3FIFO), policy  # type: ignore[operator]
    freq = sorted(((k(n), f) for n, f in policy._freq.items()), key=repr)
    return ("s3fifo", [k(n) for n in policy._small], [k(n) for n in policy._main],
            list(policy._ghost), freq, policy.capacity, tracked)


def _arc_desc(policy, nodes, k):
    """ARC's lists, ghosts, target and the lists its referenced nodes were in."""
    if isinstance(policy, ARC):
        held = sorted(((k(n), w) for n, w in policy._held.items()), key=repr)
    else:
        held = sorted(((k(n), policy.held(n)) for n in nodes if policy.held(n)), key=repr)
    first = policy.first()
    return ("arc", [k(n) for n in policy._t1], [k(n) for n in policy._t2], list(policy._b1),
            list(policy._b2), policy.p, policy.capacity, held,
            None if first is None else k(first))


def _cost_desc(policy, k):
    """Cost-aware's buckets (rank, then each node and its route tag, in order; empty
    ones left out), clock and the lower tiers it weighs."""
    if isinstance(policy, CostAware):
        buckets = [(r, [(k(n), tag) for n, tag in policy._buckets[r].items()])
                   for r in sorted(policy._buckets) if policy._buckets[r]]
    else:
        buckets = [(r, [(k(n), tag) for n, tag in b]) for r, b in policy.buckets()]
    return ("cost_aware", buckets, policy.clock, policy.checks_tags, tuple(policy._lower),
            policy._above is not None)


def _inflight_desc(node, op_name):
    inf = node.inflight
    return (inf is NO_INFLIGHT, tuple(op_name(x) for x in inf))


# ============================================================== 1. manager lockstep

def _op_id(op):
    return None if op is None else op.op_id


def _op_desc(op):
    return (op.op_id, op.kind.value, int(op.src_tier), int(op.dst_tier), list(op.src_ids),
            list(op.dst_ids), list(op.keys), [n.key for n in op.nodes],
            None if op.plan is None else op.plan.request_id,
            [p.request_id for p in op.sharers], op.num_blocks)


def _plan_desc(p):
    return (p.request_id, p.keys, [n.key for n in p.nodes], list(p.device_ids),
            list(p.source_tiers), [_op_desc(op) for op in p.ops], [op.op_id for op in p.shared],
            [n.key for n in p.computing], list(p.private), list(p.extra_ids), p.num_cached,
            [p.hits(t) for t in Tier], p.committed, p.finished)


def _res_desc(r):
    return ([_op_desc(op) for op in r.ops], [(n.key, n.ref) for n in r.nodes])


def _node_desc(n, nodes):
    parent = n.parent
    return (n.key, list(n.loc), list(n.state), n.ref, n.hits, n.children, n.depth,
            n.last_access, None if parent is None else parent.key,
            parent is not None and nodes.get(parent.key) is parent,
            _inflight_desc(n, _op_id), n.matchable, n.best_tier(), repr(n))


def _manager_snapshot(m):
    index = m.index
    nodes = index.nodes
    return {
        "nodes": [(k, _node_desc(n, nodes)) for k, n in nodes.items()],
        "keys_match": all(n.key == k for k, n in nodes.items()),
        "unreferenced": list(index.unreferenced),
        "tiers": index.tiers,
        "policies": [_policy_desc(p, index) for p in index.policies],
        "pools": [(list(p._free), bytes(p._used)) for p in m.pools],
        "stats": dataclasses.asdict(m.stats),
        "inflight": [(i, _op_desc(op)) for i, op in m.inflight.items()],
        "detached": [_op_desc(op) for op in m.detached_ops],
    }


class Lockstep(RuleBasedStateMachine):
    """Two managers, one per core; every rule runs its verb on both and compares."""

    @initialize(
        dev=st.integers(2, 5) | st.integers(2, 10), host=st.integers(1, 3) | st.integers(0, 10),
        storage=st.integers(0, 12),
        eviction=st.sampled_from(EVICTIONS),
        write=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        threshold=st.integers(0, 3),
        prefetch=st.sampled_from(["best_effort", "wait_complete", "timeout"]),
    )
    def setup(self, dev, host, storage, eviction, write, threshold, prefetch):
        self.ms = [
            CacheManager(Capacities(dev, host, storage), eviction=eviction,
                         write_policy=WritePolicy(write, threshold=threshold),
                         prefetch_policy=PrefetchPolicy(prefetch), index_core=core)
            for core in SIDES
        ]
        assert [m.index.native for m in self.ms] == [False, True]
        self.use_storage = prefetch != "best_effort"  # as the engine
        self.open = ([], [])
        self.ops = ([], [])
        self.waiting = ([], [])  # (keys, reservation)
        self.seen = []
        self.next_id = 0

    # -- running a verb on both ---------------------------------------------------
    def both(self, f, desc=lambda x: x):
        """``f(side, manager)`` on each side: the same value (through ``desc``) or the same
        error. Returns the two values, or None where both raised (``self.error``: which)."""
        (vp, ep), (vn, en) = (_outcome(lambda s=s: f(s, self.ms[s])) for s in (0, 1))
        self.error = ep
        if ep is not None or en is not None:
            _same_error(ep, en)
            return None
        assert desc(vp) == desc(vn)
        return vp, vn

    def both_ops(self, f, get=lambda v: v):
        """``both`` for a verb that returns ops (or something holding them, ``get``):
        they join the ops in flight."""
        vals = self.both(f, lambda v: [_op_desc(o) for o in get(v)])
        if vals is not None:
            for s in (0, 1):
                self.ops[s].extend(get(vals[s]))
        return vals

    def same(self, f):
        """A choice made from each side's state (they must agree); returns it."""
        a, b = f(0), f(1)
        assert a == b
        return a

    def plan_both(self, rid, keys, extra=0):
        """A plan on both sides (held in nothing yet); a refusal's copy-outs join the ops."""
        vals = self.both_ops(
            lambda s, m: m.plan(rid, keys, extra, use_storage=self.use_storage),
            lambda p: p.ops)
        if vals is not None:
            assert _plan_desc(vals[0]) == _plan_desc(vals[1])
        dp, dn = (m.detached_ops for m in self.ms)
        assert [_op_desc(o) for o in dp] == [_op_desc(o) for o in dn]
        for s in (0, 1):
            self.ops[s].extend(self.ms[s].detached_ops)
            self.ms[s].detached_ops.clear()
        return vals

    def land_all(self):
        """Complete every op in submission order, follow-ups too, on both sides."""
        while self.same(lambda s: len(self.ops[s])):
            self.both_ops(lambda s, m: m.complete(self.ops[s].pop(0), True))

    # -- verbs -------------------------------------------------------------------
    def earlier_prompt(self, i):
        """An earlier prompt, preferably one whose cached prefix reaches down to storage."""
        down = self.same(lambda s: [
            k for k in self.seen
            if any(n.best_tier() == Tier.STORAGE for n in self.ms[s].match(k))])
        pool = down or self.seen
        return pool[i % len(pool)]

    @rule(keys=prompts, extra=st.integers(0, 3), w=st.none() | st.integers(0, 100),
          again=st.none() | st.integers(0, 100))
    def plan(self, keys, extra, w, again):
        """A new request, or (``w``) a waiting one with the keys it was prefetched with,
        or (``again``) one repeating an earlier prompt without waiting."""
        if w is not None and self.waiting[0]:
            w %= len(self.waiting[0])
            keys = self.waiting[0][w][0]
        else:
            w = None
            if again is not None and self.seen:
                keys = self.earlier_prompt(again)
        vals = self.plan_both(self.next_id, keys, extra)
        if vals is None:
            return  # refused (NotEnoughBlocks, checked equal): a waiting one keeps waiting
        if w is not None:  # admitted: its reservation goes
            self.both(lambda s, m: m.release(self.waiting[s].pop(w)[1]))
        else:
            self.seen.append(keys)
        self.next_id += 1
        for s in (0, 1):
            self.open[s].append(vals[s])

    @rule(keys=prompts, again=st.none() | st.integers(0, 100), blocks_per_op=st.integers(1, 4))
    def prefetch(self, keys, again, blocks_per_op):
        """A request arrives and waits (``again``: an earlier prompt, preferably one whose
        cached prefix reaches down to storage)."""
        if again is not None and self.seen:
            keys = self.earlier_prompt(again)
        vals = self.both_ops(lambda s, m: m.prefetch(keys, blocks_per_op), lambda r: r.ops)
        if vals is not None:
            assert _res_desc(vals[0]) == _res_desc(vals[1])
            for s in (0, 1):
                self.waiting[s].append((keys, vals[s]))

    @rule(keys=prompts)
    def match(self, keys):
        self.both(lambda s, m: m.match(keys), lambda ns: [(n.key, n.ref) for n in ns])

    @precondition(lambda self: self.waiting[0])
    @rule(i=st.integers(0, 100))
    def release(self, i):
        i %= len(self.waiting[0])
        self.both(lambda s, m: m.release(self.waiting[s].pop(i)[1]))

    @precondition(lambda self: any(op.src_tier == Tier.STORAGE and op.dst_tier == Tier.HOST
                                   for op in self.ops[0]))
    @rule(i=st.integers(0, 100), mask=st.integers(1, 15))
    def lost(self, i, mask):
        """A storage read misses blocks: the op fails, then some of its keys are lost
        (as ``runtime._finished`` reports them)."""
        reads = [[op for op in self.ops[s]
                  if op.src_tier == Tier.STORAGE and op.dst_tier == Tier.HOST] for s in (0, 1)]
        assert len(reads[0]) == len(reads[1])
        i %= len(reads[0])
        for s in (0, 1):
            self.ops[s].remove(reads[s][i])
        self.both_ops(lambda s, m: m.complete(reads[s][i], False))
        gone = [k for j, k in enumerate(reads[0][i].keys) if mask >> (j % 4) & 1]
        if gone:
            self.both(lambda s, m: m.lost(Tier.STORAGE, gone))

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 100), j=st.integers(0, 4), tier=st.sampled_from([Tier.STORAGE,
                                                                             Tier.HOST]))
    def lost_any(self, i, j, tier):
        """A lower tier reports blocks gone at any time (a store restarted, evicted them)."""
        keys = self.seen[i % len(self.seen)]
        self.both(lambda s, m: m.lost(tier, keys[j % len(keys):]))

    @precondition(lambda self: self.open[0])
    @rule(i=st.integers(0, 100), done=st.booleans())
    def commit(self, i, done):
        """Once its loads landed; ``done``: the request then finishes."""
        i %= len(self.open[0])
        ready = self.same(lambda s: not any(op in self.ops[s] for op in
                                            self.open[s][i].ops + self.open[s][i].shared))
        if ready:
            self.both(lambda s, m: m.commit(self.open[s][i]))
            if done:
                self.both_ops(lambda s, m: m.finish(self.open[s].pop(i)))

    @precondition(lambda self: self.open[0])
    @rule(i=st.integers(0, 100), twice=st.booleans())
    def finish(self, i, twice):
        """Finish (committed or not: an aborted request); ``twice``: the same ValueError."""
        i %= len(self.open[0])
        plans = [self.open[s].pop(i) for s in (0, 1)]
        self.both_ops(lambda s, m: m.finish(plans[s]))
        if twice:
            assert self.both(lambda s, m: m.finish(plans[s])) is None
            assert isinstance(self.error, ValueError)

    @precondition(lambda self: self.ops[0])
    @rule(i=st.integers(0, 100), ok=st.booleans(), twice=st.booleans())
    def complete(self, i, ok, twice):
        """An op lands or fails; ``twice``: the same "not in flight" error."""
        i %= len(self.ops[0])
        ops = [self.ops[s].pop(i) for s in (0, 1)]
        self.both_ops(lambda s, m: m.complete(ops[s], ok))
        if twice:
            assert self.both(lambda s, m: m.complete(ops[s], ok)) is None
            assert isinstance(self.error, ValueError)

    @rule(keys=prompts)
    def serve(self, keys):
        """A request runs start to finish while every transfer lands."""
        vals = self.plan_both(self.next_id, keys)
        if vals is None:
            return
        self.next_id += 1
        self.seen.append(keys)
        self.land_all()
        self.both(lambda s, m: m.commit(vals[s]))
        self.both_ops(lambda s, m: m.finish(vals[s]))
        self.land_all()

    @precondition(lambda self: self.ops[0])
    @rule()
    def settle(self):
        self.land_all()

    @precondition(lambda self: not self.ops[0] and not self.open[0])
    @rule()
    def drop_all(self):
        """Idle (nothing running or in flight): drain every tier."""
        self.both(lambda s, m: m.drop_all())

    # -- after every step ---------------------------------------------------------
    @invariant()
    def same_state(self):
        if not hasattr(self, "ms"):
            return
        py, nat = (_manager_snapshot(m) for m in self.ms)
        for part in py:
            assert py[part] == nat[part], part
        for s in (0, 1):
            nodes = self.ms[s].index.nodes
            assert all(nodes.get(n.key) is n for p in self.open[s] for n in p.nodes)
        assert [_plan_desc(p) for p in self.open[0]] == [_plan_desc(p) for p in self.open[1]]
        assert [_op_desc(op) for op in self.ops[0]] == [_op_desc(op) for op in self.ops[1]]
        assert ([(k, _res_desc(r)) for k, r in self.waiting[0]]
                == [(k, _res_desc(r)) for k, r in self.waiting[1]])

    def teardown(self):
        """Drain both as test_manager_stateful does, comparing all the way."""
        if not hasattr(self, "ms"):
            return
        while self.waiting[0]:
            self.both(lambda s, m: m.release(self.waiting[s].pop(0)[1]))
        while self.open[0]:
            self.both_ops(lambda s, m: m.finish(self.open[s].pop(0)))
        self.land_all()
        self.same_state()
        keys = [("fresh", i) for i in range(self.ms[0].capacities.device)]
        for _ in range(4 * sum(self.ms[0].capacities[t] for t in (0, 1, 2)) + 4):
            plans = self.plan_both("whole-device", keys)  # refused: its copy-outs land
            self.land_all()
            if plans is not None:
                break
        if plans is not None:
            self.both(lambda s, m: m.commit(plans[s]))
            self.both_ops(lambda s, m: m.finish(plans[s]))
            self.land_all()
        self.both(lambda s, m: m.drop_all())
        self.same_state()


Lockstep.TestCase.settings = settings(
    max_examples=_n(200, EXAMPLES), stateful_step_count=_n(40, STEPS), deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestManagerLockstep = Lockstep.TestCase


# ============================================================ 2. core-level calls

# Raw keys: one key may turn up under different parents; now and then one that cannot be
# hashed (both cores raise the same TypeError and leave the index as it was).
KEYS = st.sampled_from([*range(10), *range(10), ["unhashable"]])
TIER = st.sampled_from([0, 1, 2])
HANDLE = st.integers(0, 7) | st.integers(0, 63)  # nodes handed out, counted from the newest
SEL = st.lists(HANDLE, max_size=6)
OPS = ("op-a", "op-b", "op-c")

_add = st.tuples(st.just("add"), st.none() | HANDLE, st.lists(KEYS, max_size=6),
                 st.sampled_from([0, 0, 0, 0, 0, 0, -1, 1]), st.integers(0, 9))
# A request's walk through the core, as the manager makes it: match, ref_all, best_tiers,
# add_computing below the match, then (maybe) mark_computed and release tail-first.
_request = st.tuples(st.just("request"), prompts | st.lists(KEYS, max_size=6),
                     st.booleans(), st.booleans(), st.integers(0, 9))
core_calls = st.one_of(
    _add, _request, _request, _request,
    st.tuples(st.just("match"), prompts | st.lists(KEYS, max_size=6)),
    st.tuples(st.just("ref_all"), SEL),
    st.tuples(st.just("best_tiers"), SEL),
    st.tuples(st.just("computing_on_device"), SEL),
    st.tuples(st.just("mark_computed"), SEL, st.booleans()),
    st.tuples(st.just("release"), SEL),
    st.tuples(st.just("drop_front"), TIER, st.integers(0, 6)),
    st.tuples(st.just("drop_front"), TIER, st.integers(-2, 6)),
    st.tuples(st.just("set_copy"), HANDLE, TIER, st.integers(0, 15),
              st.sampled_from([READY, READY, FILLING, COMPUTING])),
    st.tuples(st.just("drop_copy"), HANDLE, TIER),
    st.tuples(st.just("ref"), HANDLE),
    st.tuples(st.just("unref"), HANDLE),
    st.tuples(st.just("mark_ready"), HANDLE, TIER),
    st.tuples(st.just("set_inflight"), HANDLE, TIER, st.sampled_from([None, *OPS])),
    st.tuples(st.just("victims"), TIER, st.booleans(), st.integers(0, 255)),
    st.tuples(st.just("take_victims"), TIER, st.integers(-1, 7), st.integers(0, 2)),
    st.tuples(st.just("poke"), HANDLE, TIER, st.sampled_from([ABSENT, READY, FILLING, COMPUTING])),
    # The per-op loops (csrc/core_bulk.c), on any nodes in any states.
    st.tuples(st.just("land"), SEL, TIER, st.sampled_from([*OPS, None])),
    st.tuples(st.just("backups"), SEL, TIER, st.sampled_from([-1, 0, 1, 2]), st.integers(0, 2)),
    st.tuples(st.just("fill"), SEL, TIER, st.integers(-1, 1)),
    st.tuples(st.just("columns"), SEL, TIER, TIER),
    st.tuples(st.just("set_inflight_all"), SEL, TIER, st.sampled_from([*OPS, None])),
    st.tuples(st.just("admit"), SEL, st.none() | st.lists(TIER, min_size=6, max_size=6),
              st.integers(0, 9), st.integers(0, 6), st.integers(0, 3)),
)


class _Pair:
    """The two cores' indexes and every node either has handed out, as parallel handles."""

    def __init__(self, caps, eviction):
        self.idx = [PrefixIndex(caps, eviction, core=c) for c in SIDES]
        assert [i.native for i in self.idx] == [False, True]
        self.handles = ([], [])  # node objects, by handle number (kept alive: ids stay unique)
        self.ids = ({}, {})  # id(node) -> handle number

    def handle(self, pn, nn):
        hp, hn = self.ids[0].get(id(pn)), self.ids[1].get(id(nn))
        assert hp == hn, (pn, nn)
        if hp is None:
            hp = len(self.handles[0])
            for s, n in ((0, pn), (1, nn)):
                self.handles[s].append(n)
                self.ids[s][id(n)] = hp
        return hp

    def handles_of(self, py_nodes, nat_nodes):
        assert len(py_nodes) == len(nat_nodes)
        return [self.handle(p, n) for p, n in zip(py_nodes, nat_nodes, strict=True)]

    def pick(self, sel):
        """Nodes by handle numbers counted from the newest (modulo how many); per side."""
        if not self.handles[0]:
            return [], []
        h = [-1 - i % len(self.handles[0]) for i in sel]
        return [[self.handles[s][i] for i in h] for s in (0, 1)]

    def one(self, i):
        if not self.handles[0]:
            return None
        return [side[0] for side in self.pick([i])]

    def indexed(self, s, n):
        """Whether ``n`` is (still) the index's node of its key.

        Copies are only ever added to indexed nodes (the manager adds them to nodes it
        just matched and holds, or just made): a copy on a node gone from the index
        would put it in a policy's order while the index no longer has it, and
        ``drop_front`` then fails on both cores, each leaving a different half-done
        state. So no call here gives a node that left the index a copy (set_copy,
        mark_ready, mark_computed, a raw state write); ref, unref, release and the rest
        may still meet such nodes, as the manager's release of a reservation does.
        """
        return self.idx[s].nodes.get(n.key) is n

    def name(self, s, n):
        return None if n is None else self.ids[s].get(id(n), ("?", n.key))

    def node_desc(self, s, n):
        nodes = self.idx[s].nodes
        return (self.name(s, n), n.key, list(n.loc), list(n.state), n.ref, n.hits, n.children,
                n.depth, n.last_access, self.name(s, n.parent), nodes.get(n.key) is n,
                _inflight_desc(n, lambda x: x), n.matchable, n.best_tier(), repr(n))

    def policy_desc(self, s, policy):
        """As ``_policy_desc``, nodes named by handle (keys may repeat across handles)."""
        def k(n):
            return self.name(s, n)
        tracked = sorted((k(n) for n in policy.tracked()), key=repr)
        if isinstance(policy, LFU) or (LinkedLFU is not None and isinstance(policy, LinkedLFU)):
            first = policy.first()
            return ("lfu", [(k(n), n.hits) for n in _lfu_order(policy)], tracked,
                    None if first is None else k(first))
        if isinstance(policy, ARC | LinkedARC):  # type: ignore[operator]
            return (*_arc_desc(policy, self.handles[s], k), tracked)
        if isinstance(policy, CostAware | LinkedCostAware):  # type: ignore[operator]
            return (*_cost_desc(policy, k), tracked)
        if isinstance(policy, S3FIFO | LinkedS3FIFO):  # type: ignore[operator]
            return ("s3fifo", [k(n) for n in policy._small], [k(n) for n in policy._main],
                    list(policy._ghost), sorted(((k(n), f) for n, f in policy._freq.items()),
                                                key=repr), tracked)
        first = policy.first()
        return ("lru", [k(n) for n in policy], tracked, None if first is None else k(first),
                len(policy.tracked()))

    def snapshot(self, s):
        index = self.idx[s]
        return {
            "nodes": [(k, self.node_desc(s, n)) for k, n in index.nodes.items()],
            "handles": [self.node_desc(s, n) for n in self.handles[s]],
            "unreferenced": list(index.unreferenced),
            "policies": [self.policy_desc(s, p) for p in index.policies],
        }

    def check(self):
        py, nat = self.snapshot(0), self.snapshot(1)
        for part in py:
            assert py[part] == nat[part], part


def _run_core_call(pair, call):
    """One call on both sides; compares results and errors."""
    kind, *a = call
    idx = pair.idx

    def both(f, desc=lambda x: x):
        (vp, ep), (vn, en) = (_outcome(lambda s=s: f(s)) for s in (0, 1))
        if ep is not None or en is not None:
            _same_error(ep, en)
            return None
        assert desc(vp) == desc(vn), (call, vp, vn)
        return vp, vn

    def nodes_result(vals):
        if vals is not None:
            pair.handles_of(*vals)

    if kind == "add":
        parent, keys, delta, now = a
        par = pair.one(parent) if parent is not None else None
        ids = list(range(len(keys) + delta)) if len(keys) + delta >= 0 else []
        nodes_result(both(lambda s: idx[s].add_computing(None if par is None else par[s],
                                                         keys, ids, now),
                          lambda ns: [n.key for n in ns]))
    elif kind == "request":
        keys, commit, release, now = a
        matched = both(lambda s: idx[s].match(keys), lambda ns: [n.key for n in ns])
        if matched is None:
            return
        nodes_result(matched)
        both(lambda s: idx[s].ref_all(matched[s]))
        both(lambda s: idx[s].best_tiers(matched[s]))
        start = len(matched[0])
        ids = list(range(100, 100 + len(keys) - start))
        created = both(lambda s: idx[s].add_computing(matched[s][-1] if start else None,
                                                      keys[start:], ids, now),
                       lambda ns: [n.key for n in ns])
        if created is None:
            return
        nodes_result(created)
        if commit:
            both(lambda s: idx[s].mark_computed(created[s]))
        if release:
            nodes_result(both(lambda s: idx[s].release((matched[s] + created[s])[::-1]),
                              lambda ns: [n.key for n in ns]))
    elif kind == "match":
        nodes_result(both(lambda s: idx[s].match(a[0]), lambda ns: [n.key for n in ns]))
    elif kind in ("ref_all", "best_tiers"):
        sel = pair.pick(a[0])
        both(lambda s: getattr(idx[s], kind)(sel[s]))
    elif kind == "computing_on_device":
        sel = pair.pick(a[0])
        nodes_result(both(lambda s: idx[s].computing_on_device(sel[s]),
                          lambda ns: [n.key for n in ns]))
    elif kind == "mark_computed":
        sel, only_computing = pair.pick(a[0]), a[1]
        keep = [i for i, n in enumerate(sel[0]) if pair.indexed(0, n) and (
            not only_computing or (n.state[0] == COMPUTING and n.ref))]  # (as the manager)
        sel = [[side[i] for i in keep] for side in sel]
        both(lambda s: idx[s].mark_computed(sel[s]))
    elif kind == "release":
        sel = pair.pick(a[0])
        nodes_result(both(lambda s: idx[s].release(sel[s]), lambda ns: [n.key for n in ns]))
    elif kind == "drop_front":
        both(lambda s: idx[s].drop_front(a[0], a[1]))
    elif kind == "take_victims":
        tier, count, have = a
        both(lambda s: (lambda ids: (idx[s].take_victims(tier, count, ids), ids)[1])(
            list(range(-have, 0))))
    elif kind == "victims":
        tier, copy_down, mask = a
        def take(s):
            # As PrefixIndex's callers: drop (some of) what it offers, as it offers it.
            out = []
            for j, n in enumerate(idx[s].victims(tier, copy_down)):
                out.append((pair.name(s, n), n.key))
                if j >= 8:
                    break
                if mask >> j & 1 and idx[s].can_lose(n, tier):
                    out.append(idx[s].drop_copy(n, tier))
            return out
        both(take)
    elif kind == "admit":
        sel, tiers, now, n_dev, n_host = a
        sel = pair.pick(sel)
        # Referenced nodes only, as the manager's plans (which hold a reference): a node
        # still in its tier's eviction order keeps its place by its hits in the ranked
        # orders (length_aware, cost_aware), so counting a hit on it is misuse that the
        # Python buckets and the native links answer differently (found by this test).
        keep = [i for i, n in enumerate(sel[0]) if pair.indexed(0, n) and n.ref]
        sel = [[side[i] for i in keep] for side in sel]
        # Random tiers, or each node's best one (as the manager's plans: None)
        tiers = idx[0].best_tiers(sel[0]) if tiers is None else tiers[:len(sel[0])]
        ids = [(list(range(n_dev)), list(range(20, 20 + n_host))) for _ in (0, 1)]

        def admit(s):
            out = idx[s].admit(sel[s], tiers, now, *ids[s])
            return (out[0], [[n.key for n in ns] for ns in out[1:4]], out[4], ids[s])
        both(admit)
        assert ids[0] == ids[1], call  # (blocks are popped on an error too: the same ones)
    elif kind in ("land", "backups", "columns", "set_inflight_all"):
        sel, *rest = a
        sel = pair.pick(sel)
        if kind == "land":  # (land's op comes first)
            rest = [rest[1], rest[0]]
            out = both(lambda s: idx[s].land(rest[0], sel[s], rest[1]),
                       lambda ns: [n.key for n in ns])
        else:
            out = both(lambda s: getattr(idx[s], kind)(sel[s], *rest),
                       (lambda ns: [n.key for n in ns]) if kind == "backups" else
                       (lambda x: x))
        if out is not None and kind in ("land", "backups"):
            nodes_result(out)
    elif kind == "fill":
        sel, tier, extra = a
        sel = pair.pick(sel)
        ids = list(range(50, 50 + max(0, len(sel[0]) + extra)))  # (a wrong count: ValueError)
        both(lambda s: idx[s].fill(sel[s], tier, ids))
    elif kind == "set_inflight":
        h, tier, op = a
        node = pair.one(h)
        if node is not None:
            both(lambda s: set_inflight(node[s], tier, op))
    elif kind == "poke":  # a raw state write, as the manager's copy-down placeholders
        h, tier, state = a
        node = pair.one(h)
        if node is not None and pair.indexed(0, node[0]):
            def poke(s):
                node[s].state[tier] = state
            both(poke)
    else:
        node = pair.one(a[0])
        if node is None:
            return
        if kind in ("set_copy", "mark_ready") and not pair.indexed(0, node[0]):
            return  # see _Pair.indexed
        f = getattr(PrefixIndex, kind)
        both(lambda s: f(idx[s], node[s], *a[1:]))


@settings(max_examples=_n(250, EXAMPLES), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(caps=st.tuples(st.integers(1, 8), st.integers(0, 8), st.integers(0, 8)),
       eviction=st.sampled_from(EVICTIONS),
       calls=st.lists(core_calls, min_size=_n(10, STEPS), max_size=_n(60, STEPS)))
def test_core_calls_match(caps, eviction, calls):
    pair = _Pair(list(caps), eviction)
    for call in calls:
        _run_core_call(pair, call)
        pair.check()


# ------------------------------------------------------- regressions (divergences found)

@pytest.mark.parametrize("eviction", EVICTIONS)
def test_drop_front_of_a_count_below_one_drops_nothing(eviction):
    """The Python core raised islice's ValueError for a negative count under LRU (and
    under LFU only with something ordered), the native one returned []: both drop
    nothing now, for 0 too, without asking the policy."""
    pair = _Pair([4, 4, 0], eviction)
    for call in [("request", "ab", True, True, 1), ("drop_front", 0, -1), ("drop_front", 0, 0),
                 ("drop_front", 1, -3)]:
        _run_core_call(pair, call)
        pair.check()
    assert [i.drop_front(0, -1) for i in pair.idx] == [[], []]
    assert all(len(i.nodes) == 2 for i in pair.idx)


def test_add_computing_with_a_key_that_cannot_be_hashed_leaves_the_index_as_it_was():
    """The Python core left the chain made before such a key indexed (computing and
    referenced by nobody: never matchable, never evictable); the native one undid it."""
    for index in (PrefixIndex([4, 0, 0], core=c) for c in SIDES):
        (p,) = index.add_computing(None, ["p"], [0], now=1)
        with pytest.raises(TypeError, match="unhashable type: 'list'"):
            index.add_computing(p, ["a", "b", ["c"], "d"], [1, 2, 3, 4], now=1)
        assert list(index.nodes) == ["p"] and p.children == 0
        assert [n.key for n in index.add_computing(p, "ab", [1, 2], now=2)] == ["a", "b"]


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_take_victims_leaves_no_in_flight_list_behind(eviction):
    """The Python core's take_victims drops a copy through ``drop_copy``, which clears
    the node's in-flight list to NO_INFLIGHT once nothing is in flight; the native one
    cleared the tier's slot only (found by test_core_calls_match)."""
    pair = _Pair([1, 0, 0], eviction)
    for call in [("request", ((0,),), True, False, 0), ("unref", 0),
                 ("set_inflight", 0, 0, "op-a"), ("take_victims", 0, 1, 0)]:
        _run_core_call(pair, call)
        pair.check()
    assert [n.inflight for n in (pair.handles[0][0], pair.handles[1][0])] == [NO_INFLIGHT] * 2


@pytest.mark.parametrize("core", SIDES)
def test_admit_places_each_hit_and_lists_the_loads_to_share(core):
    """``admit`` on a device hit being filled, a host hit (one with its host copy in
    flight), and two storage hits with one host block: what each gets, and which
    positions the plan must share an op at (a host hit with nothing in flight: none)."""
    index = PrefixIndex([8, 8, 8], "lru", core=core)
    a, b, c, d, e = index.add_computing(None, "abcde", [0, 1, 2, 3, 4], now=1)
    index.mark_computed([e, d, c, b, a])
    index.release([e, d, c, b, a])
    for n, tier in ((b, 1), (c, 1), (d, 2), (e, 2)):
        index.set_copy(n, tier, 10 + "abcde".index(n.key), READY)
        index.drop_copy(n, 0)
    index.set_copy(a, 2, 9, READY)
    index.drop_copy(a, 0)
    index.set_copy(a, 0, 7, FILLING)
    set_inflight(a, 0, "op-a")
    set_inflight(c, 1, "op-c")
    dev, host = [20, 21, 22, 23], [30]
    out = index.admit([a, b, c, d, e], [0, 1, 1, 2, 2], 5, dev, host)
    device_ids, from_host, staged, direct, waits = out
    assert device_ids == [7, 23, 22, 21, 20] and (dev, host) == ([], [])
    assert [[n.key for n in g] for g in (from_host, staged, direct)] == [["b", "c"], ["d"],
                                                                        ["e"]]
    assert waits == [0, 2]
    assert [n.hits for n in (a, b, c, d, e)] == [1] * 5
    assert {n.last_access for n in (a, b, c, d, e)} == {5}
    assert [list(n.state) for n in (b, d, e)] == [[FILLING, READY, ABSENT],
                                                  [FILLING, FILLING, READY],
                                                  [FILLING, ABSENT, READY]]
    assert d.loc[1] == 30
