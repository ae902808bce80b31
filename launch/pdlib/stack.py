"""Where each role listens, how it is started and how its health is read, from an env dir."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from launch.pdlib.envfiles import ROLES, EnvDir, EnvFileError

ROOT = Path(__file__).resolve().parents[2]
# Without --sim the engines load a model (many minutes); the sim answers in about a second.
SIM_HEALTH_TIMEOUT_S = 30.0


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _candidates(n: int) -> list[int]:
    """Ports from 10000 up to the ephemeral range, shuffled (none where that range is small)."""
    low = _ephemeral_low()
    ports = list(range(10000, low)) if low > 10000 + 4 * n else []
    random.SystemRandom().shuffle(ports)
    return ports


def free_loopback_ports(n: int) -> list[int]:
    """n distinct free 127.0.0.1 ports (all held open until chosen, so no two are the same).

    They come from below the kernel's ephemeral range: a port from bind(0) is an ephemeral
    one, and between choosing it and the server binding it (a minute or more for an engine)
    any outgoing connection on the machine may take it as its local port. Seen once: the
    router's metrics port, taken while the engines started."""
    socks: list[socket.socket] = []
    try:
        for port in _candidates(n):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:  # no room below the ephemeral range: the kernel's choice
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def from_root(value: str) -> Path:
    path = Path(value)
    return path if path.is_absolute() else ROOT / path


@dataclass(frozen=True)
class Role:
    """One process pd runs: an engine instance (prefill/2) or the router."""

    name: str
    host: str
    port: int
    health_path: str
    health_timeout_s: float
    script: Path
    kind: str = ""
    index: int | None = None
    bootstrap_port: int | None = None
    local: bool = True

    @property
    def key(self) -> str:
        """File-safe name: pid file, log and systemd unit (decode, or decode-2 of several)."""
        return self.name.replace("/", "-")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        return self.url + self.health_path


def this_host() -> tuple[str, set[str]]:
    """How pd names this host, and the instance hosts that are this host.

    PD_HOST (pd's own environment) names this host exactly; without it, loopback addresses
    and this machine's host names count as here."""
    pinned = os.environ.get("PD_HOST", "")
    if pinned:
        return f"PD_HOST={pinned}", {pinned}
    name = socket.gethostname()
    return f"host {name}", {name, socket.getfqdn(), "localhost", "::1"}


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def is_local(host: str) -> bool:
    return host in this_host()[1] or (not os.environ.get("PD_HOST") and is_loopback(host))


@dataclass(frozen=True)
class Stack:
    env: EnvDir
    roles: dict[str, Role]
    sim: bool
    run_dir: Path
    poll_interval_s: float
    supervisor: str
    unit_prefix: str
    systemctl_timeout_s: float
    api_key: str
    here: str = ""

    def role(self, name: str) -> Role:
        if name not in self.roles:
            raise EnvFileError(f"unknown instance {name!r}; this stack has {', '.join(self.roles)}")
        return self.roles[name]

    def of_kind(self, kind: str) -> list[Role]:
        return [r for r in self.roles.values() if r.kind == kind]

    @property
    def several(self) -> bool:
        """Instance files exist: the router takes its workers from the discovery file."""
        return any(self.env.instances(kind) for kind in ("prefill", "decode"))

    @property
    def workers_file(self) -> Path:
        return self.run_dir / "router-workers.json"

    def select(self, targets: list[str]) -> list[Role]:
        """Instances named by ROLE/N, ROLE (all its instances) or nothing (all), in start
        order: prefills, decodes, router."""
        if not targets:
            return list(self.roles.values())
        chosen = set()
        for target in targets:
            kind = target.split("/", 1)[0]
            if kind not in ROLES:
                raise EnvFileError(
                    f"unknown role in {target!r}; address ROLE, ROLE/N or nothing (all); "
                    f"roles are {', '.join(ROLES)}"
                )
            # decode/1 also names the one instance of a role without instance files.
            found = [
                r
                for r in self.of_kind(kind)
                if "/" not in target or target in (r.name, f"{kind}/{r.index or 1}")
            ]
            if not found:
                have = ", ".join(r.name for r in self.of_kind(kind))
                raise EnvFileError(f"no instance {target}; {kind} has {have}")
            chosen.update(r.name for r in found)
        return [r for r in self.roles.values() if r.name in chosen]


def _number(env: dict[str, str], key: str, default: float, kind=float) -> float:
    raw = env.get(key, "")
    if raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise EnvFileError(f"{key}={raw!r}: not a number") from None
    if value <= 0:
        raise EnvFileError(f"{key}={raw!r}: must be positive")
    return value


def _instance(env: EnvDir, kind: str, index: int | None, sim: bool, timeout_override) -> Role:
    values = env.role_env(kind, index)
    upper = kind.upper()
    where = env.path / (f"{kind}.{index}.env" if index is not None else "")
    keys = [f"{upper}_HOST", f"{upper}_PORT"] + (["PREFILL_BOOTSTRAP_PORT"] * (kind == "prefill"))
    for key in keys:
        if not values.get(key):
            raise EnvFileError(f"{key} is not set in {where}")
    timeout = _number(values, f"{upper}_HEALTH_TIMEOUT_S", 1200.0)
    if sim:
        timeout = min(timeout, SIM_HEALTH_TIMEOUT_S)
    if timeout_override is not None:
        timeout = timeout_override
    bootstrap = values.get("PREFILL_BOOTSTRAP_PORT") if kind == "prefill" else None
    return Role(
        name=kind if index is None else f"{kind}/{index}",
        host=values[f"{upper}_HOST"],
        port=int(_number(values, f"{upper}_PORT", 0, int)),
        # The router's /health answers before it has workers; /readiness waits for them.
        health_path="/readiness" if kind == "router" else "/health",
        health_timeout_s=timeout,
        script=ROOT / "launch" / f"{kind}.sh",
        kind=kind,
        index=index,
        bootstrap_port=int(_number(values, "PREFILL_BOOTSTRAP_PORT", 0, int))
        if bootstrap
        else None,
        local=is_local(values[f"{upper}_HOST"]),
    )


def load_stack(env_dir: Path, sim: bool, timeout_override: float | None = None) -> Stack:
    env = EnvDir(env_dir)
    common = env.common()
    roles = {}
    for kind in ROLES:
        for index in env.instances(kind) or [None]:
            role = _instance(env, kind, index, sim, timeout_override)
            roles[role.name] = role
    supervisor = common.get("PD_SUPERVISOR", "local") or "local"
    if supervisor not in ("local", "systemd"):
        raise EnvFileError(f"PD_SUPERVISOR={supervisor!r}: must be local or systemd")
    return Stack(
        env=env,
        roles=roles,
        sim=sim,
        run_dir=from_root(common.get("PD_RUN_DIR") or "run"),
        poll_interval_s=_number(common, "PD_POLL_INTERVAL_S", 1.0),
        supervisor=supervisor,
        unit_prefix=common.get("PD_UNIT_PREFIX") or "sm120pd",
        systemctl_timeout_s=_number(common, "PD_SYSTEMCTL_TIMEOUT_S", 90.0),
        api_key=common.get("API_KEY", ""),
        here=this_host()[0],
    )


WILDCARDS = ("0.0.0.0", "::")


def normal(address: str) -> str:
    """One spelling per address: an IPv4-mapped IPv6 address as its IPv4, no zone index."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def addresses_of(host: str) -> set[str]:
    """Every address the host resolves to; the host itself when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return {normal(host)}
    return {normal(info[4][0]) for info in infos}


def router_prometheus_host(values: dict[str, str]) -> tuple[str, str]:
    """(variable, host) where smg's Prometheus endpoint listens: ROUTER_PROMETHEUS_HOST when
    set, else the router's own host (launch/router.sh passes it as --prometheus-host)."""
    if values.get("ROUTER_PROMETHEUS_HOST"):
        return "ROUTER_PROMETHEUS_HOST", values["ROUTER_PROMETHEUS_HOST"]
    return "ROUTER_HOST", values.get("ROUTER_HOST", "")


def router_metrics_host(values: dict[str, str]) -> str:
    """Where a client reaches smg's Prometheus endpoint: its host, or the router's own host
    when it listens on a wildcard address."""
    _, host = router_prometheus_host(values)
    return values.get("ROUTER_HOST", "") if host in WILDCARDS else host


def topology_problems(env: EnvDir, notes: list[str]) -> list[str]:
    """Ports unique per host, every decode able to reach every prefill's bootstrap port (smg
    pairs any prefill with any decode), host names that resolve (the router's Prometheus host
    among them), each engine's SGLANG_HOST_IP on its own host."""
    try:
        stack = load_stack(env.path, sim=False)
    except EnvFileError as exc:
        return [str(exc)]
    problems = []
    addresses: dict[str, str] = {}
    for role in stack.roles.values():
        if role.host in addresses:
            continue
        try:
            addresses[role.host] = socket.getaddrinfo(role.host, None)[0][4][0]
        except OSError as exc:
            where = env.origin(role.kind, role.index, f"{role.kind.upper()}_HOST")
            problems.append(f"{where}: host {role.host!r} of {role.name} does not resolve ({exc})")
    router_values = env.role_env("router")
    metrics_key, metrics_host = router_prometheus_host(router_values)
    if metrics_key == "ROUTER_PROMETHEUS_HOST":
        try:
            socket.getaddrinfo(metrics_host, None)
        except OSError as exc:
            problems.append(
                f"{env.origin('router', None, metrics_key)}: host {metrics_host!r} of the "
                f"router's Prometheus endpoint does not resolve ({exc})"
            )
    taken: dict[tuple[str, int], str] = {}
    prometheus = router_values.get("ROUTER_PROMETHEUS_PORT", "")
    for role in stack.roles.values():
        upper = role.kind.upper()
        ports = [(f"{upper}_PORT", role.port), ("PREFILL_BOOTSTRAP_PORT", role.bootstrap_port)]
        if role.kind == "router" and prometheus.isdigit():
            ports.append(("ROUTER_PROMETHEUS_PORT", int(prometheus)))
        for key, port in ports:
            if port is None:
                continue
            place = (addresses.get(role.host, role.host), port)
            if place in taken:
                problems.append(
                    f"{env.origin(role.kind, role.index, key)}: port {port} on {role.host} is "
                    f"already {taken[place]}; every port must be unique per host"
                )
            else:
                taken[place] = f"{role.name}'s {key}"
    prefills, decodes = stack.of_kind("prefill"), stack.of_kind("decode")
    for role in prefills + decodes:
        advertised = env.role_env(role.kind, role.index).get("SGLANG_HOST_IP", "")
        if not advertised or role.host in WILDCARDS:
            continue
        if addresses_of(advertised).isdisjoint(addresses_of(role.host)):
            problems.append(
                f"{env.origin(role.kind, role.index, 'SGLANG_HOST_IP')}={advertised}: "
                f"{role.name}'s PD sockets would listen there and the other engines connect "
                f"to them there, but {role.name} is on {role.kind.upper()}_HOST={role.host}; "
                "set it to that host's address (in each instance's file when hosts differ)"
            )
    for decode in decodes:
        for prefill in prefills:
            if is_loopback(prefill.host) and not is_loopback(decode.host):
                problems.append(
                    f"{env.origin('prefill', prefill.index, 'PREFILL_HOST')}: {prefill.name} "
                    f"listens on loopback {prefill.host}, so {decode.name} on {decode.host} "
                    f"cannot reach its bootstrap port {prefill.bootstrap_port} (the router may "
                    "pair any prefill with any decode)"
                )
    if stack.several:
        notes.append(
            f"topology: {len(prefills)} prefill and {len(decodes)} decode instance(s); the "
            f"router takes its workers from {stack.workers_file}"
        )
    return problems


@dataclass(frozen=True)
class Reply:
    status: int | None
    body: bytes
    error: str = ""

    def json(self):
        return json.loads(self.body.decode())


def http(url: str, timeout: float = 5.0, data: dict | None = None, api_key: str = "") -> Reply:
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    payload = json.dumps(data).encode() if data is not None else None
    request = urllib.request.Request(url, data=payload, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return Reply(resp.status, resp.read())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.read() or b"")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return Reply(None, b"", f"{type(reason).__name__}: {reason}")
