"""launch/pd: run the PD stack (prefill, decode, router) from the env files."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from launch.pdlib import checks, envfiles, systemd_units
from launch.pdlib.envfiles import ROLES, EnvFileError, Redactor
from launch.pdlib.stack import ROOT, load_stack
from launch.pdlib.supervise import SuperviseError, remove_secret, supervisor_for

DEFAULT_ENV_DIR = ROOT / "env"


class Out:
    """Every line goes through the redactor: secret values never reach the terminal."""

    def __init__(self, redact: Redactor):
        self.redact = redact

    def __call__(self, text: str = "", err: bool = False) -> None:
        stream = sys.stderr if err else sys.stdout
        print(self.redact(text), file=stream, flush=True)


def _roles(names: list[str]) -> list[str]:
    bad = [n for n in names if n not in ROLES]
    if bad:
        raise EnvFileError(f"unknown role(s) {', '.join(bad)}; roles are {', '.join(ROLES)}")
    # The order matters: engines before the router when starting, the reverse when stopping.
    return [r for r in ROLES if r in names] if names else list(ROLES)


def _context(args):
    stack = load_stack(args.env_dir, args.sim, getattr(args, "timeout", None))
    return stack, supervisor_for(stack, args.env_dir), Out(stack.env.redactor())


def cmd_up(args) -> int:
    stack, sup, out = _context(args)
    rc = 0
    for name in _roles(args.roles):
        role = stack.role(name)
        state = sup.state(name)
        if state.running:
            out(f"{name}: already {state.detail}")
        else:
            out(f"{name}: {sup.start(role).detail}")
        if args.no_wait:
            continue
        health = checks.wait_healthy(stack, role, sup.alive, time.time())
        if not health.ok:
            _show_failure(out, sup, name, health.detail, args.log_lines)
            return 1
        out(f"{name}: healthy ({role.health_url})")
    return rc


def cmd_down(args) -> int:
    stack, sup, out = _context(args)
    for name in reversed(_roles(args.roles)):
        detail = sup.stop(stack.role(name)).detail
        if remove_secret(stack.run_dir, name):
            detail += "; its API key file removed"
        out(f"{name}: {detail}")
    return 0


def cmd_status(args) -> int:
    stack, sup, out = _context(args)
    rc = 0
    for name in _roles(args.roles):
        role = stack.role(name)
        state = sup.state(name)
        reply = checks.http(role.health_url)
        health = f"HTTP {reply.status}" if reply.status is not None else reply.error
        healthy = reply.status == 200
        rc |= 0 if (state.running and healthy) else 1
        out(f"{name:8s} {state.detail}; {role.health_url}: {health}")
    return rc


def cmd_restart(args) -> int:
    stack, sup, out = _context(args)
    role = stack.role(args.role)
    started = time.time()
    out(f"{role.name}: {sup.restart(role).detail}")
    health = checks.wait_healthy(stack, role, sup.alive, started)
    if not health.ok:
        _show_failure(out, sup, role.name, health.detail, args.log_lines)
        return 1
    out(f"{role.name}: healthy after {health.seconds:.1f} s")
    return 0


def cmd_logs(args) -> int:
    _, sup, out = _context(args)
    _roles([args.role])
    for line in sup.logs(args.role, args.lines):
        out(line)
    return 0


def _show_failure(out, sup, role: str, detail: str, lines: int) -> None:
    out(f"{role}: {detail}", err=True)
    out(f"--- last {lines} lines of the {role} log ---", err=True)
    for line in sup.logs(role, lines):
        out(line, err=True)


def cmd_co_restart(args) -> int:
    stack, sup, out = _context(args)
    t0 = time.time()
    for name in ROLES:
        role = stack.role(name)
        started = time.time()
        out(f"[{name}] restarting ({sup.kind}{', sim' if stack.sim else ''})")
        try:
            detail = sup.restart(role).detail
            out(f"[{name}] {detail} ({time.time() - started:.1f} s)")
        except SuperviseError as exc:
            out(f"[{name}] {exc}", err=True)
            out(f"co-restart stopped at {name}; roles after it were not touched", err=True)
            return 1
        health = checks.wait_healthy(stack, role, sup.alive, started)
        if not health.ok:
            _show_failure(out, sup, name, health.detail, args.log_lines)
            out(f"co-restart stopped at {name}; roles after it were not touched", err=True)
            return 1
        detect = ""
        if health.detected_after_ready_s is not None:
            detect = f", seen {health.detected_after_ready_s:.2f} s after it reported ready"
        out(
            f"[{name}] healthy after {health.seconds:.1f} s (poll {stack.poll_interval_s:g} s"
            f"{detect})"
        )
    out(f"all roles healthy after {time.time() - t0:.1f} s")
    results = checks.verify(stack)
    for check in results:
        out(check.line())
    if not all(c.ok for c in results):
        out("co-restart: verify failed", err=True)
        return 1
    ok, lines = checks.probe(stack, args.probe_timeout, 16)
    for line in lines:
        out(line)
    out(f"co-restart {'done' if ok else 'FAILED at probe'} in {time.time() - t0:.1f} s")
    return 0 if ok else 1


def cmd_verify(args) -> int:
    stack, _, out = _context(args)
    results = checks.verify(stack)
    for check in results:
        out(check.line())
    failed = sum(not c.ok for c in results)
    out(f"verify: {len(results) - failed} ok, {failed} failed")
    return 1 if failed else 0


def cmd_probe(args) -> int:
    stack, _, out = _context(args)
    ok, lines = checks.probe(stack, args.probe_timeout, args.max_tokens)
    for line in lines:
        out(line)
    return 0 if ok else 1


def cmd_metrics(args) -> int:
    stack, _, out = _context(args)
    rows = checks.metrics_lines(stack)
    for _, line in rows:
        out(line)
    return 0 if all(ok for ok, _ in rows) else 1


def cmd_env_check(args) -> int:
    problems, notes = envfiles.check(args.env_dir)
    try:
        out = Out(envfiles.EnvDir(args.env_dir).redactor())
    except EnvFileError:
        out = Out(Redactor([]))
    for note in notes:
        out(f"note {note}")
    for problem in problems:
        out(f"FAIL {problem}")
    out(f"env check {args.env_dir}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


def cmd_env_diff(args) -> int:
    lines = envfiles.diff(args.a, args.b)
    for line in lines:
        print(line)
    print(f"{len(lines)} line(s) differ")
    return 0


def _backups(args) -> Path:
    return args.backups or (args.env_dir / "backups")


def cmd_env_snapshot(args) -> int:
    envfiles.EnvDir(args.env_dir)
    print(f"snapshot {envfiles.snapshot(args.env_dir, _backups(args))}")
    return 0


def cmd_env_restore(args) -> int:
    backups = _backups(args)
    if args.list:
        for snap in envfiles.list_snapshots(backups):
            print(snap.name)
        return 0
    if not envfiles.list_snapshots(backups):
        raise EnvFileError(f"no snapshots under {backups}")
    kept = envfiles.snapshot(args.env_dir, backups)
    chosen = envfiles.restore(args.env_dir, backups, args.name)
    print(f"restored {chosen.name} into {args.env_dir} (the files it replaced: {kept.name})")
    return 0


def cmd_units(args) -> int:
    written = systemd_units.render(args.out, args.env_dir, args.sim)
    for path in written:
        print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--env-dir",
        type=Path,
        default=DEFAULT_ENV_DIR,
        help="directory with common.env, prefill.env, decode.env, router.env (default: env/)",
    )
    stack = argparse.ArgumentParser(add_help=False, parents=[common])
    stack.add_argument(
        "--sim",
        action="store_true",
        help="simulated engines (launch/sim_engine.py) behind the real smg router",
    )
    logs = argparse.ArgumentParser(add_help=False)
    logs.add_argument(
        "--log-lines", type=int, default=30, help="log lines shown when a role fails (default: 30)"
    )
    timeout = argparse.ArgumentParser(add_help=False)
    timeout.add_argument(
        "--timeout",
        type=float,
        help="seconds to wait for each role's health (default: the "
        "ROLE_HEALTH_TIMEOUT_S env values; at most 30 with --sim)",
    )
    probe_opts = argparse.ArgumentParser(add_help=False)
    probe_opts.add_argument(
        "--probe-timeout",
        type=float,
        default=300.0,
        help="seconds the probe request may take (default: 300)",
    )

    parser = argparse.ArgumentParser(
        prog="launch/pd",
        description=__doc__,
        epilog="Roles: prefill, decode, router. Supervision (local or systemd) comes from "
        "PD_SUPERVISOR in common.env.",
    )
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("up", parents=[stack, logs, timeout], help="start roles, wait healthy")
    p.add_argument("roles", nargs="*", metavar="ROLE", help="default: all, in order")
    p.add_argument("--no-wait", action="store_true", help="do not wait for health")
    p.set_defaults(func=cmd_up)
    p = sub.add_parser("down", parents=[stack], help="stop roles (router first)")
    p.add_argument("roles", nargs="*", metavar="ROLE", help="default: all")
    p.set_defaults(func=cmd_down)
    p = sub.add_parser("status", parents=[stack], help="process state and health of each role")
    p.add_argument("roles", nargs="*", metavar="ROLE", help="default: all")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("restart", parents=[stack, logs, timeout], help="restart one role")
    p.add_argument("role", choices=ROLES)
    p.set_defaults(func=cmd_restart)
    p = sub.add_parser("logs", parents=[stack], help="last lines of a role's log")
    p.add_argument("role", choices=ROLES)
    p.add_argument("-n", "--lines", type=int, default=50, help="default: 50")
    p.set_defaults(func=cmd_logs)
    p = sub.add_parser(
        "co-restart",
        parents=[stack, logs, timeout, probe_opts],
        help="prefill, decode, router in turn, each healthy before the next; then verify, probe",
    )
    p.set_defaults(func=cmd_co_restart)
    p = sub.add_parser(
        "verify",
        parents=[stack],
        help="health, knobs in the live process environments, patched build",
    )
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser(
        "probe",
        parents=[stack, probe_opts],
        help="one chat completion through the router, with decode's load",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="default: 16")
    p.set_defaults(func=cmd_probe)
    p = sub.add_parser("metrics", parents=[stack], help="key gauges of each role")
    p.set_defaults(func=cmd_metrics)
    p = sub.add_parser("units", parents=[stack], help="render the systemd unit templates")
    p.add_argument("--out", type=Path, required=True, help="directory to write the units into")
    p.set_defaults(func=cmd_units)

    env = sub.add_parser("env", help="check, diff, snapshot and restore env files")
    env_sub = env.add_subparsers(dest="env_verb", required=True, metavar="ENV_VERB")
    p = env_sub.add_parser(
        "check", parents=[common], help="format, unknown SGLANG_* names, knob values"
    )
    p.set_defaults(func=cmd_env_check)
    p = env_sub.add_parser("diff", help="lines that differ between two env files or dirs")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.set_defaults(func=cmd_env_diff)
    backups = argparse.ArgumentParser(add_help=False)
    backups.add_argument(
        "--backups", type=Path, help="where snapshots live (default: ENV_DIR/backups)"
    )
    p = env_sub.add_parser(
        "snapshot", parents=[common, backups], help="copy the env files to a dated backup"
    )
    p.set_defaults(func=cmd_env_snapshot)
    p = env_sub.add_parser(
        "restore",
        parents=[common, backups],
        help="restore a backup (default: the newest); the current files are snapshotted first",
    )
    p.add_argument("name", nargs="?", help="snapshot name (see --list)")
    p.add_argument("--list", action="store_true", help="list snapshots")
    p.set_defaults(func=cmd_env_restore)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (EnvFileError, SuperviseError) as exc:
        print(f"launch/pd {args.verb}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
