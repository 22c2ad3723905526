"""Per-transfer times, recorded the same way in every world.

``TransferLog`` wraps a world's ``TransferBackend`` and records each op's kind,
link, blocks, submit and done times, and its service time as the world
measures it (``Site.service_s``). Both worlds' reports summarise transfers
from it, which is what makes a simulated and a real replay comparable op by op.

Kept two ways: as ``records`` (a list per op, for worlds that read them), or,
with ``keep_records=False``, as columns of numbers in submit order (a few bytes
per op, what a long simulated replay keeps); both summarise to the same figures,
bit for bit.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvflow.manager import TransferOp
from kvflow.profile import LINKS as LINK_NAMES
from kvflow.runtime import LINKS

__all__ = ["TransferLog", "summarize_logs", "summarize_transfers"]

_KINDS: list[str] = []  # op kind values by column code (shared: codes are only compared)


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
                 service: Callable[[Any], float | None], keep_records: bool = True) -> None:
        self.backend = backend
        self.num_layers = backend.num_layers
        self._loop = loop
        self._service = service
        #: [kind, link, blocks, submit time, done time, ok, handle, service_s, column]
        #: per op, or None (``keep_records=False``: only the columns below)
        self.records: list[list[Any]] | None = [] if keep_records else None
        # Columns, one entry per op in submit order: kind code, link code, blocks,
        # done with a service time (1) or not (0), service and latency (s).
        self._kind = array("b")
        self._link = array("b")
        self._blocks = array("q")
        self._ok = array("b")
        self._service_s = array("d")
        self._latency_s = array("d")
        #: Blocks submitted and not yet done, per link (a router's view of the backlog).
        self.inflight_blocks: dict[str, int] = dict.fromkeys(LINK_NAMES, 0)
        #: Ops submitted and not yet done.
        self.open_ops = 0

    def __len__(self) -> int:
        """Ops recorded (since the last ``restart``)."""
        return len(self._ok)

    def restart(self) -> None:
        """Forget every op recorded so far: what a long-lived stack calls between passes
        whose summaries are each their own, so that it keeps one pass's ops, not every
        pass's. Refused while an op is in flight (its end is recorded in place)."""
        if self.open_ops:
            raise RuntimeError(f"{self.open_ops} ops still in flight")
        if self.records is not None:
            self.records = []
        for name in ("_kind", "_link", "_blocks", "_ok", "_service_s", "_latency_s"):
            col = getattr(self, name)
            setattr(self, name, array(col.typecode))

    def submit(self, op: TransferOp, sink: Any, after: Any = ()) -> Any:
        link = LINKS.get((op.src_tier, op.dst_tier), "?")
        kind = op.kind.value
        rec = [kind, link, op.num_blocks, self._loop.time(), None, False, None, None,
               len(self._ok)]
        if self.records is not None:
            self.records.append(rec)
        if kind not in _KINDS:
            _KINDS.append(kind)
        self._kind.append(_KINDS.index(kind))
        self._link.append(_LINK_CODE.get(link, -1))
        self._blocks.append(op.num_blocks)
        self._ok.append(0)
        self._service_s.append(0.0)
        self._latency_s.append(0.0)
        if link in self.inflight_blocks:
            self.inflight_blocks[link] += op.num_blocks
        self.open_ops += 1
        rec[6] = handle = self.backend.submit(op, _LoggedSink(self, rec, sink), after)
        return handle

    def cancel(self, handle: Any) -> None:
        self.backend.cancel(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def _done(self, rec: list[Any], error: BaseException | None) -> None:
        self.open_ops -= 1
        if rec[1] in self.inflight_blocks:
            self.inflight_blocks[rec[1]] -= rec[2]
        rec[4] = self._loop.time()
        rec[5] = error is None
        if error is None:
            rec[7] = self._service(rec[6])
        rec[6] = None  # let handles and events go
        i = rec[8]
        if rec[7] is not None:
            self._ok[i] = 1
            self._service_s[i] = rec[7]
        self._latency_s[i] = rec[4] - rec[3]

    def metrics(self) -> dict[str, Any]:
        """The inner backend's, or per-link ``busy_s`` summed from service times."""
        inner = getattr(self.backend, "metrics", None)
        if inner is not None:
            return inner()
        busy = dict.fromkeys(LINK_NAMES, 0.0)
        if self.records is not None:
            for rec in self.records:
                if rec[7] is not None and rec[1] in busy:
                    busy[rec[1]] += rec[7]
        else:
            for link, ok, service in zip(self._link, self._ok, self._service_s, strict=True):
                if ok and link >= 0:
                    busy[LINK_NAMES[link]] += service
        return {k: {"busy_s": v} for k, v in busy.items()}

    def summary(self, since: int = 0) -> dict[str, Any]:
        """Per op kind: ops, blocks, mean/p50 service and latency, service per block; of
        the ops from the ``since``-th on."""
        return summarize_logs([self], since)


_LINK_CODE = {name: i for i, name in enumerate(LINK_NAMES)}


def summarize_logs(logs: Sequence[TransferLog], since: int = 0) -> dict[str, Any]:
    """``summarize_transfers`` over several logs' ops, log after log (a cluster's); in each,
    the ops from the ``since``-th on."""
    if all(log.records is not None for log in logs):
        return summarize_transfers([r for log in logs
                                    for r in log.records[since:]])  # type: ignore[index]
    kind = np.concatenate([np.frombuffer(log._kind, dtype=np.int8)[since:] for log in logs])
    ok = np.concatenate([np.frombuffer(log._ok, dtype=np.int8)[since:] for log in logs]) == 1
    service = np.concatenate([np.frombuffer(log._service_s)[since:] for log in logs])
    latency = np.concatenate([np.frombuffer(log._latency_s)[since:] for log in logs])
    blocks = np.concatenate([np.frombuffer(log._blocks, dtype=np.int64)[since:]
                             for log in logs])
    out: dict[str, Any] = {}
    for name in sorted({_KINDS[k] for k in np.unique(kind)}):
        sel = ok & (kind == _KINDS.index(name))
        if not sel.any():
            continue
        out[name] = _kind_summary(service[sel], latency[sel], blocks[sel].astype(float))
    return out


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
        out[kind] = _kind_summary(service, latency, blocks)
    return out


def _kind_summary(service: np.ndarray, latency: np.ndarray,
                  blocks: np.ndarray) -> dict[str, Any]:
    return {
        "ops": len(service), "blocks": int(blocks.sum()),
        "service_mean_s": float(service.mean()),
        "service_p50_s": float(np.percentile(service, 50)),
        "service_per_block_s": float(service.sum() / max(blocks.sum(), 1.0)),
        "latency_mean_s": float(latency.mean()),
        "latency_p50_s": float(np.percentile(latency, 50)),
    }
