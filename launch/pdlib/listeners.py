"""verify's listen layer: every socket an instance's processes listen on is on the host the env
files give that instance.

An instance's processes are the one that owns its port and that process's descendants: for an
engine the HTTP server (which also holds prefill's bootstrap port), its scheduler (NIXL and UCX
run there, and torch.distributed's rendezvous store) and its detokenizer; for the router, smg.
A TCP socket in LISTEN counts, and so does a UDP socket bound without a peer. Its address must
be one the instance's host (PREFILL_HOST, DECODE_HOST, ROUTER_HOST) resolves to; the router's
may also be on ROUTER_PROMETHEUS_HOST. A wildcard address (0.0.0.0, ::) is every interface, so
it passes only where the env files name that wildcard as the host. What listens where, and the
setting that keeps each on its host: launch/README.md, "What listens where".
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import psutil

from launch.pdlib.stack import WILDCARDS, Role, Stack, addresses_of, normal, router_prometheus_host
from launch.pdlib.supervise import port_owner


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str
    address: str
    port: int
    proto: str

    def text(self) -> str:
        address = normal(self.address)
        shown = f"[{address}]" if ":" in address else address
        every = " (every interface)" if address in WILDCARDS else ""
        return f"pid {self.pid} ({self.process}) on {shown}:{self.port}/{self.proto}{every}"


def listening(pid: int) -> tuple[list[Listener], list[str]]:
    """What the process and its descendants listen on, and the processes whose sockets could
    not be read (another user's)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return [], []
    found: set[Listener] = set()
    unread = []
    for proc in procs:
        try:
            name = proc.name()
            conns = proc.net_connections("inet")
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied:
            unread.append(f"pid {proc.pid}")
            continue
        for conn in conns:
            if conn.type == socket.SOCK_STREAM and conn.status == psutil.CONN_LISTEN:
                proto = "tcp"
            elif conn.type == socket.SOCK_DGRAM and conn.laddr and not conn.raddr:
                proto = "udp"
            else:
                continue
            found.add(Listener(proc.pid, name, conn.laddr.ip, conn.laddr.port, proto))
    return sorted(found, key=lambda s: (s.pid, s.proto, s.port)), unread


def configured_hosts(stack: Stack, role: Role) -> list[tuple[str, str]]:
    """(variable, host) pairs the instance's sockets may be on."""
    hosts = [(f"{role.kind.upper()}_HOST", role.host)]
    if role.kind == "router":
        prometheus = router_prometheus_host(stack.env.role_env("router"))
        if prometheus not in hosts:
            hosts.append(prometheus)
    return hosts


@dataclass(frozen=True)
class Finding:
    instance: str
    ok: bool
    text: str
    checked: bool = True


def findings(stack: Stack) -> list[Finding]:
    """One finding per instance: its listening sockets all on its configured host, or those
    that are not, each with its process, address, port and protocol."""
    out = []
    for role in stack.roles.values():
        hosts = configured_hosts(stack, role)
        where = " or ".join(f"{key}={host}" for key, host in hosts)
        if not role.local:
            out.append(
                Finding(
                    role.name,
                    True,
                    f"{role.name} listening sockets: not checked here: it runs on {role.host}, "
                    f"not this host ({stack.here}), and a remote /proc cannot be read from "
                    f"here; run verify on {role.host}",
                    checked=False,
                )
            )
            continue
        pid = port_owner(role.port)
        if pid is None:
            out.append(
                Finding(
                    role.name,
                    False,
                    f"{role.name}: no process listens on port {role.port}; "
                    "its listening sockets cannot be listed",
                )
            )
            continue
        found, unread = listening(pid)
        allowed = set().union(*(addresses_of(host) for _, host in hosts))
        off = [s for s in found if normal(s.address) not in allowed]
        processes = len({s.pid for s in found})
        if not off and not unread:
            out.append(
                Finding(
                    role.name,
                    True,
                    f"{role.name} listens only on {where}: {len(found)} socket(s) in "
                    f"{processes} process(es) under pid {pid}",
                )
            )
            continue
        problems = []
        if off:
            problems.append(
                f"{len(off)} of {len(found)} listening socket(s) not on {where}: "
                + "; ".join(s.text() for s in off)
            )
        if unread:
            problems.append(
                f"the sockets of {', '.join(unread)} are not readable by this user (run as "
                "root or as the service user)"
            )
        out.append(Finding(role.name, False, f"{role.name}: " + "; ".join(problems)))
    return out
