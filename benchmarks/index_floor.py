"""How fast could a per-block prefix index in Python be? Floors for ``bench_index.py``.

Two stripped loops do only what the device-only LRU manager must do per request
(walk the key dict for the cached prefix, reference the hits, pop victims from
the front of an ``OrderedDict`` and drop them, create the new blocks' nodes,
commit them, release tail-first) with no plans, ops or invariant bookkeeping:

  objects  a ``__slots__`` node per block holding two small lists (``index_core.Node``'s shape)
  arrays   no node objects: each field a flat list, a node is an int slot

Each runs against ``bench_index.plain_lru`` in the same process, best of
``--repeat``; both must give the oracle's hit count. If a floor is above 3x,
no Python index of that shape meets issue 2's target. (The object loop was
also compiled with mypyc once, by hand: 2.1x / 2.8x / 4.6x at 1k / 5k / 20k.)
These floors are why the index's loops are native (``kvflow/_index_core.c``).

    python benchmarks/index_floor.py [--capacity 1000,5000,20000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict
from collections.abc import Callable
from itertools import islice

from bench_index import DEFAULT_TRACE, load_hash_ids, plain_lru

COMPUTING, READY = 3, 1


class Node:
    __slots__ = ("children", "depth", "hits", "key", "last", "loc", "parent", "ref", "state")


def objects_floor(requests: list[list[int]], capacity: int) -> tuple[int, int]:
    nodes: dict[int, Node] = {}
    order: OrderedDict[Node, None] = OrderedDict()
    free = list(range(capacity))
    hits = total = 0
    for now, ids in enumerate(requests):
        ids = ids[:capacity]
        matched: list[Node] = []
        for k in ids:
            n = nodes.get(k)
            if n is None or n.state[0] == COMPUTING:
                break
            matched.append(n)
        for n in matched:
            if n.ref == 0:
                del order[n]
            n.ref += 1
            n.hits += 1
            n.last = now
        hits += len(matched)
        total += len(ids)
        new = ids[len(matched):]
        got: list[int] = []
        for v in list(islice(order, max(0, len(new) - len(free)))):
            del order[v], nodes[v.key]
            if v.parent is not None:
                v.parent.children -= 1
            got.append(v.loc[0])
        while len(got) < len(new):
            got.append(free.pop())
        up = matched[-1] if matched else None
        made: list[Node] = []
        for k, b in zip(new, got, strict=True):
            n = object.__new__(Node)
            n.key, n.parent, n.children, n.ref, n.hits, n.last = k, up, 1, 1, 0, now
            n.loc, n.state = [b, -1, -1], [COMPUTING, 0, 0]
            n.depth = 0 if up is None else up.depth + 1
            made.append(n)
            up = n
        if made:
            made[-1].children = 0
            if matched:
                matched[-1].children += 1
            nodes.update(zip(new, made, strict=True))
        for n in made:
            n.state[0] = READY
        for n in reversed(matched + made):
            n.ref -= 1
            if n.ref == 0:
                order[n] = None
    return hits, total


def arrays_floor(requests: list[list[int]], capacity: int) -> tuple[int, int]:
    slots = capacity + 1
    key: list[int | None] = [None] * slots
    parent, children, loc, state = [-1] * slots, [0] * slots, [-1] * slots, [0] * slots
    ref, hit_count, last = [0] * slots, [0] * slots, [0] * slots
    nodes: dict[int, int] = {}
    order: OrderedDict[int, None] = OrderedDict()
    free_slots, free = list(range(slots)), list(range(capacity))
    hits = total = 0
    for now, ids in enumerate(requests):
        ids = ids[:capacity]
        matched: list[int] = []
        for k in ids:
            s = nodes.get(k)
            if s is None or state[s] == COMPUTING:
                break
            matched.append(s)
        for s in matched:
            if ref[s] == 0:
                del order[s]
            ref[s] += 1
            hit_count[s] += 1
            last[s] = now
        hits += len(matched)
        total += len(ids)
        new = ids[len(matched):]
        got: list[int] = []
        for v in list(islice(order, max(0, len(new) - len(free)))):
            del order[v], nodes[key[v]]  # type: ignore[index]
            if parent[v] >= 0:
                children[parent[v]] -= 1
            got.append(loc[v])
            free_slots.append(v)
        while len(got) < len(new):
            got.append(free.pop())
        up = matched[-1] if matched else -1
        made: list[int] = []
        for k, b in zip(new, got, strict=True):
            s = free_slots.pop()
            key[s], parent[s], children[s], loc[s] = k, up, 1, b
            state[s], ref[s], hit_count[s], last[s] = COMPUTING, 1, 0, now
            made.append(s)
            up = s
        if made:
            children[made[-1]] = 0
            if matched:
                children[matched[-1]] += 1
            nodes.update(zip(new, made, strict=True))
        for s in made:
            state[s] = READY
        for s in reversed(matched + made):
            ref[s] -= 1
            if ref[s] == 0:
                order[s] = None
    return hits, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", default="1000,5000,20000", help="device blocks, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    reqs = load_hash_ids(DEFAULT_TRACE)
    loops: dict[str, Callable[[list[list[int]], int], tuple[int, int]]] = {
        "plain": plain_lru, "objects": objects_floor, "arrays": arrays_floor}
    print("| capacity | plain us/req | objects floor (ratio) | arrays floor (ratio) |")
    print("|---:|---:|---:|---:|")
    for cap in (int(c) for c in args.capacity.split(",")):
        best = dict.fromkeys(loops, float("inf"))
        got = {}
        for _ in range(args.repeat):
            for name, fn in loops.items():
                t0 = time.perf_counter()
                got[name] = fn(reqs, cap)
                best[name] = min(best[name], time.perf_counter() - t0)
        if got["objects"] != got["plain"] or got["arrays"] != got["plain"]:
            raise SystemExit(f"hit counts differ at capacity {cap}: {got}")
        us = {k: v / len(reqs) * 1e6 for k, v in best.items()}
        print(f"| {cap:,} | {us['plain']:.2f} | {us['objects']:.2f} "
              f"({us['objects'] / us['plain']:.2f}) | {us['arrays']:.2f} "
              f"({us['arrays'] / us['plain']:.2f}) |")


if __name__ == "__main__":
    main()
