"""torch.distributed's rendezvous store listens on the engine's host, not on every interface.

sglang starts an engine's process groups with the init method `tcp://HOST:PORT`: HOST is the
server's `--host` (or `--dist-init-addr`), PORT its `--nccl-port` (a free port when unset).
torch's tcp:// rendezvous makes rank 0 host a c10d TCPStore there, and TCPStore's server binds
the wildcard address (`::`, every interface, IPv4 included) whatever HOST says. Seen on env/cpu:
the scheduler's store answered on the machine's outward address as well as on 127.0.0.1, and
whoever reaches that port can read and write the keys the ranks rendezvous through.

Here rank 0 binds the listening socket to HOST itself and hands it to TCPStore
(`master_listen_fd`); every rank, rank 0 included, connects to HOST:PORT as before, with the
store options torch's own tcp:// rendezvous uses (multi-tenant, the backend's default timeout).
Any other init method (env://, file://, a tcp:// with a query) goes to torch unchanged.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from urllib.parse import urlsplit


class StoreListenError(OSError):
    """Rank 0 cannot listen on the init method's host and port."""


def listen_on(host: str, port: int) -> int:
    """A TCP socket bound to host:port and listening; its file descriptor, which the caller
    owns. SO_REUSEADDR as torch sets it on its own store socket (a restarted engine may find
    the port's old connections in TIME_WAIT)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        raise StoreListenError(f"{host!r} does not resolve ({exc})") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen()
    except OSError as exc:
        sock.close()
        raise StoreListenError(f"cannot listen on {address[0]} port {port} ({exc})") from exc
    return sock.detach()


def rendezvous(
    init_method: str, rank: int, world_size: int, timeout: timedelta | None, backend: str
) -> dict:
    """init_process_group's rendezvous keyword: {"store": a TCPStore whose server listens on
    the init method's host} for `tcp://HOST:PORT`, else {"init_method": init_method}."""
    parts = urlsplit(init_method)
    if parts.scheme != "tcp" or parts.query or not parts.hostname or parts.port is None:
        return {"init_method": init_method}
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import _get_default_timeout

    host, port = parts.hostname, parts.port
    listen_fd = None
    if rank == 0:
        try:
            listen_fd = listen_on(host, port)
        except StoreListenError as exc:
            raise StoreListenError(
                f"torch.distributed's rendezvous store for {init_method}: {exc}"
            ) from exc
    store = TCPStore(
        host,
        port,
        world_size,
        rank == 0,
        timeout if timeout is not None else _get_default_timeout(backend),
        multi_tenant=True,
        master_listen_fd=listen_fd,
    )
    return {"store": store}
