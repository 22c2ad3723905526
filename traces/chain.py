"""Exact prefix-chained block ids, without hashing.

Mooncake traces identify a block by an integer that is shared only between
prompts with the same whole prefix up to and including that block. The
generators (which know a prompt as a list of content segments) and the
statistics (which may be handed token ids) need the same kind of ids; a dict
from ``(parent id, block content)`` to a fresh integer gives them exactly,
with no collision to reason about.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


class BlockChainer:
    """Assigns prefix-chained block ids: same parent and same content -> same id.

    ``next_id`` is the first id handed out; ids grow by one per new block, so a
    trace's ids are dense and non-negative (the Mooncake convention).
    """

    __slots__ = ("_table", "next_id")

    def __init__(self, next_id: int = 0) -> None:
        self._table: dict[tuple[int, Hashable], int] = {}
        self.next_id = next_id

    def __len__(self) -> int:
        return len(self._table)

    def chain(self, contents: Sequence[Hashable]) -> tuple[int, ...]:
        """Ids for a prompt whose blocks have ``contents`` (one hashable per block, in order)."""
        table = self._table
        parent = -1
        out = []
        for content in contents:
            key = (parent, content)
            bid = table.get(key)
            if bid is None:
                bid = self.next_id
                self.next_id += 1
                table[key] = bid
            out.append(bid)
            parent = bid
        return tuple(out)

    def chain_tokens(self, token_ids: Sequence[int], block_tokens: int) -> tuple[int, ...]:
        """Ids for a prompt given as tokens, cut into ``block_tokens`` blocks (last partial)."""
        toks = tuple(token_ids)
        return self.chain([toks[i : i + block_tokens] for i in range(0, len(toks), block_tokens)])

    def chain_segments(
        self, segments: Sequence[tuple[int, int]], block_tokens: int
    ) -> tuple[int, ...]:
        """Ids for a prompt given as ``(segment id, length)`` pieces of distinct content.

        A block's content is the tuple of ``(segment, start, end)`` slices it
        covers, so the cost is per block, not per token: a 100k-token agent
        context costs 200 dict look-ups, not 100k tokens.
        """
        contents: list[tuple[tuple[int, int, int], ...]] = []
        cur: list[tuple[int, int, int]] = []
        room = block_tokens
        for seg, length in segments:
            pos = 0
            while pos < length:
                take = min(room, length - pos)
                cur.append((seg, pos, pos + take))
                pos += take
                room -= take
                if room == 0:
                    contents.append(tuple(cur))
                    cur = []
                    room = block_tokens
        if cur:
            contents.append(tuple(cur))
        return self.chain(contents)
