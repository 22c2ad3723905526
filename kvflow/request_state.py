"""A request as the engine sees it (``EngineRequest``), its state while the engine
holds it (``RequestState``), the engine's settings (``EngineConfig``) and counters
(``EngineStats``).

Kept apart from ``kvflow.engine`` because the executors, the handover and the
cluster pieces read these without the loop that drives them.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from kvflow.errors import ConfigError
from kvflow.plans import Plan, Reservation
from kvflow.runtime import TransferTask


@dataclass(frozen=True)
class EngineRequest:
    """What the engine needs of a request: its block keys and its lengths."""

    request_id: Hashable
    arrival_s: float
    keys: tuple[Hashable, ...]
    input_len: int
    output_len: int


@dataclass(frozen=True)
class EngineConfig:
    block_tokens: int
    max_batch_tokens: int = 8192
    max_running: int = 256

    def __post_init__(self) -> None:
        for name in ("block_tokens", "max_batch_tokens", "max_running"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"EngineConfig.{name} must be positive")

@dataclass(eq=False)
class RequestState:
    req: EngineRequest
    plan: Plan | None = None
    tasks: list[TransferTask] = field(default_factory=list)     # everything a step waits on
    shared: list[TransferTask] = field(default_factory=list)    # other requests' loads
    prefetch: list[TransferTask] = field(default_factory=list)
    prefetched: frozenset = frozenset()  # keys brought up from storage at arrival
    reservation: Reservation | None = None
    ready: bool = False             # prefetch settled, may be scheduled
    held: bool = False              # held back from outside (kvflow.pd: its KV is on its way)
    waited: bool = False            # its loads have been waited for by a step
    prefilled: int = 0              # prompt tokens whose KV exists
    #: Output tokens so far; while decoding, brought up to date when the request
    #: finishes or a per-request batch lists it (the engine counts steps instead).
    generated: int = 0
    admit_s: float = 0.0
    first_token_s: float | None = None
    finish_s: float | None = None
    hits: tuple[int, int, int] = (0, 0, 0)
    error: str | None = None
    # Prefill/decode disaggregation (kvflow.handover): the request's state on the engine
    # that prefilled it; when each layer of its last prefill step ended (prefill side);
    # when its KV was in place to decode (decode side).
    origin: RequestState | None = None
    layer_ends: list[float] | None = None
    decode_from_s: float | None = None
    seq: int = field(default=0, repr=False)       # admission order (running order)
    computing0: int = field(default=0, repr=False)  # len(plan.computing) when planned
    dstep0: int = field(default=0, repr=False)    # decode step count at its first token


@dataclass
class EngineStats:
    admitted: int = 0
    finished: int = 0
    rejected: int = 0
    replans: int = 0
    aborted: int = 0
    handed_over: int = 0
    steps: int = 0
    recomputed_tokens: int = 0
