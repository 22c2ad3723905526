"""Random sequences of plan / commit / finish / complete over every policy and tier mix,
plus the waiting-request paths: prefetch at arrival, release at admission or when
dropped, best-effort plans (``use_storage=False``), storage reads that lose blocks,
and a pool shared with other instances (``found`` copies appear, ``lost`` ones go at
any time).

After every step the manager must hold every invariant of DESIGN.md; at the
end, with every reservation released, every request finished and every op
landed, a drain frees every block of every pool.

The machine only does what ``kvflow.engine`` may do: a plan's
``use_storage`` follows the manager's prefetch policy (``not best_effort``),
as the engine's does; a waiting request is planned with the keys it was
prefetched with and its reservation released once the plan holds what it
needs (kept when the plan is refused); ``lost`` is called as the runtime calls it,
right after a storage read failed, for some of that read's keys, and as a shared pool
does (``kvflow.cluster.pool``), for any storage copy at any time.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvflow.belady import FutureUses
from kvflow.cost import BlockCosts
from kvflow.errors import NotEnoughBlocks
from kvflow.manager import CacheManager, Capacities
from kvflow.policy import EVICTION_POLICIES, WritePolicy
from kvflow.radix import ABSENT, COMPUTING, NATIVE_CORE, Tier

# Both index cores where the native one was built (test_index_core.py says when it must be).
CORES = ["python", "native"] if NATIVE_CORE is not None else ["python"]

prompts = st.lists(st.integers(0, 1), min_size=1, max_size=5).map(
    lambda syms: tuple(tuple(syms[: i + 1]) for i in range(len(syms)))
)


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        # Small devices and hosts half the time: blocks get evicted down to storage
        # within a run, so that prefetches and storage reads happen.
        dev=st.integers(2, 5) | st.integers(2, 10), host=st.integers(1, 3) | st.integers(0, 10),
        storage=st.integers(0, 12),
        eviction=st.sampled_from(sorted(EVICTION_POLICIES)),
        # Belady's future: requests that may or may not be the ones the machine makes
        # (ids 0, 1, ...): a wrong future must cost hits only, never an invariant.
        future=st.lists(prompts, max_size=12),
        write=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        threshold=st.integers(0, 2),
        prefetch=st.sampled_from(["best_effort", "wait_complete"]),
        core=st.sampled_from(CORES),
    )
    def setup(self, dev, host, storage, eviction, write, threshold, prefetch, core, future):
        self.m = CacheManager(
            Capacities(dev, host, storage), eviction=eviction,
            write_policy=WritePolicy(write, threshold=threshold), prefetch_policy=prefetch,
            index_core=core, future=FutureUses(future),
            costs=BlockCosts(1.0, 0.25, (0.0, 0.2, 0.6)))
        # As the engine does: best effort uses only what has reached host by now.
        self.use_storage = prefetch != "best_effort"
        self.open = []
        self.ops = []
        self.waiting = []  # (keys, reservation) of requests prefetched at arrival
        self.seen = []  # prompts planned so far: a later request may repeat one
        self.next_id = 0

    @rule(keys=prompts, extra=st.integers(0, 2), w=st.none() | st.integers(0, 100))
    def plan(self, keys, extra, w):
        """Plan a new request, or (``w``) a waiting one with its prefetched keys."""
        if w is not None and self.waiting:
            w %= len(self.waiting)
            keys = self.waiting[w][0]
        else:
            w = None
        try:
            p = self.m.plan(self.next_id, keys, extra, use_storage=self.use_storage)
        except NotEnoughBlocks:
            self.ops += self.m.detached_ops
            self.m.detached_ops.clear()
            return  # a waiting request keeps its reservation and waits
        if w is not None:  # admitted: the plan holds what it needs now
            self.m.release(self.waiting.pop(w)[1])
        else:
            self.seen.append(keys)
        self.next_id += 1
        self.open.append(p)
        self.ops += p.ops
        assert len(p.device_ids) == len(keys)
        assert len(set(p.device_ids) | set(p.extra_ids)) == len(keys) + extra

    @rule(keys=prompts, again=st.none() | st.integers(0, 100),
          blocks_per_op=st.integers(1, 4))
    def prefetch(self, keys, again, blocks_per_op):
        """A request arrives and waits: its storage hits start up to host. ``again``:
        it repeats an earlier prompt (by now maybe evicted down to storage)."""
        if again is not None and self.seen:
            # Preferably one whose cached prefix reaches down to storage.
            down = [k for k in self.seen
                    if any(n.best_tier() == Tier.STORAGE for n in self.m.match(k))]
            pool = down or self.seen
            keys = pool[again % len(pool)]
        r = self.m.prefetch(keys, blocks_per_op)
        assert len(set(map(id, r.nodes))) == len(r.nodes)
        self.waiting.append((keys, r))
        self.ops += r.ops

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        """A waiting request's reservation goes (the engine drops reservations when
        the head cannot fit; an aborted waiting request drops its own)."""
        _, r = self.waiting.pop(i % len(self.waiting))
        self.m.release(r)
        assert not r.nodes

    @precondition(lambda self: any(op.src_tier == Tier.STORAGE and op.dst_tier == Tier.HOST
                                   for op in self.ops))
    @rule(i=st.integers(0, 100), mask=st.integers(1, 15))
    def lost(self, i, mask):
        """A storage read misses blocks the store no longer has: the op fails, then the
        runtime tells the manager which of its keys are gone (as ``runtime._finished``)."""
        reads = [op for op in self.ops
                 if op.src_tier == Tier.STORAGE and op.dst_tier == Tier.HOST]
        op = reads[i % len(reads)]
        self.ops.remove(op)
        self.ops += self.m.complete(op, False)
        gone = [k for j, k in enumerate(op.keys) if mask >> (j % 4) & 1]
        if gone:
            self.m.lost(Tier.STORAGE, gone)

    @rule(keys=prompts, again=st.none() | st.integers(0, 100), cut=st.integers(1, 5))
    def found(self, keys, again, cut):
        """A pool shared with other instances holds a prompt's first blocks (another
        instance wrote them): they become storage copies here, where closure allows."""
        if again is not None and self.seen:
            keys = self.seen[again % len(self.seen)]
        items = [(k, k[:-1] or None) for k in keys[:cut]]
        before = sum(1 for n in self.m.index if n.state[Tier.STORAGE] != ABSENT)
        added = self.m.found(Tier.STORAGE, items)
        after = sum(1 for n in self.m.index if n.state[Tier.STORAGE] != ABSENT)
        assert after - before <= added  # (evictions to make room may take some)
        assert added <= len(items)
        self.ops += self.m.detached_ops
        self.m.detached_ops.clear()

    @precondition(lambda self: any(n.state[Tier.STORAGE] != ABSENT for n in self.m.index))
    @rule(i=st.integers(0, 100))
    def pool_evicts(self, i):
        """The shared pool evicts a block at any time: every instance's view drops it."""
        held = [n.key for n in self.m.index if n.state[Tier.STORAGE] != ABSENT]
        self.m.lost(Tier.STORAGE, [held[i % len(held)]])

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 100), done=st.booleans())
    def commit(self, i, done):
        """``done``: the request then finishes (its blocks stay cached, backups start)."""
        p = self.open[i % len(self.open)]
        if not any(op in self.ops for op in p.ops + p.shared):  # compute runs after loads
            self.m.commit(p)
            if done:
                self.open.remove(p)
                self.ops += self.m.finish(p)

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        p = self.open.pop(i % len(self.open))
        self.ops += self.m.finish(p)

    @precondition(lambda self: self.ops)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def complete(self, i, ok):
        op = self.ops.pop(i % len(self.ops))
        self.ops += self.m.complete(op, ok)

    @rule(keys=prompts)
    def serve(self, keys):
        """A request runs start to finish while every transfer lands: what it
        evicts and backs up reaches the lower tiers (storage hits for later ones)."""
        try:
            p = self.m.plan(self.next_id, keys, use_storage=self.use_storage)
        except NotEnoughBlocks:
            self.ops += self.m.detached_ops
            self.m.detached_ops.clear()
            return
        self.next_id += 1
        self.seen.append(keys)
        self.ops += p.ops
        self.land_all()
        self.m.commit(p)
        self.ops += self.m.finish(p)
        self.land_all()

    @precondition(lambda self: self.ops)
    @rule()
    def settle(self):
        """Every transfer in flight lands (follow-ups too): blocks reach the lower tiers."""
        self.land_all()

    def land_all(self):
        """Complete every op in submission order, as the runtime's ordering allows."""
        while self.ops:
            self.ops += self.m.complete(self.ops.pop(0), True)

    @invariant()
    def holds_invariants(self):
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        for p in self.open:  # referenced blocks are never evicted
            for n in p.nodes:
                assert n.ref > 0 and n.key in self.m.index.nodes
                assert n.state[Tier.DEVICE] != ABSENT, n
        for _, r in self.waiting:  # a reservation keeps its references
            assert all(n.ref > 0 for n in r.nodes)

    def whole_device_fits(self):
        """With nothing running, the engine plans the head of the queue, lets the copies a
        failed plan started land, and plans again; a request the device can hold must get
        in that way (a plan refused with nothing in flight is refused for good)."""
        m = self.m
        keys = [("fresh", i) for i in range(m.capacities.device)]
        for _ in range(4 * sum(m.capacities[t] for t in (0, 1, 2)) + 4):
            try:
                p = m.plan("whole-device", keys)
                break
            except NotEnoughBlocks:
                ops = m.detached_ops[:]
                m.detached_ops.clear()
                assert ops, "a plan for the whole device refused with nothing in flight"
                while ops:
                    ops += m.complete(ops.pop(0), True)
        else:
            raise AssertionError("a plan for the whole device never fits")
        m.check_invariants()
        self.ops += p.ops
        m.commit(p)
        self.ops += m.finish(p)
        while self.ops:
            self.ops += m.complete(self.ops.pop(0), True)

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for _, r in self.waiting:
            self.m.release(r)
        self.waiting.clear()
        for p in self.open:
            self.ops += self.m.finish(p)
        while self.ops:
            self.ops += self.m.complete(self.ops.pop(0), True)
        assert not self.m.inflight
        assert all(n.ref == 0 and n.state[0] != COMPUTING for n in self.m.index)
        self.whole_device_fits()
        self.m.drop_all()
        for pool in self.m.pools:
            assert pool.num_used == 0, pool
        assert len(self.m.index) == 0


ManagerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40,
                                            deadline=None)
TestManagerStateful = ManagerMachine.TestCase
