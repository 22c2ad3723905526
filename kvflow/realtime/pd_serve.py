"""``kvflow serve-pd``: a prefill engine and a decode engine as two processes, one trace.

The parent starts a prefill process (it listens on loopback) and a decode
process (it connects), tells both one start time on the machine's monotonic
clock, and each replays the same trace slice in real time, in the CPU world
(``kvflow.realtime.pd_instance``) or, with ``backend="cuda"``, both on one GPU
(``kernels.pd_instance``, loaded by name through ``kvflow.world``: the core
never imports CuPy): every request arrives at both; the prefill engine
computes its prompt (and first token) and sends the KV layer by layer over
TCP; the decode engine receives it into blocks it allocated at admission and
decodes the remaining tokens. In the CPU world both check every block they
read against the bytes its key implies (``corrupt_reads`` must stay 0). On a GPU
the check is the tokens: with ``check_tokens`` a third process then runs the
same requests colocated (one engine, prefill and decode) and the report's
``tokens`` section says whether every request's tokens are the same both ways
(the ``exact`` executor is batch-invariant, so they must be, bit for bit). The
decode engine recomputes the prompt's last position as its first step (one
token, over the received KV) and samples the first token again from it: its
tokens are the colocated run's first ``output_len - 1``.

The report (``build_report``) is the seam for the simulator's PD mode: per
request, arrival, the prefill's first token, the decode side's admission, KV
landed and finish, all on one clock; and

* ``ttft_s``  — arrival to the prefill's first token;
* ``tpot_s``  — (decode finish - first token) / (output tokens - 1): what a user
  sees between tokens, the transfer's exposed part and decode queueing included;
* ``transfer.bytes`` / ``wire_bytes`` — KV payload received / TCP bytes both ways;
* ``transfer.wait_at_admission_s`` — decode admission to the KV having landed;
* ``transfer.after_prefill_s`` — first token to KV landed: the part of the
  transfer not hidden under prefill; in two: ``sent_after_prefill_s`` (first
  token to the prefill side's last frame having left) and
  ``landed_after_sent_s`` (from then to the decode side having all of it);
* ``transfer.failed`` / ``recomputed`` — transfers that did not land, and the
  requests that recomputed their prefill on the decode side instead.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from asyncio.subprocess import PIPE
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvflow.engine import EngineRequest, RequestState
from kvflow.errors import ConfigError
from kvflow.hashing import BlockHasher
from kvflow.layout import ModelSpec, preset
from kvflow.pd.transports import tcp_receive_port, tcp_send_port
from kvflow.pd.verbs import DecodeSide, PrefillSide, TransferRecord
from kvflow.pd.wire import wire_id
from kvflow.realtime.pd_instance import ROLES, Instance, InstanceConfig, tiny_spec
from kvflow.replay.config import request_keys
from kvflow.replay.report import summary
from kvflow.world import load_world, new_loop

REPORT_VERSION = "pd-1"
#: Where the pair runs: the real-time CPU world, or one GPU (``kvflow.world.WORLDS``).
BACKENDS = ("cpu", "cuda")
#: The model ``tiny`` names on a GPU: the kernels need head_dim 64 or 128.
GPU_TINY = "kvflow-tiny-hd64"
#: Seconds the parent waits for a child to start, and beyond the last arrival for the end
#: (a GPU child also creates its context and compiles its kernels first).
START_TIMEOUT_S = 60.0
GPU_START_TIMEOUT_S = 240.0


@dataclass
class ServeConfig:
    """A PD run: the trace slice, the model, both instances, the transfer policy."""

    trace: str | None = None
    start: int = 0
    limit: int = 40
    #: Arrivals multiplied by this (0.1: ten times faster than the trace).
    time_scale: float = 1.0
    model: str = "tiny"
    prefill: InstanceConfig = field(default_factory=InstanceConfig)
    decode: InstanceConfig = field(default_factory=InstanceConfig)
    deadline_s: float = 30.0
    on_failure: str = "recompute"
    host: str = "127.0.0.1"
    use_uvloop: bool = True
    backend: str = "cpu"
    #: The GPU world's compute (``kernels.fast.EXECUTORS``); exact: tokens comparable.
    executor: str = "exact"
    #: GPU: run the requests colocated too and compare every request's tokens.
    check_tokens: bool = False

    def __post_init__(self) -> None:
        if self.limit <= 0 or self.start < 0:
            raise ConfigError("limit must be > 0 and start >= 0")
        if self.time_scale < 0:
            raise ConfigError(f"time_scale must be >= 0, got {self.time_scale}")
        if self.on_failure not in ("recompute", "fail"):
            raise ConfigError(f"on_failure must be recompute or fail, got {self.on_failure!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, "
                              f"got {self.backend!r}")
        if self.check_tokens and self.backend != "cuda":
            raise ConfigError("check_tokens compares sampled tokens: the GPU world's "
                              "(backend 'cuda') only")


@dataclass(frozen=True)
class PDRequest:
    rid: int
    arrival_s: float
    keys: tuple[Any, ...]
    input_len: int
    output_len: int


def load_slice(cfg: ServeConfig) -> tuple[ModelSpec, list[PDRequest]]:
    """The model (block size from the trace) and requests ``[start, start + limit)``."""
    from traces import open_trace, sample_path

    tr = open_trace(cfg.trace or sample_path())
    hasher = BlockHasher(tr.block_tokens)
    out: list[PDRequest] = []
    for req in tr:
        if req.index < cfg.start:
            continue
        if len(out) >= cfg.limit:
            break
        keys: tuple[Any, ...] = request_keys(req, hasher)
        if not keys:  # lengths only: blocks nobody shares
            keys = tuple((req.index, j) for j in range(req.num_blocks(tr.block_tokens)))
        out.append(PDRequest(req.index, req.arrival_s, keys, req.input_len, req.output_len))
    if not out:
        raise ConfigError(f"trace {cfg.trace or 'sample'} has no requests from index {cfg.start}")
    t0 = out[0].arrival_s
    out = [PDRequest(r.rid, r.arrival_s - t0, r.keys, r.input_len, r.output_len) for r in out]
    bt = tr.block_tokens
    if cfg.model == "tiny":
        spec = tiny_spec(bt) if cfg.backend == "cpu" else preset(GPU_TINY, block_tokens=bt)
    else:
        spec = preset(cfg.model, block_tokens=bt)
    return spec, out


def sized(cfg: InstanceConfig, spec: ModelSpec, reqs: list[PDRequest]) -> InstanceConfig:
    """``cfg`` with a device tier that holds at least the slice's largest request 4 times
    over where it was left at 0 (and a host tier as large, where that was 0 too)."""
    if cfg.device_blocks and cfg.host_blocks:
        return cfg
    bt = spec.block_tokens
    most = max(max(math.ceil((r.input_len + r.output_len) / bt), len(r.keys)) for r in reqs)
    dev = cfg.device_blocks or max(64, 4 * most)
    return InstanceConfig(**{**asdict(cfg), "device_blocks": dev,
                             "host_blocks": cfg.host_blocks or dev})


# --------------------------------------------------------------------------- children
def _child_main(role: str) -> None:
    """A child process (``python -m kvflow.realtime.pd_serve ROLE``): JSON lines on stdin/stdout."""
    import sys

    cfg = config_from_dict(json.loads(sys.stdin.readline()))
    conn = _Pipe()
    loop = new_loop(cfg.use_uvloop)
    try:
        conn.send(loop.run_until_complete(_run_role(role, cfg, conn)))
    except BaseException as exc:  # the parent reports it; never a silent child
        conn.send({"error": f"{role}: {exc!r}"})
        raise
    finally:
        loop.close()


class _Pipe:
    """The child's end of its pipe to the parent: JSON lines on stdin / stdout."""

    def send(self, msg: dict[str, Any]) -> None:
        import sys

        sys.stdout.write(json.dumps(msg, default=str) + "\n")
        sys.stdout.flush()

    def recv(self) -> dict[str, Any]:
        import sys

        line = sys.stdin.readline()
        if not line:
            raise EOFError("the parent closed the pipe")
        return json.loads(line)


async def _recv(conn: Any) -> Any:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, conn.recv)


async def make_instance(cfg: ServeConfig, spec: ModelSpec, icfg: InstanceConfig,
                        role: str) -> Any:
    """The role's instance in ``cfg.backend``'s world (a GPU's loaded by name)."""
    if cfg.backend == "cpu":
        return Instance(spec, icfg, role)
    world: Any = load_world(cfg.backend, executor=cfg.executor)
    return await world.pd_instance(spec, icfg, role)


async def _run_colocated(cfg: ServeConfig) -> dict[str, Any]:
    """The reference for ``check_tokens``: every request prefilled and decoded by one
    engine (the prefill instance's tiers), all at once (tokens do not depend on timing)."""
    spec, reqs = load_slice(cfg)
    inst = await make_instance(cfg, spec, sized(cfg.prefill, spec, reqs), "colocated")
    eng = inst.engine
    run = asyncio.get_running_loop().create_task(eng.run())
    for r in reqs:
        eng.add(EngineRequest(r.rid, r.arrival_s, r.keys, r.input_len, r.output_len))
    eng.close()
    await run
    await inst.drain()
    errors = {wire_id(st.req.request_id): st.error for st in eng.done if st.error is not None}
    return {"role": "colocated", "errors": errors,
            "outputs": {wire_id(k): v for k, v in inst.outputs().items()}}


async def _run_role(role: str, cfg: ServeConfig, conn: Any) -> dict[str, Any]:
    if role == "colocated":
        return await _run_colocated(cfg)
    spec, reqs = load_slice(cfg)
    icfg = sized(cfg.prefill if role == "prefill" else cfg.decode, spec, reqs)
    inst = await make_instance(cfg, spec, icfg, role)
    eng = inst.engine
    eng.clock = time.monotonic
    rec: dict[str, dict[str, Any]] = {wire_id(r.rid): {} for r in reqs}
    out_len = {wire_id(r.rid): r.output_len for r in reqs}
    server = None
    if role == "prefill":
        port, server = await tcp_send_port(spec, inst.memory, cfg.host, 0, name="prefill")
        side: Any = PrefillSide(eng, inst.pd, port, cfg.deadline_s).attach()
        send = side.send

        def on_admit(st: RequestState) -> None:
            rid = wire_id(st.req.request_id)
            rec[rid]["admit"] = time.monotonic()
            if out_len[rid] > 1:  # a request that ends with its first token is not sent
                task = send(st)
                if task is not None:  # when its last frame has left (or it failed)
                    task.wait().add_done_callback(
                        lambda _, rid=rid: rec[rid].update(sent=time.monotonic()))

        eng.on_admit = on_admit
        conn.send({"port": server.port})
    else:
        ready = await _recv(conn)
        port = tcp_receive_port(spec, inst.memory, cfg.host, ready["port"], name="decode")
        side = DecodeSide(eng, inst.pd, port, cfg.deadline_s, cfg.on_failure).attach()
        receive = side.receive

        def on_admit(st: RequestState) -> None:
            rec[wire_id(st.req.request_id)]["admit"] = time.monotonic()
            receive(st)

        def on_settled(st: RequestState, r: TransferRecord) -> None:
            d = rec[r.request]
            d.update(kv=time.monotonic(), ok=r.ok, error=r.error)

        eng.on_admit = on_admit
        side.on_settled = on_settled
        conn.send({"ready": True})

    def on_finish(st: RequestState) -> None:
        rid = wire_id(st.req.request_id)
        rec[rid].update(first=st.first_token_s, finish=st.finish_s, generated=st.generated,
                        hits=list(st.hits))
        if st.error is not None and st.plan is None:  # rejected, never admitted: tell the peer
            if role == "prefill" and out_len[rid] > 1:
                side.abandon(rid, f"rejected by the prefill instance: {st.error}")
            elif role == "decode":
                port.refuse(rid, f"rejected by the decode instance: {st.error}")

    eng.on_finish = on_finish
    t0 = (await _recv(conn))["t0"]
    run = asyncio.get_running_loop().create_task(eng.run())
    try:
        for r in reqs:
            delay = t0 + r.arrival_s * cfg.time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if run.done():
                run.result()
            if role == "prefill":
                eng.add(EngineRequest(r.rid, r.arrival_s, r.keys, r.input_len, 1))
            elif r.output_len > 1:
                eng.add(EngineRequest(r.rid, r.arrival_s, r.keys, r.input_len,
                                      r.output_len - 1))
        eng.close()
        await run
    finally:
        if not run.done():
            run.cancel()
    await inst.drain()
    for st in eng.done:
        if st.error is not None:
            rec[wire_id(st.req.request_id)]["error"] = st.error
    links = [ln.stats for ln in (server.links if server is not None else port.links)]
    result = {
        "role": role, "t0": t0, "records": rec, "counters": inst.counters(),
        "side": side.stats.as_dict(), "port": port.stats.as_dict(),
        "transfer_errors": sorted({r.error for r in side.stats.records if r.error})[:8],
        "wire_bytes": sum(s["bytes_in"] + s["bytes_out"] for s in links),
        "pools": inst.pools_free(), "config": asdict(icfg),
        "spec": {"name": spec.name, "bytes_per_block": spec.bytes_per_block,
                 "num_layers": spec.num_layers, "block_tokens": spec.block_tokens},
    }
    if hasattr(inst, "outputs"):
        result["outputs"] = {wire_id(k): v for k, v in inst.outputs().items()}
    if server is not None:
        result["refused_peers"] = server.refused
        await server.close()
    else:
        await port.close()
    return result


# --------------------------------------------------------------------------- parent
def serve_pd(cfg: ServeConfig) -> dict[str, Any]:
    """Run the pair as two processes; returns the PD report."""
    spec, reqs = load_slice(cfg)  # fail here, not in a child, on a bad trace or model
    if cfg.backend != "cpu":  # and on a missing GPU or an unknown executor
        load_world(cfg.backend, executor=cfg.executor)
    t_wall = time.perf_counter()
    p_res, d_res, c_res = asyncio.run(_parent(cfg, reqs))
    report = build_report(cfg, spec, reqs, p_res, d_res)
    if c_res is not None:
        report["tokens"] = compare_tokens(reqs, p_res, d_res, c_res)
    report["wall_s"] = round(time.perf_counter() - t_wall, 3)
    return report


async def _parent(cfg: ServeConfig, reqs: list[PDRequest]
                  ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    root = str(Path(__file__).resolve().parents[2])  # this kvflow, whatever is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    line = (json.dumps(config_to_dict(cfg)) + "\n").encode()
    procs: list[asyncio.subprocess.Process] = []
    try:
        for role in ROLES:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvflow.realtime.pd_serve", role, stdin=PIPE, stdout=PIPE,
                env=env, limit=1 << 26)
            procs.append(proc)
            proc.stdin.write(line)  # type: ignore[union-attr]
        p, d = procs
        wait_s = START_TIMEOUT_S if cfg.backend == "cpu" else GPU_START_TIMEOUT_S
        msg = await _get(p, "prefill", wait_s)
        _put(d, {"port": msg["port"]})
        await _get(d, "decode", wait_s)
        t0 = time.monotonic() + 0.2
        for proc in procs:
            _put(proc, {"t0": t0})
        span = reqs[-1].arrival_s * cfg.time_scale + wait_s + 2 * cfg.deadline_s
        p_res, d_res = await asyncio.gather(_get(p, "prefill", span), _get(d, "decode", span))
        for proc in procs:
            await asyncio.wait_for(proc.wait(), 10)
        c_res = None
        if cfg.check_tokens:  # after the pair, so that it never competes with it
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvflow.realtime.pd_serve", "colocated", stdin=PIPE,
                stdout=PIPE, env=env, limit=1 << 26)
            procs.append(proc)
            proc.stdin.write(line)  # type: ignore[union-attr]
            c_res = await _get(proc, "colocated", span)
            await asyncio.wait_for(proc.wait(), 10)
        return p_res, d_res, c_res
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def _put(proc: asyncio.subprocess.Process, msg: dict[str, Any]) -> None:
    proc.stdin.write((json.dumps(msg) + "\n").encode())  # type: ignore[union-attr]


async def _get(proc: asyncio.subprocess.Process, who: str, timeout_s: float) -> dict[str, Any]:
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)  # type: ignore[union-attr]
    except asyncio.TimeoutError:
        raise RuntimeError(f"the {who} process did not answer within {timeout_s:.0f} s") from None
    if not line:
        raise RuntimeError(f"the {who} process died (exit code {await proc.wait()})")
    msg = json.loads(line)
    if "error" in msg:
        raise RuntimeError(f"the {who} process failed: {msg['error']}")
    return msg


def config_to_dict(cfg: ServeConfig) -> dict[str, Any]:
    return asdict(cfg)


def config_from_dict(d: dict[str, Any]) -> ServeConfig:
    d = dict(d)
    d["prefill"] = InstanceConfig(**d["prefill"])
    d["decode"] = InstanceConfig(**d["decode"])
    return ServeConfig(**d)


def build_report(cfg: ServeConfig, spec: ModelSpec, reqs: list[PDRequest],
                 p_res: dict[str, Any], d_res: dict[str, Any]) -> dict[str, Any]:
    """Both processes' records on one clock -> the PD report (see the module docstring)."""
    t0 = p_res["t0"]
    pr, dr = p_res["records"], d_res["records"]
    ttft, tpot, e2e, wait, after, samples = [], [], [], [], [], []
    held, crossing = [], []
    failed: list[str] = []
    for r in reqs:
        rid = wire_id(r.rid)
        p, d = pr[rid], dr[rid]
        arrival = t0 + r.arrival_s * cfg.time_scale
        if p.get("first") is None or (r.output_len > 1 and d.get("finish") is None):
            failed.append(f"{rid}: {d.get('error') or p.get('error') or 'did not finish'}")
            continue
        ttft.append(p["first"] - arrival)
        if r.output_len > 1:
            tpot.append((d["finish"] - p["first"]) / (r.output_len - 1))
            e2e.append(d["finish"] - arrival)
            if d.get("kv") is not None:
                wait.append(d["kv"] - d["admit"])
                after.append(d["kv"] - p["first"])
                if p.get("sent") is not None:
                    held.append(p["sent"] - p["first"])
                    crossing.append(d["kv"] - p["sent"])
        else:
            e2e.append(p["first"] - arrival)
        samples.append(rid)
    side = d_res["side"]
    compute = {k: {"corrupt_reads": res["counters"]["compute"]["corrupt_reads"],
                   "blocks_verified": res["counters"]["compute"]["blocks_verified"]}
               for k, res in (("prefill", p_res), ("decode", d_res))}
    return {
        "kvflow_report": REPORT_VERSION, "mode": "pd",
        "world": "cpu-realtime" if cfg.backend == "cpu" else cfg.backend,
        "config": {**asdict(cfg), "model": spec.name, "block_tokens": spec.block_tokens,
                   "bytes_per_block": spec.bytes_per_block, "num_layers": spec.num_layers,
                   "transport": "tcp", "trace_requests": len(reqs)},
        "requests": len(samples), "failed": failed,
        "ttft_s": summary(ttft), "tpot_s": summary(tpot), "e2e_s": summary(e2e),
        "transfer": {
            "bytes": d_res["port"]["bytes"], "wire_bytes": d_res["wire_bytes"],
            "frames": d_res["port"]["frames"],
            "transfers": side["started"], "ok": side["ok"], "failed": side["failed"],
            "skipped": side["skipped"], "recomputed": side["recomputed"],
            "aborted": side["aborted"],
            "wait_at_admission_s": summary(wait), "after_prefill_s": summary(after),
            # after_prefill_s in two: the first token to the prefill side's last frame
            # having left, then that to the decode side having it all.
            "sent_after_prefill_s": summary(held), "landed_after_sent_s": summary(crossing),
            "errors": d_res["transfer_errors"], "send_errors": p_res["transfer_errors"],
        },
        "errors": {"corrupt_reads": sum(c["corrupt_reads"] for c in compute.values()),
                   "port": {"prefill": p_res["port"], "decode": d_res["port"]}},
        "compute": compute,
        "pools_after_drain": {"prefill": p_res["pools"], "decode": d_res["pools"]},
        "instances": {"prefill": {"config": p_res["config"], "counters": p_res["counters"]},
                      "decode": {"config": d_res["config"], "counters": d_res["counters"]}},
        "samples": {"ttft_s": [round(x, 6) for x in ttft], "tpot_s": [round(x, 6) for x in tpot],
                    "wait_at_admission_s": [round(x, 6) for x in wait]},
    }


def compare_tokens(reqs: list[PDRequest], p_res: dict[str, Any], d_res: dict[str, Any],
                   c_res: dict[str, Any]) -> dict[str, Any]:
    """Each request's tokens in the PD pair against the colocated run: the prefill's
    first token is the colocated first; the decode side's ``output_len - 1`` tokens
    (its first recomputed from the received KV) are the colocated first ones."""
    po, do, co = p_res.get("outputs", {}), d_res.get("outputs", {}), c_res["outputs"]
    equal, diffs = 0, []
    for r in reqs:
        rid = wire_id(r.rid)
        ref = co.get(rid, [])
        pre, dec = po.get(rid, []), do.get(rid, [])
        want_dec = ref[:r.output_len - 1] if r.output_len > 1 else []
        problem = None
        if len(ref) != r.output_len:
            problem = f"colocated run sampled {len(ref)} of {r.output_len} tokens"
        elif pre[:1] != ref[:1]:
            problem = f"prefill's first token {pre[:1]} != colocated {ref[:1]}"
        elif dec != want_dec:
            at = next((i for i, (a, b) in enumerate(zip(dec, want_dec, strict=False))
                       if a != b), min(len(dec), len(want_dec)))
            problem = (f"decode token {at} differs ({len(dec)} sampled, "
                       f"{len(want_dec)} expected)")
        if problem is None:
            equal += 1
        else:
            diffs.append(f"{rid}: {problem}")
    return {"requests": len(reqs), "equal": equal, "mismatched": len(diffs),
            "examples": diffs[:8], "colocated_errors": c_res.get("errors", {})}


if __name__ == "__main__":
    _child_main(sys.argv[1])
