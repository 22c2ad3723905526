"""Random sequences of plan / commit / finish / complete over every policy and tier mix.

After every step the manager must hold every invariant of DESIGN.md; at the
end, with every request finished and every op landed, a drain frees every
block of every pool.
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

from kvflow.errors import NotEnoughBlocks
from kvflow.manager import CacheManager, Capacities
from kvflow.policy import WritePolicy
from kvflow.radix import ABSENT, COMPUTING, Tier

prompts = st.lists(st.integers(0, 1), min_size=1, max_size=5).map(
    lambda syms: tuple(tuple(syms[: i + 1]) for i in range(len(syms)))
)


class ManagerMachine(RuleBasedStateMachine):
    @initialize(
        dev=st.integers(2, 10), host=st.integers(0, 10), storage=st.integers(0, 12),
        eviction=st.sampled_from(["lru", "lfu", "s3fifo"]),
        write=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        threshold=st.integers(0, 2),
    )
    def setup(self, dev, host, storage, eviction, write, threshold):
        self.m = CacheManager(
            Capacities(dev, host, storage), eviction=eviction,
            write_policy=WritePolicy(write, threshold=threshold))
        self.open = []
        self.ops = []
        self.next_id = 0

    @rule(keys=prompts, extra=st.integers(0, 2))
    def plan(self, keys, extra):
        try:
            p = self.m.plan(self.next_id, keys, extra)
        except NotEnoughBlocks:
            self.ops += self.m.detached_ops
            self.m.detached_ops.clear()
            return
        self.next_id += 1
        self.open.append(p)
        self.ops += p.ops
        assert len(p.device_ids) == len(keys)
        assert len(set(p.device_ids) | set(p.extra_ids)) == len(keys) + extra

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 100))
    def commit(self, i):
        p = self.open[i % len(self.open)]
        if not any(op in self.ops for op in p.ops + p.shared):  # compute runs after loads
            self.m.commit(p)

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

    @invariant()
    def holds_invariants(self):
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        for p in self.open:  # referenced blocks are never evicted
            for n in p.nodes:
                assert n.ref > 0 and n.key in self.m.index.nodes
                assert n.state[Tier.DEVICE] != ABSENT, n

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
