#!/usr/bin/env python3
"""rdmax from Python: an echo server and a client in one process, 64 B and 1 MiB calls.

    PYTHONPATH=build/python python3 examples/python/hello.py [DEVICE ADDR]

Without arguments the two talk through this node's memory (no device needed); with a
device and an address that carries it (rxe0 192.0.2.1 in the VM) they talk through it.
"""
import sys

import rdmax

device, addr = (sys.argv[1], sys.argv[2]) if len(sys.argv) == 3 else (None, "127.0.0.1")
transports = ["rdma"] if device else None
with rdmax.rpc.Server(addr, 0, device=device, transports=transports) as srv:
    srv.on(1, lambda body: bytes(body))                       # echo
    srv.start()                                               # on a thread of its own
    with rdmax.rpc.Client(device=device, transports=transports) as cli:
        peer = cli.connect(addr, srv.port)
        assert cli.call(peer, 1, b"hello from Python") == b"hello from Python"
        big = bytes(range(256)) * 4096                        # 1 MiB
        out = bytearray(len(big))
        assert cli.call(peer, 1, big, reply_into=out) == big  # a view of `out`, no copy
        print(f"hello.py: 2 calls over {cli.transport(peer)}, 1 MiB checked; "
              f"client {cli.counters()['completed']} completed, server {srv.counters()['calls']} calls")
