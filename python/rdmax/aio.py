"""asyncio for rdmax.rpc.Client: the client's descriptor on the event loop.

Pump does what include/rdmax/asio/ does for Asio: start() each call with a
cookie, poll() for results and complete their futures, and sleep on fd()
only after arm() said True (else poll again at once): arm() after a look,
then one more look is the order that loses no wake-up. asyncio watches the
descriptor level-triggered (loop.add_reader), and a timer every housekeeping
interval lets poll() see deadlines while nothing else comes.

A call that finds every slot of its connection busy (no_credit) waits in a
queue here, in order, and starts when a result gives a slot back, or ends
timed_out at its deadline.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Optional

from . import _rdmax


class Pump:
    """Completes a Client's call_async futures on one event loop."""

    def __init__(self, client) -> None:
        self._client = client
        self._c = client._c
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._futures: dict = {}  # cookie -> (future, peer)
        self._waiting: collections.deque = collections.deque()  # (future, args, deadline)
        self._reading = False
        self._timer: Optional[asyncio.TimerHandle] = None
        self._soon = False
        self._interval = max(self._c.housekeeping(), 0.001)
        self._default_timeout = None
        self._spin = client._async_spin

    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop and self._loop.is_closed():
            # The last loop ended (asyncio.run returned): its calls went with it
            # (their results, if they come, are dropped); this loop takes over.
            self.close()
            self._loop = None
        if self._loop is None:
            self._loop = loop
            self._fd = self._c.fd()
        elif self._loop is not loop:
            raise RuntimeError("rdmax.rpc.Client.call_async: one event loop at a time per "
                               "client (another one is running its calls)")
        return loop

    async def call(self, peer, method: int, body: Any, timeout: Optional[float],
                   idempotent: bool, reply_into: Any):
        loop = self._bind()
        fut = loop.create_future()
        args = (peer, method, body, timeout, idempotent, reply_into)
        if self._waiting or not self._start(fut, args):
            limit = timeout if timeout is not None else self._call_timeout()
            self._waiting.append((fut, args, time.monotonic() + limit))
        self._kick()
        return await fut

    def _call_timeout(self) -> float:
        # The client's default deadline (rpc_options::call_timeout), for calls
        # that wait here for a slot.
        if self._default_timeout is None:
            self._default_timeout = self._c.call_timeout()
        return self._default_timeout

    def _start(self, fut: asyncio.Future, args) -> bool:
        """Starts a call; False when it must wait for a slot (raises into fut otherwise)."""
        try:
            cookie = self._c.start(*args)
        except Exception as e:  # refused: bad peer, invalid method, bad buffer...
            if not fut.done():
                fut.set_exception(e)
            return True
        if cookie is None:
            return False
        self._futures[cookie] = (fut, args[0])
        fut.add_done_callback(lambda f, c=cookie: self._done(f, c))
        return True

    def _done(self, fut: asyncio.Future, cookie: int) -> None:
        # A future cancelled by its caller (a task cancelled, a wait_for that
        # expired): the call is cancelled in rdmax too; its result, when poll()
        # brings it, is dropped.
        if fut.cancelled() and cookie in self._futures and not self._c.closed:
            self._c.cancel(self._futures[cookie][1], cookie)

    def _kick(self) -> None:
        if not self._soon and self._loop is not None:
            self._soon = True
            self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        self._soon = False
        if self._c.closed:
            return
        delivered = False
        spin_until = None
        while True:
            got = self._c.poll(64, 0.0)
            for cookie, value in got:
                entry = self._futures.pop(cookie, None)
                if entry is None:
                    continue
                fut = entry[0]
                if fut.done():
                    continue
                if isinstance(value, BaseException):
                    fut.set_exception(value)
                else:
                    fut.set_result(value)
            self._start_waiting()
            if got:
                delivered = True
                continue
            # Nothing came. With async_spin, and nothing delivered yet (whose
            # callers run only once this returns to the loop), poll on a while
            # before sleeping: the loop waits meanwhile.
            if self._spin > 0 and not delivered and self._futures:
                now = time.perf_counter()
                if spin_until is None:
                    spin_until = now + self._spin
                if now < spin_until:
                    continue
            break
        if not self._futures and not self._waiting:
            self._idle()
            return
        if not self._reading:
            self._loop.add_reader(self._fd, self._readable)
            self._reading = True
        if self._timer is None:
            self._timer = self._loop.call_later(self._interval, self._tick)
        # Sleep only when armed; else something came meanwhile: look again.
        if not self._c.arm():
            self._kick()

    def _start_waiting(self) -> None:
        now = time.monotonic()
        while self._waiting:
            fut, args, deadline = self._waiting[0]
            if fut.done():
                self._waiting.popleft()
                continue
            if now >= deadline:
                self._waiting.popleft()
                e = _rdmax.RpcError("call waited for a free slot past its deadline: timed_out")
                e.status = "timed_out"
                fut.set_exception(e)
                continue
            if not self._start(fut, args):
                break
            self._waiting.popleft()

    def _readable(self) -> None:
        if self._c.closed:
            return
        self._c.awake()
        self._pump()

    def _tick(self) -> None:
        self._timer = None
        self._pump()

    def _idle(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        """Ends the pump: its calls' futures are cancelled."""
        if self._loop is None:
            return
        self._soon = False
        if self._reading and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._reading = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for fut, _ in list(self._futures.values()):
            if not fut.done() and not fut.get_loop().is_closed():
                fut.cancel()
        for fut, _, _ in self._waiting:
            if not fut.done() and not fut.get_loop().is_closed():
                fut.cancel()
        self._futures.clear()
        self._waiting.clear()
