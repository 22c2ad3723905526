"""Prefill/decode disaggregation in a simulated cluster: ``--pd P:D``.

Instances ``0 .. P-1`` prefill, ``P .. P+D-1`` decode. The router sends a
request to a prefill instance, which computes its prompt and first token (TTFT
is measured there) and then holds its KV (``Engine.handover``) while it
crosses the network to a decode instance, which decodes the rest (TPOT is
measured there, from the first token on, so it includes the wait for the KV).

**Which decode instance.** The one with the fewest decode blocks (blocks of
the requests it has received and not yet finished: prompt plus output, as
admission reserves them), the lowest index on a tie. It is chosen as the
prefill instance schedules the step that completes the request's prefill
(``Engine.on_last_chunk``), and the decode instance allocates the request's
blocks then (``Engine.receive``), before that step runs: the layer-wise path
needs somewhere to write each layer as soon as it is computed, which is why
Mooncake and SGLang's PD pre-allocate on the decode side (not at admission:
an engine admits requests long before their prefill runs, and their decode
blocks would sit empty that long). A decode instance with no room queues the
request (first in, first out); its transfer then starts once it is admitted,
and the prefill instance keeps the blocks meanwhile. Blocks the decode instance already holds on its
device (an earlier turn of the conversation decoded there) are not sent.

**The link.** Every instance has one NIC (``pd_gb_per_s`` each way,
``pd_latency_s`` per message): a transfer occupies the prefill instance's
sending side and the decode instance's receiving side. Each layer is one unit
of ``blocks * bytes_per_layer_block`` bytes, served first in first out as the
simulated hierarchy's storage links are (``sim.hierarchy``, overlapped
latency): unit ``i`` ready at ``r_i`` starts at ``s_i = max(link free, r_i +
latency)`` and lands at ``s_i + bytes / bandwidth``; a transfer's units go one
after another and the next transfer starts after its last. Layer by layer
(``pd_layerwise``, the default) ``r_i`` is when layer ``i`` of the request's
last prefill step ended (``SimExecutor.layer_ends``: earlier chunks' KV of
that layer is sent with it), else the first token's time; either way no
earlier than the decode side's allocation. Transfers are placed on the links
when the prefill step ends, in that order, so a transfer never overtakes one
placed before it. The decode instance starts decoding the request once its
last layer has landed and not before its first token exists; the prefill
instance releases the request's blocks then.

**Decode-side tiers.** A decode instance commits a received request's blocks
once they have landed and keeps them as any instance does: on its device
(a later turn decoded there sends only what is new) and, per the write policy,
on its host and storage tiers (``pd_decode_offload``; off, it has the device
alone). Its prefill never runs there, so without a pool shared with the
prefill instances those lower copies are never read, and they cost: every
decoded prompt is written to the decode instance's storage, which on a few
decode instances serving many prefill instances can fill the drive's write
bandwidth and, through the blocks those copies still read, hold decoding
back.

Times are exact arithmetic over the virtual clock; nothing here imports
simpy. Report: ``pd`` (bytes, transfer time, the part after prefill, the
wait between first token and decode start, link use) and a role per
instance row.
"""

from __future__ import annotations

import asyncio
import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.engine import Engine, RequestState
from kvflow.errors import ConfigError

ROLES = ("prefill", "decode")


def parse_pd(value: object) -> tuple[int, int]:
    """``"P:D"`` -> ``(P, D)``, both whole numbers >= 1; anything else a ``ConfigError``."""
    if not isinstance(value, str):
        raise ConfigError(f"pd must be a string 'P:D' (e.g. '2:2'), got {value!r}")
    parts = value.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"pd must be 'P:D' with P prefill and D decode instances as whole "
                          f"numbers (e.g. '2:2'), got {value!r}")
    p, d = (int(x) for x in parts)
    if p < 1 or d < 1:
        raise ConfigError(f"pd needs at least one prefill and one decode instance, got "
                          f"{value!r}")
    return p, d


@dataclass
class Transfer:
    """One request's way from its prefill instance to its decode instance (loop times)."""

    prefill: int
    decode: int
    origin: RequestState
    state: RequestState | None = None   # on the decode instance
    blocks: int = 0                     # sent (those the decode device lacked)
    reused: int = 0                     # prompt blocks the decode device already held
    asked_s: float = 0.0                # the step completing its prefill was scheduled
    alloc_s: float | None = None        # the decode instance admitted it (blocks allocated)
    first_token_s: float | None = None  # handed over by the prefill instance
    start_s: float | None = None        # its first layer started on the wire
    landed_s: float | None = None       # its last layer landed
    done: bool = False                  # landed and released
    left: bool = False                  # its decode side let it go (finished or refused)
    seq: int = 0                        # its place among the transfers (report order)


class _Folded:
    """What the report reads of the requests that left an instance, folded in as they
    leave (in that order), so that neither the engine nor this module keeps them: a
    prefill instance's hits, blocks, TTFT and admission waits; a decode instance's TPOT
    and waits for the KV. Per-request floats in arrays of C doubles."""

    __slots__ = ("blocks", "decode_wait", "hits", "queue", "requests", "tpot", "ttft")

    def __init__(self) -> None:
        self.requests = 0
        self.hits = [0, 0, 0]
        self.blocks = 0
        self.ttft, self.queue = array("d"), array("d")
        self.tpot, self.decode_wait = array("d"), array("d")

    def prefilled(self, st: RequestState) -> None:
        if st.first_token_s is None:
            return
        self.requests += 1
        for t in (0, 1, 2):
            self.hits[t] += st.hits[t]
        self.blocks += len(st.req.keys)
        self.ttft.append(st.first_token_s - st.req.arrival_s)
        self.queue.append(st.admit_s - st.req.arrival_s)

    def decoded(self, st: RequestState) -> None:
        if st.finish_s is None:
            return
        if st.generated > 1:
            self.tpot.append((st.finish_s - st.first_token_s)  # type: ignore[operator]
                             / (st.generated - 1))
        if st.decode_from_s is not None:
            self.decode_wait.append(st.decode_from_s - st.first_token_s)  # type: ignore[operator]


#: A transfer's figures once it is over (``Disaggregation._fold``): sent (1/0), blocks,
#: reused blocks, transfer s, after-prefill s, decode wait s (NaN: not decoded), alloc wait s.
_FIELDS = 7
_NAN = float("nan")


@dataclass
class Nic:
    """One instance's NIC: when each direction is free again, and its busy time."""

    free_s: float = 0.0
    busy_s: float = 0.0
    bytes: int = 0


def stream(ready: Sequence[float], unit_bytes: float, gb_per_s: float, latency_s: float,
           free_s: float) -> tuple[float, float, float]:
    """Serve one unit per entry of ``ready`` FIFO on a link free from ``free_s``:
    ``(first start, last landing, busy seconds)`` (module docstring)."""
    wire = unit_bytes / (gb_per_s * 1e9)
    first = None
    t = free_s
    for r in ready:
        s = max(t, r + latency_s)
        if first is None:
            first = s
        t = s + wire
    return (t if first is None else first), t, wire * len(ready)


class Disaggregation:
    """Hooks the prefill and decode engines together (see the module docstring)."""

    def __init__(self, cfg: Any, setup: Any, engines: Sequence[Engine], prefill: int,
                 finished: Callable[[int, RequestState], None]) -> None:
        """``finished(i, st)``: prefill instance ``i`` has let ``st`` go (the router's
        exact view)."""
        self.prefill = list(engines[:prefill])
        self.decode = list(engines[prefill:])
        self.layerwise: bool = cfg.pd_layerwise
        self.gb_per_s: float = cfg.pd_gb_per_s
        self.latency_s: float = cfg.pd_latency_s
        self.layer_bytes: int = setup.spec.bytes_per_layer_block
        self.num_layers: int = setup.spec.num_layers
        self.block_tokens: int = setup.spec.block_tokens
        self.tx = [Nic() for _ in self.prefill]
        self.rx = [Nic() for _ in self.decode]
        self.decode_blocks = [0] * len(self.decode)
        #: Transfers under way, by their prefill-side state; one that is over (landed and
        #: released, its decode side gone) is folded into ``_over`` at its ``seq`` and
        #: let go, with both its requests' states.
        self._by_origin: dict[RequestState, Transfer] = {}
        self._count = 0
        self._over = array("d")
        #: Per instance (prefill first), what its requests left behind (``_Folded``).
        self._folded = [_Folded() for _ in engines]
        self._finished = finished
        self._closing = False
        self._loop = asyncio.get_running_loop()
        for i, e in enumerate(self.prefill):
            e.on_last_chunk = lambda st, i=i: self._prefill_ending(i, st)
            e.handover = lambda st, i=i: self._handed_over(i, st)
            e.on_finish = self._chain(self._folded[i].prefilled,
                                      self._chain(e.on_finish, lambda st: self._maybe_close()))
        for j, e in enumerate(self.decode):
            e.on_admit = self._chain(e.on_admit, lambda st, j=j: self._decode_admitted(j, st))
            e.on_finish = self._chain(self._folded[prefill + j].decoded, self._chain(
                lambda st, j=j: self._decode_finished(j, st), e.on_finish))

    @staticmethod
    def _chain(first: Callable[[RequestState], None] | None,
               then: Callable[[RequestState], None] | None) -> Callable[[RequestState], None]:
        def hook(st: RequestState) -> None:
            if first is not None:
                first(st)
            if then is not None:
                then(st)
        return hook

    def _blocks(self, st: RequestState) -> int:
        """Device blocks a request holds while decoding: prompt and output, or its keys."""
        req = st.req
        return max(len(req.keys), math.ceil((req.input_len + req.output_len) / self.block_tokens))

    # -- the request's way ---------------------------------------------------------------
    def _prefill_ending(self, i: int, st: RequestState) -> None:
        if st in self._by_origin or st.req.output_len <= 1:
            return  # its step failed and runs again; or nothing to decode elsewhere
        j = min(range(len(self.decode)), key=lambda k: (self.decode_blocks[k], k))
        rec = Transfer(i, j, st, asked_s=self._loop.time(), seq=self._count)
        self._count += 1
        self._over.extend((0.0, 0.0, 0.0, _NAN, _NAN, _NAN, _NAN))
        self._by_origin[st] = rec
        self.decode_blocks[j] += self._blocks(st)
        rec.state = self.decode[j].receive(st.req, st)  # on_admit may have run inside

    def _decode_admitted(self, j: int, st: RequestState) -> None:
        rec = self._by_origin[st.origin]  # type: ignore[index]
        rec.state = st
        rec.alloc_s = self._loop.time()
        rec.blocks = self.decode[j].missing_blocks(st)
        rec.reused = math.ceil(st.req.input_len / self.block_tokens) - rec.blocks
        if rec.first_token_s is not None:
            self._place(rec)

    def _handed_over(self, i: int, st: RequestState) -> None:
        rec = self._by_origin[st]
        rec.first_token_s = st.first_token_s
        if rec.state is not None and rec.state.error is not None:
            self._release(rec)  # the decode instance refused it
        elif rec.alloc_s is not None:
            self._place(rec)
        self._maybe_close()

    def _place(self, rec: Transfer) -> None:
        """Put ``rec`` on its two NICs (both layers' readiness known now) and schedule its
        landing."""
        now = self._loop.time()
        assert rec.first_token_s is not None and rec.alloc_s is not None
        ends = rec.origin.layer_ends if self.layerwise else None
        if not ends:
            ends = [rec.first_token_s] * self.num_layers
        ready = [max(e, rec.alloc_s) for e in ends]
        tx, rx = self.tx[rec.prefill], self.rx[rec.decode]
        if rec.blocks:
            unit = rec.blocks * self.layer_bytes
            rec.start_s, rec.landed_s, busy = stream(
                ready, unit, self.gb_per_s, self.latency_s, max(tx.free_s, rx.free_s))
            tx.free_s = rx.free_s = rec.landed_s
            for nic in (tx, rx):
                nic.busy_s += busy
                nic.bytes += unit * len(ready)
        else:  # the decode device held the whole prompt: nothing to send
            rec.start_s = rec.landed_s = max(ready)
        at = max(rec.landed_s, rec.first_token_s)
        if at <= now:
            self._landed(rec)
        else:
            self._loop.call_at(at, self._landed, rec)

    def _landed(self, rec: Transfer) -> None:
        self._release(rec)
        self.decode[rec.decode].landed(rec.state)  # type: ignore[arg-type]

    def _release(self, rec: Transfer) -> None:
        rec.done = True
        self.prefill[rec.prefill].release(rec.origin)
        self._folded[rec.prefill].prefilled(rec.origin)  # (release calls no on_finish)
        self._finished(rec.prefill, rec.origin)
        if rec.left:
            self._fold(rec)
        self._maybe_close()

    def _decode_finished(self, j: int, st: RequestState) -> None:
        self.decode_blocks[j] -= self._blocks(st)
        rec = self._by_origin.get(st.origin)  # type: ignore[arg-type]
        if rec is None:
            return
        rec.left = True
        if st.error is not None and not rec.done and rec.first_token_s is not None:
            self._release(rec)  # refused after the prefill handed it over (folds it)
        elif rec.done:
            self._fold(rec)

    def _fold(self, rec: Transfer) -> None:
        """``rec`` is over (released, its decode side gone): its figures to ``_over``."""
        del self._by_origin[rec.origin]
        self._over[rec.seq * _FIELDS:(rec.seq + 1) * _FIELDS] = array("d", _figures(rec))

    # -- the end -------------------------------------------------------------------------
    def close(self) -> None:
        """No more arrivals: prefill instances close now, decode instances once no
        prefill instance has a request that may still reach them."""
        for e in self.prefill:
            e.close()
        self._closing = True
        self._maybe_close()

    def _maybe_close(self) -> None:
        if self._closing and all(not e.waiting and not e.running for e in self.prefill):
            for e in self.decode:
                e.close()

    # -- the report ------------------------------------------------------------------------
    def report(self, sim_time: float, summary: Callable[[list[float]], Any]) -> dict[str, Any]:
        """The ``pd`` section (``summary``: the report's percentile summary)."""
        span = sim_time if sim_time > 0 else 1.0
        over = self._over
        for rec in self._by_origin.values():  # still under way: their figures as they stand
            over[rec.seq * _FIELDS:(rec.seq + 1) * _FIELDS] = array("d", _figures(rec))
        # In the transfers' order: sent ones, those that moved blocks, those decoded.
        sent, blocks, reused = over[0::_FIELDS], over[1::_FIELDS], over[2::_FIELDS]
        transfer_s, after_s = over[3::_FIELDS], over[4::_FIELDS]
        decode_s, alloc_s = over[5::_FIELDS], over[6::_FIELDS]
        n = len(sent)
        moved = [i for i in range(n) if sent[i] and blocks[i]]
        moved_blocks = sum(int(blocks[i]) for i in moved)
        out: dict[str, Any] = {
            "prefill_instances": len(self.prefill), "decode_instances": len(self.decode),
            "layerwise": self.layerwise, "gb_per_s": self.gb_per_s,
            "latency_s": self.latency_s,
            "requests": sum(1 for x in sent if x), "transfers": len(moved),
            "bytes": moved_blocks * self.layer_bytes * self.num_layers,
            "blocks": moved_blocks,
            "reused_blocks": sum(int(reused[i]) for i in range(n) if sent[i]),
            "transfer_s": summary(array("d", [transfer_s[i] for i in moved])),
            "after_prefill_s": summary(array("d", [after_s[i] for i in moved])),
            "decode_wait_s": summary(array("d", [decode_s[i] for i in range(n)
                                                 if sent[i] and decode_s[i] == decode_s[i]])),
            "decode_alloc_wait_s": summary(array("d", [alloc_s[i] for i in range(n)
                                                       if sent[i]])),
            "nic_utilization": {
                "prefill_tx": sum(min(1.0, n.busy_s / span) for n in self.tx) / len(self.tx),
                "decode_rx": sum(min(1.0, n.busy_s / span) for n in self.rx) / len(self.rx)},
        }
        return out

    def rows(self, rows: list[dict[str, Any]], summary: Callable[[list[float]], Any],
             hit_rates: Callable[[list[int], int], dict[str, float]]) -> list[dict[str, Any]]:
        """The per-instance rows with their role; a prefill row counts the requests it
        prefilled (handed over or finished there), a decode row those it decoded."""
        n = len(self.prefill)
        for i, row in enumerate(rows):
            role = ROLES[0] if i < n else ROLES[1]
            row["role"] = role
            f = self._folded[i]
            if role == "prefill":
                row["requests"] = f.requests
                row["hit_rate"] = hit_rates(list(f.hits), f.blocks)
                row["ttft_s"] = summary(f.ttft)
                row["queue_s"] = summary(f.queue)
                row["pd_bytes_sent"] = self.tx[i].bytes
            else:
                row["tpot_s"] = summary(f.tpot)
                row["decode_wait_s"] = summary(f.decode_wait)
                row["pd_bytes_received"] = self.rx[i - n].bytes
        return rows



def _figures(rec: Transfer) -> tuple[float, ...]:
    """``rec``'s row of ``Disaggregation._over`` (see ``_FIELDS``)."""
    if rec.landed_s is None:
        return (0.0, 0.0, 0.0, _NAN, _NAN, _NAN, _NAN)
    first = rec.first_token_s
    st = rec.state
    decode = _NAN if st is None or st.decode_from_s is None else st.decode_from_s - first  # type: ignore[operator]
    return (1.0, float(rec.blocks), float(rec.reused),
            rec.landed_s - rec.start_s, max(0.0, rec.landed_s - first),  # type: ignore[operator]
            decode, rec.alloc_s - rec.asked_s)  # type: ignore[operator]
