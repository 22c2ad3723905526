"""The real-time CPU world: real bytes, real block stores, wall-clock time, no GPU.

``cpu`` holds its backend (device <-> host copies between numpy arrays) and its
executor (key-derived bytes written and checked); ``stack`` wires them with a
store behind one runtime and replays requests through the reference engine.
``pd_instance``, ``pd_serve`` and ``pd_cli`` are prefill/decode disaggregation in
this world: a prefill and a decode engine as two processes over TCP
(``kvflow serve-pd``), the transfers being ``kvflow.pd``'s.
"""

from kvflow.realtime.stack import (
    RealtimeConfig,
    RealtimeStack,
    engine_requests,
    run_realtime,
    service_s,
    tiny_spec,
)

__all__ = ["RealtimeConfig", "RealtimeStack", "engine_requests", "run_realtime", "service_s",
           "tiny_spec"]
