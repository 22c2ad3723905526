"""Host layouts: how the pinned host pool orders a block's layers and roles, chosen per run.

Why more than one: the device keeps each (layer, role) as its own buffer, as
the engine's attention kernels need it, and ``layer_major`` mirrors that on
the host, so a block of one layer and one role is one piece of 16-32 KB: too
small for the copy engine (microseconds per descriptor) and at the limit of
what SMs can pull over PCIe. Keeping a block's layers together on the host
makes the pieces larger and fewer, at the cost of layer-wise granularity:
a piece of G layers lands as a whole, so layers of a group become usable
together. (vLLM's CPU offloading keeps a block's layers together; SGLang's
HiCache offers ``layer_first`` and ``page_first`` for the same trade.)

The layouts, for ``L`` layers, ``R`` roles and ``N`` host blocks:

* ``layer_major`` (the default, today's): one buffer region per role,
  ``[role][layer][block][role bytes]``; a piece is one role of one layer of
  one block. Layer futures resolve one layer at a time.
* ``grouped:G``: layers in groups of ``G`` (the last group may be shorter),
  ``[group][block][layer in group][role][role bytes]``; a piece is one block's
  ``G`` layers, every role, contiguous. Layers of a group resolve together.
  Consecutive host ids of one group are adjacent, so a run of them is one
  piece.
* ``block_major``: ``grouped:L``, ``[block][layer][role][role bytes]``; a
  piece is a whole block, which is also the order a block store keeps a block
  in (``kvflow.host_memory``), so stores read and write it in place.

This module is the pure arithmetic (parse, groups, byte offsets, pieces) that
both worlds and the tests share; the core knows a layout only as a config
value and the grouping of layer futures.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from kvflow.errors import ConfigError

#: The layout names ``parse`` takes (``grouped`` needs ``:G``).
HOST_LAYOUTS = ("layer_major", "block_major", "grouped:G")
DEFAULT_HOST_LAYOUT = "layer_major"


@dataclass(frozen=True)
class HostLayout:
    """A parsed host layout: ``kind`` and, for ``grouped``, ``group`` layers per piece."""

    kind: str
    group: int = 0

    @classmethod
    def parse(cls, text: str | HostLayout) -> HostLayout:
        """``layer_major``, ``block_major`` or ``grouped:G`` (G >= 1), else ``ConfigError``."""
        if isinstance(text, HostLayout):
            return text
        if not isinstance(text, str):
            raise ConfigError(f"host_layout must be a string, one of {', '.join(HOST_LAYOUTS)}; "
                              f"got {text!r}")
        t = text.strip()
        if t in ("layer_major", "block_major"):
            return cls(t)
        kind, sep, g = t.partition(":")
        if kind == "grouped":
            if not sep or not g.strip().isdigit() or int(g) < 1:
                raise ConfigError(f"host_layout {text!r}: grouped needs a group size, an "
                                  "integer >= 1 (layers per piece), as in 'grouped:4'")
            return cls("grouped", int(g))
        raise ConfigError(f"unknown host_layout {text!r}; valid: {', '.join(HOST_LAYOUTS)}")

    def __str__(self) -> str:
        return f"grouped:{self.group}" if self.kind == "grouped" else self.kind

    @property
    def block_contiguous(self) -> bool:
        """Whether a block's layers and roles are grouped per block (not per role)."""
        return self.kind != "layer_major"

    def group_size(self, num_layers: int) -> int:
        """Layers per group (per piece, per layer-future group) for a model of ``num_layers``."""
        if num_layers < 1:
            raise ConfigError(f"num_layers must be >= 1, got {num_layers}")
        if self.kind == "layer_major":
            return 1
        if self.kind == "block_major":
            return num_layers
        return min(self.group, num_layers)

    def groups(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        """``(first layer, layers)`` of each group, in order; they tile ``[0, num_layers)``."""
        g = self.group_size(num_layers)
        return tuple((a, min(g, num_layers - a)) for a in range(0, num_layers, g))


@dataclass(frozen=True)
class HostGeometry:
    """Byte offsets of a host pool of ``num_blocks`` blocks in one layout, in one buffer.

    ``role_bytes``: bytes of one block of one layer, per role (each a multiple of 16).
    """

    layout: HostLayout
    num_layers: int
    num_blocks: int
    role_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_blocks < 1 or not self.role_bytes:
            raise ConfigError("a host pool needs layers, blocks and roles")
        if any(b <= 0 for b in self.role_bytes):
            raise ConfigError(f"role bytes must be positive, got {self.role_bytes}")

    @cached_property
    def layer_bytes(self) -> int:
        """One block of one layer, every role."""
        return sum(self.role_bytes)

    @cached_property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.layer_bytes

    @cached_property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @cached_property
    def role_offsets(self) -> tuple[int, ...]:
        """Offset of each role inside one layer of a block (block-contiguous layouts)."""
        return tuple(itertools.accumulate(self.role_bytes, initial=0))[:-1]

    @cached_property
    def groups(self) -> tuple[tuple[int, int], ...]:
        return self.layout.groups(self.num_layers)

    @cached_property
    def group_bases(self) -> tuple[int, ...]:
        """Where each group's region starts (block-contiguous layouts)."""
        return tuple(self.num_blocks * self.layer_bytes * a for a, _ in self.groups)

    def group_of(self, layer: int) -> int:
        return layer // self.layout.group_size(self.num_layers)

    def offset(self, block: int, layer: int, role: int) -> int:
        """Byte offset of ``(block, layer, role)``'s ``role_bytes[role]`` bytes."""
        if not (0 <= block < self.num_blocks and 0 <= layer < self.num_layers
                and 0 <= role < len(self.role_bytes)):
            raise IndexError(f"(block {block}, layer {layer}, role {role}) outside the pool")
        if not self.layout.block_contiguous:
            role_base = self.num_layers * self.num_blocks * sum(self.role_bytes[:role])
            return role_base + (layer * self.num_blocks + block) * self.role_bytes[role]
        g = self.group_of(layer)
        first, count = self.groups[g]
        return (self.group_bases[g] + block * count * self.layer_bytes
                + (layer - first) * self.layer_bytes + self.role_offsets[role])

    def layer_role_bases(self) -> list[list[int]]:
        """``[layer][role]`` offset of block 0 (layer-major: block b adds ``b * role_bytes``)."""
        return [[self.offset(0, layer, r) for r in range(len(self.role_bytes))]
                for layer in range(self.num_layers)]

    def piece_bytes(self, group: int) -> int:
        """Bytes of one block's piece of ``group`` (block-contiguous layouts)."""
        return self.groups[group][1] * self.layer_bytes

    def piece_offset(self, block: int, group: int) -> int:
        """Offset of one block's piece of ``group`` (block-contiguous layouts)."""
        return self.group_bases[group] + block * self.piece_bytes(group)

    def pieces(self, blocks: Sequence[int], first_layer: int, count: int
               ) -> list[tuple[int, int]]:
        """``(offset, bytes)`` of the host pieces that hold ``blocks`` in layers
        ``[first_layer, first_layer + count)``, as a copy moves them (no coalescing).

        Layer-major: one per (layer, role, block); block-contiguous: the range must be
        whole groups, one per (group, block).
        """
        out: list[tuple[int, int]] = []
        if not self.layout.block_contiguous:
            for layer in range(first_layer, first_layer + count):
                for r, rb in enumerate(self.role_bytes):
                    out += [(self.offset(b, layer, r), rb) for b in blocks]
            return out
        for g, (a, n) in enumerate(self.groups):
            if a + n <= first_layer or a >= first_layer + count:
                continue
            if a < first_layer or a + n > first_layer + count:
                raise ValueError(f"layers [{first_layer}, {first_layer + count}) cut group {g} "
                                 f"[{a}, {a + n}) of {self.layout}")
            out += [(self.piece_offset(b, g), self.piece_bytes(g)) for b in blocks]
        return out

    def block_offset(self, block: int) -> int | None:
        """Offset of a whole block where it is one contiguous piece (``block_major``)."""
        if self.layout.kind == "block_major" or (
                self.layout.block_contiguous and len(self.groups) == 1):
            return block * self.bytes_per_block
        return None


def pieces_per_unit(layout: HostLayout | str, num_roles: int, blocks: int) -> int:
    """Contiguous host pieces one unit (a layer, or a group) of an op of ``blocks`` moves:
    what a link's per-piece cost multiplies (no coalescing of consecutive ids)."""
    lay = HostLayout.parse(layout)
    return blocks * (num_roles if not lay.block_contiguous else 1)
