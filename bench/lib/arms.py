"""The two sides of an A/B: already running stacks, or env overlays co-restarted via launch/pd."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path
from typing import Any

from bench.lib.client import resolve_api_key
from bench.lib.stack import stack_from_env_dir
from launch.pdlib import router_args
from launch.pdlib.envfiles import REDACTED, EnvDir, Redactor, is_secret, parse_file
from launch.pdlib.stack import load_stack, router_metrics_host
from launch.pdlib.supervise import recorded_process

ROOT = Path(__file__).resolve().parents[2]
PD = ROOT / "launch" / "pd"
# The knob lands in the decode process; an overlay key no base file defines goes there.
DEFAULT_ROLE_FILE = "decode.env"


class ArmError(RuntimeError):
    """An arm cannot be prepared; the A/B stops and keeps what it has."""


def redactor(*arms) -> Redactor:
    """Strips every secret of these arms from a text (the longest first)."""
    return Redactor(sorted(set().union(*(arm.secrets() for arm in arms)), key=len, reverse=True))


class UrlArm:
    mode = "urls"

    def __init__(self, name: str, url: str, api_key: str = "", metrics_url: str | None = None):
        self.name = name
        self.url = url.rstrip("/")
        self.api_key = api_key
        # The router's Prometheus /metrics, when given: its counters are then read per run.
        self.metrics_url = metrics_url

    def describe(self) -> str:
        return f"running stack at {self.url}"

    def secrets(self) -> set[str]:
        return {self.api_key} - {""}

    def redact(self, text: str) -> str:
        return redactor(self)(text)

    def prepare(self, _trial: int) -> dict[str, Any]:
        return {"required": False, "verified": None, "detail": "URL mode: nothing applied"}

    def planned_router_settings(self) -> dict[str, Any] | None:
        return None

    def router_settings(self) -> dict[str, Any] | None:
        """Not known for a stack this tool did not start."""
        return None


def apply_overlay(base: Path, overlay: Path, dest: Path) -> dict[str, str]:
    """Copy the base env files to dest with the overlay's lines replacing or adding lines."""
    overlay_lines = {line.key: line for line in parse_file(overlay)}
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(base, dest, ignore=shutil.ignore_patterns("ab", "backups"))
    # The copy is the env a stack runs from, secrets as they are in the base files: only the
    # user who ran bench/ab may read it.
    dest.chmod(0o700)
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
        self.metrics_url: str | None = None
        # The words this arm's router command lines gave secret-bearing smg flags.
        self.secret_words: set[str] = set()

    def describe(self) -> str:
        return f"{self.overlay} over {self.base}" + (" (sim)" if self.sim else "")

    def secrets(self) -> set[str]:
        """This arm's secrets: its env files' (API_KEY and the like) and what its router's
        command line gives secret-bearing smg flags (known once its settings were read: bench/ab
        reads the planned ones first)."""
        words = self.secret_words | {self.api_key}
        if self.env_dir.is_dir():
            words |= set(EnvDir(self.env_dir).secrets())
        return words - {""}

    def redact(self, text: str) -> str:
        return redactor(self)(text)

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
        router_env = EnvDir(self.env_dir).role_env("router")
        self.metrics_url = (
            f"http://{router_metrics_host(router_env)}:{router_env['ROUTER_PROMETHEUS_PORT']}"
            "/metrics"
        )
        # The key this arm's stack is (re)started with, unless --api-key says otherwise.
        self.api_key = resolve_api_key(self.cli_api_key, self.env_dir)
        restart = self._pd("co-restart")
        if restart.returncode != 0:
            tail = "\n".join((restart.stdout + restart.stderr).splitlines()[-15:])
            raise ArmError(
                f"arm {self.name} trial {trial}: co-restart failed:\n{self.redact(tail)}"
            )
        verify = self._pd("verify")
        lines = self.redact(verify.stdout + verify.stderr).splitlines()
        knob_lines = [ln.strip() for ln in lines if any(k in ln for k in values)]
        missing = [k for k in values if not any(k in ln for ln in knob_lines)]
        verified = verify.returncode == 0 and not missing
        detail = "; ".join(knob_lines) or "verify printed no line for the overlay's keys"
        if missing:
            detail += f"; not checked: {', '.join(missing)}"
        if verify.returncode != 0:
            detail += f"; launch/pd verify exited {verify.returncode}"
        shown = {k: REDACTED if is_secret(k) and v else self.redact(v) for k, v in values.items()}
        return {"required": True, "verified": verified, "detail": detail, "keys": shown}

    def _settings(self, argv: list[str]) -> dict[str, Any]:
        """smg's settings for argv, read by the parser of the smg that SMG_BIN runs (found as
        launch/router.sh finds it). The words argv and ROUTER_ARGS give secret-bearing flags are
        kept for redact (--dry-run shows --api-key's value as <redacted>; ROUTER_ARGS has it)."""
        env = EnvDir(self.env_dir).role_env("router")
        name = env.get("SMG_BIN") or "smg"
        smg_bin = router_args.find_smg_bin(name, env.get("PATH"))
        if smg_bin is None:
            raise router_args.RouterArgsError(f"SMG_BIN={name}: no such executable on PATH")
        python = router_args.smg_python(smg_bin)
        secret, other = router_args.flag_names(python)
        for words in (argv, env.get("ROUTER_ARGS", "").split()):
            self.secret_words |= set(router_args.secret_words(secret, other, words))
        return router_args.ask_smg(python, "settings", argv)

    def planned_router_settings(self) -> dict[str, Any]:
        """The routing settings launch/router.sh would start this arm's router with (the base
        env with the arm's overlay, read by smg's parser), before anything is started."""
        apply_overlay(self.base, self.overlay, self.env_dir)
        try:
            argv = router_args.launch_args(router_args.router_command(self.env_dir))
            settings = self._settings(argv)
        except router_args.RouterArgsError as exc:
            raise ArmError(
                f"arm {self.name}: the router's command line: {self.redact(str(exc))}"
            ) from exc
        return {"source": "launch/router.sh --dry-run", "settings": settings}

    def router_settings(self) -> dict[str, Any]:
        """The routing settings this arm's router runs with: its live command line when
        launch/pd started it here (pid file), else the one launch/router.sh would use."""
        stack = load_stack(self.env_dir, sim=self.sim)
        proc = recorded_process(stack.run_dir / "router.pid")
        try:
            if proc is None:
                return self.planned_router_settings()
            settings = self._settings(router_args.launch_args(proc.cmdline()))
        except (router_args.RouterArgsError, OSError) as exc:
            return {"source": "unreadable", "error": self.redact(str(exc)), "settings": None}
        return {"source": f"router pid {proc.pid} command line", "settings": settings}


def arms_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    urls = (args.url_a, args.url_b)
    envs = (args.a, args.b)
    if any(urls) and any(envs):
        raise ArmError("give either --a/--b or --url-a/--url-b, not both")
    if any(urls):
        if not all(urls):
            raise ArmError("--url-a and --url-b go together")
        key = resolve_api_key(args.api_key, args.env_dir)
        metrics = (args.router_metrics_a, args.router_metrics_b)
        if any(metrics) and not all(metrics):
            raise ArmError("--router-metrics-a and --router-metrics-b go together")
        return (
            UrlArm("A", args.url_a, key, args.router_metrics_a),
            UrlArm("B", args.url_b, key, args.router_metrics_b),
        )
    if args.router_metrics_a or args.router_metrics_b:
        raise ArmError("--router-metrics-a/-b are for --url-a/--url-b (env arms read env's)")
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
