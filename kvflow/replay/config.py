"""What a replay depends on (``ReplayConfig``) and what it resolves to (``Setup``).

Field names of ``ReplayConfig`` are ``kvflow sweep --param`` names, and every
field is checked here, at construction, so a bad value fails with its name
before any trace is read.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvflow.belady import FutureUses
from kvflow.cost import BlockCosts
from kvflow.engine import EngineRequest
from kvflow.errors import ConfigError
from kvflow.hashing import BlockHasher, ExtraKeys
from kvflow.host_layout import HostLayout
from kvflow.layout import ModelSpec, preset
from kvflow.manager import CacheManager, Capacities
from kvflow.policy import EVICTION_POLICIES, PrefetchPolicy, WritePolicy
from kvflow.profile import GpuProfile, Link, load_profile, tensor_parallel_links
from kvflow.replay.cluster_file import InstanceGroup, read_cluster_file
from kvflow.replay.requests import Requests
from kvflow.world import WORLDS, TierRequest, World, blocks_for_gb, default_capacities
from traces import Request, open_trace, sample_path
from traces.reshape import bound, poisson_arrivals, rate_scale
from traces.schema import TraceLimits

MODES = ("full", "cache")
#: Worlds a full replay runs in (``kvflow.world.WORLDS``): the simulator, or a real GPU.
BACKENDS = tuple(WORLDS)
#: Compute of the cuda world (``kernels.fast``): "fast" (cuBLAS + FlashAttention-style, the
#: default) or "exact" (batch-invariant, bit-identical whatever the batching).
EXECUTORS = ("fast", "exact")
#: An instance's link to a shared pool, where none is given: one 400 Gb/s port (50 GB/s;
#: NVIDIA DGX H100 datasheet: eight single-port ConnectX-7 400 Gb/s for the compute
#: fabric, one per GPU). Bandwidths are decimal GB/s (1e9 bytes), sizes GiB as elsewhere.
DEFAULT_NIC_GB_PER_S = 50.0
#: Its latency per request: an assumption (an RDMA round trip is a few microseconds; a
#: pool's lookup of the object adds some); calibrate it.
DEFAULT_NIC_LATENCY_S = 10e-6


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
    #: Eviction policy (``kvflow.policy.EVICTION_POLICIES``; ``belady`` is offline).
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
    #: Trace limits (``traces.TraceLimits``); None: the environment's, else the defaults.
    max_request_tokens: int | None = None
    max_trace_bytes: int | None = None
    # -- a cluster of instances (kvflow.cluster) ---------------------------------------------
    #: Engine instances, each with its own device and host tiers, links and scheduler;
    #: "auto": the fewest that bring the predicted utilisation to 0.7 (``kvflow.replay.load``).
    instances: int | str = 1
    #: How a request picks its instance: ``kvflow.cluster.router.ROUTERS``.
    router: str = "round_robin"
    #: What the router sees of instances: "exact" (their events) or "approx" (its own record).
    router_view: str = "exact"
    #: Prefill/decode disaggregation, "P:D" (``kvflow.cluster.pd``): P prefill and D decode
    #: instances (``instances`` becomes P + D); None: every instance does both.
    pd: str | None = None
    #: The network link a request's KV crosses from prefill to decode instance, per
    #: instance NIC: GB/s (1e9 bytes) and per-layer latency. Defaults: one 400 Gb/s RDMA
    #: NIC per GPU (NVIDIA ConnectX-7, as DGX H100 pairs them) and ~5 us a message.
    pd_gb_per_s: float = 50.0
    pd_latency_s: float = 5e-6
    #: Send each layer's KV as prefill computes it (True), or all of it after prefill.
    pd_layerwise: bool = True
    #: Decode instances copy KV down their host and storage tiers per the write policy,
    #: as any instance does (True), or keep it on the device only (False): without a
    #: pool shared with the prefill instances, nothing ever reads their lower tiers.
    pd_decode_offload: bool = True
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
    #: Its storage tier's block store (``kvflow.stores.spec``): "dir:PATH" or a redis://
    #: URL; None: no storage tier. (The simulated world models storage as sizes.)
    store: str | None = None
    # -- the host pool's layout (``kvflow.host_layout``) -------------------------------------
    #: ``layer_major`` (per layer and role, the default), ``block_major`` or ``grouped:G``:
    #: the piece size of every host <-> device copy, and how layer futures group.
    host_layout: str = "layer_major"
    # -- reports --------------------------------------------------------------------------------
    #: Report the offline optimum's hit rates at the same capacities beside the policy's
    #: (``kvflow.headroom``: Belady's MIN in cache mode, a few tenths of a second).
    headroom: bool = True
    # -- the instances' hardware ----------------------------------------------------------------
    #: GPUs each instance spans (tensor parallelism): weights and KV split that many ways,
    #: one PCIe link per GPU, two all-reduces per layer (``kvflow.cost``).
    tp: int = 1
    # -- a KV pool shared by the cluster (``kvflow.cluster.pool``) ---------------------------
    #: Its size (blocks or GiB); None for both: no pool, each instance its own storage.
    pool_blocks: int | None = None
    pool_gb: float | None = None
    #: Its aggregate bandwidth each way, GB/s (None: only the instances' NICs bound it).
    pool_gb_per_s: float | None = None
    #: Each instance's NIC to it: GB/s each way and latency per request (defaults:
    #: ``DEFAULT_NIC_GB_PER_S``, ``DEFAULT_NIC_LATENCY_S``).
    nic_gb_per_s: float | None = None
    nic_latency_s: float | None = None
    # -- the cluster from a TOML file (``kvflow.replay.cluster_file``) ----------------------
    #: Its top-level keys set these fields (those left at their defaults; a field given
    #: another value here and in the file is an error); its ``[[group]]`` tables, if any,
    #: make the instances heterogeneous (``groups``).
    cluster: str | None = None
    groups: tuple[InstanceGroup, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        if self.cluster is not None:
            self._apply_cluster_file()
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
        self._check_store()
        for name in ("device_blocks", "host_blocks", "storage_blocks", "limit",
                     "device_gb", "host_gb", "storage_gb"):
            v = getattr(self, name)
            if v is not None and not (v >= 0 and math.isfinite(v)):  # (NaN compares False)
                raise ConfigError(f"{name} must be a finite number >= 0, got {v}")
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
        self._check_pd()
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
        self._check_hardware()
        self.host_layout = str(HostLayout.parse(self.host_layout))  # ConfigError names it
        # Fail early, with the field named, rather than mid-replay.
        if self.eviction.lower() not in EVICTION_POLICIES:
            raise ConfigError(f"unknown eviction policy {self.eviction!r}; "
                              f"valid: {', '.join(EVICTION_POLICIES)}")
        WritePolicy(self.write_policy, threshold=self.write_threshold)
        PrefetchPolicy(self.prefetch_policy)

    @property
    def has_pool(self) -> bool:
        """Whether the instances share a pool instead of each having its own storage."""
        return self.pool_blocks is not None or self.pool_gb is not None

    def _check_store(self) -> None:
        """A real block store: the GPU world's, staged through a host tier."""
        if self.store is None:
            return
        from kvflow.stores.spec import parse_store

        parse_store(self.store)
        if self.backend != "cuda":
            raise ConfigError(f"store {self.store!r} holds real bytes: give it with backend "
                              "'cuda' (the simulated world models storage as sizes)")
        if self.host_blocks == 0 or self.host_gb == 0:
            raise ConfigError("store: storage -> device goes through the host tier in the "
                              "cuda world (StoreBackend moves host <-> storage only); give "
                              "host_blocks > 0")
        if self.storage_blocks == 0 or self.storage_gb == 0:
            raise ConfigError("store given with a storage tier of 0 blocks: drop one")

    def _check_hardware(self) -> None:
        """Tensor parallelism and the shared pool."""
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError(f"tp must be an integer >= 1, got {self.tp!r}")
        if self.backend != "sim" and (self.tp > 1 or any((g.tp or 1) > 1 for g in self.groups)):
            raise ConfigError("tensor parallelism (tp > 1) runs in the simulated world only "
                              "(backend 'sim')")
        v = self.pool_blocks
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"pool_blocks must be an integer >= 1, got {v!r}")
        for name in ("pool_gb", "pool_gb_per_s", "nic_gb_per_s", "nic_latency_s"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0 or (v == 0 and name != "nic_latency_s"):
                low = ">= 0" if name == "nic_latency_s" else "> 0"
                raise ConfigError(f"{name} must be a finite number {low}, got {v!r}")
        if self.pool_blocks is not None and self.pool_gb is not None:
            raise ConfigError("give pool_blocks or pool_gb, not both")
        if not self.has_pool:
            given = [n for n in ("pool_gb_per_s", "nic_gb_per_s", "nic_latency_s")
                     if getattr(self, n) is not None]
            given += [f"nic_* of group {i}" for i, g in enumerate(self.groups, 1)
                      if g.nic_gb_per_s is not None or g.nic_latency_s is not None]
            if given:
                raise ConfigError(f"{', '.join(given)} need a shared pool: give pool_gb or "
                                  "pool_blocks")
            return
        if self.backend != "sim" or self.mode != "full":
            raise ConfigError("a shared pool runs in full mode in the simulated world only "
                              "(mode 'full', backend 'sim')")
        local = [n for n in ("storage_blocks", "storage_gb") if getattr(self, n) is not None]
        local += [f"storage_* of group {i}" for i, g in enumerate(self.groups, 1)
                  if g.storage_blocks is not None or g.storage_gb is not None]
        if local:
            raise ConfigError(f"{', '.join(local)} and a shared pool: with a pool, the pool is "
                              "every instance's storage (drop one)")

    def _apply_cluster_file(self) -> None:
        """Take the cluster file's settings and groups (see ``cluster``)."""
        path = self.cluster
        assert path is not None
        settings, groups = cluster_file_settings(path)
        defaults = {f.name: f.default for f in dataclasses.fields(ReplayConfig) if f.init}
        for key, value in settings.items():
            given = getattr(self, key)
            if given == defaults[key]:
                setattr(self, key, value)
            elif given != value:
                raise ConfigError(f"{path}: key {key!r} = {value!r}, but {key}={given!r} is "
                                  "given too: give it in one place")
        if groups:
            total = sum(g.count for g in groups)
            if self.instances not in (defaults["instances"], total):
                raise ConfigError(f"{path}: its groups hold {total} instances, but "
                                  f"instances={self.instances!r} is given")
            self.instances = total
        self.groups = groups

    def _check_pd(self) -> None:
        """``pd`` well formed and consistent with the rest; sets ``instances`` to P + D."""
        for name in ("pd_gb_per_s", "pd_latency_s"):
            v = getattr(self, name)
            low_ok = v > 0 if name == "pd_gb_per_s" else v >= 0
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    math.isfinite(v) and low_ok):
                raise ConfigError(f"{name} must be a finite number "
                                  f"{'> 0' if name == 'pd_gb_per_s' else '>= 0'}, got {v!r}")
        for name in ("pd_layerwise", "pd_decode_offload"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.pd is None:
            return
        from kvflow.cluster.pd import parse_pd  # the cluster sits above the driver

        p, d = parse_pd(self.pd)
        if self.instances == "auto" or self.instances not in (1, p + d):
            raise ConfigError(f"pd {self.pd!r} runs {p + d} instances; instances is "
                              f"{self.instances!r} (leave it out, or give {p + d})")
        if self.backend != "sim" or self.mode != "full":
            raise ConfigError("pd (prefill/decode disaggregation) runs in the simulated "
                              "world in full mode only (backend 'sim', mode 'full')")
        self.instances = p + d

    def tier_request(self) -> TierRequest:
        """The tier sizes asked for, as a world reads them."""
        return TierRequest(self.device_blocks, self.host_blocks, self.storage_blocks,
                           self.device_gb, self.host_gb, self.storage_gb,
                           self.max_batch_tokens + self.max_running, self.tp)


def cluster_file_settings(path: str) -> tuple[dict[str, Any], tuple[InstanceGroup, ...]]:
    """A cluster file's top-level settings (``ReplayConfig`` fields) and groups, each value
    checked, on its own, as the config checks it (so that an error names the file)."""
    own = [f for f in dataclasses.fields(ReplayConfig) if f.init]
    hints = typing.get_type_hints(ReplayConfig)
    settings, groups = read_cluster_file(path, {f.name: hints[f.name] for f in own})
    try:
        ReplayConfig(**settings)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    for i, g in enumerate(groups, 1):
        values = {k: v for k, v in dataclasses.asdict(g).items()
                  if v is not None and k not in ("count", "profile")}
        if "nic_gb_per_s" in values or "nic_latency_s" in values:
            values["pool_blocks"] = 1  # a NIC is to the shared pool (which the top level has)
        try:
            ReplayConfig(**values)
        except ConfigError as exc:
            raise ConfigError(f"{path}: group {i}: {exc}") from None
    return settings, groups


@dataclass(frozen=True)
class InstanceSpec:
    """One instance's hardware, as its world is started with it.

    ``profile`` carries the instance's own links: PCIe times ``tp``
    (``tensor_parallel_links``) and, with a shared pool, its NIC as its storage
    links (``nic``: bytes/s, latency). ``group``: its ``[[group]]`` in the
    cluster file (counting from 0), None without groups.
    """

    profile: GpuProfile
    capacities: Capacities
    tp: int = 1
    group: int | None = None
    nic: tuple[float, float] | None = None


@dataclass
class Setup:
    """What a config resolves to: the model, the GPU, the tiers, the requests.

    ``profile`` and ``capacities`` are the first instance's; ``kinds`` are the
    instances' hardware by group: ``(count, spec)``, a count of None meaning
    "all the instances" (no groups); ``instance_specs`` spells them out.
    ``pool_blocks``: the shared pool's size (None: no pool).
    """

    spec: ModelSpec
    profile: GpuProfile
    capacities: Capacities
    #: Read from the trace each pass (``kvflow.replay.requests.Requests``), not held.
    requests: Sequence[EngineRequest]
    trace_path: str
    skipped: int
    kinds: tuple[tuple[int | None, InstanceSpec], ...] = ()
    pool_blocks: int | None = None

    def load_kwargs(self) -> dict[str, Any]:
        """What ``load.load_section`` needs to know of the instances' hardware beyond the
        first instance's profile and tiers: their tensor parallelism, and the groups
        where they differ."""
        first = self.kinds[0][1] if self.kinds else InstanceSpec(self.profile, self.capacities)
        if len(self.kinds) <= 1:
            return {"tp": first.tp}
        return {"tp": first.tp, "mix": [(count, s.profile, s.capacities, s.tp)
                                        for count, s in self.kinds]}

    def instance_specs(self, instances: int) -> list[InstanceSpec]:
        """Each of ``instances`` instances' hardware, in order."""
        if not self.kinds:
            return [InstanceSpec(self.profile, self.capacities)] * instances
        out = [s for count, s in self.kinds for _ in range(instances if count is None else count)]
        if len(out) != instances:
            raise ConfigError(f"{instances} instances asked for, the groups hold {len(out)}")
        return out


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


def resolve(cfg: ReplayConfig, world: World | None = None, *, count: bool = True) -> Setup:
    """Read the trace and size the tiers as ``world`` holds them (no world: cache mode,
    sized from the profile). ``count=False``: the requests are counted by the first
    pass that reads them all (``Requests``), not up front; ``skipped`` is set then."""
    path = Path(cfg.trace) if cfg.trace else sample_path()
    limits = TraceLimits.from_env(max_request_tokens=cfg.max_request_tokens,
                                  max_trace_bytes=cfg.max_trace_bytes)
    trace = open_trace(path, skip_bad=cfg.skip_bad, limits=limits)
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
    made: list[Setup] = []

    def counted() -> None:  # (skipped lines are counted afresh by each pass of the trace)
        if made:
            made[0].skipped = trace.skipped

    requests = Requests(source, lambda req: request_keys(req, hasher), count=count,
                        on_counted=None if count else counted)
    pool_blocks = None
    if cfg.has_pool:
        pool_blocks = cfg.pool_blocks if cfg.pool_blocks is not None else \
            blocks_for_gb(cfg.pool_gb, spec)  # type: ignore[arg-type]
        if pool_blocks < 1:
            raise ConfigError(f"pool_gb={cfg.pool_gb} holds no block of {spec.name} "
                              f"({spec.bytes_per_block / 2**20:.1f} MiB each)")
    groups: tuple[InstanceGroup | None, ...] = cfg.groups or (None,)
    kinds = tuple((None if g is None else g.count,
                   _instance(cfg, spec, profile, world, g, i, pool_blocks))
                  for i, g in enumerate(groups))
    first = kinds[0][1]
    made.append(Setup(spec, first.profile, first.capacities, requests, str(path),
                      trace.skipped, kinds, pool_blocks))
    return made[0]


def _instance(cfg: ReplayConfig, spec: ModelSpec, profile: GpuProfile, world: World | None,
              group: InstanceGroup | None, index: int, pool_blocks: int | None) -> InstanceSpec:
    """The hardware of one kind of instance: the config's, with a group's keys over it."""
    tp = cfg.tp
    want = cfg.tier_request()
    nic_gb, nic_latency = cfg.nic_gb_per_s, cfg.nic_latency_s
    if group is not None:
        if group.profile is not None:
            profile = load_profile(group.profile)
        tp = group.tp or tp
        tiers = {}
        for tier in ("device", "host", "storage"):
            blocks, gb = getattr(group, f"{tier}_blocks"), getattr(group, f"{tier}_gb")
            if blocks is not None or gb is not None:
                tiers[f"{tier}_blocks"], tiers[f"{tier}_gb"] = blocks, gb
        want = replace(want, tp=tp, **tiers)
        nic_gb = group.nic_gb_per_s if group.nic_gb_per_s is not None else nic_gb
        nic_latency = group.nic_latency_s if group.nic_latency_s is not None else nic_latency
    # the links of this run's host layout, where the profile measured them per layout
    links = tensor_parallel_links(profile.for_host_layout(cfg.host_layout), tp)
    nic = None
    if pool_blocks is not None:
        want = replace(want, storage_blocks=pool_blocks, storage_gb=None)  # its view
        nic = ((DEFAULT_NIC_GB_PER_S if nic_gb is None else nic_gb) * 1e9,
               DEFAULT_NIC_LATENCY_S if nic_latency is None else nic_latency)
        link = Link(nic[0], nic[1], overlap_latency=True)  # many requests in flight
        links = replace(links, storage_read=link, storage_write=link)
    capacities = (default_capacities(spec, links, want) if world is None
                  else world.capacities(spec, links, want))
    return InstanceSpec(links, capacities, tp, None if group is None else index, nic)


def make_pool(cfg: ReplayConfig, setup: Setup) -> Any:
    """The cluster's shared pool (``kvflow.cluster.pool.GlobalPool``), or None without one."""
    if setup.pool_blocks is None:
        return None
    from kvflow.cluster.pool import GlobalPool, PoolGate

    gate = None
    if cfg.pool_gb_per_s is not None:
        gate = PoolGate(cfg.pool_gb_per_s * 1e9, cfg.pool_gb_per_s * 1e9)
    return GlobalPool(setup.pool_blocks, gate)


def instance_capacities(cfg: ReplayConfig, capacities: Capacities, i: int) -> Capacities:
    """Instance ``i``'s tiers: ``capacities``, or the device alone for a decode instance
    that does not offload (``pd_decode_offload=False``)."""
    if cfg.pd is None or cfg.pd_decode_offload:
        return capacities
    from kvflow.cluster.pd import parse_pd

    return capacities if i < parse_pd(cfg.pd)[0] else Capacities(capacities.device)


def make_manager(cfg: ReplayConfig, capacities: Capacities,
                 setup: Setup | None = None) -> CacheManager:
    """One instance's manager (with a shared pool, one whose storage is its view of it).

    ``belady`` (offline) reads the future from ``setup``'s requests, as the mode
    plans them (cache mode keeps each request's first ``device`` blocks);
    ``cost_aware`` weighs blocks under the replay's cost model and links."""
    kind = CacheManager
    if cfg.has_pool:
        from kvflow.cluster.pool import PoolViewManager  # the cluster sits above the driver

        kind = PoolViewManager
    future = costs = None
    eviction = cfg.eviction.lower()
    if eviction in ("belady", "cost_aware") and setup is None:
        raise ConfigError(f"eviction {cfg.eviction!r} needs the replay's setup "
                          "(make_manager(cfg, capacities, setup))")
    if eviction == "belady" and setup is not None:
        cut = capacities.device if cfg.mode == "cache" else None
        future = FutureUses((r.keys[:cut] for r in setup.requests),
                            ids=[r.request_id for r in setup.requests])
    if eviction == "cost_aware" and setup is not None:
        costs = BlockCosts.from_profile(setup.spec, setup.profile)
    return kind(
        capacities, eviction=cfg.eviction,
        write_policy=WritePolicy(cfg.write_policy, threshold=cfg.write_threshold),
        prefetch_policy=PrefetchPolicy(cfg.prefetch_policy), future=future, costs=costs)
