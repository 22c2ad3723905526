"""Per-transfer times, recorded the same way in every world.

``TransferLog`` wraps a world's ``TransferBackend`` and records each op's kind,
link, blocks, submit and done times, and its service time as the world
measures it (``Site.service_s``). Both worlds' reports summarise transfers
from it, which is what makes a simulated and a real replay comparable op by op.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from kvflow.manager import TransferOp
from kvflow.profile import LINKS as LINK_NAMES
from kvflow.runtime import LINKS

__all__ = ["TransferLog"]


class _LoggedSink:
    """Forwards a backend's reports to the runtime's sink; notes when the op ended."""

    __slots__ = ("_log", "_rec", "_sink", "layer_done", "lazy_layers")

    def __init__(self, log: TransferLog, rec: list[Any], sink: Any) -> None:
        self._log, self._rec, self._sink = log, rec, sink
        self.layer_done = sink.layer_done  # per layer: no extra frame
        self.lazy_layers = getattr(sink, "lazy_layers", False)

    def done(self, error: BaseException | None = None) -> None:
        self._log._done(self._rec, error)
        self._sink.done(error)


class TransferLog:
    """A ``TransferBackend`` wrapper recording every op's kind, blocks and times.

    Both worlds wrap their backend in one, so their reports measure transfers
    the same way: ``latency`` from submit to the op's end in loop time
    (queueing and dependencies included) and ``service`` from the op's first
    layer starting on its link to its last layer landing, as the world's
    ``service(handle, token)`` reports it (simulated: from the link model's
    times; CUDA: from the task's own events around its copies). Handles are
    the inner backend's, so device-side waits (``wait_layer``) work unchanged.
    """

    def __init__(self, backend: Any, loop: asyncio.AbstractEventLoop,
                 service: Callable[[Any], float | None]) -> None:
        self.backend = backend
        self.num_layers = backend.num_layers
        self._loop = loop
        self._service = service
        #: [kind, link, blocks, submit time, done time, ok, handle, service_s]
        self.records: list[list[Any]] = []
        #: Blocks submitted and not yet done, per link (a router's view of the backlog).
        self.inflight_blocks: dict[str, int] = dict.fromkeys(LINK_NAMES, 0)

    def submit(self, op: TransferOp, sink: Any, after: Any = ()) -> Any:
        link = LINKS.get((op.src_tier, op.dst_tier), "?")
        rec = [op.kind.value, link, op.num_blocks, self._loop.time(), None, False, None, None]
        self.records.append(rec)
        if link in self.inflight_blocks:
            self.inflight_blocks[link] += op.num_blocks
        rec[6] = handle = self.backend.submit(op, _LoggedSink(self, rec, sink), after)
        return handle

    def cancel(self, handle: Any) -> None:
        self.backend.cancel(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def _done(self, rec: list[Any], error: BaseException | None) -> None:
        if rec[1] in self.inflight_blocks:
            self.inflight_blocks[rec[1]] -= rec[2]
        rec[4] = self._loop.time()
        rec[5] = error is None
        if error is None:
            rec[7] = self._service(rec[6])
        rec[6] = None  # let handles and events go

    def metrics(self) -> dict[str, Any]:
        """The inner backend's, or per-link ``busy_s`` summed from service times."""
        inner = getattr(self.backend, "metrics", None)
        if inner is not None:
            return inner()
        busy = dict.fromkeys(LINK_NAMES, 0.0)
        for rec in self.records:
            if rec[7] is not None and rec[1] in busy:
                busy[rec[1]] += rec[7]
        return {k: {"busy_s": v} for k, v in busy.items()}

    def summary(self) -> dict[str, Any]:
        """Per op kind: ops, blocks, mean/p50 service and latency, service per block."""
        return summarize_transfers(self.records)


def summarize_transfers(records: list[list[Any]]) -> dict[str, Any]:
    """Per op kind of ``TransferLog`` records (one log's, or several's together): ops,
    blocks, mean/p50 service and latency, service per block."""
    out: dict[str, Any] = {}
    kinds = sorted({r[0] for r in records})
    for kind in kinds:
        done = [r for r in records if r[0] == kind and r[5] and r[7] is not None]
        if not done:
            continue
        service = np.array([r[7] for r in done])
        latency = np.array([r[4] - r[3] for r in done])
        blocks = np.array([r[2] for r in done], dtype=float)
        out[kind] = {
            "ops": len(done), "blocks": int(blocks.sum()),
            "service_mean_s": float(service.mean()),
            "service_p50_s": float(np.percentile(service, 50)),
            "service_per_block_s": float(service.sum() / max(blocks.sum(), 1.0)),
            "latency_mean_s": float(latency.mean()),
            "latency_p50_s": float(np.percentile(latency, 50)),
        }
    return out
