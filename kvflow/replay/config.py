"""What a replay depends on (``ReplayConfig``) and what it resolves to (``Setup``).

Field names of ``ReplayConfig`` are ``kvflow sweep --param`` names, and every
field is checked here, at construction, so a bad value fails with its name
before any trace is read.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvflow.engine import EngineRequest
from kvflow.errors import ConfigError
from kvflow.hashing import BlockHasher, ExtraKeys
from kvflow.layout import ModelSpec, preset
from kvflow.manager import CacheManager, Capacities
from kvflow.policy import PrefetchPolicy, WritePolicy
from kvflow.profile import GpuProfile, load_profile
from kvflow.replay.requests import Requests
from kvflow.world import WORLDS, TierRequest, World, default_capacities
from traces import Request, open_trace, sample_path
from traces.reshape import bound, poisson_arrivals, rate_scale

MODES = ("full", "cache")
#: Worlds a full replay runs in (``kvflow.world.WORLDS``): the simulator, or a real GPU.
BACKENDS = tuple(WORLDS)
#: Compute of the cuda world (``kernels.fast``): "fast" (cuBLAS + FlashAttention-style, the
#: default) or "exact" (batch-invariant, bit-identical whatever the batching).
EXECUTORS = ("fast", "exact")


@dataclass
class ReplayConfig:
    """Everything a replay depends on; field names are ``kvflow sweep --param`` names."""

    trace: str | None = None
    model: str = "llama-3-8b"
    profile: str = "h100"
    device_blocks: int | None = None
    host_blocks: int | None = None
    storage_blocks: int | None = None
    device_gb: float | None = None
    host_gb: float | None = None
    storage_gb: float | None = None
    eviction: str = "lru"
    write_policy: str = "write_through"
    write_threshold: int = 1
    prefetch_policy: str = "best_effort"
    mode: str = "full"
    seed: int = 0
    limit: int | None = None
    max_batch_tokens: int = 8192
    max_running: int = 256
    sample_interval_s: float = 10.0
    skip_bad: bool = False
    backend: str = "sim"
    # -- a cluster of instances (kvflow.cluster) ---------------------------------------------
    #: Engine instances, each with its own device and host tiers, links and scheduler;
    #: "auto": the fewest that bring the predicted utilisation to 0.7 (``kvflow.replay.load``).
    instances: int | str = 1
    #: How a request picks its instance: ``kvflow.cluster.router.ROUTERS``.
    router: str = "round_robin"
    #: What the router sees of instances: "exact" (their events) or "approx" (its own record).
    router_view: str = "exact"
    # -- load -----------------------------------------------------------------------------------
    #: Replay the trace this many times faster (arrival times divided by it).
    rate_scale: float = 1.0
    #: Only requests arriving within this many seconds (after scaling).
    duration_s: float | None = None
    #: Poisson arrivals at this many requests/s (seeded) instead of the trace's times.
    rate: float | None = None
    #: With ``rate``: gamma gaps of this shape (1: Poisson; < 1 burstier), as bench_serving.
    burstiness: float = 1.0
    # -- service targets ----------------------------------------------------------------------
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # -- the cuda world ---------------------------------------------------------------------
    #: Its executor (``EXECUTORS``); None: "fast".
    executor: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; valid: {', '.join(MODES)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; valid: {', '.join(BACKENDS)}")
        if self.backend == "cuda" and self.mode != "full":
            raise ConfigError("backend 'cuda' replays in full mode only")
        if self.executor is not None:
            if self.executor not in EXECUTORS:
                raise ConfigError(f"unknown executor {self.executor!r}; "
                                  f"valid: {', '.join(EXECUTORS)}")
            if self.backend != "cuda":
                raise ConfigError("executor is the cuda world's compute: give it with "
                                  "backend 'cuda'")
        for name in ("device_blocks", "host_blocks", "storage_blocks", "limit",
                     "device_gb", "host_gb", "storage_gb"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ConfigError(f"{name} must be >= 0, got {v}")
        for tier in ("device", "host", "storage"):
            if getattr(self, f"{tier}_blocks") is not None and getattr(
                    self, f"{tier}_gb") is not None:
                raise ConfigError(f"give {tier}_blocks or {tier}_gb, not both")
        if self.sample_interval_s <= 0:
            raise ConfigError("sample_interval_s must be positive")
        if self.instances != "auto" and (isinstance(self.instances, bool)
                                         or not isinstance(self.instances, int)
                                         or self.instances < 1):
            raise ConfigError(f"instances must be an integer >= 1 or 'auto', "
                              f"got {self.instances!r}")
        if self.instances != "auto" and self.instances > 1:
            if self.backend != "sim":
                raise ConfigError("several instances run in the simulated world only "
                                  "(backend 'sim')")
            if self.mode != "full":
                raise ConfigError("several instances replay in full mode only "
                                  "(cache mode replays one cache)")
        from kvflow.cluster.router import ROUTERS, VIEWS  # the cluster sits above the driver

        if self.router not in ROUTERS:
            raise ConfigError(f"unknown router {self.router!r}; valid: {', '.join(ROUTERS)}")
        if self.router_view not in VIEWS:
            raise ConfigError(f"unknown router_view {self.router_view!r}; valid: "
                              f"{', '.join(VIEWS)}")
        for name in ("rate_scale", "duration_s", "rate", "burstiness", "slo_ttft_s",
                     "slo_tpot_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {v!r}")
        # Fail early, with the field named, rather than mid-replay.
        WritePolicy(self.write_policy, threshold=self.write_threshold)
        PrefetchPolicy(self.prefetch_policy)

    def tier_request(self) -> TierRequest:
        """The tier sizes asked for, as a world reads them."""
        return TierRequest(self.device_blocks, self.host_blocks, self.storage_blocks,
                           self.device_gb, self.host_gb, self.storage_gb,
                           self.max_batch_tokens + self.max_running)


@dataclass
class Setup:
    """What a config resolves to: the model, the GPU, the tiers, the requests."""

    spec: ModelSpec
    profile: GpuProfile
    capacities: Capacities
    #: Read from the trace each pass (``kvflow.replay.requests.Requests``), not held.
    requests: Sequence[EngineRequest]
    trace_path: str
    skipped: int


def request_keys(req: Request, hasher: BlockHasher | None) -> tuple[Hashable, ...]:
    """Block keys of a request: the trace's hash ids, or hashes of its tokens.

    A tenant gets its own key space, so tenants never share a block.
    """
    if req.block_hashes is not None:
        keys: tuple[Hashable, ...] = req.block_hashes
        if req.tenant is not None:
            keys = tuple((req.tenant, h) for h in keys)
        return keys
    if req.token_ids is not None and hasher is not None:
        extra = ExtraKeys(tenant_salt=req.tenant) if req.tenant is not None else None
        return tuple(hasher.hash_blocks(req.token_ids, extra=extra))
    return ()


def resolve(cfg: ReplayConfig, world: World | None = None) -> Setup:
    """Read the trace and size the tiers as ``world`` holds them (no world: cache mode,
    sized from the profile)."""
    path = Path(cfg.trace) if cfg.trace else sample_path()
    trace = open_trace(path, skip_bad=cfg.skip_bad)
    spec = preset(cfg.model, block_tokens=trace.block_tokens)
    profile = load_profile(cfg.profile)
    hasher = BlockHasher(trace.block_tokens)
    source: Iterable[Request] = trace
    if cfg.rate is not None:
        source = poisson_arrivals(source, cfg.rate, burstiness=cfg.burstiness, seed=cfg.seed)
    if cfg.rate_scale != 1.0:
        source = rate_scale(source, cfg.rate_scale)
    if cfg.duration_s is not None or cfg.limit is not None:
        source = bound(source, duration_s=cfg.duration_s, limit=cfg.limit)
    requests = Requests(source, lambda req: request_keys(req, hasher))
    want = cfg.tier_request()
    capacities = (default_capacities(spec, profile, want) if world is None
                  else world.capacities(spec, profile, want))
    return Setup(spec, profile, capacities, requests, str(path), trace.skipped)


def make_manager(cfg: ReplayConfig, capacities: Capacities) -> CacheManager:
    return CacheManager(
        capacities, eviction=cfg.eviction,
        write_policy=WritePolicy(cfg.write_policy, threshold=cfg.write_threshold),
        prefetch_policy=PrefetchPolicy(cfg.prefetch_policy))
