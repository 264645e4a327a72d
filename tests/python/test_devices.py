"""rdmax.devices() and rdmax.Arena: an empty list and an rdmax.Error where
there is no device (checked everywhere); registered memory and RPC through
the device where there is one (skipped without, saying so). The device and
address are the C++ rxe suite's: RDMAX_TEST_DEVICE (default: the first
with an ACTIVE port) and RDMAX_TEST_ADDR (default 192.0.2.1, the VM's)."""

import os

import numpy as np
import pytest

import rdmax

DEVICES = rdmax.devices()
# The rxe suite's run (python_rxe) sets it: there a missing device fails, never skips.
REQUIRED = os.environ.get("RDMAX_PYTHON_DEVICE_REQUIRED") == "1"
needs_device = pytest.mark.skipif(not DEVICES and not REQUIRED,
                                  reason="no RDMA device on this machine (rdmax.devices() is "
                                  "empty): the VM's rxe suite runs this (python_rxe)")


def test_devices_is_a_list():
    assert isinstance(DEVICES, list)
    for d in DEVICES:
        assert d["name"]
        assert d["max_mr_size"] > 0
        assert d["max_qp_wr"] > 0
        assert len(d["ports"]) == d["phys_port_cnt"]
        for p in d["ports"]:
            assert p["state"] in ("NOP", "DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER")


@pytest.mark.skipif(bool(DEVICES), reason="this machine has an RDMA device")
def test_arena_without_device_raises():
    with pytest.raises(rdmax.Error) as e:
        rdmax.Arena()
    assert "no RDMA device" in str(e.value)
    assert e.value.verb


DEVICE = os.environ.get("RDMAX_TEST_DEVICE") or None
ADDR = os.environ.get("RDMAX_TEST_ADDR") or "192.0.2.1"


@needs_device
def test_arena_blocks_are_registered_writable_memory():
    arena = rdmax.Arena(DEVICE)
    block = arena.allocate(1 << 16)
    assert block.lkey != 0 and block.rkey != 0 and block.address != 0
    view = memoryview(block)
    assert not view.readonly and len(view) == 1 << 16
    a = np.frombuffer(block, dtype=np.float32)
    a[:] = np.arange(a.size, dtype=np.float32)
    assert np.frombuffer(bytes(view[:16]), dtype=np.float32).tolist() == [0, 1, 2, 3]
    block.release()  # no new view; `view` still holds the memory
    assert view[0:4].tobytes() == a[:1].tobytes()
    assert len(memoryview(block)) == 0  # a released block exports nothing new
    del a, view


@needs_device
def test_rpc_with_device():
    name = DEVICE or next(d["name"] for d in DEVICES
                          if any(p["state"] == "ACTIVE" for p in d["ports"]))
    with rdmax.rpc.Server(ADDR, 0, device=name, call_timeout=10.0) as srv:
        srv.on(1, lambda b: bytes(b))
        srv.start()
        with rdmax.rpc.Client(device=name, transports=["rdma"], call_timeout=10.0) as cli:
            p = cli.connect(ADDR, srv.port)
            assert cli.transport(p) == "rdma"
            body = np.frombuffer(bytes(i % 251 for i in range(1 << 20)), dtype=np.uint8)
            out = bytearray(1 << 20)  # 1 MiB: read from the caller, written into `out`
            assert cli.call(p, 1, body, reply_into=out) == body.tobytes()
            assert out == body.tobytes()
            assert cli.call(p, 1, b"small") == b"small"


def test_no_such_device_is_error():
    with pytest.raises(rdmax.Error) as e:
        rdmax.rpc.Client(device="no_such_device0")
    assert "no_such_device0" in str(e.value)
    with pytest.raises(rdmax.Error):
        rdmax.rpc.Server("127.0.0.1", 0, device="no_such_device0")
    with pytest.raises(rdmax.Error):
        rdmax.Arena("no_such_device0")
