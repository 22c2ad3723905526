"""The world-agnostic replay driver: trace -> manager, runtime, engine in a World -> report.

``run_replay(ReplayConfig(...))`` is the whole API most callers need; the
modules hold the config (``config``), the driver (``driver``), the report
builder (``report``) and the per-transfer log every world's report shares
(``transfer_log``).
"""

from kvflow.replay.config import (
    BACKENDS,
    MODES,
    ReplayConfig,
    Setup,
    make_manager,
    request_keys,
    resolve,
)
from kvflow.replay.driver import replay_in_world, run_replay, wire_engine
from kvflow.replay.report import REPORT_VERSION, Sampler, assemble_report, full_report, summary
from kvflow.replay.transfer_log import TransferLog

__all__ = [
    "BACKENDS", "MODES", "REPORT_VERSION", "ReplayConfig", "Sampler", "Setup", "TransferLog",
    "assemble_report", "full_report", "make_manager", "replay_in_world", "request_keys",
    "resolve", "run_replay", "summary", "wire_engine",
]
