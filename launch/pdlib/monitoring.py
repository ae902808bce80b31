"""launch/pd monitoring: a Prometheus scrape config, alert rules and a Grafana dashboard for one
stack, rendered from its env files.

Every metric name used here was read from a live scrape of the env/cpu stack (sglang's engines
with --enable-metrics, smg's --prometheus-port) or is one `launch/pd verify --textfile` writes;
tests/engine checks each name against a live scrape.

How the engines' gauges behave shapes the windows below. sglang publishes its scheduler gauges
(running, queued, the PD queues, token usage) when it logs a batch, and while idle only when
the running count it published is stale or every 30 s: a gauge may lag the engine by up to
30 s. So no rule reads one sample of a PD queue gauge: each asks that the gauge stayed non-zero
for the whole window, the window is the engine's own timeout plus a slack that covers the lag,
and a counter that moves whenever the queue makes progress must not have moved.

A scheduler that stops behind a live HTTP server leaves every gauge and /health as they were;
what it stops is its time counters, which a running scheduler adds to about once a second
whether it is busy or idle: its loop's wall time by stage, and its idle time besides
(launch/pdlib/wedged.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from launch.pdlib import maintenance, rotation
from launch.pdlib.files import write_whole
from launch.pdlib.stack import ROOT, Stack, router_metrics_host

ROLE_KINDS = ("prefill", "decode", "router")
# Where ./build.sh test unpacks Debian's prometheus package; else the tools on PATH.
PROMETHEUS_BIN = ROOT / "build" / "prometheus" / "usr" / "bin"
# sglang's defaults, where the env files leave a timeout unset.
UPSTREAM_WAITING_S = 300.0
UPSTREAM_BOOTSTRAP_S = 300.0
# Without SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT patch 0003 is off: a room may sit in prefill's
# inflight queue for as long as its transfer takes. The alert then waits this long.
UNBOUNDED_INFLIGHT_S = 600.0
# How long an engine's scheduler time counters may stand still before PDSchedulerStalled fires:
# far above one forward pass on a GPU, and far below sglang's 300 s watchdog, which stops with
# the scheduler anyway.
STALLED_AFTER_S = 120.0
# With maintenance marks (PD_TEXTFILE_DIR), an instance that fails its scrape outside launch/pd's
# own work pages after this long.
DOWN_AFTER_S = 120.0
# A crash loop: this many changes of `up` (two down-and-back cycles) within FLAP_S.
FLAP_S = 900.0
FLAP_CHANGES = 4
# The newest verify result may be this old (verify from cron or a timer, at least hourly).
VERIFY_STALE_S = 3600.0
# How long a decode room may stay in decode's KV quarantine (patch 0024) before
# PDDecodeKVQuarantined fires: sglang's --watchdog-timeout (300 s) ends a prefill hung in a
# forward, and decode's heartbeat then declares it lost, well within the minute on top.
QUARANTINE_AFTER_S = 360.0
# sglang's per-step token counter: it moves on every forward step (mode prefill_compute,
# prefill_cache, decode), where sglang:generation_tokens_total moves only when a request ends.
STEP_TOKENS = "realtime_tokens_total"
SCHEDULER_SECONDS = ("scheduler_stage_seconds_total", "scheduler_idle_seconds_total")
# Patch 0025's count of PD queue gauge refreshes that failed (the gauges read NaN then).
QUEUE_ERRORS = "pd_queue_metrics_errors_total"
# Decode's KV quarantine (patch 0024): when the oldest room now in it entered, 0 when empty.
QUARANTINE_SINCE = "decode_kv_quarantine_oldest_timestamp_seconds"
METRIC_RE = re.compile(r"\b(sglang:[a-z0-9_:]+|smg_[a-z0-9_]+|sm120pd_[a-z0-9_]+|up)\b")
EITHER_RE = re.compile(r'__name__=~"sglang\[:_\]([a-z0-9_:]+)"')


def tool(name: str) -> str | None:
    """Path of prometheus or promtool: build/prometheus's, else the one on PATH, else None."""
    local = PROMETHEUS_BIN / name
    return str(local) if os.access(local, os.X_OK) else shutil.which(name)


@dataclass(frozen=True)
class Windows:
    """Seconds each alert waits (its `for:` or its window)."""

    stuck: float
    held: float
    slack: float
    down: dict[str, float]
    unrouted: dict[str, float]
    inflight: float
    transfer: float
    prealloc: float
    inflight_bounded: bool
    marked: bool = False
    # Whether a scrape of PD_TEXTFILE_DIR is rendered or declared (--textfile-target,
    # --textfile-scraped): the marks and verify's results reach Prometheus only then.
    scraped: bool = False
    down_given: bool = False
    stalled: float = STALLED_AFTER_S
    flap: float = FLAP_S
    verify_stale: float = VERIFY_STALE_S
    scrape: float = 15.0
    queue_given: bool = False
    quarantine: float = QUARANTINE_AFTER_S


def _max_value(stack: Stack, kind: str, key: str) -> float | None:
    """The largest value of key over the role's instances (None where none sets it)."""
    values = []
    for role in stack.of_kind(kind):
        raw = stack.env.role_env(kind, role.index).get(key, "")
        if raw:
            values.append(float(raw))
    return max(values) if values else None


def windows(
    stack: Stack,
    stuck: float,
    held: float,
    slack: float,
    down=None,
    stalled: float = STALLED_AFTER_S,
    flap: float = FLAP_S,
    verify_stale: float = VERIFY_STALE_S,
    scrape: float = 15.0,
    queue_after: float | None = None,
    quarantine: float = QUARANTINE_AFTER_S,
    scraped: bool = False,
) -> Windows:
    """The alert windows from the env files (launch/pd env check has vetted the values). An
    instance may be down DOWN_AFTER_S when launch/pd marks its own work (PD_TEXTFILE_DIR) and
    the marks are scraped (`scraped`), else its role's health timeout: marks nobody reads
    cannot hold an alert back. `down` replaces either."""
    health = {kind: max(r.health_timeout_s for r in stack.of_kind(kind)) for kind in ROLE_KINDS}
    marked = maintenance.textfile_dir(stack) is not None and scraped
    down_s = {
        kind: down if down is not None else DOWN_AFTER_S if marked else health[kind]
        for kind in ROLE_KINDS
    }
    unrouted = {
        kind: 2 * down
        if down is not None
        else DOWN_AFTER_S + rotation.ROUTER_TIMEOUT_S
        if marked
        else rotation.DRAIN_TIMEOUT_S + health[kind] + 2 * rotation.ROUTER_TIMEOUT_S
        for kind in ("prefill", "decode")
    }
    inflight = _max_value(stack, "prefill", "SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT")
    waiting = _max_value(stack, "decode", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
    # sglang 0.5.23 applies the bootstrap timeout on the sender only (common/conn.py sets
    # bootstrap_timeout for a prefill KV manager, and the sender's poll fails the room): a
    # decode room waits in the prealloc queue until its prefill gives up on it.
    bootstrap = _max_value(stack, "prefill", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")
    return Windows(
        stuck=stuck,
        held=held,
        slack=slack,
        down=down_s,
        unrouted=unrouted,
        inflight=queue_after or (inflight if inflight else UNBOUNDED_INFLIGHT_S) + slack,
        transfer=queue_after or (waiting or UPSTREAM_WAITING_S) + slack,
        prealloc=queue_after or (bootstrap or UPSTREAM_BOOTSTRAP_S) + slack,
        inflight_bounded=bool(inflight),
        marked=marked,
        scraped=scraped,
        down_given=down is not None,
        stalled=stalled,
        flap=flap,
        verify_stale=verify_stale,
        scrape=scrape,
        queue_given=queue_after is not None,
        quarantine=quarantine,
    )


def _d(seconds: float) -> str:
    """A Prometheus duration."""
    return f"{int(round(seconds))}s"


def job(stack: Stack, kind: str) -> str:
    return f"{stack.unit_prefix}-{kind}"


def host_port(host: str, port: int) -> str:
    """A scrape target's address: an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def targets(stack: Stack) -> dict[str, list[dict]]:
    """file_sd entries per role, from the same instances and URLs as the router's worker list:
    each engine instance's HTTP port (where sglang serves /metrics), the router's metrics port
    where a client reaches it (ROUTER_PROMETHEUS_HOST when set).
    Labels: pd_instance (prefill, decode/2, router), pd_role, stack, and for an engine the
    `worker` URL smg labels its own series with."""
    out: dict[str, list[dict]] = {}
    for kind in ROLE_KINDS:
        out[kind] = []
        for role in stack.of_kind(kind):
            labels = {"pd_instance": role.name, "pd_role": kind, "stack": stack.unit_prefix}
            if kind == "router":
                values = stack.env.role_env("router")
                host = router_metrics_host(values)
                port = int(values["ROUTER_PROMETHEUS_PORT"])
            else:
                host, port = role.host, role.port
                labels["worker"] = rotation.worker_entry(role)["url"]
            out[kind].append({"targets": [host_port(host, port)], "labels": labels})
    return out


def _sglang(name: str, selector: str) -> str:
    """A selector for an sglang series under either spelling of its name. sglang names its
    metrics `sglang:NAME`; the pinned prometheus_client (0.26.0) writes the samples
    `sglang_NAME` when the scrape asks for OpenMetrics, as Prometheus does by default, and
    keeps the colon in the plain text format (seen with curl and in a real Prometheus's
    TSDB)."""
    return f'{{__name__=~"sglang[:_]{name}",{selector}}}'


def _over(fn: str, name: str, selector: str, window: str) -> str:
    """fn (increase, rate) over a range of an sglang series under either spelling of its name,
    each spelling in its own call, then combined. One call over both (`__name__=~`) fails with
    "vector cannot contain metrics with the same labelset" for as long as the window holds a
    series of each, which a target whose spelling changed (a Prometheus or prometheus_client
    upgrade, a scrape-protocol change) has for one window: fn drops the name, and the two
    results collide. Here, where both spellings have a result, their sum (each part counts the
    change under its own name); else whichever has one. `window` is the range with brackets."""
    colon = f"{fn}(sglang:{name}{{{selector}}}{window})"
    under = f"{fn}(sglang_{name}{{{selector}}}{window})"
    return f"({colon} + {under} or {colon} or {under})"


def _sum0(metric: str, selector: str, by: str = "") -> str:
    """sum(metric), 0 where it has no series yet (sglang registers a gauge's series on its first
    publish)."""
    grouping = f" by ({by})" if by else ""
    return f"(sum{grouping}({metric}{{{selector}}}) or vector(0))"


def _alert(
    name: str, expr: str, wait: float, severity: str, summary: str, what: str, role: str = ""
) -> dict:
    """One alerting rule; `role` labels the rules of one alert made once per role apart."""
    return {
        "alert": name,
        "expr": expr,
        "for": _d(wait),
        "labels": {"severity": severity} | ({"pd_role": role} if role else {}),
        "annotations": {"summary": summary, "description": what},
    }


_DECODE_MODE = 'mode="decode"'


def _queue(name: str) -> str:
    return f'queue="{name}"'


def _q(name: str, selector: str, labels: str = "") -> str:
    """An sglang series under either spelling, with extra label matchers."""
    return _sglang(name, selector + (f",{labels}" if labels else ""))


def _marked(stack: Stack, w: Windows) -> str:
    """`unless` clause: the instance is under a maintenance mark (launch/pd is stopping or
    restarting it); empty when the env files give launch/pd nowhere to write marks."""
    if not w.marked:
        return ""
    mark = f'{maintenance.METRIC}{{stack="{stack.unit_prefix}"}}'
    return f"\nunless on(stack, pd_instance) ({mark} > time())"


def rules(stack: Stack, w: Windows, env_dir: Path) -> dict:
    """The alert rules: each says what the series show and what to run next, never a cause."""
    p = stack.unit_prefix
    engines = f'job=~"{p}-(prefill|decode)"'
    prefill, decode, router = (f'job="{job(stack, k)}"' for k in ROLE_KINDS)
    pd = f"{ROOT}/launch/pd"
    env = f"--env-dir {env_dir}"
    triage = f"{ROOT}/bench/triage {env}"
    verify, probe = f"{pd} verify {env}", f"{pd} probe {env}"
    progress = min(60.0, w.stuck)
    brief = 2 * w.scrape
    requests = f"(sum({_q('pd_queue_requests', engines)}) or vector(0))"
    steps = f"(sum({_over('increase', STEP_TOKENS, engines, f'[{_d(progress)}]')}) or vector(0))"
    oldest = "pd_queue_oldest_seconds"
    out = [
        _alert(
            "PDRequestsStuckBeforeIdleEngines",
            f"sum(smg_worker_requests_active{{{router}}}) > 0\n"
            f"and on() {requests} == 0\n"
            f"and on() {steps} == 0\n"
            f"unless on() (min(up{{{engines}}}) == 0)",
            w.stuck,
            "critical",
            f"Requests held by the router, engines idle. Run: {triage}",
            "The router has had {{ $value }} call(s) out to its engines (a PD request makes "
            f"one to a prefill and one to a decode) for {_d(w.stuck)} while every engine "
            "held no request, running, waiting or in a PD queue (sglang:pd_queue_requests, "
            f"refreshed with its load snapshot), and ran no forward step ({STEP_TOKENS} did "
            "not move), all engines answering their scrapes.",
        ),
        _alert(
            "PDPrefillKVPinned",
            f"{_q(oldest, prefill, _queue('prefill_inflight'))} > {w.inflight:g}",
            0,
            "critical",
            f"A prefill room holds its KV past the inflight timeout. Run: {verify}; then {triage}",
            "{{ $labels.pd_instance }}'s oldest room in the inflight queue (its KV sent or "
            'being sent, waiting for decode to conclude) has waited {{ printf "%.0f" $value }} s'
            + (
                f": longer than monitoring's --queue-after ({_d(w.inflight)})."
                if w.queue_given
                else f": longer than SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT + {_d(w.slack)}, "
                "which should have failed it and released its KV."
                if w.inflight_bounded
                else "; SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT is not set in the env files, "
                "so nothing bounds such a room."
            ),
        ),
        _alert(
            "PDDecodeTransferQueueStuck",
            f"{_q(oldest, decode, _queue('decode_transfer'))} > {w.transfer:g}",
            0,
            "critical",
            f"A decode room waits for its KV past the waiting timeout. Run: {verify}; then "
            f"{triage}",
            "{{ $labels.pd_instance }}'s oldest room in the transfer queue has waited "
            '{{ printf "%.0f" $value }} s for its KV: longer than '
            + (
                f"monitoring's --queue-after ({_d(w.transfer)})."
                if w.queue_given
                else f"SGLANG_DISAGGREGATION_WAITING_TIMEOUT + {_d(w.slack)}, which should have "
                "failed it."
            ),
        ),
        _alert(
            "PDDecodePreallocQueueStuck",
            f"{_q(oldest, decode, _queue('decode_prealloc'))} > {w.prealloc:g}\n"
            f"unless on(instance) (sum by (instance) "
            f"{_over('increase', STEP_TOKENS, f'{decode},{_DECODE_MODE}', f'[{_d(w.prealloc)}]')}"
            " > 0)",
            0,
            "critical",
            f"A decode room waits to be admitted while decode runs no step. Run: {verify}; then "
            f"{triage}",
            "{{ $labels.pd_instance }}'s oldest room in the prealloc queue has waited "
            '{{ printf "%.0f" $value }} s to bootstrap or for KV space, longer than '
            + (
                f"monitoring's --queue-after ({_d(w.prealloc)})"
                if w.queue_given
                else f"prefill's SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT + {_d(w.slack)}"
            )
            + f", and decode ran no decode step in that time ({STEP_TOKENS}).",
        ),
        _alert(
            "PDDecodeKVQuarantined",
            # The age grows by itself while the room stays, so no `for:`; a gauge at 0 (no room
            # quarantined) is no timestamp.
            f"time() - ({_sglang(QUARANTINE_SINCE, decode)} > 0) > {w.quarantine:g}",
            0,
            "critical",
            f"A decode room's KV stays quarantined. Run: {pd} logs {{{{ $labels.pd_instance }}}} "
            f"{env}, whose KV quarantine lines name the prefill; then {triage}",
            "{{ $labels.pd_instance }} has held a room in its KV quarantine for "
            '{{ printf "%.0f" $value }} s: longer than monitoring\'s --quarantine-after '
            f"({_d(w.quarantine)}). The room's pages stay out of decode's free list until "
            "prefill acknowledges its abort (after it proved its writes to them drained) or is "
            "proven gone (decode's heartbeat declares it lost, or sees a new prefill instance "
            f"id at the same bootstrap address). The default, {_d(QUARANTINE_AFTER_S)}, covers "
            "a prefill hung in a forward (sglang's --watchdog-timeout, 300 s, ends that "
            "process) plus decode's heartbeat. A prefill stopped whole (SIGSTOP of its process "
            "group, a frozen VM) holds the room as long as it is stopped: nothing can prove "
            "its writes stopped.",
        ),
        _alert(
            "PDTokensHeldAfterTraffic",
            f"{_q('pd_used_tokens', engines)} > 0\n"
            f"and on(instance) (sum by (instance) ({_q('pd_queue_requests', engines)}) == 0)\n"
            f"unless on(instance) (sum by (instance) "
            f"{_over('increase', STEP_TOKENS, engines, f'[{_d(w.held)}]')} > 0)",
            w.held,
            "warning",
            f"KV tokens still used after the traffic stopped. Run: {pd} metrics {env}; then "
            f"{probe}",
            "{{ $labels.pd_instance }} still uses {{ $value }} KV tokens (sglang:pd_used_tokens) "
            "although it holds no request, running, waiting or in a PD queue, and has run no "
            f"forward step for {_d(w.held)}.",
        ),
        _alert(
            "PDQueueMetricsFailing",
            f"{_over('increase', QUEUE_ERRORS, engines, f'[{_d(4 * w.scrape)}]')} > 0",
            0,
            "warning",
            "An engine's PD queue gauges are not refreshed. Run: "
            f"{pd} logs {{{{ $labels.pd_instance }}}} {env}; then {probe}",
            "{{ $labels.pd_instance }} failed to refresh its PD queue gauges "
            f"(sglang:{QUEUE_ERRORS}) in the last {_d(4 * w.scrape)}: they read NaN until a "
            "refresh succeeds, so the queue alerts cannot see its rooms meanwhile. Its log "
            "has the error (`PD queue metrics not refreshed`).",
        ),
    ]
    stage, idle = (_over("increase", m, engines, f"[{_d(w.stalled)}]") for m in SCHEDULER_SECONDS)
    out.append(
        _alert(
            "PDSchedulerStalled",
            # The window is the range: the sum is 0 once no sample in it moved, so no `for:`.
            f"(sum without (category, forward_overlap) ({stage})\n+ {idle}) == 0\n"
            f"and on(instance) (up{{{engines}}} == 1)",
            0,
            "critical",
            f"An engine's scheduler stands still while its HTTP server answers. Run: {triage}; "
            f"then {probe}",
            "{{ $labels.pd_instance }} ({{ $labels.instance }}) answers its scrape, and its "
            "scheduler has added no idle or stage time (sglang:scheduler_idle_seconds_total, "
            f"sglang:scheduler_stage_seconds_total) for {_d(w.stalled)}: a running scheduler "
            "adds to them every second, busy or idle. Its /health answers 503 once its load "
            "snapshot is older than SGLANG_HEALTH_SCHEDULER_STALL_S (patch 0033), and the "
            "router then stops routing to it; with that check off, /health keeps passing.",
        )
    )
    marked = _marked(stack, w)
    why_down = (
        "monitoring's --down-after"
        if w.down_given
        else "with no maintenance mark from launch/pd"
        if w.marked
        else "longer than launch/pd waits for a {kind} to come up"
    )
    for kind in ROLE_KINDS:
        out.append(
            _alert(
                "PDInstanceDown",
                f'up{{job="{job(stack, kind)}"}} == 0{marked}',
                w.down[kind],
                "critical",
                f"A {kind} instance does not answer its scrape. Run: {pd} status {env}; then "
                f"{pd} logs {{{{ $labels.pd_instance }}}} {env}",
                "{{ $labels.pd_instance }} ({{ $labels.instance }}) has not answered Prometheus "
                f"for {_d(w.down[kind])}, {why_down.format(kind=kind)}.",
                role=kind,
            )
        )
        out.append(
            _alert(
                "PDTargetsAbsent",
                f'absent(up{{job="{job(stack, kind)}"}})',
                3 * w.scrape,
                "critical",
                f"Prometheus has no {kind} target for this stack. Run: {pd} monitoring {env} "
                "--out DIR --force, and compare DIR/targets with the files Prometheus reads",
                f"Job {job(stack, kind)} has no target: its file_sd file is missing or empty, so "
                f"nothing about the {kind} instances can alert.",
                role=kind,
            )
        )
    everyone = f'job=~"{p}-(prefill|decode|router)"'
    mark = f'{maintenance.METRIC}{{stack="{p}"}}'
    out.append(
        _alert(
            "PDInstanceFlapping",
            f"changes(up{{{everyone}}}[{_d(w.flap)}]) >= {FLAP_CHANGES}"
            + (
                f"\nunless on(stack, pd_instance) "
                f"(max_over_time({mark}[{_d(w.flap)}]) > time() - {w.flap:g})"
                if w.marked
                else ""
            ),
            0,
            "critical",
            f"An instance keeps going down and coming back. Run: {pd} status {env}; then "
            f"{pd} logs {{{{ $labels.pd_instance }}}} {env}",
            "{{ $labels.pd_instance }} ({{ $labels.instance }}) changed between answering and "
            f"not answering its scrape {{{{ $value }}}} times in {_d(w.flap)}"
            + (", none of it under a maintenance mark" if w.marked else "")
            + ": a crash loop can answer one scrape per cycle and never stay down long "
            "enough for PDInstanceDown.",
        )
    )
    for kind in ("prefill", "decode"):
        out.append(
            _alert(
                "PDInstanceNotRouted",
                f'up{{job="{job(stack, kind)}"}} == 1\n'
                f"unless on(worker) (smg_worker_health{{{router}}} == 1)\n"
                f"and on() (up{{{router}}} == 1){marked}",
                w.unrouted[kind],
                "warning",
                f"An engine answers, but the router does not route to it. Run: {probe}",
                "{{ $labels.pd_instance }} ({{ $labels.worker }}) answers its scrape, and the "
                "router has not listed it as a healthy worker for "
                f"{_d(w.unrouted[kind])}"
                + (
                    " (twice monitoring's --down-after)."
                    if w.down_given
                    else ", with no maintenance mark from launch/pd."
                    if w.marked
                    else ": longer than a rolling restart takes."
                ),
                role=kind,
            )
        )
    check = f'sm120pd_verify_check_ok{{stack="{p}"'
    out.append(
        _alert(
            "PDKnobDrift",
            f'{check},layer="env",variable!=""}} == 0\nor {check},layer="build"}} == 0',
            brief,
            "warning",
            f"A knob or the build in a live process differs from the env files. Run: {verify}",
            "The last launch/pd verify --textfile failed its {{ $labels.layer }} check"
            "{{ if $labels.pd_instance }} of {{ $labels.pd_instance }}{{ end }}"
            "{{ if $labels.variable }} for {{ $labels.variable }}{{ end }}: the live process "
            "or the installed build is not what the env files and this checkout say.",
        )
    )
    out.append(
        _alert(
            "PDVerifyCheckFailed",
            f'{check},layer=~"health|listen"}} == 0\nor {check},layer="env",variable=""}} == 0',
            brief,
            "warning",
            f"launch/pd verify could not pass a health, listen or access check. Run: {verify}",
            "The last launch/pd verify --textfile failed its {{ $labels.layer }} check of "
            "{{ $labels.pd_instance }}: an instance that does not answer, a port on an address "
            "the env files do not name, or a process whose environment it could not read.",
        )
    )
    last = f'sm120pd_verify_last_run_timestamp_seconds{{stack="{p}"}}'
    # Only where verify's results are scraped: elsewhere absent() would warn forever.
    out.extend(
        [
            _alert(
                "PDVerifyStale",
                f"time() - max by (stack) ({last}) > {w.verify_stale:g}\nor absent({last})",
                3 * w.scrape,
                "warning",
                f"No recent launch/pd verify result for this stack. Run: {verify} --textfile, and "
                "check its cron job or timer",
                f"The newest verify result Prometheus has for {p} is older than "
                f"{_d(w.verify_stale)}, or there is none: PDKnobDrift cannot fire on results that "
                "do not arrive.",
            )
        ]
        if w.scraped
        else []
    )
    for rule in out:
        rule["labels"]["stack"] = p
    return {"groups": [{"name": f"{p}-pd", "rules": out}]}


def _panel(title: str, exprs: list[tuple[str, str]], unit: str = "short") -> dict:
    return {
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": expr,
                "legendFormat": legend,
            }
            for i, (expr, legend) in enumerate(exprs)
        ],
    }


def dashboard(stack: Stack) -> dict:
    """A Grafana dashboard (schema 39): rows for the router, the engines, the PD queues and the
    targets and verify checks; a datasource variable and an instance variable."""
    p = stack.unit_prefix
    router = f'job="{job(stack, "router")}"'
    picked = 'pd_instance=~"$pd_instance"'
    engines = f'job=~"{p}-(prefill|decode)",{picked}'
    prefill = f'job="{job(stack, "prefill")}",{picked}'
    pd_engines = f'{engines},queue=~"prefill_.*|decode_.*"'
    busy = f'{engines},queue=~"running|waiting"'
    rate = "[$__rate_interval]"
    rows = [
        (
            "Router",
            [
                _panel(
                    "Requests out to each worker",
                    [(f"smg_worker_requests_active{{{router}}}", "{{worker}}")],
                ),
                _panel(
                    "HTTP requests by path",
                    [
                        (
                            f"sum by (path) (rate(smg_http_requests_total{{{router}}}{rate}))",
                            "{{path}}",
                        )
                    ],
                    "reqps",
                ),
                _panel(
                    "HTTP responses by status",
                    [
                        (
                            f"sum by (status_code) (rate(smg_http_responses_total{{{router}}}"
                            f"{rate}))",
                            "{{status_code}}",
                        )
                    ],
                    "reqps",
                ),
                _panel(
                    "Time to first token (PD)",
                    [
                        (
                            f"histogram_quantile({q}, sum by (le) "
                            f"(rate(smg_pd_ttft_seconds_bucket{{{router}}}{rate})))",
                            f"p{int(q * 100)}",
                        )
                        for q in (0.5, 0.95)
                    ],
                    "s",
                ),
                _panel(
                    "Worker health (router's view) and open connections",
                    [
                        (f"smg_worker_health{{{router}}}", "{{worker}}"),
                        (f"smg_http_connections_active{{{router}}}", "connections"),
                    ],
                ),
            ],
        ),
        (
            "Engines",
            [
                _panel(
                    "Running and waiting requests",
                    [
                        (
                            f"sum by (pd_instance, queue) ({_q('pd_queue_requests', busy)})",
                            "{{pd_instance}} {{queue}}",
                        )
                    ],
                ),
                _panel(
                    "KV tokens in use",
                    [
                        (
                            f"sum by (pd_instance) ({_q('pd_used_tokens', engines)})",
                            "{{pd_instance}}",
                        )
                    ],
                ),
                _panel(
                    "Scheduler loop seconds per second (1 while it runs, 0 when it stands still)",
                    [
                        (
                            f"sum by (pd_instance) {_over('rate', m, engines, rate)}",
                            f"{{{{pd_instance}}}} {m.split('_')[1]}",
                        )
                        for m in SCHEDULER_SECONDS
                    ],
                ),
                _panel(
                    "Tokens per second, per forward step",
                    [
                        (
                            "sum by (pd_instance, mode) "
                            + _over("rate", STEP_TOKENS, engines, rate),
                            "{{pd_instance}} {{mode}}",
                        )
                    ],
                ),
            ],
        ),
        (
            "PD queues",
            [
                _panel(
                    "Requests in each PD queue",
                    [
                        (
                            f"sum by (pd_instance, queue) ({_q('pd_queue_requests', pd_engines)})",
                            "{{pd_instance}} {{queue}}",
                        )
                    ],
                ),
                _panel(
                    "Oldest request in each PD queue",
                    [
                        (
                            f"max by (pd_instance, queue) "
                            f"({_q('pd_queue_oldest_seconds', pd_engines)})",
                            "{{pd_instance}} {{queue}}",
                        )
                    ],
                    "s",
                ),
                _panel(
                    "KV transfer latency (prefill, p95)",
                    [
                        (
                            "histogram_quantile(0.95, sum by (le, pd_instance) "
                            f"{_over('rate', 'kv_transfer_latency_ms_bucket', prefill, rate)})",
                            "{{pd_instance}}",
                        )
                    ],
                    "ms",
                ),
            ],
        ),
        (
            "Targets and verify",
            [
                _panel("Scrape targets up", [(f'up{{stack="{p}"}}', "{{pd_instance}}")]),
                _panel(
                    "Failed verify checks",
                    [(f'sm120pd_verify_checks{{stack="{p}",result="failed"}}', "failed")],
                ),
                _panel(
                    "Age of the last verify run",
                    [(f'time() - sm120pd_verify_last_run_timestamp_seconds{{stack="{p}"}}', "age")],
                    "s",
                ),
            ],
        ),
    ]
    panels, y, next_id = [], 0, 1
    for title, row in rows:
        panels.append(
            {
                "type": "row",
                "title": title,
                "id": next_id,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            }
        )
        next_id, y = next_id + 1, y + 1
        for i, panel in enumerate(row):
            panel["id"] = next_id
            panel["gridPos"] = {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)}
            panels.append(panel)
            next_id += 1
        y += 8 * ((len(row) + 2) // 3)
    return {
        "title": f"PD stack {p}",
        "uid": re.sub(r"[^A-Za-z0-9_-]", "-", f"pd-{p}")[:40],
        "tags": ["sglang", "pd", p],
        "schemaVersion": 39,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                },
                {
                    "name": "pd_instance",
                    "label": "Instance",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {
                        "query": f'label_values(up{{stack="{p}"}}, pd_instance)',
                        "refId": "instances",
                    },
                    "definition": f'label_values(up{{stack="{p}"}}, pd_instance)',
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def config(stack: Stack, scrape_s: float, textfile_target: str | None = None) -> dict:
    """prometheus.yml: one job per role, its targets in targets/ROLE.json (file_sd); with
    textfile_target (HOST:PORT of a node_exporter reading PD_TEXTFILE_DIR), a job for it, so
    the verify results and maintenance marks reach this Prometheus."""
    interval = _d(scrape_s)
    textfile = [
        {
            "job_name": f"{stack.unit_prefix}-textfile",
            "metrics_path": "/metrics",
            # The files' own stack and pd_instance labels win over the target's.
            "honor_labels": True,
            "static_configs": [{"targets": [textfile_target]}],
        }
    ]
    return {
        "global": {
            "scrape_interval": interval,
            "scrape_timeout": _d(min(10.0, scrape_s)),
            "evaluation_interval": interval,
        },
        "rule_files": ["rules.yml"],
        "scrape_configs": [
            {
                "job_name": job(stack, kind),
                "metrics_path": "/metrics",
                "file_sd_configs": [{"files": [f"targets/{kind}.json"], "refresh_interval": "30s"}],
            }
            for kind in ROLE_KINDS
        ]
        + (textfile if textfile_target else []),
    }


class _Block(str):
    """A string yaml writes as a literal block (the multi-line PromQL stays readable)."""


def _block(dumper, data):
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")


yaml.SafeDumper.add_representer(_Block, _block)


def _yaml(data: dict, head: str) -> str:
    def blocks(node):
        if isinstance(node, dict):
            return {k: blocks(v) for k, v in node.items()}
        if isinstance(node, list):
            return [blocks(v) for v in node]
        return _Block(node) if isinstance(node, str) and "\n" in node else node

    body = yaml.safe_dump(blocks(data), sort_keys=False, width=100, default_flow_style=False)
    return head + body


def render(
    out: Path,
    stack: Stack,
    w: Windows,
    scrape_s: float,
    env_dir: Path,
    textfile_target: str | None = None,
) -> list[Path]:
    head = (
        f"# Rendered by launch/pd monitoring from {env_dir}; render again (--force) after the\n"
        "# env files change. Every window is in launch/README.md, Monitoring.\n"
    )
    files = {
        out / "prometheus.yml": _yaml(config(stack, scrape_s, textfile_target), head),
        out / "rules.yml": _yaml(rules(stack, w, env_dir), head),
        out / "dashboard.json": json.dumps(dashboard(stack), indent=1) + "\n",
    }
    for kind, entries in targets(stack).items():
        files[out / "targets" / f"{kind}.json"] = json.dumps(entries, indent=1) + "\n"
    for path, text in files.items():
        # Whole, then renamed: Prometheus rereads a file_sd file as soon as it changes.
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, text, 0o644)
    return list(files)


def textfile_problems(stack: Stack) -> list[str]:
    """A PD_TEXTFILE_DIR this user cannot write: launch/pd's maintenance marks would never be
    written there, so rules rendered for marks would page on every restart."""
    where = maintenance.textfile_dir(stack)
    if where is None:
        return []
    origin = stack.env.origin("common", None, maintenance.VARIABLE)
    if not where.is_dir():
        why = "no such directory"
    elif not os.access(where, os.W_OK | os.X_OK):
        why = f"this user ({_user()}) cannot write it"
    else:
        return []
    return [
        f"{origin}={where}: {why}, so launch/pd cannot write its maintenance marks there "
        f"(and verify --textfile its results); make it writable for the user that runs "
        f"launch/pd, or unset {maintenance.VARIABLE}"
    ]


def _user() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


def metrics_problems(stack: Stack) -> list[str]:
    """Engines that would serve no /metrics: sglang answers it only with --enable-metrics, and
    without it every engine scrape fails (PDInstanceDown) and every engine rule has no data."""
    problems = []
    for role in stack.of_kind("prefill") + stack.of_kind("decode"):
        variable = f"{role.kind.upper()}_ARGS"
        args = stack.env.role_env(role.kind, role.index).get(variable, "")
        if "--enable-metrics" not in shlex.split(args):
            where = stack.env.origin(role.kind, role.index, variable)
            problems.append(
                f"{where}: {role.name} has no --enable-metrics, so it serves no /metrics and "
                "launch/pd monitoring's alerts cannot see it; add --enable-metrics there"
            )
    return problems


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (ours, sglang's, smg's and up); an sglang
    name selected under either spelling counts as `sglang:NAME`."""
    either = {f"sglang:{name}" for name in EITHER_RE.findall(expr)}
    return either | set(METRIC_RE.findall(re.sub(r'"[^"]*"', '""', expr)))


def promtool_check(out: Path) -> tuple[bool | None, str]:
    """promtool check config (it checks the rule files too): None when there is no promtool."""
    promtool = tool("promtool")
    if promtool is None:
        return None, "promtool not found (./build.sh test unpacks it into build/prometheus)"
    done = subprocess.run(
        [promtool, "check", "config", str(out / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode == 0, (done.stdout + done.stderr).strip()
