"""A prefill peer in its own process, for the test that kills one mid-transfer.

``python tests/pd_peer_process.py`` (the repository root on PYTHONPATH) listens on
loopback, prints its port, waits for one pull, sends the first layer of it (the real
bytes a prefill of those keys writes) and then hangs, as a peer stuck mid-transfer
until it is killed.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

from kvflow.pd.memory import ArrayMemory
from kvflow.pd.transports import tcp_send_port
from kvflow.realtime.cpu import block_bytes
from kvflow.realtime.pd_instance import tiny_spec


async def main() -> None:
    spec = tiny_spec()
    lay = spec.layout
    mem = ArrayMemory(np.zeros((lay.num_layers, 64, lay.bytes_per_layer_block), np.uint8))
    port, server = await tcp_send_port(spec, mem)
    print(server.port, flush=True)
    request = sys.stdin.readline().strip()
    pull = await port.pull(request)
    keys = [("dies", j) for j in range(pull.end)]
    ids = np.arange(pull.first, pull.end)
    for i, b in enumerate(ids):
        mem.array[:, b] = block_bytes(keys[pull.first + i], lay.num_layers,
                                      lay.bytes_per_layer_block)
    await port.put(pull, 0, pull.first, ids)
    print("sent", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main())
