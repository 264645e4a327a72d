"""RPC between processes: rdmax.rpc.Client and rdmax.rpc.Server.

Without a device (device=None) an endpoint uses the node-local path ("shm":
shared memory and CMA, for peers on this node) and TCP; with one (device=
"rxe0") RDMA too. Each peer takes the best transport both ends have.

Options (keywords, each overriding RDMAX_RPC_* from the environment):
call_timeout, connect_timeout, housekeeping, keepalive, keepalive_timeout
(seconds, floats), slots, slot_bytes, max_message, max_peers (ints),
reconnect, local (bools); transports: a list of "rdma", "shm", "tcp".

The GIL is released while rdmax waits (connect, call, poll, serving), and a
client or server may be shared between threads: each takes a lock of its own
for every use (a call holds it until the call ends, so calls from two threads
to one Client go one after the other; use call_async for concurrency).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Iterable, Optional

from . import _rdmax
from ._rdmax import Peer, RpcError

__all__ = ["Client", "Server", "Peer", "RpcError"]

log = logging.getLogger("rdmax.rpc")

Handler = Callable[[memoryview], Any]


def _transports(transports: Optional[Iterable[str]]) -> Optional[list]:
    if transports is None:
        return None
    if isinstance(transports, str):
        transports = [t for t in transports.split(",") if t]
    return list(transports)


class Client:
    """Calls to rdmax RPC servers.

    call() waits for its reply (the GIL released meanwhile); call_async() is
    the asyncio way, with many calls in flight. A reply is bytes (a copy), or,
    when the call offered reply_into (a writable C-contiguous buffer), a
    memoryview of the part of that buffer the reply filled: no copy, and a
    reply over a slot is written there by the server directly.

    Request bodies are any C-contiguous buffer (bytes, bytearray,
    memoryview, numpy arrays), used in place: do not change one until its
    call ended (a body over a slot is read from it by the server).
    """

    def __init__(self, transports: Optional[Iterable[str]] = None,
                 device: Optional[str] = None, async_spin: float = 0.0,
                 **options: Any) -> None:
        if not async_spin >= 0:
            raise ValueError("async_spin: seconds >= 0 expected")
        self._async_spin = float(async_spin)
        self._c = _rdmax.Client(_transports(transports), device, options)
        self._pump = None  # the asyncio pump (rdmax.aio), made at the first call_async

    def connect(self, addr: str, port: int) -> Peer:
        """Connects to the server at addr:port (raises rdmax.Error naming why not)."""
        return self._c.connect(addr, port)

    def disconnect(self, peer: Peer) -> None:
        self._c.disconnect(peer)

    def call(self, peer: Peer, method: int, body: Any = b"", timeout: Optional[float] = None,
             idempotent: bool = False, reply_into: Any = None):
        """Calls `method` (1..65535) of `peer` with `body` and waits for the reply.

        The client spins on the reply (as rpc::client::call does; the GIL
        released), up to the deadline: a core busy while the call waits.
        call_async sleeps on the descriptor instead.

        timeout: seconds, > 0 (None: the client's call_timeout). Raises
        rdmax.RpcError (.status: "timed_out", "unknown_method",
        "handler_failed", ...) when the call did not end ok, TypeError for a
        body that is not a C-contiguous buffer.
        """
        return self._c.call(peer, method, body, timeout, idempotent, reply_into)

    async def call_async(self, peer: Peer, method: int, body: Any = b"",
                         timeout: Optional[float] = None, idempotent: bool = False,
                         reply_into: Any = None):
        """call() for asyncio: the client's fd() on the running loop, no thread.

        A call that finds every slot of the connection busy waits for one
        (up to its deadline). Keep `body` and `reply_into` unchanged until the
        call ended. One event loop at a time per client. With async_spin=S
        (Client's keyword, seconds), the pump polls up to S for a reply before
        it sleeps on the descriptor (the loop runs nothing else meanwhile):
        lower latency for a few calls in flight, at a core's cost.
        """
        from . import aio
        if self._pump is None:
            self._pump = aio.Pump(self)
        return await self._pump.call(peer, method, body, timeout, idempotent, reply_into)

    # The building blocks of call_async, for an event loop of your own.
    def start(self, peer: Peer, method: int, body: Any = b"", timeout: Optional[float] = None,
              idempotent: bool = False, reply_into: Any = None) -> Optional[int]:
        """Starts a call: its cookie, or None when every slot holds a call (no_credit)."""
        return self._c.start(peer, method, body, timeout, idempotent, reply_into)

    def poll(self, max: int = 64, timeout: float = 0.0) -> list:
        """Calls that ended, as (cookie, reply-or-RpcError) pairs; waits up to `timeout` s."""
        return self._c.poll(max, timeout)

    def cancel(self, peer: Peer, cookie: int) -> bool:
        return self._c.cancel(peer, cookie)

    def fd(self) -> int:
        """Readable when poll() may have results: sleep on it only after arm() said True."""
        return self._c.fd()

    def arm(self) -> bool:
        return self._c.arm()

    def awake(self) -> None:
        """Call when fd() was readable (before poll())."""
        self._c.awake()

    def in_flight(self) -> int:
        return self._c.in_flight()

    def transport(self, peer: Peer) -> Optional[str]:
        """How the calls to `peer` go now: "rdma", "shm", "tcp" (None: not connected)."""
        return self._c.transport(peer)

    def state(self, peer: Peer) -> str:
        return self._c.state(peer)

    def counters(self) -> dict:
        """Every field of rdmax::rpc::rpc_counters, by name."""
        return self._c.counters()

    def close(self) -> None:
        if self._pump is not None:
            self._pump.close()
            self._pump = None
        if not self._c.closed:
            self._c.close()

    @property
    def closed(self) -> bool:
        return self._c.closed

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stop_at_exit(stop: "weakref.WeakMethod") -> None:
    def at_exit() -> None:
        f = stop()
        if f is not None:
            f()
    # Run before threads are joined at shutdown (as concurrent.futures does);
    # atexit callbacks would run too late for a daemon thread.
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(at_exit)
            return
    except RuntimeError:  # registered while shutting down: nothing to do
        return
    import atexit
    atexit.register(at_exit)


def _copying(handler: Handler) -> Handler:
    """The handler, given its body as bytes: nothing it keeps can see the ring."""
    def copy_then(body):
        return handler(bytes(body))
    return copy_then


def _weak_hook(method: "weakref.WeakMethod") -> Callable[[BaseException], None]:
    """Calls the method while its object lives (the Server's error hook)."""
    def hook(exc: BaseException) -> None:
        f = method()
        if f is not None:
            f(exc)
    return hook


class Server:
    """An rdmax RPC server on addr:port (port 0: a free one, see .port).

    Handlers run in the thread that serves (poll(), serve_forever(), or the
    thread start() made), one at a time, holding the GIL.
    """

    def __init__(self, addr: str, port: int = 0, transports: Optional[Iterable[str]] = None,
                 device: Optional[str] = None, **options: Any) -> None:
        self._s = _rdmax.Server(addr, port, _transports(transports), device, options)
        # A weak reference: a strong one would make a cycle through the
        # extension object that the garbage collector cannot see, keeping a
        # dropped Server (and its port) alive until the process ends.
        self._s.set_error_hook(_weak_hook(weakref.WeakMethod(self._handler_failed)))
        self._stop = threading.Event()
        self._lifecycle = threading.Lock()  # start() and stop() from any threads
        self._thread: Optional[threading.Thread] = None
        self.last_handler_error: Optional[BaseException] = None

    def on(self, method: int, handler: Handler, zero_copy: bool = False) -> None:
        """Serves `method` (1..65535) with handler(body) -> reply.

        `body` is the request as bytes (a copy), unless zero_copy: then a
        read-only memoryview of the server's ring, valid only during the call.
        It is released when the handler returns, but a slice of it or a
        numpy.frombuffer of it is not: one kept past the call would read
        later requests (other clients') in that slot. Use zero_copy only in
        handlers that keep nothing of the body.

        The reply is any bytes-like object (copied), or None for an empty
        one. A handler that raises answers "handler_failed" to the
        caller; the exception is logged (logger "rdmax.rpc") and kept in
        last_handler_error, and the server goes on serving.
        """
        self._s.on(method, handler if zero_copy else _copying(handler))

    def _handler_failed(self, exc: BaseException) -> None:
        self.last_handler_error = exc
        log.error("handler failed: %r", exc, exc_info=(type(exc), exc, exc.__traceback__))

    @property
    def port(self) -> int:
        return self._s.port()

    def peers(self) -> int:
        return self._s.peers()

    def poll(self, timeout: float = 0.0) -> int:
        """Serves what came, waiting up to `timeout` seconds when nothing had: requests handled."""
        return self._s.poll(timeout)

    def serve_forever(self, poll_interval: float = 0.1) -> None:
        """Serves in this thread until stop() or close() (from another thread) or KeyboardInterrupt."""
        self._stop.clear()
        self._serve(poll_interval)

    def _serve(self, poll_interval: float) -> None:
        while not self._stop.is_set() and not self._s.closed:
            try:
                self._s.poll(poll_interval)
            except RuntimeError:
                if self._s.closed:  # close() from another thread meanwhile
                    return
                raise

    def start(self) -> "Server":
        """Serves on a background thread (daemon) until stop() or close()."""
        with self._lifecycle:
            if self._thread is not None:
                raise RuntimeError("the server is serving already")
            self._stop.clear()  # here, not in the thread: a stop() right after start() holds
            self._thread = threading.Thread(target=self._serve, args=(0.05,),
                                            name="rdmax-server", daemon=True)
            self._thread.start()
        # Stopped before the interpreter finalizes: a daemon thread that wakes
        # from poll() then (to take the GIL back) is ended by Python inside
        # C++ code, which aborts the process.
        _stop_at_exit(weakref.WeakMethod(self.stop))
        return self

    def stop(self) -> None:
        """Stops serve_forever() and the background thread (the server stays open)."""
        self._stop.set()
        with self._lifecycle:
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()  # (from a handler: the thread ends after it returns)

    def counters(self) -> dict:
        """Every field of rdmax::rpc::rpc_counters by name, and handler_errors."""
        return self._s.counters()

    def close(self) -> None:
        self.stop()
        if not self._s.closed:
            self._s.close()

    @property
    def closed(self) -> bool:
        return self._s.closed

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
