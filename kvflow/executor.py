"""What one engine step hands the world's compute (``StepBatch``) and what that
compute must do with it (``ComputeExecutor``, ``MultiStepExecutor``).

The engine is written once for both worlds; these are the seam between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvflow.request_state import RequestState
from kvflow.runtime import TransferTask


@dataclass
class StepBatch:
    """One step's work: prefill chunks and decode tokens.

    ``prefill`` items are ``(new_tokens, context_tokens_before)``; ``decode``
    items are the context lengths of the decoding requests. ``decode_count`` and
    ``decode_context_sum`` are their number and sum (from ``decode`` when not
    given); an executor with ``per_request = False`` gets only these, not the list.
    """

    prefill: list[tuple[int, int]] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)
    #: The request of each item: decodes first, then prefills, in the order of
    #: ``decode`` and ``prefill``. An executor that computes real data (the GPU
    #: one) reads block tables and tokens from these; the simulated one ignores them.
    requests: list[RequestState] = field(default_factory=list)
    decode_count: int = -1
    decode_context_sum: int = 0

    def __post_init__(self) -> None:
        if self.decode_count < 0:
            self.decode_count = len(self.decode)
            self.decode_context_sum = sum(self.decode)

    @property
    def tokens(self) -> int:
        return sum(n for n, _ in self.prefill) + self.decode_count


class ComputeExecutor(Protocol):
    """Runs one step's compute; the world-specific half of the engine."""

    async def run_step(self, batch: StepBatch, waits: Sequence[TransferTask]) -> None:
        """Compute ``batch``; layer i may start only once layer i of each wait landed.

        Raises ``TransferError`` if a wait failed; the engine then redoes the
        step for the affected requests.
        """
        ...


class MultiStepExecutor(ComputeExecutor, Protocol):
    """An executor that can run several pure-decode steps as one (the simulator)."""

    async def run_decode_steps(self, count: int, context_sum: int, max_steps: int,
                               until: float | None) -> int:
        """Run up to ``max_steps`` decode steps of ``count`` sequences whose contexts sum
        to ``context_sum`` in the first (and grow by one each a step).

        Stops after the step that ends at or past ``until`` (loop time), always
        running at least one; returns how many ran.
        """
        ...

    def cut_decode_steps(self, until: float) -> None:
        """End the run in progress after the step that ends at or past ``until``."""
        ...
