"""Finished requests folded into a replay's report as they finish, and then let go.

A replay of a day's trace finishes millions of requests; keeping each one's
state (its plan, its transfer tasks with their per-layer times) until the
report is built made memory grow ~12 KB per request. ``Finished`` keeps only
what the report needs: one float per request and metric (TTFT, end-to-end,
TPOT, admission wait, arrival) in arrays of C doubles, in finish order, so
percentiles and means are exact and the same, bit for bit, as computed from
the requests themselves; integer sums (hits, blocks, tokens); and per sampling
interval, the blocks and hits of the requests that arrived in it (in arrays of
C integers, a chunk of intervals each: a dict of lists per interval cost ~280
bytes an interval and instance). The report's queue-growth and SLO figures read
these arrays as they are (no list of pairs or of floats per request).

``RequestsCsv`` streams one row per finished (or rejected) request to disk, if
asked (``run_replay(..., requests_csv=PATH)``), instead of keeping them.
"""

from __future__ import annotations

import csv
import math
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from kvflow.engine import RequestState

__all__ = ["CSV_COLUMNS", "Finished", "RequestsCsv"]

_NAN = float("nan")
#: Sampling intervals per chunk of ``Finished``'s per-interval counts (a power of two).
CHUNK = 8
_SHIFT = CHUNK.bit_length() - 1
_MASK = CHUNK - 1


class Finished:
    """Per-metric float arrays and sums over the requests an engine finished.

    ``start`` is the loop time of the first arrival (the report counts from it);
    ``interval`` the sampler's, for the per-interval hit rates.
    """

    def __init__(self, start: float, interval: float) -> None:
        self.start = start
        self.interval = interval
        self.ttft = array("d")
        self.e2e = array("d")
        self.tpot = array("d")      # requests with more than one output token
        self.tpot_all = array("d")  # every request, NaN where it has no TPOT
        self.wait = array("d")      # admission wait
        self.arrival = array("d")
        self.hits = [0, 0, 0]
        self.blocks = 0
        self.out_tokens = 0
        self.in_tokens = 0
        #: chunk of ``CHUNK`` intervals -> for each, [blocks, device, host, storage hits]
        self._chunks: dict[int, array[int]] = {}

    def __len__(self) -> int:
        return len(self.ttft)

    def add(self, st: RequestState) -> None:
        """Fold one request that finished (``finish_s`` set) in; ignore a rejected one."""
        if st.finish_s is None:
            return
        start = self.start
        req = st.req
        first = st.first_token_s - start  # type: ignore[operator]
        finish = st.finish_s - start
        arrival = req.arrival_s
        self.ttft.append(first - arrival)
        self.e2e.append(finish - arrival)
        if st.generated > 1:
            t = (finish - first) / (st.generated - 1)
            self.tpot.append(t)
            self.tpot_all.append(t)
        else:
            self.tpot_all.append(_NAN)
        self.wait.append((st.admit_s - start) - arrival)
        self.arrival.append(arrival)
        h = st.hits
        hits = self.hits
        hits[0] += h[0]
        hits[1] += h[1]
        hits[2] += h[2]
        n = len(req.keys)
        self.blocks += n
        self.out_tokens += st.generated
        self.in_tokens += req.input_len
        b = math.floor(arrival / self.interval)
        c = b >> _SHIFT
        chunk = self._chunks.get(c)
        if chunk is None:
            chunk = self._chunks[c] = array("q", bytes(8 * 4 * CHUNK))
        i = (b & _MASK) << 2
        chunk[i] += n
        chunk[i + 1] += h[0]
        chunk[i + 2] += h[1]
        chunk[i + 3] += h[2]

    def by_interval(self) -> Iterator[tuple[int, array[int]]]:
        """``(interval index, [blocks, device hits, host hits, storage hits])`` for every
        interval some request arrived in (and, with zeros, others of its chunk)."""
        for c, chunk in self._chunks.items():
            for j in range(CHUNK):
                row = chunk[4 * j:4 * j + 4]
                if any(row):
                    yield (c << _SHIFT) | j, row

    def tpot_or_none(self) -> Iterator[float | None]:
        """Each request's TPOT in finish order, None where it has none (one at a time)."""
        return (None if x != x else x for x in self.tpot_all)

    def queue_growth(self) -> tuple[float, float] | None:
        """``kvflow.replay.load.queue_growth`` of the ``(arrival, wait)`` pairs, the same
        floats (sorted by arrival then wait, summed in that order by ``sum``), without a
        list of pairs."""
        n = len(self.wait)
        if n < 8:
            return None
        order = np.lexsort((np.frombuffer(self.wait), np.frombuffer(self.arrival)))
        waits = np.frombuffer(self.wait)[order]
        q = n // 4
        first = sum(array("d", waits[:q].tobytes())) / q
        last = sum(array("d", waits[n - q:].tobytes())) / q
        return first, last


def merged(parts: list[Finished]) -> Finished:
    """One instance's aggregate, or several concatenated in instance order (a cluster's:
    the arrays in the order the report always listed the instances' requests)."""
    if len(parts) == 1:
        return parts[0]
    out = Finished(parts[0].start, parts[0].interval)
    for p in parts:
        for name in ("ttft", "e2e", "tpot", "tpot_all", "wait", "arrival"):
            getattr(out, name).extend(getattr(p, name))
        for t in (0, 1, 2):
            out.hits[t] += p.hits[t]
        out.blocks += p.blocks
        out.out_tokens += p.out_tokens
        out.in_tokens += p.in_tokens
        for c, chunk in p._chunks.items():
            mine = out._chunks.get(c)
            if mine is None:
                out._chunks[c] = array("q", chunk)
            else:
                for i in range(4 * CHUNK):
                    mine[i] += chunk[i]
    return out


#: Columns of ``RequestsCsv``: times in seconds from the first arrival.
CSV_COLUMNS = ("request_id", "instance", "arrival_s", "admit_s", "first_token_s", "finish_s",
               "ttft_s", "e2e_s", "input_tokens", "output_tokens", "blocks", "hits_device",
               "hits_host", "hits_storage", "error")


class RequestsCsv:
    """One CSV row per request as it leaves (finished or rejected), written as it goes."""

    def __init__(self, path: str | Path) -> None:
        self._f: IO[str] = open(path, "w", newline="")  # noqa: SIM115 (closed by close())
        self._w = csv.writer(self._f)
        self._w.writerow(CSV_COLUMNS)

    def writer(self, instance: int, start: float) -> Callable[[RequestState], None]:
        """The ``on_finish`` hook of one engine instance."""
        w = self._w

        def row(st: RequestState) -> None:
            req = st.req
            if st.finish_s is None:  # rejected
                w.writerow((req.request_id, instance, req.arrival_s, "", "", "", "", "",
                            req.input_len, req.output_len, len(req.keys), "", "", "",
                            st.error or ""))
                return
            first = st.first_token_s - start  # type: ignore[operator]
            finish = st.finish_s - start
            w.writerow((req.request_id, instance, req.arrival_s, st.admit_s - start, first,
                        finish, first - req.arrival_s, finish - req.arrival_s, req.input_len,
                        st.generated, len(req.keys), *st.hits, ""))

        return row

    def close(self) -> None:
        self._f.close()


def as_list(values: Any) -> list[float]:
    """An array of doubles as a list of floats (what the report's JSON holds)."""
    return values.tolist()
