"""Health waits and the verification layers: health, live process environment, patched build,
an end-to-end probe, and the key gauges."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import psutil

from launch.pdlib import listeners
from launch.pdlib.envfiles import REDACTED, is_secret
from launch.pdlib.promtext import sample_sums
from launch.pdlib.rotation import list_workers
from launch.pdlib.stack import ROOT, Reply, Role, Stack, from_root, http, router_metrics_host
from launch.pdlib.supervise import port_owner
from launch.pdlib.unresponsive import (
    NOTHING_ANSWERED,
    UNRESPONSIVE,
    Silent,
    no_answer,
    reason,
    router_view,
)
from launch.pdlib.wedged import (
    LOADS_PATH,
    LOADS_TIMEOUT_S,
    WEDGED,
    WEDGED_AFTER_S,
    Life,
    Wedged,
    scheduler_seconds,
    snapshot_from,
)
from launch.pdlib.wedged import reason as wedged_reason

MANIFEST_CODE = (
    "from importlib.metadata import distribution as d; "
    "print(d('sglang').read_text('sm120pd_manifest.json') or '')"
)


@dataclass(frozen=True)
class Healthy:
    ok: bool
    seconds: float
    detail: str
    detected_after_ready_s: float | None = None


def wait_healthy(stack: Stack, role: Role, alive, started_at: float) -> Healthy:
    """Poll the role's health URL until 200, its process dies, or its timeout passes."""
    deadline = started_at + role.health_timeout_s
    last = "no answer yet"
    while True:
        reply = http(role.health_url, timeout=min(5.0, max(1.0, stack.poll_interval_s)))
        now = time.time()
        if reply.status == 200:
            return Healthy(True, now - started_at, "healthy", _sim_detection(stack, role, now))
        last = f"HTTP {reply.status}" if reply.status is not None else reply.error
        if not alive(role.key):
            return Healthy(False, now - started_at, f"process exited (last health: {last})")
        if now >= deadline:
            return Healthy(
                False,
                now - started_at,
                f"not healthy within {role.health_timeout_s:g} s (last: {last})",
            )
        time.sleep(stack.poll_interval_s)


def _sim_detection(stack: Stack, role: Role, seen_at: float) -> float | None:
    """The simulated engine reports when it became ready; the gap is our polling latency."""
    if not stack.sim or role.name == "router":
        return None
    reply = http(role.url + "/server_info", api_key=stack.api_key)
    try:
        ready_at = reply.json()["sim"]["ready_at"]
    except (ValueError, KeyError, TypeError):
        return None
    return None if ready_at is None else max(0.0, seen_at - float(ready_at))


@dataclass(frozen=True)
class Check:
    ok: bool
    text: str
    # False: the check could not run from this host; it neither passes nor fails.
    checked: bool = True
    # What was checked, for `verify --textfile`: the instance (prefill, decode/2, router; empty
    # for the installed build), the layer (health, env, build) and the variable (env checks of
    # one knob; empty otherwise). Never a value.
    instance: str = ""
    layer: str = ""
    variable: str = ""

    def line(self) -> str:
        return f"{'skip' if not self.checked else 'ok  ' if self.ok else 'FAIL'} {self.text}"


def health_checks(stack: Stack) -> list[Check]:
    out = []
    for role in stack.roles.values():
        reply = http(role.health_url)
        got = f"HTTP {reply.status}" if reply.status is not None else reply.error
        out.append(
            Check(
                reply.status == 200,
                f"{role.name} health {role.health_url}: {got}",
                instance=role.name,
                layer="health",
            )
        )
    return out


def environ_checks(stack: Stack) -> list[Check]:
    """Knobs as the engines hold them: in the port-owning process and in each scheduler rank
    under it (the processes that run the model and read most knobs; at TP > 1 one per rank).
    The router is left out: smg reads no SGLANG_* knob, and it rewrites its process title,
    which blanks /proc/PID/environ."""
    out = []
    for role in stack.of_kind("prefill") + stack.of_kind("decode"):
        before = len(out)
        _role_environ_checks(stack, role, out)
        out[before:] = [replace(c, instance=role.name, layer="env") for c in out[before:]]
    return out


# sglang titles each scheduler process "sglang::scheduler", "sglang::scheduler_TP1" and so on;
# the kernel keeps the first 15 characters as the process name.
SCHEDULER_NAME = "sglang::schedul"


def scheduler_ranks(pid: int) -> list[psutil.Process]:
    """The scheduler processes under the engine's `pid`, in pid order."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    ranks = []
    for child in children:
        try:
            if child.name().startswith(SCHEDULER_NAME):
                ranks.append(child)
        except psutil.Error:
            continue
    return sorted(ranks, key=lambda p: p.pid)


def _title(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()).strip() or proc.name()
    except psutil.Error:
        return SCHEDULER_NAME


def _role_environ_checks(stack: Stack, role: Role, out: list[Check]) -> None:
    knobs = stack.env.knobs(role.kind, role.index)
    if not knobs:
        return
    if not role.local:
        out.append(
            Check(
                True,
                f"{role.name}: not checked here: it runs on {role.host}, not this host "
                f"({stack.here}), and a remote /proc cannot be read from here; run verify "
                f"on {role.host} for {', '.join(knobs)}",
                checked=False,
            )
        )
        return
    pid = port_owner(role.port)
    if pid is None:
        out.append(
            Check(
                False,
                f"{role.name}: no process listens on port {role.port}; "
                f"cannot read its environment for {', '.join(knobs)}",
            )
        )
        return
    _process_environ_checks(role, knobs, pid, f"pid {pid}", out)
    ranks = scheduler_ranks(pid)
    if not ranks and not stack.sim:  # a simulated engine is one process
        out.append(
            Check(
                False,
                f"{role.name}: no scheduler process ({SCHEDULER_NAME}*) under pid {pid}; "
                "the ranks' knobs cannot be checked",
            )
        )
    for rank in ranks:
        _process_environ_checks(role, knobs, rank.pid, f"{_title(rank)} pid {rank.pid}", out)


def _process_environ_checks(
    role: Role, knobs: dict[str, str], pid: int, who: str, out: list[Check]
) -> None:
    try:
        live = psutil.Process(pid).environ()
    except psutil.AccessDenied:
        out.append(
            Check(
                False,
                f"{role.name}: /proc/{pid}/environ is not readable by this "
                "user (run as root or as the service user)",
            )
        )
        return
    except psutil.Error as exc:
        out.append(Check(False, f"{role.name}: pid {pid}: {exc}"))
        return
    if not live:
        out.append(
            Check(
                False,
                f"{role.name}: /proc/{pid}/environ ({who}) reads empty: the process rewrote "
                "its title over it, so its knobs cannot be checked; SPT_NOENV=1 in the env "
                "files keeps sglang's process titles (setproctitle) off the environment",
            )
        )
        return
    for key, want in knobs.items():
        shown = REDACTED if is_secret(key) else want
        if key not in live:
            out.append(
                Check(
                    False,
                    f"{role.name} {key}={shown}: in the env files but "
                    f"missing from the environment of {who}",
                    variable=key,
                )
            )
        elif live[key] != want:
            got = REDACTED if is_secret(key) else live[key]
            out.append(
                Check(
                    False,
                    f"{role.name} {key}: {who} has {got!r}, the env files say {shown!r}",
                    variable=key,
                )
            )
        else:
            out.append(Check(True, f"{role.name} {key}={shown} live in {who}", variable=key))


def expected_label() -> tuple[str | None, str]:
    build = ROOT / "build.sh"
    if not build.is_file():
        return None, "build.sh is missing"
    try:
        done = subprocess.run(
            [str(build), "label"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"./build.sh label failed: {exc}"
    if done.returncode != 0 or not done.stdout.strip():
        return None, f"./build.sh label exited {done.returncode}: {done.stderr.strip()[-200:]}"
    return done.stdout.strip().splitlines()[-1], "./build.sh label"


def manifest_check(stack: Stack) -> Check:
    python = from_root(stack.env.common().get("PD_PYTHON") or "python3")
    try:
        done = subprocess.run(
            [str(python), "-c", MANIFEST_CODE], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check(False, f"patched build: cannot run {python}: {exc}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return Check(False, f"patched build: {python} has no sglang distribution ({last})")
    text = done.stdout.strip()
    if not text:
        return Check(
            False,
            f"patched build: the sglang installed for {python} carries no "
            "sm120pd_manifest.json (plain upstream, not our patched wheel)",
        )
    try:
        manifest = json.loads(text)
    except ValueError:
        return Check(False, "patched build: sm120pd_manifest.json is not valid JSON")
    if manifest.get("project") != "sm120pd":
        return Check(
            False, f"patched build: manifest project is {manifest.get('project')!r}, not 'sm120pd'"
        )
    label = manifest.get("label")
    want, source = expected_label()
    if want is None:
        return Check(
            False,
            f"patched build: installed {manifest.get('version')}, but the "
            f"expected label is unknown ({source})",
        )
    if label != want:
        return Check(
            False,
            f"patched build: installed label {label!r}, this checkout's "
            f"patches give {want!r} (rebuild and reinstall the wheel)",
        )
    return Check(
        True,
        f"patched build: sglang {manifest.get('version')} ({len(manifest.get('patches', []))} "
        f"patches) matches {source}",
    )


def listen_checks(stack: Stack) -> list[Check]:
    """Each instance's listening sockets on the host the env files give it (listeners.py)."""
    return [
        Check(f.ok, f.text, checked=f.checked, instance=f.instance, layer="listen")
        for f in listeners.findings(stack)
    ]


def verify(stack: Stack) -> list[Check]:
    build = replace(manifest_check(stack), layer="build")
    return health_checks(stack) + environ_checks(stack) + listen_checks(stack) + [build]


TEXTFILE_HELP = {
    "sm120pd_verify_check_ok": "1 when a launch/pd verify check passed, 0 when it failed",
    "sm120pd_verify_checks": "launch/pd verify's checks by result (ok, failed, skipped)",
    "sm120pd_verify_last_run_timestamp_seconds": "when launch/pd verify last ran (Unix time)",
}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def textfile(results: list[Check], now: float, stack: str) -> str:
    """verify's results in the Prometheus text format, for node_exporter's textfile collector:
    one gauge per check that ran, labelled by instance, layer and variable (names only, never a
    value), the counts by result, and the time of the run; every sample carries the stack's
    name (PD_UNIT_PREFIX), so that several stacks on one host keep their own series. The
    instance label is `pd_instance`, as on the scrape targets `launch/pd monitoring` writes: a
    scraped `instance` label would clash with the node exporter target's own."""
    lines = []
    own = f'stack="{_label(stack)}"'

    def head(name: str) -> None:
        lines.extend([f"# HELP {name} {TEXTFILE_HELP[name]}", f"# TYPE {name} gauge"])

    head("sm120pd_verify_check_ok")
    for c in results:
        if c.checked:
            labels = f'{own},pd_instance="{_label(c.instance)}",layer="{_label(c.layer)}",'
            labels += f'variable="{_label(c.variable)}"'
            lines.append(f"sm120pd_verify_check_ok{{{labels}}} {int(c.ok)}")
    head("sm120pd_verify_checks")
    counts = {
        "ok": sum(c.checked and c.ok for c in results),
        "failed": sum(c.checked and not c.ok for c in results),
        "skipped": sum(not c.checked for c in results),
    }
    for result, count in counts.items():
        lines.append(f'sm120pd_verify_checks{{{own},result="{result}"}} {count}')
    head("sm120pd_verify_last_run_timestamp_seconds")
    lines.append(f"sm120pd_verify_last_run_timestamp_seconds{{{own}}} {now:.3f}")
    return "\n".join(lines) + "\n"


def summary(results: list[Check]) -> tuple[bool, str]:
    failed = [c for c in results if c.checked and not c.ok]
    skipped = [c for c in results if not c.checked]
    text = f"{len(results) - len(failed) - len(skipped)} ok, {len(failed)} failed"
    if skipped:
        text += f", {len(skipped)} not checked from this host (see the skip lines)"
    return not failed, text


# --- metrics --------------------------------------------------------------------------------

ENGINE_GAUGES = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:gen_throughput",
    "sglang:token_usage",
    "sglang:num_prefill_inflight_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs",
)


ENGINE_READ_TIMEOUT_S = 5.0


def engine_load(role: Role, reply: Reply | None = None) -> dict[str, float] | str:
    """The engine's /metrics values, or why not; from `reply` when it was already read."""
    if reply is None:
        reply = http(role.url + "/metrics", timeout=ENGINE_READ_TIMEOUT_S)
    if reply.status != 200:
        return f"metrics unavailable ({reply.status or reply.error})"
    try:
        return sample_sums(reply.body.decode(errors="replace"))
    except ValueError as exc:
        return f"metrics unreadable ({exc})"


def metrics_lines(stack: Stack) -> list[tuple[bool, str]]:
    out = []
    for role in stack.of_kind("prefill") + stack.of_kind("decode"):
        values = engine_load(role)
        if isinstance(values, str):
            out.append((False, f"{role.name}: {values}"))
            continue
        shown = [f"{g.split(':', 1)[1]}={values[g]:g}" for g in ENGINE_GAUGES if g in values]
        out.append((True, f"{role.name}: " + " ".join(shown)))
    if "router" not in stack.roles:
        return out
    router_env = stack.env.role_env("router")
    port = router_env.get("ROUTER_PROMETHEUS_PORT", "")
    reply = http(f"http://{router_metrics_host(router_env)}:{port}/metrics", timeout=5.0)
    if reply.status != 200:
        out.append((False, f"router: metrics unavailable ({reply.status or reply.error})"))
    else:
        try:
            values = sample_sums(reply.body.decode(errors="replace"))
        except ValueError as exc:
            out.append((False, f"router: metrics unreadable ({exc})"))
            return out
        keys = sorted(
            k
            for k in values
            if any(w in k for w in ("worker", "active", "running"))
            and not k.endswith(("_bucket", "_sum", "_count"))
        )
        out.append(
            (
                True,
                "router: "
                + (
                    " ".join(f"{k}={values[k]:g}" for k in keys[:12])
                    or f"{len(values)} series, none of the key gauges"
                ),
            )
        )
    return out


# --- probe ----------------------------------------------------------------------------------


def _load_text(values) -> str:
    if isinstance(values, str):
        return values
    running = values.get("sglang:num_running_reqs")
    queued = values.get("sglang:num_queue_reqs")
    if running is None:
        # sglang's load gauges carry labels, so /metrics lists them only once they are first set:
        # when the scheduler logs the stats of its first batch of that kind.
        return "load gauges not published yet (sglang sets them with its first batch's stats)"
    return f"running={running:g} queued={'n/a' if queued is None else f'{queued:g}'}"


ASKED = ("/metrics", "/health")


def _ask(role: Role, path: str, api_key: str) -> Reply:
    if path == LOADS_PATH:
        return http(role.url + path, timeout=LOADS_TIMEOUT_S, api_key=api_key)
    return http(role.url + path, timeout=ENGINE_READ_TIMEOUT_S)


def _ask_engines(
    engines: list[Role], api_key: str = ""
) -> tuple[dict[str, Reply], list[Silent], dict[tuple[str, str], Reply]]:
    """Every engine's /metrics reply, the engines whose /metrics or /health gave no answer at
    all (frozen, or nothing listening), and every reply by (instance, path), /v1/loads
    included; every endpoint of every engine asked at once, so silent engines cost one
    timeout in all. A /v1/loads that does not answer is not silence of the engine: its
    handler may wait on a stopped scheduler (launch/pdlib/wedged.py)."""
    asked = [(role, path) for role in engines for path in (*ASKED, LOADS_PATH)]
    with ThreadPoolExecutor(max_workers=max(1, len(asked))) as pool:
        replies = list(pool.map(lambda a: _ask(a[0], a[1], api_key), asked))
    metrics: dict[str, Reply] = {}
    failures: dict[str, list[str]] = {}
    for (role, path), reply in zip(asked, replies, strict=True):
        if path == "/metrics":
            metrics[role.name] = reply
        if reply.status is None and path in ASKED:
            failures.setdefault(role.name, []).append(
                no_answer(path, reply.error, ENGINE_READ_TIMEOUT_S)
            )
    silent = [Silent(r.name, r.url, tuple(failures[r.name])) for r in engines if r.name in failures]
    answers = {(role.name, path): reply for (role, path), reply in zip(asked, replies, strict=True)}
    return metrics, silent, answers


def _life(metrics: Reply, loads: Reply) -> Life:
    """One read of an engine's scheduler: its load snapshot's age and its time counters."""
    try:
        seconds = scheduler_seconds(metrics.body.decode(errors="replace"))
    except ValueError:
        seconds = {}
    snapshot = snapshot_from(loads.status, loads.body, loads.error, LOADS_TIMEOUT_S)
    return Life(first=snapshot, seconds_before=seconds if metrics.status == 200 else {})


def _wedged(
    engines: list[Role], answers: dict[tuple[str, str], Reply]
) -> tuple[list[Wedged], list[str]]:
    """The engines whose HTTP server answers and whose scheduler does not run, and the names
    of those whose scheduler runs."""
    wedged, running = [], []
    for role in engines:
        life = _life(answers[(role.name, "/metrics")], answers[(role.name, LOADS_PATH)])
        signals, _ = life.stopped(WEDGED_AFTER_S)
        if signals:
            health = answers[(role.name, "/health")]
            answered = f"/health: HTTP {health.status}"
            wedged.append(Wedged(role.name, role.url, answered, tuple(signals)))
        elif life.runs(WEDGED_AFTER_S):
            running.append(role.name)
    return wedged, running


def probe(stack: Stack, timeout_s: float, max_tokens: int) -> tuple[bool, list[str]]:
    """One chat completion through the router, with every engine's answer and the decodes' load.

    An engine that gives no answer on /metrics or /health fails the probe with the same verdict
    bench/triage gives, whatever the request did: the router may still route around it. So does
    an engine that answers while its scheduler does not run (launch/pdlib/wedged.py): the
    router keeps routing to it."""
    router = stack.role("router")
    body = {
        "model": stack.env.common().get("SERVED_MODEL_NAME") or "default",
        "messages": [{"role": "user", "content": "Reply with one short sentence."}],
        "max_tokens": max_tokens,
        "stream": False,
    }
    engines = stack.of_kind("prefill") + stack.of_kind("decode")
    metrics, silent, answers = _ask_engines(engines, stack.api_key)
    quiet = {s.name for s in silent}
    decodes = [r for r in stack.of_kind("decode") if r.name not in quiet]
    before = [engine_load(role, metrics[role.name]) for role in decodes]
    t0 = time.perf_counter()
    reply = http(
        router.url + "/v1/chat/completions", timeout=timeout_s, data=body, api_key=stack.api_key
    )
    latency = time.perf_counter() - t0
    after = [engine_load(role) for role in decodes]
    lines = []
    ok = reply.status == 200 and not silent
    status = f"HTTP {reply.status}" if reply.status is not None else f"no reply ({reply.error})"
    detail = ""
    if reply.status == 200:
        try:
            usage = reply.json().get("usage") or {}
            detail = f", {usage.get('completion_tokens', '?')} completion tokens"
        except ValueError:
            ok = False
            detail = ", body is not JSON"
    elif reply.body:
        detail = f", body: {reply.body.decode(errors='replace')[:300]}"
    lines.append(f"probe {router.url}/v1/chat/completions: {status} in {latency:.3f} s{detail}")
    for role, sent, answered in zip(decodes, before, after, strict=True):
        lines.append(
            f"{role.name} load when sent: {_load_text(sent)}; when answered: {_load_text(answered)}"
        )
    if silent:
        answering = [r.name for r in engines if r.name not in quiet]
        listing = list_workers(router.url, stack.api_key, ENGINE_READ_TIMEOUT_S)
        because = reason(silent, answering)
        if answering or reply.status is not None or listing.answered:
            lines.append(f"verdict: {UNRESPONSIVE}: {because}")
        else:
            lines.append(f"verdict: inconclusive: {NOTHING_ANSWERED}: {because}")
        by_url = {str(w.get("url", "")).rstrip("/"): w for w in listing.workers}
        for s in silent:
            said = listing.error or router_view(by_url.get(s.url))
            lines.append(f"router on {s.name}: {said}")
        return ok, lines
    wedged, running = _wedged(engines, answers)
    if wedged:
        ok = False
        lines.append(f"verdict: {WEDGED}: {wedged_reason(wedged, running)}")
    return ok, lines
