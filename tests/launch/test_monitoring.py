"""launch/pd monitoring: the files it renders, checked with Debian's promtool (./build.sh test
unpacks it into build/prometheus): `check config`, `check rules`, and `test rules` unit tests in
which every alert fires on a failing series and stays silent on the healthy series next to it.
The live side (a real Prometheus scraping real engines) is in tests/engine."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import yaml
from launch_harness import ROOT, run_pd

from launch.pdlib import monitoring, rotation
from launch.pdlib.stack import load_stack

PROMTOOL = monitoring.tool("promtool")


def promtool(*args: str) -> subprocess.CompletedProcess:
    assert PROMTOOL, (
        "no promtool: ./build.sh test unpacks Debian's prometheus into build/prometheus"
    )
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("monitoring") / "out"
    done = run_pd("monitoring", "--env-dir", str(ROOT / "env" / "cpu"), "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def rules_of(out: Path) -> list[dict]:
    return yaml.safe_load((out / "rules.yml").read_text())["groups"][0]["rules"]


def seconds(duration: str) -> int:
    assert duration.endswith("s"), duration
    return int(duration[:-1])


def test_monitoring_writes_the_files_and_promtool_accepts_them(rendered: Path):
    names = sorted(str(p.relative_to(rendered)) for p in rendered.rglob("*") if p.is_file())
    assert names == [
        "dashboard.json",
        "prometheus.yml",
        "rules.yml",
        "targets/decode.json",
        "targets/prefill.json",
        "targets/router.json",
    ]
    assert not list(rendered.rglob(".*.tmp"))
    checked = promtool("check", "config", str(rendered / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 1 rule files found" in checked.stdout
    linted = promtool("check", "rules", str(rendered / "rules.yml"))
    assert linted.returncode == 0, linted.stdout + linted.stderr
    assert "SUCCESS: 12 rules found" in linted.stdout
    config = yaml.safe_load((rendered / "prometheus.yml").read_text())
    jobs = {c["job_name"]: c["file_sd_configs"][0]["files"] for c in config["scrape_configs"]}
    assert jobs == {f"sm120pd-cpu-{k}": [f"targets/{k}.json"] for k in monitoring.ROLE_KINDS}


def test_every_summary_names_a_command_to_run_and_no_cause(rendered: Path):
    for rule in rules_of(rendered):
        summary = rule["annotations"]["summary"]
        run = summary.split("Run: ", 1)
        assert len(run) == 2, summary
        assert re.match(rf"{re.escape(str(ROOT))}/(launch/pd|bench/triage) ", run[1]), summary
        assert f"--env-dir {ROOT / 'env' / 'cpu'}" in run[1], summary
        for guess in ("because", "caused", "probably", "likely"):
            assert guess not in (summary + rule["annotations"]["description"]).lower(), rule


def test_windows_come_from_the_env_files(rendered: Path):
    """env/cpu: prefill's inflight timeout 60 s, decode's waiting timeout 300 s (bootstrap
    unset: sglang's 300 s), health timeouts 300/300/120 s, and the 60 s slack."""
    waits = {
        (r["alert"], r["labels"].get("pd_role")): seconds(r["for"]) for r in rules_of(rendered)
    }
    assert waits == {
        ("PDRequestsStuckBeforeIdleEngines", None): 120,
        ("PDPrefillKVPinned", None): 60 + 60,
        ("PDDecodeTransferQueueStuck", None): 300 + 60,
        ("PDDecodePreallocQueueStuck", None): 300 + 60,
        ("PDTokensHeldAfterTraffic", None): 300,
        ("PDSchedulerStalled", None): 0,
        ("PDInstanceDown", "prefill"): 300,
        ("PDInstanceDown", "decode"): 300,
        ("PDInstanceDown", "router"): 120,
        ("PDInstanceNotRouted", "prefill"): 600 + 300 + 240,
        ("PDInstanceNotRouted", "decode"): 600 + 300 + 240,
        ("PDKnobDrift", None): 0,
    }
    # PDSchedulerStalled's wait is its range: --stalled-after's default.
    (stalled,) = [r for r in rules_of(rendered) if r["alert"] == "PDSchedulerStalled"]
    assert set(re.findall(r"\[(\d+s)\]", stalled["expr"])) == {"120s"}


def test_targets_follow_the_topology_of_several_instances(tmp_path: Path):
    """xPyD: one target per instance, at the URL the router's worker list gives it."""
    env = tmp_path / "env"
    env.mkdir()
    for path in [*(ROOT / "env").glob("*.env"), *(ROOT / "env" / "2p2d").glob("*.env")]:
        shutil.copy(path, env / path.name)
    out = tmp_path / "out"
    done = run_pd("monitoring", "--env-dir", str(env), "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    stack = load_stack(env, sim=False)
    for kind in ("prefill", "decode"):
        entries = json.loads((out / "targets" / f"{kind}.json").read_text())
        want = [rotation.worker_entry(r)["url"] for r in stack.of_kind(kind)]
        assert [e["labels"]["worker"] for e in entries] == want
        assert [e["labels"]["pd_instance"] for e in entries] == [f"{kind}/1", f"{kind}/2"]
        assert [e["targets"] for e in entries] == [[u.removeprefix("http://")] for u in want]
    router = json.loads((out / "targets" / "router.json").read_text())
    prom = stack.env.role_env("router")["ROUTER_PROMETHEUS_PORT"]
    assert router[0]["targets"] == [f"{stack.roles['router'].host}:{prom}"]


def test_an_env_dir_that_fails_env_check_is_refused_with_its_message(tmp_path: Path):
    env = tmp_path / "env"
    shutil.copytree(ROOT / "env" / "cpu", env)
    with (env / "decode.env").open("a") as f:
        f.write("SGLANG_SM120_MMA_TARGET_CTA=512\n")
    check = run_pd("env", "check", "--env-dir", str(env))
    assert check.returncode == 1
    problems = [ln for ln in check.stdout.splitlines() if ln.startswith("FAIL ")]
    assert problems and "SGLANG_SM120_MMA_TARGET_CTA is not a knob" in problems[0]
    done = run_pd("monitoring", "--env-dir", str(env), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert [ln for ln in done.stderr.splitlines() if ln.startswith("FAIL ")] == problems
    assert "monitoring: nothing written" in done.stderr
    assert not (tmp_path / "out").exists()


def test_an_out_dir_that_is_not_empty_is_refused_without_force(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep\n")
    args = ("monitoring", "--env-dir", str(ROOT / "env" / "cpu"), "--out", str(out))
    done = run_pd(*args)
    assert done.returncode == 2
    assert f"--out {out} exists and is not empty; --force writes over it" in done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    forced = run_pd(*args, "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert (out / "rules.yml").is_file() and (out / "mine.txt").read_text() == "keep\n"
    bad = run_pd(*args, "--force", "--stuck-after", "0")
    assert bad.returncode == 2 and "--stuck-after must be positive" in bad.stderr


# ---- promtool test rules ---------------------------------------------------------------------

STACK = "sm120pd-cpu"
JOB = {k: f"{STACK}-{k}" for k in monitoring.ROLE_KINDS}
PREFILL = {"job": JOB["prefill"], "instance": "127.0.0.1:31000", "pd_instance": "prefill"}
PREFILL["worker"] = "http://127.0.0.1:31000"
DECODE = {"job": JOB["decode"], "instance": "127.0.0.1:31001", "pd_instance": "decode"}
DECODE["worker"] = "http://127.0.0.1:31001"
ROUTER = {"job": JOB["router"], "instance": "127.0.0.1:31090", "pd_instance": "router"}
STEP_S = 15


def series(name: str, labels: dict, values: str) -> dict:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def flat(value: float, steps: int) -> str:
    return f"{value:g}x{steps}"


def engines_at_rest(steps: int, running: float = 0, tokens_step: float = 0) -> list[dict]:
    """Both engines answering, nothing running, queued or in a PD queue, token counters flat
    (or growing by tokens_step a step)."""
    out = []
    for eng in (PREFILL, DECODE):
        out.append(series("up", eng, flat(1, steps)))
        out.append(
            series("sglang:num_running_reqs", eng, flat(running if eng is DECODE else 0, steps))
        )
        out.append(series("sglang:num_queue_reqs", eng, flat(0, steps)))
        for kind in ("prompt", "generation"):
            out.append(series(f"sglang:{kind}_tokens_total", eng, f"100+{tokens_step:g}x{steps}"))
    for q in ("bootstrap", "inflight"):
        out.append(series(f"sglang:num_prefill_{q}_queue_reqs", PREFILL, flat(0, steps)))
    for q in ("prealloc", "transfer"):
        out.append(series(f"sglang:num_decode_{q}_queue_reqs", DECODE, flat(0, steps)))
    return out


def template(text: str, labels: dict, value: str) -> str:
    """The rules' annotation templates, as Prometheus fills them in (the constructs they use)."""
    text = re.sub(
        r"\{\{ if \$labels\.(\w+) \}\}(.*?)\{\{ end \}\}",
        lambda m: m.group(2) if labels.get(m.group(1)) else "",
        text,
    )
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)
    return text.replace("{{ $value }}", value)


def expect(rule: dict, labels: dict, value: str) -> dict:
    """The alert promtool must see: the series' labels (without the name), the rule's labels,
    and its annotations filled in."""
    full = {**labels, **rule["labels"]}
    return {
        "exp_labels": full,
        "exp_annotations": {k: template(v, full, value) for k, v in rule["annotations"].items()},
    }


def case(name: str, inputs: list[dict], alert: str, at_s: int, fired: list[dict]) -> dict:
    return {
        "name": name,
        "interval": f"{STEP_S}s",
        "input_series": inputs,
        "alert_rule_test": [{"eval_time": f"{at_s}s", "alertname": alert, "exp_alerts": fired}],
    }


def span(rule: dict) -> tuple[int, int, int]:
    """A rule's wait, the steps of series three times that long, and a time to look at the
    alert: twice the wait and a minute (a window and a `for:` of that length both passed)."""
    wait = seconds(rule["for"])
    return wait, (3 * wait) // STEP_S, 2 * wait + 60


def rule_cases(rules: list[dict]) -> list[dict]:
    by = {(r["alert"], r["labels"].get("pd_role")): r for r in rules}
    cases = []

    # Router holding requests in front of idle engines.
    stuck = by[("PDRequestsStuckBeforeIdleEngines", None)]
    wait = seconds(stuck["for"])
    steps = (wait + 300) // STEP_S
    held = [
        series("smg_worker_requests_active", ROUTER | {"worker": DECODE["worker"]}, flat(1, steps))
    ]
    at = wait + 180
    cases.append(
        case(
            "stuck: fires",
            held + engines_at_rest(steps),
            stuck["alert"],
            at,
            [expect(stuck, {}, "1")],
        )
    )
    cases.append(
        case(
            "stuck: decode running",
            held + engines_at_rest(steps, running=1),
            stuck["alert"],
            at,
            [],
        )
    )
    cases.append(
        case(
            "stuck: tokens counted",
            held + engines_at_rest(steps, tokens_step=5),
            stuck["alert"],
            at,
            [],
        )
    )
    down = [
        s
        for s in engines_at_rest(steps)
        if not (s["series"].startswith("up{") and "decode" in s["series"])
    ]
    down.append(series("up", DECODE, flat(0, steps)))
    cases.append(case("stuck: decode down is not idle", held + down, stuck["alert"], at, []))
    idle_router = [
        series("smg_worker_requests_active", ROUTER | {"worker": DECODE["worker"]}, flat(0, steps))
    ]
    cases.append(
        case(
            "stuck: router holds nothing",
            idle_router + engines_at_rest(steps),
            stuck["alert"],
            at,
            [],
        )
    )

    # KV pinned in prefill's inflight queue.
    pinned = by[("PDPrefillKVPinned", None)]
    wait, steps, at = span(pinned)
    inflight = "sglang:num_prefill_inflight_queue_reqs"
    done = "sglang:kv_transfer_latency_ms_count"
    cases.append(
        case(
            "pinned: fires",
            [series(inflight, PREFILL, flat(1, steps)), series(done, PREFILL, flat(7, steps))],
            pinned["alert"],
            at,
            [expect(pinned, PREFILL, "1")],
        )
    )
    # As patch 0003 makes it: the room fails after the inflight timeout (60 s) and the gauge
    # follows within sglang's 30 s idle refresh.
    cleared = f"{flat(1, (60 + 30) // STEP_S)} {flat(0, steps)}"
    cases.append(
        case(
            "pinned: failed by the inflight timeout",
            [series(inflight, PREFILL, cleared), series(done, PREFILL, flat(7, steps * 2))],
            pinned["alert"],
            at,
            [],
        )
    )
    cases.append(
        case(
            "pinned: busy, transfers concluding",
            [series(inflight, PREFILL, flat(2, steps)), series(done, PREFILL, f"7+1x{steps}")],
            pinned["alert"],
            at,
            [],
        )
    )

    # Decode's transfer and prealloc queues.
    for queue in ("transfer", "prealloc"):
        rule = by[(f"PDDecode{queue.capitalize()}QueueStuck", None)]
        wait, steps, at = span(rule)
        gauge = f"sglang:num_decode_{queue}_queue_reqs"
        tokens = "sglang:generation_tokens_total"
        cases.append(
            case(
                f"{queue}: fires",
                [series(gauge, DECODE, flat(3, steps)), series(tokens, DECODE, flat(50, steps))],
                rule["alert"],
                at,
                [expect(rule, DECODE, "3")],
            )
        )
        cases.append(
            case(
                f"{queue}: busy, tokens generated",
                [series(gauge, DECODE, flat(3, steps)), series(tokens, DECODE, f"50+20x{steps}")],
                rule["alert"],
                at,
                [],
            )
        )
        short = f"{flat(1, (wait - 90) // STEP_S)} {flat(0, steps)}"
        cases.append(
            case(
                f"{queue}: cleared within the timeout",
                [series(gauge, DECODE, short), series(tokens, DECODE, flat(50, steps * 2))],
                rule["alert"],
                at,
                [],
            )
        )

    # Tokens still used after the traffic stopped.
    rule = by[("PDTokensHeldAfterTraffic", None)]
    wait, steps, at = span(rule)
    rest = [
        s
        for s in engines_at_rest(steps)
        if "prefill" in s["series"] and "_prefill_" not in s["series"]
    ]
    used = "sglang:num_used_tokens"
    cases.append(
        case(
            "held: fires",
            rest + [series(used, PREFILL, flat(64, steps))],
            rule["alert"],
            at,
            [expect(rule, PREFILL, "64")],
        )
    )
    cases.append(
        case("held: freed", rest + [series(used, PREFILL, flat(0, steps))], rule["alert"], at, [])
    )
    busy = [s for s in rest if "running" not in s["series"]] + [
        series("sglang:num_running_reqs", PREFILL, flat(1, steps))
    ]
    cases.append(
        case(
            "held: still running",
            busy + [series(used, PREFILL, flat(64, steps))],
            rule["alert"],
            at,
            [],
        )
    )

    # A scheduler whose time counters stand still while its engine answers its scrape.
    rule = by[("PDSchedulerStalled", None)]
    (window,) = {seconds(d) for d in re.findall(r"\[(\d+s)\]", rule["expr"])}
    steps = 3 * window // STEP_S
    at = 2 * window

    def scheduler(engine: dict, values: str, sep: str = "_") -> list[dict]:
        """The two counters as sglang labels them: idle, and stage by category (idle among
        them) and forward overlap; `values` for idle and the idle stage, run_batch flat.
        Named `sglang_...` as a real Prometheus stores them (sep ":" for sglang's own
        spelling, which the text format keeps)."""
        labels = engine | {"engine_type": engine["pd_instance"], "tp_rank": "0"}
        stage = f"sglang{sep}scheduler_stage_seconds_total"
        return [
            series(f"sglang{sep}scheduler_idle_seconds_total", labels, values),
            series(stage, labels | {"category": "idle", "forward_overlap": "none"}, values),
            series(stage, labels | {"category": "run_batch", "forward_overlap": "none"}, "3x99"),
        ]

    running = f"0+15x{steps}"
    up = [series("up", PREFILL, flat(1, steps)), series("up", DECODE, flat(1, steps))]
    stopped = DECODE | {"engine_type": "decode", "tp_rank": "0"}
    cases.append(
        case(
            "stalled: fires for decode, not for prefill next to it",
            up + scheduler(PREFILL, running) + scheduler(DECODE, flat(500, steps)),
            rule["alert"],
            at,
            [expect(rule, stopped, "0")],
        )
    )
    # Stopped at 150 s, looked at 90 s later: shorter than the window.
    short = f"0+15x10 {flat(150, steps)}"
    cases.append(
        case(
            "stalled: fires under sglang's own spelling too",
            up + scheduler(DECODE, flat(500, steps), ":"),
            rule["alert"],
            at,
            [expect(rule, stopped, "0")],
        )
    )
    cases.append(
        case(
            "stalled: a stop shorter than the window",
            up + scheduler(PREFILL, running) + scheduler(DECODE, short),
            rule["alert"],
            150 + window - 30,
            [],
        )
    )
    gone = [series("up", DECODE, flat(0, steps))]
    cases.append(
        case(
            "stalled: a failing scrape is PDInstanceDown's",
            gone + scheduler(DECODE, flat(500, steps)),
            rule["alert"],
            at,
            [],
        )
    )

    # An instance down, and a restart that comes back in time.
    for kind, labels in (("prefill", PREFILL), ("decode", DECODE), ("router", ROUTER)):
        rule = by[("PDInstanceDown", kind)]
        wait = seconds(rule["for"])
        steps = (2 * wait + 300) // STEP_S
        at = wait + 120
        fired = expect(rule, labels, "0")
        cases.append(
            case(
                f"down {kind}: fires",
                [series("up", labels, f"1 {flat(0, steps)}")],
                rule["alert"],
                at,
                [fired],
            )
        )
        back = (wait - 60) // STEP_S
        restart = f"1 {flat(0, back)} {flat(1, steps)}"
        cases.append(
            case(
                f"down {kind}: restarted in time",
                [series("up", labels, restart)],
                rule["alert"],
                at,
                [],
            )
        )

    # An engine the router does not route to.
    for kind, labels in (("prefill", PREFILL), ("decode", DECODE)):
        rule = by[("PDInstanceNotRouted", kind)]
        wait = seconds(rule["for"])
        steps = (wait + 600) // STEP_S
        at = wait + 300
        other = PREFILL if labels is DECODE else DECODE
        up = [series("up", labels, flat(1, steps)), series("up", ROUTER, flat(1, steps))]
        health = series("smg_worker_health", ROUTER | {"worker": other["worker"]}, flat(1, steps))
        cases.append(
            case(
                f"unrouted {kind}: fires",
                up + [health],
                rule["alert"],
                at,
                [expect(rule, labels, "1")],
            )
        )
        listed = series("smg_worker_health", ROUTER | {"worker": labels["worker"]}, flat(1, steps))
        cases.append(case(f"unrouted {kind}: listed", up + [health, listed], rule["alert"], at, []))
        router_down = [series("up", labels, flat(1, steps)), series("up", ROUTER, flat(0, steps))]
        cases.append(
            case(f"unrouted {kind}: router down", router_down + [health], rule["alert"], at, [])
        )

    # Knob drift, from launch/pd verify --textfile.
    rule = by[("PDKnobDrift", None)]
    check = {"job": "node", "instance": "gpu-a:9100", "stack": STACK, "pd_instance": "decode"}
    check |= {"layer": "env", "variable": "SGLANG_SM120_MMA_TARGET_CTAS"}
    ok = "sm120pd_verify_check_ok"
    cases.append(
        case(
            "drift: fires",
            [series(ok, check, "1 0 0")],
            rule["alert"],
            30,
            [expect(rule, check, "0")],
        )
    )
    cases.append(case("drift: passing", [series(ok, check, "1 1 1")], rule["alert"], 30, []))
    other_stack = check | {"stack": "sm120pd-other"}
    cases.append(
        case("drift: another stack's", [series(ok, other_stack, "0 0 0")], rule["alert"], 30, [])
    )
    return cases


def test_every_alert_fires_on_its_failing_series_and_not_on_healthy_ones(rendered: Path, tmp_path):
    rules = rules_of(rendered)
    cases = rule_cases(rules)
    assert {c["alert_rule_test"][0]["alertname"] for c in cases} == {r["alert"] for r in rules}
    # Each rule (one per role for some alerts) has a case in which it fires.
    fired = Counter(t["alertname"] for c in cases for t in c["alert_rule_test"] if t["exp_alerts"])
    assert fired >= Counter(r["alert"] for r in rules), fired
    tests = {
        "rule_files": [str(rendered / "rules.yml")],
        "evaluation_interval": f"{STEP_S}s",
        "tests": cases,
    }
    path = tmp_path / "rules_test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    done = promtool("test", "rules", str(path))
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    assert "SUCCESS" in done.stdout


def test_the_dashboard_is_whole_and_every_panel_queries_through_the_datasource_variable(
    rendered: Path,
):
    """Structure only (Grafana is not needed): a prometheus datasource variable that every
    panel and query uses, unique panel ids, panels on the 24-column grid without overlap, each
    query with a refId and a metric name (tests/engine checks those names against a live
    scrape)."""
    board = json.loads((rendered / "dashboard.json").read_text())
    assert board["title"] == "PD stack sm120pd-cpu" and board["uid"] == "pd-sm120pd-cpu"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    source = {"type": "prometheus", "uid": "${datasource}"}
    assert variables["pd_instance"]["datasource"] == source
    assert "pd_instance" in variables["pd_instance"]["definition"]
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    rows = [p for p in panels if p["type"] == "row"]
    assert [r["title"] for r in rows] == ["Router", "Engines", "PD queues", "Targets and verify"]
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        here = {
            (grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"]) for dy in range(grid["h"])
        }
        assert not cells & here, f"{panel['title']} overlaps another panel"
        cells |= here
        if panel["type"] == "row":
            continue
        assert panel["type"] == "timeseries" and panel["datasource"] == source, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == source
            assert monitoring.metric_names(target["expr"]), target["expr"]
    engine_panels = [p for p in panels if any("sglang:" in t["expr"] for t in p.get("targets", []))]
    for panel in engine_panels:
        for target in panel["targets"]:
            assert 'pd_instance=~"$pd_instance"' in target["expr"], target["expr"]


def test_without_an_inflight_timeout_the_pinned_alert_says_nothing_bounds_the_room(tmp_path):
    env = tmp_path / "env"
    shutil.copytree(ROOT / "env" / "cpu", env)
    prefill = env / "prefill.env"
    prefill.write_text(
        "".join(
            line
            for line in prefill.read_text().splitlines(keepends=True)
            if not line.startswith("SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT=")
        )
    )
    out = tmp_path / "out"
    done = run_pd("monitoring", "--env-dir", str(env), "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    window = monitoring.UNBOUNDED_INFLIGHT_S + 60
    assert (
        "note: SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT is not set for prefill; "
        f"PDPrefillKVPinned waits {window:g} s"
    ) in done.stdout
    (pinned,) = [r for r in rules_of(out) if r["alert"] == "PDPrefillKVPinned"]
    assert seconds(pinned["for"]) == window
    assert "is not set in the env files, so nothing bounds such a room" in str(pinned)
