#!/usr/bin/env python3
"""64 B echo from Python: rdmax.rpc on the node-local path (shm), over
rdmax's TCP and, with --device, through an RDMA device, against asyncio's own
TCP streams on loopback, in one run.

    PYTHONPATH=build/python python3 examples/bench/python_echo_bench.py [-n CALLS] [--rounds R]
        [--cxx build/examples/bench/rdmax_rpc_bench] [--device DEV --addr ADDR]

Each server runs in a process of its own (this script with --serve), its
handler a Python function: rdmax's sleeps on its fd() when idle, as
Server.serve_forever() does (poll(0.05)), except in the "spin" row (poll(0)
in a loop, as rdmax_rpc_bench's C++ server does); asyncio's is its loop. The
client runs here, one call in flight unless said, and every reply is checked.
Rows:
  rdmax-shm sync     Client.call (spins on the reply, GIL released)
  rdmax-shm sync spin  the same against a spinning server
  rdmax-shm async    await Client.call_async, 1 and 64 in flight (the loop sleeps on fd())
  rdmax-tcp sync     Client.call over rdmax's TCP transport
  asyncio-tcp        asyncio streams: 4-byte length + body each way, 1 in flight
With --device DEV --addr ADDR (both ends on this node, on ADDR, the device's
address; transports=["rdma"] alone, so the node-local path is not taken):
  rdmax-rdma sync    Client.call through the device
  rdmax-rdma sync spin  the same against a spinning server
With --cxx, rdmax_rpc_bench --sweep latency (C++ client and server, local and
rdmax-tcp rows; with --device, its rdmax row through the device on ADDR too,
a second run of it) runs too, for the C++ figures of the same run. Medians of
the rounds are printed, with the ratios.
"""

import argparse
import asyncio
import os
import select
import statistics
import struct
import subprocess
import sys
import time

BODY = bytes(range(64))
START_DEADLINE = 120.0  # seconds for a server process to say its port (slow under TCG)


def serve(kind: str, transport: str, mode: str = "wait", addr: str = "127.0.0.1",
          device: str = "-") -> None:
    """The server process: prints its port, serves until stdin closes."""
    import threading

    def watch_stdin(stop):
        sys.stdin.read()
        stop()

    if kind == "rdmax":
        import rdmax
        srv = rdmax.rpc.Server(addr, 0, transports=[transport], housekeeping=0.001,
                               device=None if device == "-" else device)
        srv.on(1, lambda body: bytes(body))
        done = threading.Event()
        threading.Thread(target=watch_stdin, args=(done.set,), daemon=True).start()
        print(srv.port, flush=True)
        while not done.is_set():
            if mode == "spin":
                for _ in range(1000):
                    srv.poll(0)  # spinning, as the C++ bench's server does
            else:
                srv.poll(0.05)  # sleeping on fd() when idle, as serve_forever() does
        srv.close()
        return

    async def handle(reader, writer):
        try:
            while True:
                n = struct.unpack("!I", await reader.readexactly(4))[0]
                body = await reader.readexactly(n)
                writer.write(struct.pack("!I", n) + body)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        print(port, flush=True)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        threading.Thread(target=watch_stdin, args=(lambda: loop.call_soon_threadsafe(stop.set),),
                         daemon=True).start()
        await stop.wait()
        server.close()

    asyncio.run(main())


class server_process:
    def __init__(self, kind: str, transport: str = "shm", mode: str = "wait",
                 addr: str = "127.0.0.1", device: str = "-") -> None:
        self.p = subprocess.Popen([sys.executable, __file__, "--serve", kind, transport, mode,
                                   addr, device],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.p.stdout], [], [], START_DEADLINE)
        line = self.p.stdout.readline() if ready else ""
        if not line:
            self.p.kill()
            self.p.wait()
            raise RuntimeError(f"{kind} server ({transport}, {device}) did not start"
                               + ("" if ready else f" in {START_DEADLINE:.0f} s"))
        self.port = int(line)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.p.stdin.close()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def summary(lat_ns: list, seconds: float, calls: int) -> tuple:
    lat_ns.sort()
    return (lat_ns[len(lat_ns) // 2] / 1000.0, calls / seconds)


def rdmax_sync(transport: str, n: int, mode: str = "wait", addr: str = "127.0.0.1",
               device: str = "-") -> tuple:
    import rdmax
    with server_process("rdmax", transport, mode, addr, device) as s, \
            rdmax.rpc.Client(transports=[transport], housekeeping=0.001,
                             device=None if device == "-" else device) as cli:
        peer = cli.connect(addr, s.port)
        assert cli.transport(peer) == transport
        for _ in range(1000):  # warm up
            cli.call(peer, 1, BODY)
        lat = []
        call = cli.call
        clock = time.perf_counter_ns
        t0 = time.perf_counter()
        for _ in range(n):
            a = clock()
            r = call(peer, 1, BODY)
            lat.append(clock() - a)
            if r != BODY:
                raise AssertionError("wrong reply")
        return summary(lat, time.perf_counter() - t0, n)


def rdmax_async(n: int, inflight: int) -> tuple:
    import rdmax

    async def main(cli, peer):
        lat = []
        clock = time.perf_counter_ns

        async def one(k):
            for _ in range(k):
                a = clock()
                r = await cli.call_async(peer, 1, BODY)
                lat.append(clock() - a)
                if r != BODY:
                    raise AssertionError("wrong reply")

        await one(200)  # warm up
        lat.clear()
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(one(n // inflight) for _ in range(inflight))), 300)
        return summary(lat, time.perf_counter() - t0, (n // inflight) * inflight)

    with server_process("rdmax", "shm") as s, \
            rdmax.rpc.Client(transports=["shm"], housekeeping=0.001) as cli:
        peer = cli.connect("127.0.0.1", s.port)
        return asyncio.run(main(cli, peer))


def asyncio_tcp(n: int) -> tuple:
    async def main(port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sock = writer.get_extra_info("socket")
        import socket
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = struct.pack("!I", len(BODY)) + BODY

        async def call():
            writer.write(msg)
            n = struct.unpack("!I", await reader.readexactly(4))[0]
            return await reader.readexactly(n)

        for _ in range(1000):
            await call()
        lat = []
        clock = time.perf_counter_ns
        t0 = time.perf_counter()
        for _ in range(n):
            a = clock()
            r = await call()
            lat.append(clock() - a)
            if r != BODY:
                raise AssertionError("wrong reply")
        s = summary(lat, time.perf_counter() - t0, n)
        writer.close()
        return s

    with server_process("asyncio") as s:
        return asyncio.run(main(s.port))


def cxx_rows(path: str, n: int, transports: str = "local,rdmax-tcp,tcp",
             more: tuple = ()) -> dict:
    """rdmax_rpc_bench --sweep latency: {transport: its output line}, and its header."""
    out = subprocess.run([path, "--sweep", "latency", "--transports", transports,
                          "-n", str(n), *more], capture_output=True, text=True, timeout=600)
    rows = {}
    for line in out.stdout.splitlines():
        f = line.split()
        if len(f) >= 7 and f[0] in ("transport", *transports.split(",")):
            rows[f[0]] = line.rstrip()
    if out.returncode != 0 or len(rows) < 2:
        raise RuntimeError(f"{path}: exit {out.returncode}, {len(rows) - 1} rows\n"
                           f"{out.stdout}{out.stderr}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=20000, help="calls per row and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cxx", help="rdmax_rpc_bench to run for the C++ rows")
    ap.add_argument("--device", help="RDMA device (rxe0) for the rdmax-rdma rows; needs --addr")
    ap.add_argument("--addr", help="the device's address (192.0.2.1): both ends bind it")
    ap.add_argument("--serve", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(*a.serve)
        return
    if (a.device is None) != (a.addr is None):
        ap.error("--device and --addr go together")
    rows = {
        "rdmax-shm sync": lambda: rdmax_sync("shm", a.n),
        "rdmax-shm sync spin": lambda: rdmax_sync("shm", a.n, "spin"),
        "rdmax-shm async x1": lambda: rdmax_async(a.n // 2, 1),
        "rdmax-shm async x64": lambda: rdmax_async(a.n, 64),
        "rdmax-tcp sync": lambda: rdmax_sync("tcp", a.n),
        "asyncio-tcp": lambda: asyncio_tcp(a.n),
    }
    if a.device:
        rows["rdmax-rdma sync"] = lambda: rdmax_sync("rdma", a.n, "wait", a.addr, a.device)
        rows["rdmax-rdma sync spin"] = lambda: rdmax_sync("rdma", a.n, "spin", a.addr, a.device)
    got = {k: [] for k in rows}
    for r in range(a.rounds):
        for name, run in rows.items():
            got[name].append(run())
            print(f"round {r + 1}: {name}: p50 {got[name][-1][0]:.1f} us, "
                  f"{got[name][-1][1]:.0f} calls/s", file=sys.stderr)
    base = statistics.median(x[0] for x in got["asyncio-tcp"]), \
        statistics.median(x[1] for x in got["asyncio-tcp"])
    print(f"64 B echo from Python, median of {a.rounds} rounds of {a.n} calls "
          f"(x64: 64 calls in flight)")
    print(f"{'row':<22} {'p50 us':>8} {'calls/s':>10} {'p50 vs asyncio':>15} "
          f"{'calls/s vs asyncio':>19}")
    for name in rows:
        p50 = statistics.median(x[0] for x in got[name])
        rate = statistics.median(x[1] for x in got[name])
        print(f"{name:<22} {p50:8.1f} {rate:10.0f} {p50 / base[0]:14.2f}x {rate / base[1]:18.2f}x")
    if a.cxx:
        rows = cxx_rows(a.cxx, a.n)
        print(f"\nC++ client and spinning C++ server (rdmax_rpc_bench --sweep latency -n {a.n}, "
              f"same run, after the rounds above):")
        for line in rows.values():
            print(line)
        pairs = [("rdmax-shm sync spin", "local"), ("rdmax-tcp sync", "rdmax-tcp")]
        if a.device:
            dev = cxx_rows(a.cxx, a.n, "rdmax", ("-a", a.addr))
            print(f"(through the device: rdmax_rpc_bench --sweep latency --transports rdmax "
                  f"-a {a.addr} -n {a.n})")
            print(dev["rdmax"])
            rows["rdmax"] = dev["rdmax"]
            pairs += [("rdmax-rdma sync spin", "rdmax"), ("rdmax-rdma sync", "rdmax")]
        for py_row, cxx_row in pairs:
            if cxx_row in rows:
                f = rows[cxx_row].split()
                p50 = statistics.median(x[0] for x in got[py_row])
                rate = statistics.median(x[1] for x in got[py_row])
                print(f"Python {py_row} / C++ {cxx_row}: p50 {p50 / float(f[4]):.2f}x, "
                      f"calls/s {rate / float(f[6]):.2f}x")


if __name__ == "__main__":
    main()
