"""A trace's requests as a replay reads them: streamed, not held.

A day's trace is millions of requests, each with its block keys; a list of
them costs ~1.2 KB a request before the replay has done anything. ``Requests``
reads its source once up front for what a replay needs of every request before
it starts (how many, their arrivals and lengths: the offered load, the cluster
size, the arrival clock), keeps those as arrays of numbers, and reads the source
again, request by request, while the replay feeds them, so only the requests
in flight exist at a time.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any, overload

from kvflow.engine import EngineRequest

__all__ = ["Requests"]


class Requests(Sequence[EngineRequest]):
    """Engine requests made from ``source`` (a trace or a view of one, readable again) by
    ``keys_of`` (a request's block keys), one pass per iteration.

    ``arrival_s``, ``input_len`` and ``output_len`` hold every request's numbers, in
    order. Indexing reads the source up to the index (for tests and small traces).
    """

    def __init__(self, source: Iterable[Any], keys_of: Callable[[Any], tuple[Hashable, ...]]
                 ) -> None:
        self._source = source
        self._keys_of = keys_of
        self.arrival_s = array("d")
        self.input_len = array("q")
        self.output_len = array("q")
        for req in source:
            self.arrival_s.append(req.arrival_s)
            self.input_len.append(req.input_len)
            self.output_len.append(req.output_len)

    def __len__(self) -> int:
        return len(self.arrival_s)

    def __iter__(self) -> Iterator[EngineRequest]:
        keys_of = self._keys_of
        n = len(self)
        for i, req in enumerate(self._source):
            if i >= n:  # the source grew since it was counted: stop where the count did
                return
            yield EngineRequest(req.index, req.arrival_s, keys_of(req), req.input_len,
                                req.output_len)

    @overload
    def __getitem__(self, i: int) -> EngineRequest: ...

    @overload
    def __getitem__(self, i: slice) -> list[EngineRequest]: ...

    def __getitem__(self, i: int | slice) -> EngineRequest | list[EngineRequest]:
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"request {i} out of range ({n} requests)")
        for k, req in enumerate(self):
            if k == j:
                return req
        raise IndexError(f"request {i}: the trace changed since it was read")


def numbers(requests: Sequence[EngineRequest]) -> tuple[Sequence[float], Sequence[int],
                                                         Sequence[int]]:
    """Arrivals, prompt and output lengths of ``requests``, without reading them again
    where they are ``Requests``."""
    if isinstance(requests, Requests):
        return requests.arrival_s, requests.input_len, requests.output_len
    return ([r.arrival_s for r in requests], [r.input_len for r in requests],
            [r.output_len for r in requests])
