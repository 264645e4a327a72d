"""Fixtures of the Python bindings' tests (tests/python, docs/python.md).

Meson runs them with PYTHONPATH=build/python (the extension and a copy of
the package); by hand: PYTHONPATH=build/python python3 -m pytest tests/python.
Every wait has a deadline: the servers serve on a background thread, calls
have timeouts, and the suite runs under meson's timeout.
"""

import pytest

import rdmax

ECHO = 1  # reply = request
FAIL = 2  # raises
SLOW = 3  # sleeps for the seconds its body says, then echoes
SIZE = 4  # reply: as many bytes as the body's decimal text says (pattern i % 251)

OPTS = dict(call_timeout=10.0, housekeeping=0.001, connect_timeout=10.0)


def pattern(n: int) -> bytes:
    return bytes(i % 251 for i in range(n))


def _slow(body):
    import time
    time.sleep(float(bytes(body).decode()))
    return bytes(body)


def _size(body):
    n = int(bytes(body).decode())
    return pattern(n)


def _fail(body):
    raise ValueError("this handler fails on purpose")


@pytest.fixture(params=["shm", "tcp"])
def transport(request):
    return request.param


@pytest.fixture
def server(transport):
    srv = rdmax.rpc.Server("127.0.0.1", 0, transports=[transport], **OPTS)
    srv.on(ECHO, lambda body: bytes(body))
    srv.on(FAIL, _fail)
    srv.on(SLOW, _slow)
    srv.on(SIZE, _size)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def client(transport):
    cli = rdmax.rpc.Client(transports=[transport], **OPTS)
    yield cli
    cli.close()


@pytest.fixture
def peer(server, client, transport):
    p = client.connect("127.0.0.1", server.port)
    assert client.transport(p) == transport
    return p
