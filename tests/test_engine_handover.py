"""The engine's prefill/decode handover (``kvflow.handover``), driven by hand.

A prefill engine holds a request after its first token (its blocks referenced)
until released; a decode engine takes it with ``receive``, allocates its
blocks at once, keeps them unmatchable until ``landed``, then decodes it with
the prefill's first token and hits; ``device_only`` plans load nothing.
"""

from __future__ import annotations

import asyncio

from kvflow.engine import Engine, EngineConfig, EngineRequest, RequestState
from kvflow.layout import preset
from kvflow.manager import CacheManager, Capacities
from kvflow.profile import load_profile
from kvflow.radix import Tier
from kvflow.runtime import Runtime
from kvflow.world import WorldSetup
from sim.loop import run_sim
from sim.world import SimWorld

BT = 16
SPEC = preset("llama-3-8b", block_tokens=BT)
CAPS = Capacities(64, 64)


async def engine_pair() -> tuple[Engine, Engine]:
    engines = []
    for _ in range(2):
        site = await SimWorld().start(WorldSetup(SPEC, load_profile("h100"), CAPS))
        manager = CacheManager(CAPS)
        runtime = Runtime(manager, site.backend, SPEC.bytes_per_block,
                          asyncio.get_running_loop())
        engines.append(Engine(manager, runtime, site.executor, EngineConfig(BT)))
    return engines[0], engines[1]


def test_handover_holds_then_decodes_elsewhere() -> None:
    req = EngineRequest("r", 0.0, tuple(f"k{i}" for i in range(4)), 4 * BT - 3, 5)
    seen: dict[str, object] = {}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pre, dec = await engine_pair()
        got: list[RequestState] = []
        pre.handover = got.append

        def last_chunk(st: RequestState) -> None:
            seen["decode"] = dec.receive(st.req, st)
            seen["allocated"] = len(dec.running) == 1 and next(iter(dec.running)).held
            seen["missing"] = dec.missing_blocks(next(iter(dec.running)))

        pre.on_last_chunk = last_chunk
        runs = [loop.create_task(e.run()) for e in (pre, dec)]
        pre.add(req)
        pre.close()
        while not got:
            await asyncio.sleep(0.001)
        st_p = got[0]
        st_d: RequestState = seen["decode"]  # type: ignore[assignment]
        seen["layer_ends"] = st_p.layer_ends
        seen["held_refs"] = [n.ref for n in st_p.plan.nodes]  # type: ignore[union-attr]
        seen["matchable_before"] = len(dec.manager.match(req.keys))
        seen["prefill_match"] = len(pre.manager.match(req.keys))
        await asyncio.sleep(0.05)  # the KV "crosses the network"
        assert st_d.first_token_s is None and not dec.done  # no decode before it lands
        pre.release(st_p)
        dec.landed(st_d)
        seen["matchable_after"] = len(dec.manager.match(req.keys))
        dec.close()
        await asyncio.gather(*runs)
        seen["pre_done"] = list(pre.done)
        seen["dec_done"] = list(dec.done)
        seen["refs_after"] = [n.ref for n in st_p.plan.nodes]  # type: ignore[union-attr]

    run_sim(main())
    assert seen["allocated"] and seen["missing"] == 4
    assert seen["matchable_before"] == 0 and seen["prefill_match"] == 4
    assert seen["matchable_after"] == 4
    assert all(r > 0 for r in seen["held_refs"])  # type: ignore[attr-defined]
    assert all(r == 0 for r in seen["refs_after"])  # type: ignore[attr-defined]
    ends = seen["layer_ends"]
    assert isinstance(ends, list) and len(ends) == SPEC.num_layers and ends == sorted(ends)
    st_p, = seen["pre_done"]  # type: ignore[misc]
    st_d, = seen["dec_done"]  # type: ignore[misc]
    assert st_p.finish_s is None and st_p.generated == 1
    assert st_d.finish_s is not None and st_d.generated == 5
    assert st_d.first_token_s == st_p.first_token_s and st_d.admit_s == st_p.admit_s
    assert st_d.hits == st_p.hits
    assert st_d.decode_from_s is not None and st_d.decode_from_s >= st_p.first_token_s + 0.05


def test_device_only_plan_loads_nothing() -> None:
    """Blocks on host only end the cached prefix of a ``device_only`` plan; a plain plan
    would load them."""
    m = CacheManager(Capacities(3, 8))
    keys = ("a", "b", "c")
    plan = m.plan("p", keys)
    m.commit(plan)
    for op in m.finish(plan):  # write_through: backups to host, landed at once
        m.complete(op, True)
    other = m.plan("x", ("x", "y"))  # evicts the two oldest device copies: c, then b
    m.commit(other)
    for op in m.finish(other):
        m.complete(op, True)
    tiers = [m.index.get(k).best_tier() for k in keys]  # type: ignore[union-attr]
    assert tiers == [Tier.DEVICE, Tier.HOST, Tier.HOST]
    only = m.plan("r", keys, device_only=True)
    assert only.num_cached == 1 and only.source_tiers == [Tier.DEVICE]
    assert not [op for op in only.ops if op.dst_tier == Tier.DEVICE and op.src_tier != Tier.DEVICE]
    m.finish(only)
    m.check_invariants()
    plain = m.plan("q", keys)
    assert plain.num_cached == 3 and any(op.kind.value == "swap_in" for op in plain.ops)
