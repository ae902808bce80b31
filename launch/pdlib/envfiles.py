"""The env files: parsing, per-role views, secret redaction, validation, diff, snapshots.

The files are read by three readers: bash (`set -a; . file`), systemd (`EnvironmentFile=`) and
this module. They agree only on a plain subset, so that subset is the format and `env check`
rejects anything outside it: `KEY=value` or `KEY="value"` / `KEY='value'`, full-line `#`
comments, no `export`, no `$` expansion, no backquotes, no trailing comments, no line
continuations.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

ROLES = ("prefill", "decode", "router")
FILES = ("common.env", "prefill.env", "decode.env", "router.env")
# One engine instance of several: ROLE.N.env, read after common.env and ROLE.env.
INSTANCE_FILE_RE = re.compile(r"^(prefill|decode)\.([1-9][0-9]*)\.env$")
KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SECRET_RE = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)
REDACTED = "<redacted>"
# Variables the running processes read from their environment (as opposed to our own launch
# settings): these are what `verify` compares against /proc/PID/environ.
KNOB_PREFIXES = (
    "SGLANG_",
    "SGL_",
    "NCCL_",
    "NVSHMEM_",
    "UCX_",
    "NIXL_",
    "CUDA_",
    "TORCH_",
    "GLOO_",
)


class EnvFileError(ValueError):
    """An env file line outside the format every reader agrees on."""


@dataclass(frozen=True)
class Line:
    path: Path
    number: int
    key: str
    value: str
    raw: str


def parse_file(path: Path) -> list[Line]:
    lines = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{path}:{number}"
        if stripped.startswith("export "):
            raise EnvFileError(
                f"{where}: drop 'export' (systemd's EnvironmentFile= reads it as part of the name)"
            )
        key, sep, value = stripped.partition("=")
        if not sep or not KEY_RE.match(key):
            raise EnvFileError(f"{where}: not a KEY=value line: {_redact_line(raw)!r}")
        if raw != raw.lstrip():
            raise EnvFileError(f"{where}: {key}: leading whitespace")
        value = _unquote(value, where, key)
        lines.append(Line(path, number, key, value, raw))
    return lines


def _unquote(value: str, where: str, key: str) -> str:
    if value.endswith("\\"):
        raise EnvFileError(
            f"{where}: {key}: line continuations are not read the same by bash and systemd"
        )
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        inner = value[1:-1]
        if value[0] in inner:
            raise EnvFileError(f"{where}: {key}: nested quote in a quoted value")
        if value[0] == '"' and any(c in inner for c in "$`\\"):
            raise EnvFileError(
                f"{where}: {key}: '$', '`' and '\\' expand differently in bash "
                "and systemd; use a literal value"
            )
        return inner
    if any(c in value for c in "\"'"):
        raise EnvFileError(f"{where}: {key}: quote the whole value or none of it")
    if any(c in value for c in " \t#$`\\;&|<>()"):
        raise EnvFileError(
            f"{where}: {key}: unquoted value with spaces or shell characters "
            "(bash and systemd would read it differently); quote it"
        )
    return value


def quote(value: str) -> str:
    """The value as an env file must hold it: plain, or single-quoted when it must be."""
    if not any(c in value for c in " \t#$`\\;&|<>()\"'"):
        return value
    if "'" in value:
        raise EnvFileError("an env value with a single quote cannot be written to an env file")
    return f"'{value}'"


def set_values(path: Path, values: dict[str, str]) -> None:
    """Replace the KEY=... lines of an env file, appending the keys it does not have. Each
    text is written as it stands (pass it through quote() where it needs quoting)."""
    lines = path.read_text().splitlines()
    pending = dict(values)
    for i, line in enumerate(lines):
        key = line.partition("=")[0]
        if key in pending and not line.startswith("#"):
            lines[i] = f"{key}={pending.pop(key)}"
    lines += [f"{k}={v}" for k, v in pending.items()]
    path.write_text("\n".join(lines) + "\n")


def _redact_line(raw: str) -> str:
    key, sep, _ = raw.partition("=")
    return f"{key}={REDACTED}" if sep and SECRET_RE.search(key) else raw


def is_secret(key: str) -> bool:
    return bool(SECRET_RE.search(key))


def is_knob(key: str) -> bool:
    return key.startswith(KNOB_PREFIXES)


class EnvDir:
    """One directory of env files and the views the launch tools need."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise EnvFileError(f"--env-dir {self.path}: not a directory")
        missing = [f for f in FILES if not (self.path / f).is_file()]
        if missing:
            raise EnvFileError(f"--env-dir {self.path}: missing {', '.join(missing)}")
        self.lines = {name: parse_file(self.path / name) for name in FILES + instance_files(path)}

    def values(self, name: str) -> dict[str, str]:
        return {line.key: line.value for line in self.lines[name]}

    def common(self) -> dict[str, str]:
        return self.values("common.env")

    def instances(self, role: str) -> list[int]:
        """The numbers N of the role's ROLE.N.env files; empty: the role is one instance."""
        found = (INSTANCE_FILE_RE.match(name) for name in self.lines)
        return sorted(int(m.group(2)) for m in found if m and m.group(1) == role)

    def files(self, role: str, index: int | None = None) -> list[str]:
        """The files an instance reads, in order: common, the role's file, its own file."""
        own = [f"{role}.{index}.env"] if index is not None else []
        return ["common.env", f"{role}.env", *own]

    def role_env(self, role: str, index: int | None = None) -> dict[str, str]:
        """What the process gets from the files: common, the role's file, the instance's."""
        merged: dict[str, str] = {}
        for name in self.files(role, index):
            merged.update(self.values(name))
        return merged

    def origin(self, role: str, index: int | None, key: str) -> str:
        """FILE:LINE of the line that sets key for this instance (the last one read)."""
        where = key
        for name in self.files(role, index):
            for line in self.lines[name]:
                if line.key == key:
                    where = f"{line.path}:{line.number}: {key}"
        return where

    def knobs(self, role: str, index: int | None = None) -> dict[str, str]:
        return {k: v for k, v in self.role_env(role, index).items() if is_knob(k)}

    def secrets(self) -> list[str]:
        found = []
        for lines in self.lines.values():
            found += [ln.value for ln in lines if is_secret(ln.key) and ln.value]
        return sorted(set(found), key=len, reverse=True)

    def redactor(self) -> Redactor:
        return Redactor(self.secrets())


def instance_files(env_dir: Path) -> tuple[str, ...]:
    return tuple(
        sorted(p.name for p in Path(env_dir).glob("*.env") if INSTANCE_FILE_RE.match(p.name))
    )


class Redactor:
    def __init__(self, secrets: list[str]):
        self.secrets = [s for s in secrets if s]

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, REDACTED)
        return text

    def env_line(self, key: str, value: str) -> str:
        return f"{key}={REDACTED if is_secret(key) and value else self(value)}"


# --- validation -----------------------------------------------------------------------------

# Knobs our patches register, with the rules their parsers apply (kept identical here so a
# bad value is refused before a launch rather than at import time on the GPU host).
OUR_KNOBS = {
    "SGLANG_SM120_FLASHMLA_BACKEND": "one of flashinfer, triton, torch, mma",
    "SGLANG_SM120_MMA_TARGET_CTAS": "a positive integer or 'auto'",
    "SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT": "a positive number of seconds",
    "SGLANG_HEALTH_SCHEDULER_STALL_S": "a number of seconds >= 0 (0 turns the check off)",
}
# Upstream variables our patches lean on. Upstream's registry reads them leniently (a
# malformed value warns and falls back to the default), so a typo would silently change
# how long decode holds KV for a transfer that never concludes (patch 0004).
UPSTREAM_CHECKED = {
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "a positive whole number of seconds",
}
# Variables upstream reads with os.getenv outside its env registry, so the registry check
# would call them typos: SGLANG_USE_CPU_ENGINE (srt/utils/common.py is_cpu), SGLANG_HOST_IP
# (srt/utils/network.py, the address the PD bootstrap advertises) and
# SGLANG_CPU_OMP_THREADS_BIND (srt/utils/numa_utils.py: each CPU TP rank's cores, `0|1`).
UPSTREAM_UNREGISTERED = {"SGLANG_USE_CPU_ENGINE", "SGLANG_HOST_IP", "SGLANG_CPU_OMP_THREADS_BIND"}
# Launch settings whose form is fixed by the program they are passed to (smg takes whole
# seconds, and a bare host for --prometheus-host); checked with the knobs so a bad one is
# refused before a launch too.
LAUNCH_SETTINGS = {
    "ROUTER_SHUTDOWN_GRACE_S": "a whole number of seconds, or empty for smg's default",
    "ROUTER_PROMETHEUS_HOST": (
        "a host name or an IP address (no scheme, no port), or empty for ROUTER_HOST"
    ),
}
HOST_NAME_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")


def knob_value_error(key: str, value: str) -> str | None:
    if key == "SGLANG_SM120_FLASHMLA_BACKEND":
        ok = value in ("flashinfer", "triton", "torch", "mma")
    elif key == "SGLANG_SM120_MMA_TARGET_CTAS":
        ok = value == "auto" or (value.isdigit() and int(value) > 0)
    elif key == "SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT":
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        ok = seconds > 0 and seconds != float("inf")
    elif key == "SGLANG_HEALTH_SCHEDULER_STALL_S":
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        ok = 0 <= seconds < float("inf")
    elif key == "SGLANG_DISAGGREGATION_WAITING_TIMEOUT":
        ok = value.isdigit() and int(value) > 0
    elif key == "ROUTER_SHUTDOWN_GRACE_S":
        ok = re.fullmatch(r"[0-9]*", value) is not None
    elif key == "ROUTER_PROMETHEUS_HOST":
        ok = value == "" or _is_ip(value) or HOST_NAME_RE.fullmatch(value) is not None
    else:
        return None
    rule = (OUR_KNOBS | UPSTREAM_CHECKED | LAUNCH_SETTINGS)[key]
    return None if ok else f"{key}={value!r}: must be {rule}"


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def registered_sglang_names() -> tuple[set[str], str]:
    """SGLANG_* names the installed sglang knows, plus ours; and where they came from."""
    # Importing the sglang package pulls in torch (many seconds); environ.py itself needs only
    # the standard library, so it is loaded on its own from the installed package's files.
    import importlib.util

    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return set(OUR_KNOBS), "sglang is not installed; only our knobs are known"
    path = Path(list(spec.submodule_search_locations)[0]) / "srt" / "environ.py"
    try:
        environ_spec = importlib.util.spec_from_file_location("_sglang_environ", path)
        environ = importlib.util.module_from_spec(environ_spec)
        environ_spec.loader.exec_module(environ)
    except Exception as exc:  # noqa: BLE001 - any failure means "registry unavailable"
        return set(OUR_KNOBS), f"cannot read {path} ({exc}); only our knobs are known"
    names = {n for n in vars(environ.Envs) if n.startswith(("SGLANG_", "SGL_"))}
    known = names | set(OUR_KNOBS) | UPSTREAM_UNREGISTERED
    return known, f"registry of the installed sglang ({len(names)} names)"


# Settings that make an engine take DeepSeek-V4's SM120 attention path: meaningless (or worse)
# on another model, so a model that is not DSV4 next to them is refused.
DSV4_SETTINGS = ("SGLANG_CPU_SM120_PATH",)


# Settings for a CPU engine only (SGLANG_USE_CPU_ENGINE=1, upstream's is_cpu), each with the
# values that leave it off: on any other engine the engine stops at start with an error naming
# it (patch 0016 for the SM120 path, patch 0020 for the NIXL threads' nice value).
CPU_ENGINE_SETTINGS = {
    "SGLANG_CPU_SM120_PATH": ("", "0"),
    "SGLANG_DISAGGREGATION_NIXL_THREAD_NICE": ("",),
}


def cpu_engine_problems(env: EnvDir) -> list[str]:
    """A CPU-only setting on an engine that is not a CPU engine, one line per line that sets it."""
    problems: list[str] = []
    said = set()
    for role in ("prefill", "decode"):
        for index in env.instances(role) or [None]:
            values = env.role_env(role, index)
            if values.get("SGLANG_USE_CPU_ENGINE", "").strip() == "1":
                continue
            name = role if index is None else f"{role}/{index}"
            for key, off in CPU_ENGINE_SETTINGS.items():
                value = values.get(key)
                where = env.origin(role, index, key)
                if value is None or value.strip() in off or where in said:
                    continue
                said.add(where)
                problems.append(
                    f"{where}={value} is for a CPU engine only, and the {name} engine is not "
                    "one (no SGLANG_USE_CPU_ENGINE=1 for it): it would stop at start; unset "
                    f"{key} there"
                )
    return problems


# --- diff, snapshots ------------------------------------------------------------------------


def diff(a: Path, b: Path) -> list[str]:
    """Lines that differ between two env files or two env dirs, secrets redacted."""
    pairs = []
    if a.is_dir() and b.is_dir():
        names = sorted({p.name for p in a.glob("*.env")} | {p.name for p in b.glob("*.env")})
        pairs = [(a / n, b / n) for n in names]
    elif a.is_file() and b.is_file():
        pairs = [(a, b)]
    else:
        raise EnvFileError(f"env diff wants two files or two directories: {a}, {b}")
    out = []
    for pa, pb in pairs:
        va = {ln.key: ln for ln in parse_file(pa)} if pa.is_file() else {}
        vb = {ln.key: ln for ln in parse_file(pb)} if pb.is_file() else {}
        for key in sorted(set(va) | set(vb)):
            la, lb = va.get(key), vb.get(key)
            if la and lb and la.value == lb.value:
                continue
            shown = lambda ln: REDACTED if is_secret(ln.key) else ln.value  # noqa: E731
            left = f"{key}={shown(la)}" if la else "(absent)"
            right = f"{key}={shown(lb)}" if lb else "(absent)"
            label = pa.name if pa.name == pb.name else f"{pa.name} / {pb.name}"
            out.append(f"{label}: - {left}\n{' ' * len(label)}  + {right}")
    return out


def snapshot(env_dir: Path, backups: Path, now: _dt.datetime | None = None) -> Path:
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    dest = backups / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = backups / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for path in sorted(env_dir.glob("*.env")):
        shutil.copy2(path, dest / path.name)
    return dest


def list_snapshots(backups: Path) -> list[Path]:
    return sorted(p for p in backups.iterdir() if p.is_dir()) if backups.is_dir() else []


def restore(env_dir: Path, backups: Path, name: str | None) -> Path:
    snaps = list_snapshots(backups)
    if not snaps:
        raise EnvFileError(f"no snapshots under {backups}")
    if name is None:
        chosen = snaps[-1]
    else:
        matches = [p for p in snaps if p.name == name]
        if not matches:
            raise EnvFileError(
                f"no snapshot {name!r} under {backups}; have: " + ", ".join(p.name for p in snaps)
            )
        chosen = matches[0]
    for path in sorted(chosen.glob("*.env")):
        shutil.copy2(path, env_dir / path.name)
    return chosen
