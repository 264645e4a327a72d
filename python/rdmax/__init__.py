"""rdmax from Python: RPC between processes (node-local shared memory, TCP, RDMA
with a device), the machine's RDMA devices, and registered memory.

    import rdmax
    with rdmax.rpc.Server("127.0.0.1", 0) as srv:
        srv.on(1, lambda body: bytes(body))      # echo
        srv.start()                              # serves on a background thread
        with rdmax.rpc.Client() as cli:
            peer = cli.connect("127.0.0.1", srv.port)
            assert cli.call(peer, 1, b"hi") == b"hi"

docs/python.md has the tour: the GIL rule, reply lifetimes, asyncio.
"""

from ._rdmax import Arena, ArenaBlock, Error, Peer, RpcError, devices, stats
from . import rpc

__all__ = ["Arena", "ArenaBlock", "Error", "Peer", "RpcError", "devices", "rpc", "stats"]
