"""The infinite prefix cache: which prompt tokens of a trace any cache could have served.

Both the trace statistics (the hit ceiling) and the offered load (the new,
uncached prompt tokens per second a cluster must prefill at the very least)
need the same accounting, so it lives here once: a block is a hit if its id
was seen in an earlier prompt (or earlier in the same one), and a hit block
counts its own tokens (``block_tokens``, or what the prompt's partial last
block holds).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from traces.chain import BlockChainer
from traces.schema import Request

__all__ = ["InfiniteCache"]


class InfiniteCache:
    """Every block id ever seen, and the token hits that implies.

    Requests with block ids use them as they are; requests that carry only
    token ids are chained here into exact prefix ids of their own namespace
    (``("t", id)``: they never meet trace ids); lengths-only requests get
    unique ids (``("u", n)``), so they never hit.
    """

    __slots__ = ("_chainer", "_unique", "block_tokens", "seen")

    def __init__(self, block_tokens: int) -> None:
        if type(block_tokens) is not int or block_tokens <= 0:
            raise ValueError(f"block_tokens must be a positive integer, got {block_tokens!r}")
        self.block_tokens = block_tokens
        self.seen: set[Hashable] = set()
        self._chainer: BlockChainer | None = None
        self._unique = 0

    def ids(self, req: Request) -> Sequence[Hashable]:
        """The ids of ``req``'s prompt blocks, as this cache keys them."""
        if req.block_hashes is not None:
            return req.block_hashes
        if req.token_ids is not None:
            self._chainer = self._chainer or BlockChainer()
            return [("t", h) for h in self._chainer.chain_tokens(req.token_ids, self.block_tokens)]
        n = -(-req.input_len // self.block_tokens)
        first = self._unique
        self._unique += n
        return [("u", first + k) for k in range(n)]

    def admit(self, req: Request, ids: Sequence[Hashable] | None = None) -> int:
        """Prompt tokens of ``req`` found in the cache; its blocks are in the cache afterwards.

        ``ids`` is ``self.ids(req)`` when the caller already has them (call
        :meth:`ids` once per request: lengths-only requests get fresh ids each time).
        """
        if ids is None:
            ids = self.ids(req)
        bt = self.block_tokens
        seen = self.seen
        last = -(-req.input_len // bt) - 1
        hit = 0
        for j, h in enumerate(ids):
            if h in seen:
                hit += bt if j < last else req.input_len - j * bt
            else:
                seen.add(h)
        return hit
