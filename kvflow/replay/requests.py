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

    ``count=False`` leaves the up-front pass out: the first pass that reads the whole
    source records the numbers as it goes (a cache-mode replay needs nothing before
    it starts, so it reads the trace once), and anything that asks for them or the
    length before then gets a pass of its own. ``on_counted`` is called once, right
    after the first whole pass (what the source counted on its way: skipped lines).
    """

    def __init__(self, source: Iterable[Any], keys_of: Callable[[Any], tuple[Hashable, ...]],
                 *, count: bool = True, on_counted: Callable[[], None] | None = None) -> None:
        self._source = source
        self._keys_of = keys_of
        self._numbers: tuple[array[float], array[int], array[int]] | None = None
        self._on_counted = on_counted
        if count:
            self._count()

    def _count(self) -> tuple[array[float], array[int], array[int]]:
        if self._numbers is None:
            arrival_s, input_len, output_len = array("d"), array("q"), array("q")
            for req in self._source:
                arrival_s.append(req.arrival_s)
                input_len.append(req.input_len)
                output_len.append(req.output_len)
            self._counted(arrival_s, input_len, output_len)
        return self._numbers  # type: ignore[return-value]

    def _counted(self, *numbers: array[Any]) -> None:
        self._numbers = numbers  # type: ignore[assignment]
        if self._on_counted is not None:
            self._on_counted()
            self._on_counted = None

    @property
    def arrival_s(self) -> array[float]:
        return self._count()[0]

    @property
    def input_len(self) -> array[int]:
        return self._count()[1]

    @property
    def output_len(self) -> array[int]:
        return self._count()[2]

    def __len__(self) -> int:
        return len(self._count()[0])

    def __iter__(self) -> Iterator[EngineRequest]:
        if self._numbers is None:
            return self._first_pass()
        return self._pass()

    def _first_pass(self) -> Iterator[EngineRequest]:
        """A pass that records the numbers, kept if it reads the whole source."""
        keys_of = self._keys_of
        arrival_s, input_len, output_len = array("d"), array("q"), array("q")
        for req in self._source:
            arrival_s.append(req.arrival_s)
            input_len.append(req.input_len)
            output_len.append(req.output_len)
            yield EngineRequest(req.index, req.arrival_s, keys_of(req), req.input_len,
                                req.output_len)
        if self._numbers is None:
            self._counted(arrival_s, input_len, output_len)

    def _pass(self) -> Iterator[EngineRequest]:
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
