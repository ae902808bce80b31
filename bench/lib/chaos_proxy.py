"""bench/chaos's connection proxy: bench/proxy's forwarding, between chaos's clients and the
router, with stalls and resets switched on and off while it runs.

bench/proxy counts requests per connection and faults the ones past a count, for good; a chaos
fault lasts a hold and ends. Here a stall holds every request that arrives while it lasts (read,
unanswered, its connection open) and forwards them when it ends; a reset aborts every client
connection with a request in flight when it begins, and each one that sends a request while it
lasts. The proxy runs in chaos's own event loop, on a free loopback port.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import aiohttp
from aiohttp import web

from bench.lib.proxy import FaultProxy


def reset(transport) -> None:
    """Close the connection with a TCP RST (SO_LINGER 0), as bench/proxy's --reset-after."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class ChaosProxy(FaultProxy):
    def __init__(self, upstream: str):
        super().__init__(upstream)
        self.open = asyncio.Event()  # set: forwarding; clear: stalled
        self.open.set()
        self.resetting = False
        self.held = 0  # requests waiting for a stall to end
        self.forwarding = 0  # requests being forwarded (their answer not fully written)
        self.upstream_failures = 0  # requests the router refused or dropped
        self._inflight: set = set()  # transports with a request in flight
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, host: str = "127.0.0.1") -> str:
        """Listen on a free port of host; its URL."""
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, 0).start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def close(self) -> None:
        self.open.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def stall(self) -> None:
        self.open.clear()

    def begin_reset(self) -> int:
        """Reset every connection with a request in flight, and the ones that send a request
        from now on, until end(); how many were reset now."""
        self.resetting = True
        now = list(self._inflight)
        for transport in now:
            self.resets += 1
            reset(transport)
        return len(now)

    def end(self) -> None:
        self.resetting = False
        self.open.set()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        transport = request.transport
        if self.resetting and transport is not None:
            self.resets += 1
            reset(transport)
            # Parked until aiohttp cancels the handler of the connection it lost.
            await asyncio.Event().wait()
        self._inflight.add(transport)
        try:
            body = await request.read()
            if not self.open.is_set():
                self.stalled += 1
                self.held += 1
                try:
                    await self.open.wait()
                finally:
                    self.held -= 1
            self.forwarding += 1
            try:
                return await self._forward(request, body)
            except (aiohttp.ClientConnectionError, OSError):
                # The router refused or dropped the connection (a router restart): the client
                # meets what it would without the proxy, a connection that fails, and aiohttp
                # prints no handler traceback for it.
                self.upstream_failures += 1
                if transport is not None:
                    reset(transport)
                await asyncio.Event().wait()  # parked until aiohttp cancels the handler
                raise
            finally:
                self.forwarding -= 1
        finally:
            self._inflight.discard(transport)

    async def idle(self, limit_s: float) -> bool:
        """Wait until no request is being forwarded, at most limit_s; whether it got there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        while self.forwarding and loop.time() < deadline:
            await asyncio.sleep(0.1)
        return not self.forwarding
