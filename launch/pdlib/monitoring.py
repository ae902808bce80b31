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
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from launch.pdlib import rotation
from launch.pdlib.files import write_whole
from launch.pdlib.stack import ROOT, Stack

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
SCHEDULER_SECONDS = ("scheduler_stage_seconds_total", "scheduler_idle_seconds_total")
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
    decode_queue: float
    inflight_bounded: bool
    down_given: bool = False
    stalled: float = STALLED_AFTER_S


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
) -> Windows:
    """The alert windows from the env files (launch/pd env check has vetted the values); down
    replaces the roles' health timeouts as the time an instance may be down."""
    health = {kind: max(r.health_timeout_s for r in stack.of_kind(kind)) for kind in ROLE_KINDS}
    down_s = {kind: down if down is not None else health[kind] for kind in ROLE_KINDS}
    unrouted = {
        kind: rotation.DRAIN_TIMEOUT_S + health[kind] + 2 * rotation.ROUTER_TIMEOUT_S
        if down is None
        else 2 * down
        for kind in ("prefill", "decode")
    }
    inflight = _max_value(stack, "prefill", "SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT")
    waiting = _max_value(stack, "decode", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
    bootstrap = _max_value(stack, "decode", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")
    return Windows(
        stuck=stuck,
        held=held,
        slack=slack,
        down=down_s,
        unrouted=unrouted,
        inflight=(inflight if inflight else UNBOUNDED_INFLIGHT_S) + slack,
        decode_queue=max(waiting or UPSTREAM_WAITING_S, bootstrap or UPSTREAM_BOOTSTRAP_S) + slack,
        inflight_bounded=bool(inflight),
        down_given=down is not None,
        stalled=stalled,
    )


def _d(seconds: float) -> str:
    """A Prometheus duration."""
    return f"{int(round(seconds))}s"


def job(stack: Stack, kind: str) -> str:
    return f"{stack.unit_prefix}-{kind}"


def targets(stack: Stack) -> dict[str, list[dict]]:
    """file_sd entries per role, from the same instances and URLs as the router's worker list:
    each engine instance's HTTP port (where sglang serves /metrics), the router's metrics port.
    Labels: pd_instance (prefill, decode/2, router), pd_role, stack, and for an engine the
    `worker` URL smg labels its own series with."""
    out: dict[str, list[dict]] = {}
    for kind in ROLE_KINDS:
        out[kind] = []
        for role in stack.of_kind(kind):
            labels = {"pd_instance": role.name, "pd_role": kind, "stack": stack.unit_prefix}
            if kind == "router":
                port = int(stack.env.role_env("router")["ROUTER_PROMETHEUS_PORT"])
            else:
                port = role.port
                labels["worker"] = rotation.worker_entry(role)["url"]
            out[kind].append({"targets": [f"{role.host}:{port}"], "labels": labels})
    return out


def _sglang(name: str, selector: str) -> str:
    """A selector for an sglang series under either spelling of its name. sglang names its
    metrics `sglang:NAME`; the pinned prometheus_client (0.26.0) writes the samples
    `sglang_NAME` when the scrape asks for OpenMetrics, as Prometheus does by default, and
    keeps the colon in the plain text format (seen with curl and in a real Prometheus's
    TSDB)."""
    return f'{{__name__=~"sglang[:_]{name}",{selector}}}'


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
    requests = " + ".join(
        [_sum0(m, engines) for m in ("sglang:num_running_reqs", "sglang:num_queue_reqs")]
        + [_sum0(f"sglang:num_prefill_{q}_queue_reqs", prefill) for q in ("bootstrap", "inflight")]
        + [_sum0(f"sglang:num_decode_{q}_queue_reqs", decode) for q in ("prealloc", "transfer")]
    )
    tokens = " + ".join(
        f"(sum(increase(sglang:{c}_tokens_total{{{engines}}}[{_d(progress)}])) or vector(0))"
        for c in ("prompt", "generation")
    )
    out = [
        _alert(
            "PDRequestsStuckBeforeIdleEngines",
            f"sum(smg_worker_requests_active{{{router}}}) > 0\n"
            f"and on() ({requests}) == 0\n"
            f"and on() ({tokens}) == 0\n"
            f"unless on() (min(up{{{engines}}}) == 0)",
            w.stuck,
            "critical",
            f"Requests held by the router, engines idle. Run: {triage}",
            "The router has had {{ $value }} call(s) out to its engines (a PD request makes "
            f"one to a prefill and one to a decode) for {_d(w.stuck)} while every engine "
            "reported nothing running or queued (PD queues included) and counted no token, all "
            "engines answering their scrapes.",
        ),
        _alert(
            "PDPrefillKVPinned",
            f"sglang:num_prefill_inflight_queue_reqs{{{prefill}}} > 0\n"
            f"and on(instance) (sum by (instance) "
            f"(increase(sglang:kv_transfer_latency_ms_count{{{prefill}}}[{_d(w.inflight)}])) "
            "== 0)",
            w.inflight,
            "critical",
            f"KV held in prefill's inflight queue with no transfer concluding. Run: {verify}; "
            f"then {triage}",
            "{{ $labels.pd_instance }} has held {{ $value }} request(s) in its inflight queue "
            f"for {_d(w.inflight)} and concluded no KV transfer in that time"
            + (
                f": longer than SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT (+{_d(w.slack)} for the "
                "gauge's refresh), which should fail such a room."
                if w.inflight_bounded
                else "; SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT is not set in the env files, "
                "so nothing bounds such a room."
            ),
        ),
    ]
    for queue in ("transfer", "prealloc"):
        out.append(
            _alert(
                f"PDDecode{queue.capitalize()}QueueStuck",
                f"sglang:num_decode_{queue}_queue_reqs{{{decode}}} > 0\n"
                f"and on(instance) (sum by (instance) "
                f"(increase(sglang:generation_tokens_total{{{decode}}}[{_d(w.decode_queue)}])) "
                "== 0)",
                w.decode_queue,
                "critical",
                f"Requests held in decode's {queue} queue with no token generated. Run: {verify}; "
                f"then {triage}",
                "{{ $labels.pd_instance }} has held {{ $value }} request(s) in its "
                f"{queue} queue for {_d(w.decode_queue)} and generated no token in that time: "
                "longer than SGLANG_DISAGGREGATION_WAITING_TIMEOUT and "
                f"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (+{_d(w.slack)} for the gauge's "
                "refresh).",
            )
        )
    used = f"(sglang:num_used_tokens{{{engines}}} > 0 or sglang:swa_used_tokens{{{engines}}} > 0)"
    out.append(
        _alert(
            "PDTokensHeldAfterTraffic",
            f"{used}\n"
            f"and on(instance) ((sum by (instance) (sglang:num_running_reqs{{{engines}}}) "
            f"+ sum by (instance) (sglang:num_queue_reqs{{{engines}}})) == 0)\n"
            f"and on(instance) ((sum by (instance) "
            f"(increase(sglang:prompt_tokens_total{{{engines}}}[{_d(w.held)}])) "
            f"+ sum by (instance) "
            f"(increase(sglang:generation_tokens_total{{{engines}}}[{_d(w.held)}]))) == 0)",
            w.held,
            "warning",
            f"KV tokens still used after the traffic stopped. Run: {pd} metrics {env}; then "
            f"{probe}",
            "{{ $labels.pd_instance }} still uses {{ $value }} KV tokens although it has "
            f"run, queued and counted no request token for {_d(w.held)}.",
        )
    )
    stage, idle = (f"increase({_sglang(m, engines)}[{_d(w.stalled)}])" for m in SCHEDULER_SECONDS)
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
            "adds to them every second, busy or idle. Its /health and the router's health "
            "checks keep passing while it stands still.",
        )
    )
    for kind in ROLE_KINDS:
        out.append(
            _alert(
                "PDInstanceDown",
                f'up{{job="{job(stack, kind)}"}} == 0',
                w.down[kind],
                "critical",
                f"A {kind} instance does not answer its scrape. Run: {pd} status {env}; then "
                f"{pd} logs {{{{ $labels.pd_instance }}}} {env}",
                "{{ $labels.pd_instance }} ({{ $labels.instance }}) has not answered Prometheus "
                f"for {_d(w.down[kind])}: "
                + (
                    "monitoring's --down-after."
                    if w.down_given
                    else f"longer than launch/pd waits for a {kind} to come up."
                ),
                role=kind,
            )
        )
    for kind in ("prefill", "decode"):
        out.append(
            _alert(
                "PDInstanceNotRouted",
                f'up{{job="{job(stack, kind)}"}} == 1\n'
                f"unless on(worker) (smg_worker_health{{{router}}} == 1)\n"
                f"and on() (up{{{router}}} == 1)",
                w.unrouted[kind],
                "warning",
                f"An engine answers, but the router does not route to it. Run: {probe}",
                "{{ $labels.pd_instance }} ({{ $labels.worker }}) answers its scrape, and the "
                "router has not listed it as a healthy worker for "
                f"{_d(w.unrouted[kind])}: "
                + (
                    "twice monitoring's --down-after."
                    if w.down_given
                    else "longer than a rolling restart takes."
                ),
                role=kind,
            )
        )
    out.append(
        _alert(
            "PDKnobDrift",
            f'sm120pd_verify_check_ok{{stack="{p}"}} == 0',
            0,
            "warning",
            f"launch/pd verify failed a check. Run: {verify}",
            "The last launch/pd verify --textfile failed its {{ $labels.layer }} check of "
            "{{ $labels.pd_instance }}{{ if $labels.variable }} for {{ $labels.variable }}"
            "{{ end }}.",
        )
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
    decode = f'job="{job(stack, "decode")}",{picked}'
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
                    "Running and queued requests",
                    [
                        (f"sglang:num_running_reqs{{{engines}}}", "{{pd_instance}} running"),
                        (f"sglang:num_queue_reqs{{{engines}}}", "{{pd_instance}} queued"),
                    ],
                ),
                _panel(
                    "KV token usage",
                    [(f"sglang:token_usage{{{engines}}}", "{{pd_instance}}")],
                    "percentunit",
                ),
                _panel(
                    "Scheduler loop seconds per second (1 while it runs, 0 when it stands still)",
                    [
                        (
                            f"sum by (pd_instance) (rate({_sglang(m, engines)}{rate}))",
                            f"{{{{pd_instance}}}} {m.split('_')[1]}",
                        )
                        for m in SCHEDULER_SECONDS
                    ],
                ),
                _panel(
                    "Tokens per second",
                    [
                        (
                            f"sum by (pd_instance) (rate(sglang:generation_tokens_total"
                            f"{{{engines}}}{rate}))",
                            "{{pd_instance}} generated",
                        ),
                        (
                            f"sum by (pd_instance) (rate(sglang:prompt_tokens_total"
                            f"{{{engines}}}{rate}))",
                            "{{pd_instance}} prompt",
                        ),
                    ],
                ),
            ],
        ),
        (
            "PD queues",
            [
                _panel(
                    "Prefill bootstrap and inflight queues",
                    [
                        (
                            f"sglang:num_prefill_{q}_queue_reqs{{{prefill}}}",
                            f"{{{{pd_instance}}}} {q}",
                        )
                        for q in ("bootstrap", "inflight")
                    ],
                ),
                _panel(
                    "Decode prealloc and transfer queues",
                    [
                        (
                            f"sglang:num_decode_{q}_queue_reqs{{{decode}}}",
                            f"{{{{pd_instance}}}} {q}",
                        )
                        for q in ("prealloc", "transfer")
                    ],
                ),
                _panel(
                    "KV transfer latency (prefill, p95)",
                    [
                        (
                            "histogram_quantile(0.95, sum by (le, pd_instance) "
                            f"(rate(sglang:kv_transfer_latency_ms_bucket{{{prefill}}}{rate})))",
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


def config(stack: Stack, scrape_s: float) -> dict:
    """prometheus.yml: one job per role, its targets in targets/ROLE.json (file_sd)."""
    interval = _d(scrape_s)
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
        ],
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


def render(out: Path, stack: Stack, w: Windows, scrape_s: float, env_dir: Path) -> list[Path]:
    head = (
        f"# Rendered by launch/pd monitoring from {env_dir}; render again (--force) after the\n"
        "# env files change. Every window is in launch/README.md, Monitoring.\n"
    )
    files = {
        out / "prometheus.yml": _yaml(config(stack, scrape_s), head),
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
