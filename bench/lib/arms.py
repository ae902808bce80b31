"""The two sides of an A/B: already running stacks, or env overlays co-restarted via launch/pd."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path
from typing import Any

from bench.lib.client import resolve_api_key
from bench.lib.stack import stack_from_env_dir
from launch.pdlib.envfiles import parse_file

ROOT = Path(__file__).resolve().parents[2]
PD = ROOT / "launch" / "pd"
# The knob lands in the decode process; an overlay key no base file defines goes there.
DEFAULT_ROLE_FILE = "decode.env"


class ArmError(RuntimeError):
    """An arm cannot be prepared; the A/B stops and keeps what it has."""


class UrlArm:
    mode = "urls"

    def __init__(self, name: str, url: str, api_key: str = ""):
        self.name = name
        self.url = url.rstrip("/")
        self.api_key = api_key

    def describe(self) -> str:
        return f"running stack at {self.url}"

    def prepare(self, _trial: int) -> dict[str, Any]:
        return {"required": False, "verified": None, "detail": "URL mode: nothing applied"}


def apply_overlay(base: Path, overlay: Path, dest: Path) -> dict[str, str]:
    """Copy the base env files to dest with the overlay's lines replacing or adding lines."""
    overlay_lines = {line.key: line for line in parse_file(overlay)}
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(base, dest, ignore=shutil.ignore_patterns("ab", "backups"))
    pending = dict(overlay_lines)
    for path in sorted(dest.glob("*.env")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            key = line.partition("=")[0]
            if key in pending and not line.startswith("#"):
                # The overlay's raw line keeps its quoting, so the copy stays in launch's format.
                lines[i] = pending.pop(key).raw
        path.write_text("\n".join(lines) + "\n")
    if pending:
        target = dest / DEFAULT_ROLE_FILE
        with target.open("a") as f:
            f.write(f"# added by bench/ab from {overlay.name}\n")
            f.writelines(line.raw + "\n" for line in pending.values())
    return {key: line.value for key, line in overlay_lines.items()}


class EnvArm:
    mode = "co-restart"

    def __init__(
        self,
        name: str,
        overlay: Path,
        base: Path,
        work: Path,
        sim: bool,
        timeout_s: float = 900.0,
        cli_api_key: str | None = None,
    ):
        self.name = name
        self.overlay = overlay
        self.base = base
        self.env_dir = work / f"env-{name}"
        self.sim = sim
        self.timeout_s = timeout_s
        self.url = ""
        self.cli_api_key = cli_api_key
        self.api_key = ""

    def describe(self) -> str:
        return f"{self.overlay} over {self.base}" + (" (sim)" if self.sim else "")

    def _pd(self, verb: str) -> subprocess.CompletedProcess:
        cmd = [str(PD), verb, "--env-dir", str(self.env_dir)] + (["--sim"] if self.sim else [])
        try:
            return subprocess.run(
                cmd, cwd=ROOT, capture_output=True, text=True, timeout=self.timeout_s
            )
        except subprocess.TimeoutExpired as exc:
            raise ArmError(
                f"arm {self.name}: launch/pd {verb} still running after {self.timeout_s:g} s"
            ) from exc

    def prepare(self, trial: int) -> dict[str, Any]:
        values = apply_overlay(self.base, self.overlay, self.env_dir)
        self.url = stack_from_env_dir(self.env_dir).router_url or ""
        # The key this arm's stack is (re)started with, unless --api-key says otherwise.
        self.api_key = resolve_api_key(self.cli_api_key, self.env_dir)
        restart = self._pd("co-restart")
        if restart.returncode != 0:
            tail = "\n".join((restart.stdout + restart.stderr).splitlines()[-15:])
            raise ArmError(f"arm {self.name} trial {trial}: co-restart failed:\n{tail}")
        verify = self._pd("verify")
        lines = (verify.stdout + verify.stderr).splitlines()
        knob_lines = [ln.strip() for ln in lines if any(k in ln for k in values)]
        missing = [k for k in values if not any(k in ln for ln in knob_lines)]
        verified = verify.returncode == 0 and not missing
        detail = "; ".join(knob_lines) or "verify printed no line for the overlay's keys"
        if missing:
            detail += f"; not checked: {', '.join(missing)}"
        if verify.returncode != 0:
            detail += f"; launch/pd verify exited {verify.returncode}"
        return {"required": True, "verified": verified, "detail": detail, "keys": values}


def arms_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    urls = (args.url_a, args.url_b)
    envs = (args.a, args.b)
    if any(urls) and any(envs):
        raise ArmError("give either --a/--b or --url-a/--url-b, not both")
    if any(urls):
        if not all(urls):
            raise ArmError("--url-a and --url-b go together")
        key = resolve_api_key(args.api_key, args.env_dir)
        return UrlArm("A", args.url_a, key), UrlArm("B", args.url_b, key)
    if not all(envs):
        raise ArmError("give --a and --b (env overlays) or --url-a and --url-b")
    for path in envs:
        if not path.is_file():
            raise ArmError(f"env overlay {path}: no such file")
        try:
            parse_file(path)
        except ValueError as exc:
            raise ArmError(str(exc)) from exc
    try:
        stack_from_env_dir(args.env_dir)
    except ValueError as exc:
        raise ArmError(str(exc)) from exc
    if not PD.exists():
        raise ArmError(f"co-restart mode needs {PD.relative_to(ROOT)}, which is missing")
    work = args.out_work
    return (
        EnvArm("A", args.a, args.env_dir, work, args.sim, cli_api_key=args.api_key),
        EnvArm("B", args.b, args.env_dir, work, args.sim, cli_api_key=args.api_key),
    )
