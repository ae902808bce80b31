"""Fault-injecting keep-alive HTTP proxy.

Counts requests per client connection. After N requests on one connection it either stops
forwarding on that connection (--stall-after: the request is read and then left unanswered while
the connection stays open) or resets it (--reset-after). New connections start counting from
zero, so a fresh client is served normally: the failure mode of the reference incident.
With --only-path the faults apply only to requests whose path starts with one of the given
prefixes; the others are forwarded and not counted (between a router and an engine: the
router's health checks and load polls pass while its /generate calls stall).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import struct
import sys
import weakref
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

# Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection and are not forwarded.
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "host",
}


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        stall_after: int | None = None,
        reset_after: int | None = None,
        delay_ms: float = 0.0,
        log=None,
        only_paths: tuple[str, ...] = (),
    ):
        self.upstream = upstream.rstrip("/")
        self.stall_after = stall_after
        self.reset_after = reset_after
        self.delay_s = delay_ms / 1000
        self.only_paths = tuple(only_paths)
        self.log = log or (lambda msg: None)
        self._count: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._client: aiohttp.ClientSession | None = None
        self.stalled = 0
        self.resets = 0
        self.forwarded = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app):
        self._client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )

    async def _stop(self, _app):
        if self._client:
            await self._client.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        transport = request.transport
        if self.only_paths and not request.path.startswith(self.only_paths):
            return await self._forward(request, await request.read())
        n = self._count.get(transport, 0) + 1
        self._count[transport] = n
        host, port = (transport.get_extra_info("peername") or ("?", "?"))[:2]
        peer = f"{host}:{port}"
        body = await request.read()
        if self.stall_after is not None and n > self.stall_after:
            self.stalled += 1
            self.log(f"stall: request {n} on connection from {peer} ({request.path})")
            # Parked until the client goes away; the handler is cancelled then.
            await asyncio.Event().wait()
        if self.reset_after is not None and n > self.reset_after and transport is not None:
            self.resets += 1
            self.log(f"reset: request {n} on connection from {peer} ({request.path})")
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
            raise ConnectionResetError("reset injected by bench/proxy")
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return await self._forward(request, body)

    async def _forward(self, request: web.Request, body: bytes) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        assert self._client is not None
        async with self._client.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=body
        ) as upstream:
            self.forwarded += 1
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP_BY_HOP:
                    response.headers[key] = value
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen wants HOST:PORT, got {text!r}")
    return host, int(port)


def _url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme != "http" or not parts.hostname:
        raise argparse.ArgumentTypeError(f"--upstream wants an http://HOST:PORT URL, got {text!r}")
    return text


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"wants a whole number >= 0, got {text!r}")
    return int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/proxy",
        description="Keep-alive HTTP proxy that injects per-connection faults. Each client "
        "connection has its own request count; new connections are served normally.",
    )
    parser.add_argument("--listen", type=_host_port, required=True, help="HOST:PORT to bind")
    parser.add_argument("--upstream", type=_url, required=True, help="URL to forward to")
    parser.add_argument(
        "--stall-after",
        type=_count,
        metavar="N",
        default=None,
        help="forward the first N requests of a connection, then read and never "
        "answer the rest (default: never stall)",
    )
    parser.add_argument(
        "--reset-after",
        type=_count,
        metavar="N",
        default=None,
        help="forward the first N requests of a connection, then reset the "
        "connection on the next one (default: never reset)",
    )
    parser.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="delay before forwarding each request (default: 0)",
    )
    parser.add_argument(
        "--only-path",
        metavar="PREFIX",
        action="append",
        default=[],
        help="apply the faults and the delay only to requests whose path starts with PREFIX "
        "(repeatable); the others are forwarded at once and not counted (default: every path)",
    )
    args = parser.parse_args(argv)
    if args.delay_ms < 0:
        parser.error("--delay-ms must be >= 0")
    if args.stall_after is not None and args.reset_after is not None:
        parser.error("--stall-after and --reset-after are alternatives; give one")
    bad = [p for p in args.only_path if not p.startswith("/")]
    if bad:
        parser.error(f"--only-path wants a path starting with '/', got {bad[0]!r}")
    return args


async def serve(args: argparse.Namespace) -> None:
    proxy = FaultProxy(
        args.upstream,
        args.stall_after,
        args.reset_after,
        args.delay_ms,
        log=lambda msg: print(f"bench/proxy: {msg}", file=sys.stderr, flush=True),
        only_paths=tuple(args.only_path),
    )
    runner = web.AppRunner(proxy.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    host, port = args.listen
    await web.TCPSite(runner, host, port).start()
    print(f"bench/proxy: listening on http://{host}:{port} -> {args.upstream}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        asyncio.run(serve(args))
    except OSError as exc:
        print(
            f"bench/proxy: cannot listen on {args.listen[0]}:{args.listen[1]}: {exc}",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
