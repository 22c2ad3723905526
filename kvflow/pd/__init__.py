"""Prefill/decode disaggregation: a request's prompt KV sent from the instance that
prefilled it to the one that decodes it, layer by layer, as prefill writes it.

Layers, from the wire up:

* ``wire``    — the frame format (versioned header, XXH3 checksums, layout fingerprint);
* ``memory``  — ``BlockMemory``: an instance's device blocks as layers of bytes;
* ``link``    — the transports' one protocol (``Link``) and the in-process link (a
  direct copy between two pools; on a GPU ``kernels.pd_peer``'s device copies);
* ``tcp``     — the TCP link (an asyncio buffered protocol, host staging), with a
  handshake that refuses a peer of another layout;
* ``ports``   — the pull protocol on links: ``SendPort`` (prefill), ``ReceivePort`` (decode);
* ``backend`` — ``PDBackend``, the ``TransferBackend`` running SEND / RECEIVE ops;
* ``verbs``   — ``PrefillSide.send`` and ``DecodeSide.receive`` wired into an ``Engine``.

This package is core: it knows the engine, the runtime and the manager, never a
world or the driver. The PD engine pair of the real-time CPU world (``kvflow
serve-pd``: a prefill and a decode engine as two processes) is
``kvflow.realtime.pd_serve``; the GPU memory for the transports is
``kernels.pd_peer``.
"""

from kvflow.pd.backend import PDBackend, ReceiveJob, SendJob
from kvflow.pd.link import InProcLink, Local
from kvflow.pd.memory import ArrayMemory, BlockMemory
from kvflow.pd.ports import ReceivePort, SendPort
from kvflow.pd.tcp import TcpLink, TcpServer, connect
from kvflow.pd.verbs import DecodeSide, PrefillSide
from kvflow.pd.wire import CorruptFrame, LayoutMismatch, ProtocolError

__all__ = [
    "ArrayMemory", "BlockMemory", "CorruptFrame", "DecodeSide", "InProcLink", "LayoutMismatch",
    "Local", "PDBackend", "PrefillSide", "ProtocolError", "ReceiveJob", "ReceivePort",
    "SendJob", "SendPort", "TcpLink", "TcpServer", "connect",
]
