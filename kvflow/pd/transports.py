"""Ports over each transport, ready to use: in-process, TCP (server / client).

The GPU peer transport (``kernels.pd_peer``) is the in-process one over CUDA
memories: ``inproc_ports`` with two ``CudaBlockMemory`` objects.
"""

from __future__ import annotations

from kvflow.layout import ModelSpec
from kvflow.pd.link import InProcLink, Link, Local
from kvflow.pd.memory import BlockMemory
from kvflow.pd.ports import ReceivePort, SendPort
from kvflow.pd.tcp import TcpServer, connect


def inproc_ports(prefill: tuple[ModelSpec, BlockMemory], decode: tuple[ModelSpec, BlockMemory],
                 names: tuple[str, str] = ("prefill", "decode")) -> tuple[SendPort, ReceivePort]:
    """Two instances in one process; ``LayoutMismatch`` if their layouts differ."""
    (p_spec, p_mem), (d_spec, d_mem) = prefill, decode
    p_end, d_end = InProcLink.pair(Local(p_spec, names[0], "prefill"),
                                   Local(d_spec, names[1], "decode"))
    send = SendPort(p_mem)
    send.attach(p_end)
    return send, ReceivePort(d_mem, link=d_end)


async def tcp_send_port(spec: ModelSpec, memory: BlockMemory, host: str = "127.0.0.1",
                        port: int = 0, name: str = "prefill") -> tuple[SendPort, TcpServer]:
    """A prefill instance's port, listening (``server.port`` once started)."""
    send = SendPort(memory)
    server = await TcpServer(Local(spec, name, "prefill"), send.attach, host, port).start()
    return send, server


def tcp_receive_port(spec: ModelSpec, memory: BlockMemory, host: str, port: int,
                     name: str = "decode") -> ReceivePort:
    """A decode instance's port; connects on its first receive (and again after a
    broken link)."""
    local = Local(spec, name, "decode")

    async def dial() -> Link:
        return await connect(host, port, local)

    return ReceivePort(memory, connect=dial)
