"""rdmax.rpc from Python over the device-less transports (node-local shm and
TCP): every test runs once per transport (conftest.transport)."""

import array
import asyncio
import logging
import threading

import numpy as np
import pytest

import rdmax
from conftest import ECHO, FAIL, OPTS, SIZE, SLOW, pattern


def test_echo(client, peer):
    assert client.call(peer, ECHO, b"hello") == b"hello"
    assert client.call(peer, ECHO, b"") == b""


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "array", "numpy", "numpy2d"])
def test_body_types(client, peer, kind):
    raw = pattern(1000)
    body = {
        "bytes": lambda: raw,
        "bytearray": lambda: bytearray(raw),
        "memoryview": lambda: memoryview(raw)[100:900],
        "array": lambda: array.array("B", raw),
        "numpy": lambda: np.arange(250, dtype=np.float32),
        "numpy2d": lambda: np.arange(200, dtype=np.int32).reshape(10, 20),
    }[kind]()
    reply = client.call(peer, ECHO, body)
    assert isinstance(reply, bytes)
    assert reply == memoryview(body).tobytes()


def test_non_contiguous_is_type_error(client, peer):
    a = np.arange(100, dtype=np.int64)[::2]
    with pytest.raises(TypeError, match="C-contiguous"):
        client.call(peer, ECHO, a)
    with pytest.raises(TypeError):
        client.call(peer, ECHO, "a str is not bytes")
    with pytest.raises(TypeError):  # reply_into must be writable
        client.call(peer, ECHO, b"x", reply_into=b"read-only")
    # The client is still fine.
    assert client.call(peer, ECHO, b"ok") == b"ok"


def test_one_mib_both_ways(client, peer):
    n = 1 << 20
    body = np.frombuffer(pattern(n), dtype=np.uint8).copy()
    out = bytearray(n)
    reply = client.call(peer, ECHO, body, reply_into=out)
    assert isinstance(reply, memoryview)
    assert len(reply) == n
    assert reply.obj is out or bytes(reply[:16]) == bytes(out[:16])
    assert out == body.tobytes()
    # A reply over a slot without reply_into has nowhere to go.
    with pytest.raises(rdmax.RpcError) as e:
        client.call(peer, ECHO, body)
    assert e.value.status == "reply_too_large"
    # Large reply of a small request, into a numpy array.
    dst = np.zeros(n, dtype=np.uint8)
    got = client.call(peer, SIZE, str(n).encode(), reply_into=dst)
    assert len(got) == n
    assert dst.tobytes() == pattern(n)
    c = client.counters()
    assert c["external_bodies"] >= 2
    assert c["external_replies"] >= 2


def test_small_reply_into(client, peer):
    out = bytearray(64)
    got = client.call(peer, ECHO, b"abc", reply_into=out)
    assert bytes(got) == b"abc"
    assert out[:3] == b"abc"


def test_handler_raises(client, peer, server, caplog):
    with caplog.at_level(logging.ERROR, logger="rdmax.rpc"):
        with pytest.raises(rdmax.RpcError) as e:
            client.call(peer, FAIL, b"x")
    assert e.value.status == "handler_failed"
    assert isinstance(e.value, rdmax.Error)
    assert isinstance(server.last_handler_error, ValueError)
    assert "fails on purpose" in caplog.text
    # The server keeps serving.
    assert client.call(peer, ECHO, b"after") == b"after"
    assert server.counters()["handler_errors"] == 1


def test_handler_replies(client, peer, server):
    server.on(10, lambda body: (np.frombuffer(body, dtype=np.uint8) * 2).astype(np.uint8))
    server.on(11, lambda body: None)
    server.on(12, lambda body: "a str is not a reply")
    server.on(13, lambda body: memoryview(bytes(body)[::-1]))
    assert client.call(peer, 10, bytes([1, 2, 3])) == bytes([2, 4, 6])
    assert client.call(peer, 11, b"ignored") == b""
    with pytest.raises(rdmax.RpcError) as e:
        client.call(peer, 12, b"")
    assert e.value.status == "handler_failed"
    assert isinstance(server.last_handler_error, TypeError)
    assert client.call(peer, 13, b"abc") == b"cba"


def test_unknown_method(client, peer, server):
    with pytest.raises(rdmax.RpcError) as e:
        client.call(peer, 999, b"x")
    assert e.value.status == "unknown_method"
    assert server.counters()["unknown_method"] == 1
    with pytest.raises(ValueError):
        client.call(peer, 0, b"x")


def test_timeout(client, peer):
    with pytest.raises(rdmax.RpcError) as e:
        client.call(peer, SLOW, b"0.5", timeout=0.1)
    assert e.value.status == "timed_out"
    assert client.counters()["timed_out"] == 1
    with pytest.raises(ValueError):
        client.call(peer, ECHO, b"x", timeout=0)
    # The next call goes through once the server is free again.
    assert client.call(peer, ECHO, b"next", timeout=5) == b"next"


def test_counters(client, peer, server):
    before_c = client.counters()
    before_s = server.counters()
    for i in range(10):
        client.call(peer, ECHO, bytes([i]) * 10)
    with pytest.raises(rdmax.RpcError):
        client.call(peer, 999, b"")
    c = client.counters()
    s = server.counters()
    assert c["calls"] - before_c["calls"] == 11
    assert c["completed"] - before_c["completed"] == 10
    assert c["failed"] - before_c["failed"] == 1
    assert s["calls"] - before_s["calls"] == 11
    assert s["unknown_method"] - before_s["unknown_method"] == 1
    assert c["bytes_out"] > before_c["bytes_out"]
    transport = client.transport(peer)
    if transport == "shm":
        assert c["connected_local"] == 1
    else:
        assert c["connected_tcp"] == 1
    # Every field of rpc_counters is there.
    for key in ("calls", "completed", "failed", "timed_out", "cancelled", "late_replies",
                "no_credit", "external_bodies", "external_replies", "keepalive_probes",
                "reconnects", "bytes_in", "bytes_out", "rejected", "connected",
                "disconnected", "last_refusal", "stray_completions"):
        assert key in c
    assert server.peers() == 1


def test_async_64_in_flight(client, peer):
    async def main():
        bodies = [pattern(i * 37 % 3000 + 1) for i in range(64)]
        replies = await asyncio.wait_for(
            asyncio.gather(*(client.call_async(peer, ECHO, b) for b in bodies)), 30)
        assert replies == bodies
        # More than the slots: the rest wait for a slot, in order.
        bodies = [str(i).encode() * 3 for i in range(300)]
        replies = await asyncio.wait_for(
            asyncio.gather(*(client.call_async(peer, ECHO, b) for b in bodies)), 30)
        assert replies == bodies
        # Errors arrive as exceptions of their own call only.
        res = await asyncio.wait_for(asyncio.gather(
            client.call_async(peer, FAIL, b""), client.call_async(peer, 999, b""),
            client.call_async(peer, ECHO, b"fine"), return_exceptions=True), 30)
        assert isinstance(res[0], rdmax.RpcError) and res[0].status == "handler_failed"
        assert isinstance(res[1], rdmax.RpcError) and res[1].status == "unknown_method"
        assert res[2] == b"fine"
    asyncio.run(main())
    assert client.in_flight() == 0


def test_async_large_and_timeout(client, peer):
    async def main():
        n = 1 << 20
        out = np.zeros(n, dtype=np.uint8)
        got = await asyncio.wait_for(
            client.call_async(peer, ECHO, pattern(n), reply_into=out), 30)
        assert len(got) == n and out.tobytes() == pattern(n)
        with pytest.raises(rdmax.RpcError) as e:
            await asyncio.wait_for(client.call_async(peer, SLOW, b"0.5", timeout=0.1), 30)
        assert e.value.status == "timed_out"
    asyncio.run(main())


def test_async_spin(server, transport):
    with rdmax.rpc.Client(transports=[transport], async_spin=50e-6, **OPTS) as cli:
        peer = cli.connect("127.0.0.1", server.port)

        async def main():
            bodies = [pattern(i + 1) for i in range(100)]
            for b in bodies[:20]:  # one at a time: the pump spins for each reply
                assert await asyncio.wait_for(cli.call_async(peer, ECHO, b), 30) == b
            assert await asyncio.wait_for(
                asyncio.gather(*(cli.call_async(peer, ECHO, b) for b in bodies)), 30) == bodies
        asyncio.run(main())
    with pytest.raises(ValueError):
        rdmax.rpc.Client(async_spin=-1)


def test_async_on_a_second_loop(client, peer):
    # asyncio.run twice with one client: the second loop takes over.
    for k in range(2):
        got = asyncio.run(asyncio.wait_for(client.call_async(peer, ECHO, bytes([k])), 30))
        assert got == bytes([k])


def test_async_cancel(client, peer):
    async def main():
        task = asyncio.ensure_future(client.call_async(peer, SLOW, b"0.3", timeout=5))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The client goes on.
        assert await asyncio.wait_for(client.call_async(peer, ECHO, b"on"), 30) == b"on"
    asyncio.run(main())
    assert client.counters()["cancelled"] == 1


def test_threads_share_a_client(client, peer):
    errors = []

    def worker(k):
        try:
            for i in range(50):
                body = f"{k}:{i}".encode()
                assert client.call(peer, ECHO, body) == body
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_handler_cannot_reenter_its_server(client, peer, server):
    seen = []

    def reenter(body):
        seen.append(server.counters()["calls"])  # allowed: a read
        server.poll(0)  # not allowed: raises, answered handler_failed

    server.on(9, reenter)
    with pytest.raises(rdmax.RpcError) as e:
        client.call(peer, 9, b"")
    assert e.value.status == "handler_failed"
    assert isinstance(server.last_handler_error, RuntimeError)
    assert seen


def test_bad_options():
    with pytest.raises(TypeError, match="unknown rpc option"):
        rdmax.rpc.Client(no_such_option=1)
    with pytest.raises(ValueError):
        rdmax.rpc.Client(transports=["carrier-pigeon"])
    with pytest.raises(rdmax.Error):
        rdmax.rpc.Client(transports=["shm"], slot_bytes=7)  # rpc_options::check


def test_connect_refused_is_error():
    with rdmax.rpc.Client(transports=["shm"], **OPTS) as cli:
        with pytest.raises(rdmax.Error) as e:
            cli.connect("127.0.0.1", 1)  # nobody serves there
        assert str(e.value)


def test_closed_objects():
    srv = rdmax.rpc.Server("127.0.0.1", 0, transports=["shm"], **OPTS)
    srv.close()
    srv.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        srv.poll(0)
    cli = rdmax.rpc.Client(transports=["shm"])
    cli.close()
    with pytest.raises(RuntimeError, match="closed"):
        cli.counters()


def test_refused_buffer_is_released(client, peer):
    """A body refused (not contiguous) leaves its object as it was: resizable."""
    ba = bytearray(10)
    with pytest.raises(TypeError, match="C-contiguous"):
        client.call(peer, ECHO, memoryview(ba)[::2])
    ba.append(0)  # BufferError if the refused export were still held
    assert len(ba) == 11


def test_handler_body_is_a_copy_unless_zero_copy(transport):
    """By default a handler gets bytes (nothing it keeps sees the ring);
    zero_copy=True gives the ring's memoryview, released after the call."""
    kept = {}

    def keep(name):
        def h(body):
            kept[name] = body
            return b""
        return h

    with rdmax.rpc.Server("127.0.0.1", 0, transports=[transport], **OPTS) as srv:
        srv.on(1, keep("copy"))
        srv.on(2, keep("view"), zero_copy=True)
        srv.start()
        with rdmax.rpc.Client(transports=[transport], **OPTS) as cli:
            p = cli.connect("127.0.0.1", srv.port)
            cli.call(p, 1, b"first")
            cli.call(p, 2, b"second")
            cli.call(p, 1, b"third, in the same slot")
    assert kept["copy"] == b"third, in the same slot"
    assert isinstance(kept["view"], memoryview)
    with pytest.raises(ValueError):  # released: no read of the ring after the call
        bytes(kept["view"])


def test_dropped_server_is_collected():
    """A Server dropped without close() is freed (its port too): its error
    hook holds it weakly, so no cycle through the extension keeps it."""
    import gc
    import weakref

    srv = rdmax.rpc.Server("127.0.0.1", 0, transports=["tcp"], **OPTS)
    srv.on(1, lambda body: body)
    ref = weakref.ref(srv)
    del srv
    gc.collect()
    assert ref() is None


def test_start_then_stop_at_once_and_stop_from_a_handler():
    """stop() right after start() ends the thread (it is not lost to the
    thread clearing the flag); stop() from inside a handler does not join
    the serving thread from itself (close() there is refused: not re-entrant)."""
    srv = rdmax.rpc.Server("127.0.0.1", 0, transports=["tcp"], **OPTS)
    for _ in range(20):
        srv.start()
        srv.stop()

    def stopper(body):
        srv.stop()
        return b"stopped"

    srv.on(1, stopper)
    srv.start()
    with rdmax.rpc.Client(transports=["tcp"], **OPTS) as cli:
        p = cli.connect("127.0.0.1", srv.port)
        assert cli.call(p, 1, b"x", timeout=5.0) == b"stopped"
    srv.close()
    assert srv._thread is None


def test_process_stats_as_dicts(client, peer, server):
    """rdmax.stats(): this process's published counters (docs/stats.md), the
    endpoints' and, with them, the arenas' (and the caches', where there are)."""
    import time

    for _ in range(5):
        client.call(peer, ECHO, b"s")
    deadline = time.monotonic() + 10
    kinds = set()
    while time.monotonic() < deadline:
        objs = rdmax.stats()
        kinds = {o["kind"] for o in objs}
        clients = [o for o in objs if o["kind"] == "rpc_client" and o["values"]["completed"] >= 5]
        if clients and "arena" in kinds:
            break
        client.call(peer, ECHO, b"s")  # its housekeeping publishes
        time.sleep(0.05)
    assert "arena" in kinds and "rpc_server" in kinds
    assert clients, kinds
    assert set(clients[0]["values"]) >= {"calls", "completed", "bytes_in", "in_flight"}
