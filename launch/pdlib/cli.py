"""launch/pd: run the PD stack (prefill, decode, router) from the env files."""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import replace
from pathlib import Path

from launch.pdlib import (
    checks,
    envcheck,
    envfiles,
    k8s,
    loadfiles,
    maintenance,
    model_path,
    monitoring,
    rotation,
    systemd_units,
    tp_mix,
)
from launch.pdlib.envfiles import EnvFileError, Redactor
from launch.pdlib.files import write_whole
from launch.pdlib.stack import ROOT, Role, Stack, load_stack
from launch.pdlib.supervise import SuperviseError, remove_secret, supervisor_for

DEFAULT_ENV_DIR = ROOT / "env"


class Out:
    """Every line goes through the redactor: secret values never reach the terminal."""

    def __init__(self, redact: Redactor):
        self.redact = redact

    def __call__(self, text: str = "", err: bool = False) -> None:
        stream = sys.stderr if err else sys.stdout
        print(self.redact(text), file=stream, flush=True)


def _out_refusal(verb: str, args: argparse.Namespace) -> str:
    """Why `verb` may not write into --out ('' when it may): not a directory, or not empty
    without --force."""
    out_dir: Path = args.out
    if out_dir.exists() and not out_dir.is_dir():
        return f"{verb}: --out {out_dir}: not a directory"
    if out_dir.is_dir() and any(out_dir.iterdir()) and not args.force:
        return f"{verb}: --out {out_dir} exists and is not empty; --force writes over it"
    return ""


def _out_args(p: argparse.ArgumentParser) -> None:
    """--out and --force of the verbs that render files."""
    p.add_argument("--out", type=Path, required=True, help="directory to write into")
    p.add_argument(
        "--force", action="store_true", help="write into --out even when it is not empty"
    )


def _context(args):
    stack = load_stack(args.env_dir, args.sim, getattr(args, "timeout", None))
    return stack, supervisor_for(stack, args.env_dir), Out(stack.env.redactor())


def _narrowed(stack: Stack, targets: list[str], with_router: bool = False) -> Stack:
    """The stack seen through the instances the targets name (ROLE/N, ROLE or all)."""
    chosen = {r.name: r for r in stack.select(targets)}
    if with_router:
        chosen.update({r.name: r for r in stack.of_kind("router")})
    return replace(stack, roles={n: r for n, r in stack.roles.items() if n in chosen})


def _here(stack: Stack, roles: list[Role], out) -> list[Role]:
    """The instances of this host; the others are named and left alone."""
    for role in roles:
        if not role.local:
            out(f"{role.name}: on {role.host}, not this host ({stack.here}); skipped")
    return [r for r in roles if r.local]


def _one(stack: Stack, target: str) -> Role:
    roles = stack.select([target])
    if len(roles) != 1:
        raise EnvFileError(
            f"{target} names {len(roles)} instances ({', '.join(r.name for r in roles)}); "
            "name one as ROLE/N"
        )
    return roles[0]


def _started(stack: Stack, role: Role, out) -> None:
    """Bookkeeping after a role is (re)started, with several instances: the router reads its
    workers from the file, so it is written before the router starts, and an engine that is
    up again is put back on the list."""
    if not stack.several:
        return
    if role.kind == "router":
        rotation.write(stack, list(stack.roles))
        out(f"router: worker list {stack.workers_file} lists every instance")
    elif rotation.put(stack, role, True):
        out(f"{role.name}: back in the router's worker list ({stack.workers_file})")


def _mark(out, problem: str | None) -> None:
    """A maintenance mark that could not be written is said, and the verb goes on."""
    if problem:
        out(f"note: {problem}", err=True)


def _routes_to_all(stack: Stack, router: Role, out) -> bool:
    """With several instances the router is ready once it has one prefill and one decode;
    wait until it routes to every instance on its worker list."""
    if not stack.several:
        return True
    started = time.time()
    listed = rotation.listed(stack)
    for role in [r for r in stack.roles.values() if r.name in listed]:
        left = max(0.0, router.health_timeout_s - (time.time() - started))
        waited = rotation.wait_router(stack, role, True, left)
        if not waited.ok:
            out(f"router: {waited.detail}", err=True)
            return False
    out(f"router: routes to every listed instance after {time.time() - started:.1f} s")
    return True


def _models_refused(stack: Stack, out, verb: str) -> bool:
    """True (after saying why) when the engines would not serve one model, a DSV4-only
    setting sits next to another model, or prefill and decode differ in attention TP size on a
    model that is not MLA: checked before anything is started or stopped."""
    refused = model_path.model_problems(stack.env) or tp_mix.problems(stack.env, [])
    for problem in refused:
        out(f"FAIL {problem}", err=True)
    if refused:
        out(f"{verb}: nothing started or stopped (launch/pd env check lists them all)", err=True)
    return bool(refused)


def _starts_engines(cmd):
    """The start path of every verb that (re)starts engines: the stack is loaded and the env
    files' models are checked (`_models_refused`, exit 2) before the verb touches anything."""

    @functools.wraps(cmd)
    def start(args) -> int:
        stack, sup, out = _context(args)
        if _models_refused(stack, out, args.verb):
            return 2
        return cmd(args, stack, sup, out)

    return start


@_starts_engines
def cmd_up(args, stack: Stack, sup, out) -> int:
    for role in _here(stack, stack.select(args.roles), out):
        state = sup.state(role.key)
        if state.running:
            out(f"{role.name}: already {state.detail}")
        else:
            if role.kind == "router":
                _started(stack, role, out)
            _mark(out, maintenance.starting(stack, role))
            out(f"{role.name}: {sup.start(role).detail}")
        if args.no_wait:
            continue
        health = checks.wait_healthy(stack, role, sup.alive, time.time())
        if not health.ok:
            _show_failure(out, sup, role, health.detail, args.log_lines)
            return 1
        out(f"{role.name}: healthy ({role.health_url})")
        if role.kind != "router":
            loadfiles.remember(stack.run_dir, role.key, sup.processes(role.key))
            _started(stack, role, out)
        elif not _routes_to_all(stack, role, out):
            return 1
        _mark(out, maintenance.in_service(stack, role))
    return 0


def cmd_down(args) -> int:
    stack, sup, out = _context(args)
    for role in reversed(_here(stack, stack.select(args.roles), out)):
        if stack.several and role.kind != "router" and rotation.put(stack, role, False):
            out(f"{role.name}: taken out of the router's worker list")
        _mark(out, maintenance.stopped(stack, role))
        detail = sup.stop(role).detail
        if remove_secret(stack.run_dir, role):
            detail += "; its API key file removed"
        out(f"{role.name}: {detail}")
    return 0


def cmd_status(args) -> int:
    stack, sup, out = _context(args)
    rc = 0
    width = max(8, *(len(r.name) for r in stack.roles.values()))
    for role in stack.select(args.roles):
        state = sup.state(role.key) if role.local else None
        reply = checks.http(role.health_url)
        health = f"HTTP {reply.status}" if reply.status is not None else reply.error
        healthy = reply.status == 200
        running = state.running if state else True
        rc |= 0 if (running and healthy) else 1
        detail = state.detail if state else f"on {role.host} (process not visible from here)"
        out(f"{role.name:{width}s} {detail}; {role.health_url}: {health}")
    return rc


@_starts_engines
def cmd_restart(args, stack: Stack, sup, out) -> int:
    role = _one(stack, args.role)
    if not _here(stack, [role], out):
        return 1
    return 0 if _restart_in_service(stack, sup, role, out, args.log_lines) else 1


def cmd_logs(args) -> int:
    stack, sup, out = _context(args)
    for line in sup.logs(_one(stack, args.role).key, args.lines):
        out(line)
    return 0


def _show_failure(out, sup, role: Role, detail: str, lines: int) -> None:
    out(f"{role.name}: {detail}", err=True)
    out(f"--- last {lines} lines of the {role.name} log ---", err=True)
    for line in sup.logs(role.key, lines):
        out(line, err=True)


def _restart_healthy(
    stack: Stack, sup, role: Role, out, log_lines: int, tag: str, mark: bool = True
):
    """Restart one instance and wait for its health; the Healthy result, or None when the
    supervisor could not restart it (said on stderr)."""
    started = time.time()
    out(f"[{tag}] restarting ({sup.kind}{', sim' if stack.sim else ''})")
    if mark:  # rolling-restart marked it when it took it out of rotation
        _mark(out, maintenance.starting(stack, role))
    try:
        detail = sup.restart(role).detail
        out(f"[{tag}] {detail} ({time.time() - started:.1f} s)")
    except SuperviseError as exc:
        out(f"[{tag}] {exc}", err=True)
        return None
    health = checks.wait_healthy(stack, role, sup.alive, started)
    if not health.ok:
        _show_failure(out, sup, role, health.detail, log_lines)
        return None
    if role.kind != "router":
        loadfiles.remember(stack.run_dir, role.key, sup.processes(role.key))
    detect = ""
    if health.detected_after_ready_s is not None:
        detect = f", seen {health.detected_after_ready_s:.2f} s after it reported ready"
    out(f"[{tag}] healthy after {health.seconds:.1f} s (poll {stack.poll_interval_s:g} s{detect})")
    return health


def _restart_in_service(stack: Stack, sup, role: Role, out, log_lines: int) -> bool:
    """Restart one instance and wait for its health; with several instances, the router
    starts from the full worker list and routes to every instance on it, and an engine goes
    back on the list."""
    if role.kind == "router":
        _started(stack, role, out)
    if _restart_healthy(stack, sup, role, out, log_lines, role.name) is None:
        return False
    if role.kind != "router":
        _started(stack, role, out)
    elif not _routes_to_all(stack, role, out):
        return False
    _mark(out, maintenance.in_service(stack, role))
    return True


@_starts_engines
def cmd_co_restart(args, stack: Stack, sup, out) -> int:
    t0 = time.time()
    for role in _here(stack, stack.select(args.roles), out):
        if not _restart_in_service(stack, sup, role, out, args.log_lines):
            out(f"co-restart stopped at {role.name}; instances after it were not touched", err=True)
            return 1
    out(f"all roles healthy after {time.time() - t0:.1f} s")
    results = checks.verify(_narrowed(stack, args.roles))
    for check in results:
        out(check.line())
    if not checks.summary(results)[0]:
        out("co-restart: verify failed", err=True)
        return 1
    ok, lines = checks.probe(stack, args.probe_timeout, args.probe_max_tokens)
    for line in lines:
        out(line)
    out(f"co-restart {'done' if ok else 'FAILED at probe'} in {time.time() - t0:.1f} s")
    return 0 if ok else 1


def _out_of_rotation(out, role: Role, why: str) -> int:
    out(f"rolling-restart stopped at {role.name}: {why}", err=True)
    out(
        f"{role.name} is OUT of rotation (not in the router's worker list); the other "
        f"instances keep serving. Fix it, then `launch/pd up {role.name}` puts it back.",
        err=True,
    )
    return 1


def _stopped_before(out, role: Role, why: str) -> int:
    out(
        f"rolling-restart stopped before {role.name}: {why}; it and the instances after it "
        "were not touched",
        err=True,
    )
    return 1


@_starts_engines
def cmd_rolling_restart(args, stack: Stack, sup, out) -> int:
    if args.role not in ("prefill", "decode"):
        raise EnvFileError(f"rolling-restart takes prefill or decode, not {args.role!r}")
    instances = stack.of_kind(args.role)
    if len(instances) < 2:
        raise EnvFileError(
            f"{args.role} has a single instance: taking it out of rotation would stop the "
            f"service. Use `launch/pd co-restart` (or add {args.role}.N.env instance files)"
        )
    if not stack.role("router").local:
        raise EnvFileError(
            f"the router runs on {stack.role('router').host}, not this host ({stack.here}); "
            "its worker list is there: run rolling-restart on the router's host"
        )
    t0 = time.time()
    mine = _here(stack, instances, out)
    for n, role in enumerate(mine, 1):
        tag = f"{role.name} {n}/{len(mine)}"
        workers = rotation.router_workers(stack)
        if isinstance(workers, str):
            return _stopped_before(out, role, f"cannot read the router's workers ({workers})")
        others = [r.name for r in instances if rotation.routable(workers.get(r.name))]
        others = [name for name in others if name != role.name]
        if not others:
            return _stopped_before(
                out,
                role,
                f"no other {args.role} instance is in rotation and ready, so taking "
                f"{role.name} out would stop the service",
            )
        out(f"[{tag}] out of rotation (the router keeps {', '.join(others)})")
        _mark(
            out,
            maintenance.starting(stack, role, args.drain_timeout + 2 * args.router_timeout),
        )
        rotation.put(stack, role, False)
        gone = rotation.wait_router(stack, role, False, args.router_timeout)
        if not gone.ok:
            return _out_of_rotation(out, role, gone.detail)
        out(f"[{tag}] {gone.detail} after {gone.seconds:.1f} s")
        drained = rotation.wait_drained(stack, role, args.drain_timeout, out)
        if drained.ok:
            out(f"[{tag}] drained after {drained.seconds:.1f} s ({drained.detail})")
        else:
            out(f"[{tag}] {drained.detail}; restarting anyway")
        if _restart_healthy(stack, sup, role, out, args.log_lines, tag, mark=False) is None:
            return _out_of_rotation(out, role, "it did not come back healthy")
        results = checks.environ_checks(replace(stack, roles={role.name: role}))
        for check in results:
            out(check.line())
        if not checks.summary(results)[0]:
            return _out_of_rotation(out, role, "its knobs are not live in its process")
        rotation.put(stack, role, True)
        back = rotation.wait_router(stack, role, True, args.router_timeout)
        if not back.ok:
            return _out_of_rotation(out, role, back.detail)
        out(f"[{tag}] {back.detail} after {back.seconds:.1f} s")
        _mark(out, maintenance.in_service(stack, role))
    out(f"rolling-restart {args.role} done in {time.time() - t0:.1f} s")
    return 0


def cmd_verify(args) -> int:
    textfile = Path(args.textfile) if args.textfile else None
    # node_exporter's textfile collector reads *.prom only; this also stops a target name taken
    # for PATH (`--textfile decode`).
    if textfile is not None and textfile.suffix != ".prom":
        print(
            f"verify: --textfile {textfile}: not a .prom file (node_exporter's textfile "
            "collector reads only *.prom); give PATH ending in .prom, or --textfile last with "
            f"no PATH for {maintenance.VARIABLE}/sm120pd_verify_<PD_UNIT_PREFIX>.prom",
            file=sys.stderr,
        )
        return 2
    stack, _, out = _context(args)
    if args.textfile == "":
        textfile = maintenance.verify_textfile(stack)
        if textfile is None:
            print(
                f"verify: --textfile with no PATH writes into {maintenance.VARIABLE}, which "
                "common.env does not set; set it or give PATH",
                file=sys.stderr,
            )
            return 2
    if textfile is not None and not textfile.parent.is_dir():
        print(f"verify: --textfile {textfile}: no directory {textfile.parent}", file=sys.stderr)
        return 2
    results = checks.verify(_narrowed(stack, args.roles))
    for check in results:
        out(check.line())
    ok, text = checks.summary(results)
    out(f"verify: {text}")
    if textfile is not None:
        # Written whole, then renamed: a collector never reads half a file.
        try:
            text = checks.textfile(results, time.time(), stack.unit_prefix)
            write_whole(textfile, text, 0o644)
        except OSError as exc:
            print(f"verify: --textfile {textfile}: {exc}", file=sys.stderr)
            return 2
        out(f"verify: results written to {textfile}")
    return 0 if ok else 1


def cmd_probe(args) -> int:
    stack, _, out = _context(args)
    ok, lines = checks.probe(
        _narrowed(stack, args.roles, with_router=True), args.probe_timeout, args.max_tokens
    )
    for line in lines:
        out(line)
    return 0 if ok else 1


def cmd_metrics(args) -> int:
    stack, _, out = _context(args)
    rows = checks.metrics_lines(_narrowed(stack, args.roles))
    for _, line in rows:
        out(line)
    return 0 if all(ok for ok, _ in rows) else 1


def _checked(env_dir: Path, for_monitoring: bool) -> tuple[list[str], list[str]]:
    """env check's problems and notes; for monitoring, also the engines without /metrics."""
    problems, notes = envcheck.check(env_dir)
    if for_monitoring and not problems:
        stack = load_stack(env_dir, sim=False)
        problems = monitoring.metrics_problems(stack) + monitoring.textfile_problems(stack)
    return problems, notes


def cmd_env_check(args) -> int:
    problems, notes = _checked(args.env_dir, args.monitoring)
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


def cmd_monitoring(args) -> int:
    problems, _ = _checked(args.env_dir, True)
    if problems:
        out = Out(Redactor([]))
        for problem in problems:
            out(f"FAIL {problem}", err=True)
        out(f"env check {args.env_dir}: {len(problems)} problem(s)", err=True)
        out("monitoring: nothing written", err=True)
        return 2
    for option in (
        "scrape_interval",
        "stuck_after",
        "held_after",
        "slack",
        "down_after",
        "stalled_after",
        "flap_window",
        "verify_stale_after",
        "queue_after",
        "quarantine_after",
    ):
        value = getattr(args, option)
        if value is not None and value <= 0:
            print(f"monitoring: --{option.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    out_dir: Path = args.out
    if refused := _out_refusal("monitoring", args):
        print(refused, file=sys.stderr)
        return 2
    stack = load_stack(args.env_dir, sim=False)
    windows = monitoring.windows(
        stack,
        args.stuck_after,
        args.held_after,
        args.slack,
        args.down_after,
        args.stalled_after,
        args.flap_window,
        args.verify_stale_after,
        args.scrape_interval,
        args.queue_after,
        quarantine=args.quarantine_after,
        scraped=bool(args.textfile_target) or args.textfile_scraped,
    )
    for path in monitoring.render(
        out_dir,
        stack,
        windows,
        args.scrape_interval,
        args.env_dir.resolve(),
        args.textfile_target,
    ):
        print(f"wrote {path}")
    waits = (
        "PDInstanceDown waits each role's health timeout "
        f"({', '.join(f'{k} {v:g} s' for k, v in windows.down.items())}) instead of "
        f"{monitoring.DOWN_AFTER_S:g} s"
    )
    if maintenance.textfile_dir(stack) is None:
        if args.down_after is None:
            print(
                f"note: {maintenance.VARIABLE} is not set in common.env, so launch/pd cannot "
                f"mark its own restarts; {waits}"
            )
    elif not windows.scraped:
        print(
            f"note: nothing scrapes {maintenance.VARIABLE} here (--textfile-target renders a "
            "job for a node_exporter that reads it, --textfile-scraped says your own does), so "
            "no maintenance mark or verify result reaches this Prometheus: "
            + (f"{waits}, and " if args.down_after is None else "")
            + "PDVerifyStale is not rendered"
        )
    if not windows.inflight_bounded:
        print(
            "note: SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT is not set for prefill; "
            f"PDPrefillKVPinned waits {windows.inflight:g} s"
        )
    ok, text = monitoring.promtool_check(out_dir)
    print(f"promtool check config: {text}" if ok is not None else f"note: {text}")
    return 1 if ok is False else 0


def cmd_k8s(args) -> int:
    problems, _ = _checked(args.env_dir, True)
    out = Out(Redactor([]))
    if problems:
        for problem in problems:
            out(f"FAIL {problem}", err=True)
        out(f"env check {args.env_dir}: {len(problems)} problem(s)", err=True)
        out("k8s: nothing written", err=True)
        return 2
    out_dir: Path = args.out
    if refused := _out_refusal("k8s", args):
        print(refused, file=sys.stderr)
        return 2
    stack = load_stack(args.env_dir, sim=False)
    out = Out(stack.env.redactor())
    opts = k8s.Options(
        flavor=args.flavor,
        namespace=args.namespace,
        image=args.image,
        api_key_secret=args.api_key_secret or f"{stack.unit_prefix}-api-key",
    )
    try:
        written = k8s.render(out_dir, args.env_dir, opts)
    except k8s.K8sRefused as exc:
        for line in exc.lines:
            out(f"FAIL {line}", err=True)
        out("k8s: nothing written", err=True)
        return 2
    for path in written:
        out(f"wrote {path}")
    if stack.api_key:
        out(
            f"note: the pods read API_KEY from Secret {opts.api_key_secret}, which this does not "
            f"write; make it with the key in KEY: {k8s.secret_command(opts)}"
        )
    if any(
        stack.env.role_env(r.kind, r.index).get("UCX_NET_DEVICES") == "lo"
        for r in stack.roles.values()
    ):
        out(
            "note: UCX_NET_DEVICES=lo keeps NIXL's KV on loopback, which prefill and decode "
            "pods do not share: set the pods' devices in the env files"
        )
    out(f"apply: kubectl apply -f {out_dir}")
    return 0


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
    stack, _, out = _context(args)
    roles = _here(stack, stack.select(args.roles), out)
    written = systemd_units.render(args.out, stack, roles, args.sim)
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

    targets = argparse.ArgumentParser(add_help=False)
    targets.add_argument(
        "roles",
        nargs="*",
        metavar="TARGET",
        help="ROLE (all its instances), ROLE/N (instance N) or nothing (every instance)",
    )

    parser = argparse.ArgumentParser(
        prog="launch/pd",
        description=__doc__,
        epilog="Roles: prefill, decode, router. With instance files (prefill.N.env, "
        "decode.N.env) a role has several instances, addressed as ROLE/N; pd starts and "
        "stops only the instances of this host (PD_HOST, else its host name). Supervision "
        "(local or systemd) comes from PD_SUPERVISOR in common.env.",
    )
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser(
        "up", parents=[stack, logs, timeout, targets], help="start instances, wait healthy"
    )
    p.add_argument("--no-wait", action="store_true", help="do not wait for health")
    p.set_defaults(func=cmd_up)
    p = sub.add_parser("down", parents=[stack, targets], help="stop instances (router first)")
    p.set_defaults(func=cmd_down)
    p = sub.add_parser(
        "status", parents=[stack, targets], help="process state and health of each instance"
    )
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("restart", parents=[stack, logs, timeout], help="restart one instance")
    p.add_argument("role", metavar="TARGET", help="ROLE (when it has one instance) or ROLE/N")
    p.set_defaults(func=cmd_restart)
    p = sub.add_parser("logs", parents=[stack], help="last lines of an instance's log")
    p.add_argument("role", metavar="TARGET", help="ROLE (when it has one instance) or ROLE/N")
    p.add_argument("-n", "--lines", type=int, default=50, help="default: 50")
    p.set_defaults(func=cmd_logs)
    p = sub.add_parser(
        "co-restart",
        parents=[stack, logs, timeout, probe_opts, targets],
        help="prefill, decode, router instances in turn, each healthy before the next; "
        "then verify, probe",
    )
    p.add_argument(
        "--probe-max-tokens",
        type=int,
        default=16,
        help="tokens the closing probe generates (default: 16)",
    )
    p.set_defaults(func=cmd_co_restart)
    p = sub.add_parser(
        "rolling-restart",
        parents=[stack, logs, timeout],
        help="restart a role's instances one at a time, each out of the router's rotation "
        "while it restarts",
    )
    p.add_argument("role", metavar="ROLE", help="prefill or decode (it needs 2 or more instances)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=rotation.DRAIN_TIMEOUT_S,
        help="seconds to wait for an instance's running and queued requests to reach zero "
        "before restarting it anyway (default: 600)",
    )
    p.add_argument(
        "--router-timeout",
        type=float,
        default=rotation.ROUTER_TIMEOUT_S,
        help="seconds to wait for the router to drop or take back an instance (default: 120)",
    )
    p.set_defaults(func=cmd_rolling_restart)
    p = sub.add_parser(
        "verify",
        parents=[stack, targets],
        help="health, knobs in the live process environments, patched build",
    )
    p.add_argument(
        "--textfile",
        metavar="PATH",
        nargs="?",
        const="",
        help="also write the results in the Prometheus text format to PATH, a .prom file (for "
        "node_exporter's textfile collector: one gauge per check, labelled by instance, layer "
        "and variable); with no PATH (put it last), to "
        f"{maintenance.VARIABLE}/sm120pd_verify_<PD_UNIT_PREFIX>.prom, a file per stack",
    )
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser(
        "probe",
        parents=[stack, probe_opts, targets],
        help="one chat completion through the router, with the decodes' load",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="default: 16")
    p.set_defaults(func=cmd_probe)
    p = sub.add_parser("metrics", parents=[stack, targets], help="key gauges of each instance")
    p.set_defaults(func=cmd_metrics)
    p = sub.add_parser(
        "units", parents=[stack, targets], help="render one systemd unit per instance of this host"
    )
    p.add_argument("--out", type=Path, required=True, help="directory to write the units into")
    p.set_defaults(func=cmd_units)

    p = sub.add_parser(
        "monitoring",
        parents=[common],
        help="render a Prometheus scrape config (file_sd targets per role), alert rules and "
        "a Grafana dashboard for the stack",
    )
    _out_args(p)
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=15.0,
        help="seconds between scrapes and rule evaluations (default: 15)",
    )
    p.add_argument(
        "--stuck-after",
        type=float,
        default=120.0,
        help="seconds the router may hold requests while every engine idles before "
        "PDRequestsStuckBeforeIdleEngines fires (default: 120)",
    )
    p.add_argument(
        "--held-after",
        type=float,
        default=300.0,
        help="seconds an engine without traffic may still use KV tokens before "
        "PDTokensHeldAfterTraffic fires (default: 300)",
    )
    p.add_argument(
        "--slack",
        type=float,
        default=60.0,
        help="seconds a room may outlive the PD timeout that bounds it before its queue alert "
        "fires (default: 60)",
    )
    p.add_argument(
        "--down-after",
        type=float,
        help="seconds an instance may fail its scrape, outside launch/pd's maintenance marks, "
        "before PDInstanceDown fires; also sets PDInstanceNotRouted to twice this (default: "
        f"{monitoring.DOWN_AFTER_S:g} with PD_TEXTFILE_DIR set and scraped, and that + "
        f"{rotation.ROUTER_TIMEOUT_S:g} for PDInstanceNotRouted; otherwise the role's "
        "ROLE_HEALTH_TIMEOUT_S, and a rolling restart's longest run for PDInstanceNotRouted)",
    )
    p.add_argument(
        "--queue-after",
        type=float,
        help="seconds the oldest room of a PD queue may wait before its alert fires (default: "
        "the timeout that bounds that queue in the env files + --slack)",
    )
    p.add_argument(
        "--flap-window",
        type=float,
        default=monitoring.FLAP_S,
        help=f"seconds in which {monitoring.FLAP_CHANGES} changes of an instance's `up` fire "
        f"PDInstanceFlapping (default: {monitoring.FLAP_S:g})",
    )
    p.add_argument(
        "--verify-stale-after",
        type=float,
        default=monitoring.VERIFY_STALE_S,
        help="seconds the newest launch/pd verify --textfile result may be old before "
        f"PDVerifyStale fires (default: {monitoring.VERIFY_STALE_S:g})",
    )
    p.add_argument(
        "--textfile-target",
        metavar="HOST:PORT",
        help="a node_exporter that reads PD_TEXTFILE_DIR: adds a scrape job for it, so verify "
        "results and maintenance marks reach this Prometheus (default: none; your own "
        "node_exporter job does the same)",
    )
    p.add_argument(
        "--textfile-scraped",
        action="store_true",
        help="your own node_exporter job scrapes PD_TEXTFILE_DIR (as --textfile-target does): "
        "the short PDInstanceDown windows and PDVerifyStale are rendered only when one of the "
        "two says the marks and verify's results reach Prometheus (default: off)",
    )
    p.add_argument(
        "--stalled-after",
        type=float,
        default=monitoring.STALLED_AFTER_S,
        help="seconds an engine's scheduler time counters may stand still while it answers its "
        f"scrape before PDSchedulerStalled fires (default: {monitoring.STALLED_AFTER_S:g})",
    )
    p.add_argument(
        "--quarantine-after",
        type=float,
        default=monitoring.QUARANTINE_AFTER_S,
        help="seconds a room may stay in decode's KV quarantine before PDDecodeKVQuarantined "
        f"fires (default: {monitoring.QUARANTINE_AFTER_S:g})",
    )
    p.set_defaults(func=cmd_monitoring)

    p = sub.add_parser(
        "k8s",
        parents=[common],
        help="render the stack as Kubernetes objects: a RoleBasedGroup (or an LWS "
        "DisaggregatedSet), the env files as a ConfigMap, smg's discovery, a PodMonitor per "
        "role and the monitoring rules as a PrometheusRule",
        description="Render the stack as Kubernetes objects from the env files, one YAML file "
        "per object in --out (kubectl apply -f OUT). Refuses what `env check --monitoring` "
        "refuses, instance files that differ in more than where they run, and anything that "
        "fails its schema (the RBG, LWS and prometheus-operator CRDs vendored in "
        "launch/k8s_schemas/, the Kubernetes API's own for core kinds) or smg's parser; "
        "nothing is written then. The API key is read from a Secret that this does not write.",
    )
    _out_args(p)
    p.add_argument(
        "--flavor",
        choices=k8s.FLAVORS,
        default="rbg",
        help="rbg: a RoleBasedGroup and its CoordinatedPolicy (sgl-project/rbg); lws: an LWS "
        "DisaggregatedSet for the engines and a Deployment for the router (default: rbg)",
    )
    p.add_argument(
        "--image",
        required=True,
        help="the container image of every pod: the patched sglang wheel and smg installed, "
        "python3 and smg on its PATH",
    )
    p.add_argument(
        "--namespace", default="default", help="namespace of every object (default: default)"
    )
    p.add_argument(
        "--api-key-secret",
        metavar="NAME",
        help="the Secret holding API_KEY when the env files set it, with the keys api-key and "
        "engine.yaml (default: PD_UNIT_PREFIX-api-key)",
    )
    p.set_defaults(func=cmd_k8s)

    env = sub.add_parser("env", help="check, diff, snapshot and restore env files")
    env_sub = env.add_subparsers(dest="env_verb", required=True, metavar="ENV_VERB")
    p = env_sub.add_parser(
        "check", parents=[common], help="format, unknown SGLANG_* names, knob values"
    )
    p.add_argument(
        "--monitoring",
        action="store_true",
        help="also what launch/pd monitoring needs: every engine started with --enable-metrics",
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
