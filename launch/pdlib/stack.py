"""Where each role listens, how it is started and how its health is read, from an env dir."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from launch.pdlib.envfiles import ROLES, EnvDir, EnvFileError

ROOT = Path(__file__).resolve().parents[2]
# Without --sim the engines load a model (many minutes); the sim answers in about a second.
SIM_HEALTH_TIMEOUT_S = 30.0


def free_loopback_ports(n: int) -> list[int]:
    """n distinct free 127.0.0.1 ports (all held open until chosen, so no two are the same)."""
    socks = []
    try:
        for _ in range(n):
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
    name: str
    host: str
    port: int
    health_path: str
    health_timeout_s: float
    script: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        return self.url + self.health_path


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

    def role(self, name: str) -> Role:
        if name not in self.roles:
            raise EnvFileError(f"unknown role {name!r}; roles are {', '.join(ROLES)}")
        return self.roles[name]


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


def load_stack(env_dir: Path, sim: bool, timeout_override: float | None = None) -> Stack:
    env = EnvDir(env_dir)
    common = env.common()
    roles = {}
    for name in ROLES:
        values = env.role_env(name)
        upper = name.upper()
        for key in (f"{upper}_HOST", f"{upper}_PORT"):
            if not values.get(key):
                raise EnvFileError(f"{key} is not set in {env_dir}")
        port = int(_number(values, f"{upper}_PORT", 0, int))
        timeout = _number(values, f"{upper}_HEALTH_TIMEOUT_S", 1200.0)
        if sim:
            timeout = min(timeout, SIM_HEALTH_TIMEOUT_S)
        if timeout_override is not None:
            timeout = timeout_override
        roles[name] = Role(
            name=name,
            host=values[f"{upper}_HOST"],
            port=port,
            # The router's /health answers before it has workers; /readiness waits for them.
            health_path="/readiness" if name == "router" else "/health",
            health_timeout_s=timeout,
            script=ROOT / "launch" / f"{name}.sh",
        )
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
    )


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
