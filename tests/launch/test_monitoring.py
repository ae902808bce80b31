"""launch/pd monitoring: the files it renders, checked with Debian's promtool (./build.sh test
unpacks it into build/prometheus): `check config`, `check rules`, and `test rules` unit tests in
which every alert fires on a failing series and stays silent on the healthy series next to it.
The rules under test are rendered from env/cpu with PD_TEXTFILE_DIR set (maintenance marks on);
env/cpu as shipped (no marks) is checked for its windows and its note. The live side (a real
Prometheus scraping real engines) is in tests/engine."""

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
TEXTFILE_TARGET = "127.0.0.1:9100"


def promtool(*args: str) -> subprocess.CompletedProcess:
    assert PROMTOOL, (
        "no promtool: ./build.sh test unpacks Debian's prometheus into build/prometheus"
    )
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


def copy_env(base: Path, extra: str = "") -> Path:
    """A copy of env/cpu under base, with extra appended to its common.env."""
    env = base / "env"
    shutil.copytree(ROOT / "env" / "cpu", env)
    if extra:
        with (env / "common.env").open("a") as f:
            f.write(extra)
    return env


@pytest.fixture(scope="module")
def marked_env(tmp_path_factory) -> Path:
    """env/cpu with PD_TEXTFILE_DIR set: launch/pd writes maintenance marks, the rules read
    them."""
    base = tmp_path_factory.mktemp("marked")
    (base / "textfiles").mkdir()
    return copy_env(base, f"PD_TEXTFILE_DIR={base / 'textfiles'}\n")


@pytest.fixture(scope="module")
def rendered(marked_env: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("monitoring") / "out"
    done = run_pd(
        "monitoring",
        "--env-dir",
        str(marked_env),
        "--out",
        str(out),
        "--textfile-target",
        TEXTFILE_TARGET,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # With marks, PDInstanceDown no longer waits the health timeout: no note says it does.
    assert "PD_TEXTFILE_DIR" not in done.stdout, done.stdout
    return out


def rules_of(out: Path) -> list[dict]:
    return yaml.safe_load((out / "rules.yml").read_text())["groups"][0]["rules"]


def by_key(rules: list[dict]) -> dict[tuple[str, str | None], dict]:
    return {(r["alert"], r["labels"].get("pd_role")): r for r in rules}


def seconds(duration: str) -> int:
    assert duration.endswith("s"), duration
    return int(duration[:-1])


def ranges(rule: dict) -> set[int]:
    """The range selectors' lengths in a rule's expression, in seconds."""
    return {int(s) for s in re.findall(r"\[(\d+)s\]", rule["expr"])}


def limit(rule: dict) -> float:
    """The first threshold a rule compares with (`> N` or `>= N`)."""
    found = re.search(r" >=? (\d+(?:\.\d+)?)\b", rule["expr"])
    assert found, rule["expr"]
    return float(found.group(1))


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
    assert "SUCCESS: 20 rules found" in linted.stdout
    config = yaml.safe_load((rendered / "prometheus.yml").read_text())
    jobs = {c["job_name"]: c for c in config["scrape_configs"]}
    assert set(jobs) == {f"sm120pd-cpu-{k}" for k in (*monitoring.ROLE_KINDS, "textfile")}
    for kind in monitoring.ROLE_KINDS:
        assert jobs[f"sm120pd-cpu-{kind}"]["file_sd_configs"][0]["files"] == [
            f"targets/{kind}.json"
        ]
        assert not jobs[f"sm120pd-cpu-{kind}"].get("honor_labels")
    # --textfile-target: node_exporter's textfile collector, its stack and pd_instance labels
    # kept as the files write them (the marks and verify results join on them).
    textfile = jobs["sm120pd-cpu-textfile"]
    assert textfile["honor_labels"] is True
    assert textfile["static_configs"] == [{"targets": [TEXTFILE_TARGET]}]


def test_every_summary_names_a_command_to_run_and_no_cause(rendered: Path, marked_env: Path):
    for rule in rules_of(rendered):
        summary = rule["annotations"]["summary"]
        run = summary.split("Run: ", 1)
        assert len(run) == 2, summary
        assert re.match(rf"{re.escape(str(ROOT))}/(launch/pd|bench/triage) ", run[1]), summary
        assert f"--env-dir {marked_env.resolve()}" in run[1], summary
        for guess in ("because", "caused", "probably", "likely"):
            assert guess not in (summary + rule["annotations"]["description"]).lower(), rule


def test_windows_come_from_the_env_files(rendered: Path):
    """env/cpu with marks: prefill's inflight timeout 60 s, decode's waiting timeout 300 s
    (bootstrap unset: sglang's 300 s), the 60 s slack; PDInstanceDown 120 s (marks), the
    unrouted wait that + the router's timeouts; a 15 s scrape interval."""
    rules = rules_of(rendered)
    waits = {(r["alert"], r["labels"].get("pd_role")): seconds(r["for"]) for r in rules}
    assert waits == {
        ("PDRequestsStuckBeforeIdleEngines", None): 120,
        # The queue alerts compare the oldest room's age with the window: no `for:`.
        ("PDPrefillKVPinned", None): 0,
        ("PDDecodeTransferQueueStuck", None): 0,
        ("PDDecodePreallocQueueStuck", None): 0,
        # Its age grows by itself: no `for:`.
        ("PDDecodeKVQuarantined", None): 0,
        ("PDTokensHeldAfterTraffic", None): 300,
        ("PDQueueMetricsFailing", None): 0,
        ("PDSchedulerStalled", None): 0,
        ("PDInstanceDown", "prefill"): 120,
        ("PDInstanceDown", "decode"): 120,
        ("PDInstanceDown", "router"): 120,
        ("PDTargetsAbsent", "prefill"): 45,
        ("PDTargetsAbsent", "decode"): 45,
        ("PDTargetsAbsent", "router"): 45,
        ("PDInstanceFlapping", None): 0,
        # The marked down window and the router's own timeout (120 s) on top.
        ("PDInstanceNotRouted", "prefill"): 240,
        ("PDInstanceNotRouted", "decode"): 240,
        ("PDKnobDrift", None): 30,
        ("PDVerifyCheckFailed", None): 30,
        ("PDVerifyStale", None): 45,
    }
    by = by_key(rules)
    assert limit(by[("PDPrefillKVPinned", None)]) == 60 + 60
    assert limit(by[("PDDecodeTransferQueueStuck", None)]) == 300 + 60
    prealloc = by[("PDDecodePreallocQueueStuck", None)]
    assert limit(prealloc) == 300 + 60 and ranges(prealloc) == {360}
    # Progress: forward steps in the last minute (at most --stuck-after) and in --held-after.
    assert ranges(by[("PDRequestsStuckBeforeIdleEngines", None)]) == {60}
    assert ranges(by[("PDTokensHeldAfterTraffic", None)]) == {300}
    # Four scrape intervals of the error counter.
    assert ranges(by[("PDQueueMetricsFailing", None)]) == {60}
    # PDSchedulerStalled's wait is its range: --stalled-after's default.
    assert ranges(by[("PDSchedulerStalled", None)]) == {120}
    flapping = by[("PDInstanceFlapping", None)]
    assert ranges(flapping) == {900} and limit(flapping) == 4
    assert limit(by[("PDVerifyStale", None)]) == 3600
    assert by[("PDDecodeKVQuarantined", None)]["expr"] == (
        'time() - ({__name__=~"sglang[:_]decode_kv_quarantine_oldest_timestamp_seconds",'
        'job="sm120pd-cpu-decode"} > 0) > 360'
    )
    # Every rule that an instance's planned work would trip reads the marks.
    for key, rule in by.items():
        marked = key[0] in ("PDInstanceDown", "PDInstanceNotRouted", "PDInstanceFlapping")
        assert ("sm120pd_maintenance_until_timestamp_seconds" in rule["expr"]) == marked, key


def health_timeout_waits(rules: list[dict]) -> dict:
    """Each rule's wait, after checking that PDInstanceDown waits env/cpu's health timeouts
    (prefill 300 s, decode 300 s, router 120 s): the windows without marks."""
    waits = {(r["alert"], r["labels"].get("pd_role")): seconds(r["for"]) for r in rules}
    assert {k: v for k, v in waits.items() if k[0] == "PDInstanceDown"} == {
        ("PDInstanceDown", "prefill"): 300,
        ("PDInstanceDown", "decode"): 300,
        ("PDInstanceDown", "router"): 120,
    }
    return waits


def test_without_textfile_dir_instance_down_waits_the_health_timeout(tmp_path: Path):
    """env/cpu as shipped sets no PD_TEXTFILE_DIR: launch/pd writes no marks, so the rules read
    none, PDInstanceDown waits each role's health timeout (300/300/120 s), PDInstanceNotRouted
    a rolling restart's longest run, and the command says so."""
    out = tmp_path / "out"
    done = run_pd("monitoring", "--env-dir", str(ROOT / "env" / "cpu"), "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "note: PD_TEXTFILE_DIR is not set in common.env, so launch/pd cannot mark its own "
        "restarts; PDInstanceDown waits each role's health timeout (prefill 300 s, decode 300 s, "
        "router 120 s) instead of 120 s"
    ) in done.stdout
    rules = rules_of(out)
    waits = health_timeout_waits(rules)
    # rolling-restart's drain (600 s) + the health timeout + twice the router timeout (120 s).
    unrouted = 600 + 300 + 2 * 120
    assert waits[("PDInstanceNotRouted", "prefill")] == unrouted
    assert waits[("PDInstanceNotRouted", "decode")] == unrouted
    for rule in rules:
        assert "maintenance" not in rule["expr"], rule["alert"]
    config = yaml.safe_load((out / "prometheus.yml").read_text())
    assert [c["job_name"] for c in config["scrape_configs"]] == [
        f"sm120pd-cpu-{k}" for k in monitoring.ROLE_KINDS
    ]


def test_marks_nothing_scrapes_hold_no_alert_back_and_verify_stale_is_not_rendered(
    marked_env: Path, tmp_path: Path
):
    """PD_TEXTFILE_DIR set and writable, but neither --textfile-target nor --textfile-scraped:
    no maintenance mark and no verify result reaches this Prometheus, so PDInstanceDown waits
    each role's health timeout (300/300/120 s) and reads no mark, and PDVerifyStale is not
    rendered (its absent() would warn forever 45 s after Prometheus starts). The command says
    so. --textfile-scraped (your own node_exporter job) gives the marked windows back."""
    out = tmp_path / "out"
    done = run_pd("monitoring", "--env-dir", str(marked_env), "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "note: nothing scrapes PD_TEXTFILE_DIR here (--textfile-target renders a job for a "
        "node_exporter that reads it, --textfile-scraped says your own does), so no maintenance "
        "mark or verify result reaches this Prometheus: PDInstanceDown waits each role's health "
        "timeout (prefill 300 s, decode 300 s, router 120 s) instead of 120 s, and PDVerifyStale "
        "is not rendered"
    ) in done.stdout
    rules = rules_of(out)
    health_timeout_waits(rules)
    assert not [r for r in rules if "maintenance" in r["expr"]]
    assert "PDVerifyStale" not in {r["alert"] for r in rules}
    scraped = tmp_path / "scraped"
    done = run_pd(
        "monitoring", "--env-dir", str(marked_env), "--out", str(scraped), "--textfile-scraped"
    )
    assert done.returncode == 0 and "PD_TEXTFILE_DIR" not in done.stdout, done.stdout
    by = by_key(rules_of(scraped))
    assert seconds(by[("PDInstanceDown", "prefill")]["for"]) == 120
    assert ("PDVerifyStale", None) in by


def test_a_textfile_dir_launch_pd_cannot_write_is_refused_naming_its_line(tmp_path: Path):
    """env check --monitoring and monitoring refuse a PD_TEXTFILE_DIR launch/pd could not write
    its marks into (here one that does not exist; a directory this user may not write is
    refused the same way, which a root test process cannot show), naming file, line and
    variable; nothing is rendered."""
    env = copy_env(tmp_path, f"PD_TEXTFILE_DIR={tmp_path / 'missing'}\n")
    line = (
        (env / "common.env")
        .read_text()
        .splitlines()
        .index(f"PD_TEXTFILE_DIR={tmp_path / 'missing'}")
    )
    said = (
        f"common.env:{line + 1}: PD_TEXTFILE_DIR={tmp_path / 'missing'}: no such directory, "
        "so launch/pd "
        "cannot write its maintenance marks there"
    )
    checked = run_pd("env", "check", "--env-dir", str(env), "--monitoring")
    assert checked.returncode == 1 and said in checked.stdout, checked.stdout
    plain = run_pd("env", "check", "--env-dir", str(env))
    assert "no such directory" not in plain.stdout, plain.stdout
    out = tmp_path / "out"
    done = run_pd("monitoring", "--env-dir", str(env), "--out", str(out))
    assert done.returncode == 2 and said in done.stderr, done.stdout + done.stderr
    assert "monitoring: nothing written" in done.stderr and not out.exists()


def test_the_prealloc_bound_is_prefills_bootstrap_timeout_not_decodes(tmp_path: Path):
    """sglang 0.5.23 reads SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT only for a prefill KV
    manager (common/conn.py: `self.bootstrap_timeout` is set in the PREFILL branch, and the
    sender's poll fails a room still bootstrapping after it), so decode's value bounds nothing:
    PDDecodePreallocQueueStuck waits prefill's 120 s + the 60 s slack, whatever decode's says."""
    env = copy_env(tmp_path)
    with (env / "prefill.env").open("a") as f:
        f.write("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=120\n")
    with (env / "decode.env").open("a") as f:
        f.write("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=900\n")
    out = tmp_path / "out"
    done = run_pd("monitoring", "--env-dir", str(env), "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    prealloc = by_key(rules_of(out))[("PDDecodePreallocQueueStuck", None)]
    assert limit(prealloc) == 180 and ranges(prealloc) == {180}
    assert (
        "longer than prefill's SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT + 60s"
        in prealloc["annotations"]["description"]
    )


def test_the_window_options_reach_the_rules(marked_env: Path, tmp_path: Path):
    out = tmp_path / "out"
    args = ("monitoring", "--env-dir", str(marked_env), "--out", str(out), "--textfile-scraped")
    done = run_pd(
        *args, "--flap-window", "600", "--verify-stale-after", "7200", "--down-after", "90"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    by = by_key(rules_of(out))
    flapping = by[("PDInstanceFlapping", None)]
    assert ranges(flapping) == {600} and "> time() - 600" in flapping["expr"]
    assert limit(by[("PDVerifyStale", None)]) == 7200
    for kind in monitoring.ROLE_KINDS:
        assert seconds(by[("PDInstanceDown", kind)]["for"]) == 90
    assert seconds(by[("PDInstanceNotRouted", "decode")]["for"]) == 180
    for option in ("--flap-window", "--verify-stale-after"):
        bad = run_pd(*args, "--force", option, "0")
        assert bad.returncode == 2 and f"{option} must be positive" in bad.stderr


def test_quarantine_after_is_the_bound_of_pd_decode_kv_quarantined(marked_env: Path):
    stack = load_stack(marked_env, sim=False)
    w = monitoring.windows(stack, 120.0, 300.0, 60.0, quarantine=90.0)
    rules = monitoring.rules(stack, w, marked_env)["groups"][0]["rules"]
    (rule,) = [r for r in rules if r["alert"] == "PDDecodeKVQuarantined"]
    assert rule["expr"] == (
        'time() - ({__name__=~"sglang[:_]decode_kv_quarantine_oldest_timestamp_seconds",'
        'job="sm120pd-cpu-decode"} > 0) > 90'
    )
    description = rule["annotations"]["description"]
    assert "longer than monitoring's --quarantine-after (90s). " in description


def test_the_router_target_is_where_smg_serves_its_metrics_and_ipv6_is_bracketed(
    tmp_path: Path,
):
    """smg's Prometheus endpoint listens on ROUTER_PROMETHEUS_HOST when it is set
    (launch/router.sh passes it as --prometheus-host), so that is where Prometheus must scrape;
    an IPv6 literal goes in brackets, as Prometheus's target syntax (host:port) needs."""
    env = tmp_path / "env"
    shutil.copytree(ROOT / "env" / "cpu", env)
    with (env / "router.env").open("a") as f:
        f.write("ROUTER_PROMETHEUS_HOST=127.0.0.2\n")
    out = tmp_path / "out"
    done = run_pd("monitoring", "--env-dir", str(env), "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    argv = subprocess.run(
        ["bash", str(ROOT / "launch" / "router.sh"), "--env-dir", str(env), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "--prometheus-host 127.0.0.2" in argv, argv
    router = json.loads((out / "targets" / "router.json").read_text())
    assert router[0]["targets"] == ["127.0.0.2:31090"]
    assert monitoring.host_port("::1", 31001) == "[::1]:31001"
    assert monitoring.host_port("127.0.0.1", 31001) == "127.0.0.1:31001"


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


def test_an_engine_without_metrics_is_refused_naming_its_file_line_and_variable(tmp_path: Path):
    """decode without --enable-metrics serves no /metrics: plain env check passes, env check
    --monitoring and monitoring refuse it at the line that sets DECODE_ARGS."""
    env = tmp_path / "env"
    shutil.copytree(ROOT / "env" / "cpu", env)
    decode = env / "decode.env"
    lines = decode.read_text().splitlines(keepends=True)
    (number,) = [i + 1 for i, ln in enumerate(lines) if ln.startswith("DECODE_ARGS=")]
    assert "--enable-metrics" in lines[number - 1]
    lines[number - 1] = lines[number - 1].replace(" --enable-metrics", "")
    decode.write_text("".join(lines))
    plain = run_pd("env", "check", "--env-dir", str(env))
    assert plain.returncode == 0, plain.stdout + plain.stderr
    checked = run_pd("env", "check", "--env-dir", str(env), "--monitoring")
    assert checked.returncode == 1, checked.stdout + checked.stderr
    problems = [ln for ln in checked.stdout.splitlines() if ln.startswith("FAIL ")]
    assert len(problems) == 1, checked.stdout
    assert problems[0].startswith(f"FAIL {decode}:{number}: DECODE_ARGS: "), problems
    assert "decode has no --enable-metrics" in problems[0]
    out = tmp_path / "out"
    done = run_pd("monitoring", "--env-dir", str(env), "--out", str(out))
    assert done.returncode == 2, done.stdout + done.stderr
    assert [ln for ln in done.stderr.splitlines() if ln.startswith("FAIL ")] == problems
    assert "monitoring: nothing written" in done.stderr
    assert not out.exists()


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
STEP_S = 15
# The PD queues patch 0025 publishes on every engine (pd_queue_metrics.COUNTED and AGED).
COUNTED = (
    "running",
    "waiting",
    "prefill_bootstrap",
    "prefill_inflight",
    "decode_prealloc",
    "decode_transfer",
    "decode_retracted",
)
AGED = ("prefill_bootstrap", "prefill_inflight", "decode_prealloc", "decode_transfer")
# sglang:realtime_tokens_total's modes on each role.
MODES = {"prefill": ("prefill_compute", "prefill_cache"), "decode": ("decode",)}
# Sample names: sglang's own spelling (the text format keeps it) and the one Prometheus stores
# when it scrapes OpenMetrics, as it does by default.
COLON, OPENMETRICS = ":", "_"
MARK = "sm120pd_maintenance_until_timestamp_seconds"


def target(kind: str, port: int, name: str | None = None) -> dict:
    """A scraped series' labels: the job, the target, and the file_sd labels monitoring writes."""
    labels = {"job": JOB[kind], "instance": f"127.0.0.1:{port}"}
    labels |= {"pd_instance": name or kind, "pd_role": kind, "stack": STACK}
    if kind != "router":
        labels["worker"] = f"http://127.0.0.1:{port}"
    return labels


PREFILL = target("prefill", 31000)
DECODE = target("decode", 31001)
ROUTER = target("router", 31090)
PREFILL2 = target("prefill", 31010, "prefill/2")
DECODE2 = target("decode", 31011, "decode/2")
# node_exporter's textfile collector, scraped with honor_labels (--textfile-target).
TEXTFILE = {"job": f"{STACK}-textfile", "instance": "127.0.0.1:9100"}


def series(name: str, labels: dict, values: str) -> dict:
    """An input series; labels with an empty value are left out, as Prometheus stores them."""
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items() if v != "")
    return {"series": f"{name}{{{inner}}}", "values": values}


def flat(value: float, steps: int) -> str:
    return f"{value:g}x{steps}"


def vals(value: float | str, steps: int) -> str:
    """Series notation as given, or a number held flat."""
    return value if isinstance(value, str) else flat(value, steps)


def listed(values: list[float]) -> str:
    return " ".join(f"{v:g}" for v in values)


def sawtooth(top: int, steps: int) -> str:
    """Rooms each failed by their timeout: the oldest age climbs to top, drops to 0 (the room
    failed, the next one just entered), climbs again."""
    tooth = top // STEP_S + 1
    return listed([STEP_S * (i % tooth) for i in range(steps + 1)])


def sg(engine: dict) -> dict:
    """An sglang series' labels: the scrape's and sglang's own."""
    return engine | {"model_name": "tiny-llama", "engine_type": engine["pd_role"], "tp_rank": "0"}


def engine(
    eng: dict,
    steps: int,
    *,
    sep: str = COLON,
    up: float | str = 1,
    requests: dict | None = None,
    oldest: dict | None = None,
    used: float | str = 0,
    tokens: float | str | None = 100,
) -> list[dict]:
    """One engine's series: up, patch 0025's PD queues (0 unless requests/oldest say), its KV
    tokens in use, and sglang:realtime_tokens_total per mode (tokens: a number holds it flat;
    None: no series at all, as before the engine's first forward step)."""
    labels = sg(eng)
    out = [series("up", eng, vals(up, steps))]
    for q in COUNTED:
        value = (requests or {}).get(q, 0)
        out.append(
            series(f"sglang{sep}pd_queue_requests", labels | {"queue": q}, vals(value, steps))
        )
    for q in AGED:
        value = (oldest or {}).get(q, 0)
        out.append(
            series(f"sglang{sep}pd_queue_oldest_seconds", labels | {"queue": q}, vals(value, steps))
        )
    out.append(series(f"sglang{sep}pd_used_tokens", labels, vals(used, steps)))
    if tokens is not None:
        for mode in MODES[eng["pd_role"]]:
            name = f"sglang{sep}realtime_tokens_total"
            out.append(series(name, labels | {"mode": mode}, vals(tokens, steps)))
    return out


def switched_spelling(
    eng: dict, name: str, labels: dict, steps: int, step: int, switch: int
) -> list[dict]:
    """One sglang counter whose sample name changes spelling at sample `switch` (sglang:NAME,
    then sglang_NAME, as after an upgrade that changes the scrape protocol), climbing by `step`
    per sample throughout: for a window across the change both series exist, with the same
    labels once a range function drops their names."""
    first = f"500+{step}x{switch - 1}"
    second = f"{500 + step * switch}+{step}x{steps - switch}"
    full = sg(eng) | labels
    return [
        series(f"sglang{COLON}{name}", full, f"{first} _x{steps - switch + 1}"),
        series(f"sglang{OPENMETRICS}{name}", full, f"_x{switch} {second}"),
    ]


def mark(eng: dict, values: str) -> dict:
    """launch/pd's maintenance mark for one instance, as node_exporter serves it."""
    return series(MARK, TEXTFILE | {"stack": STACK, "pd_instance": eng["pd_instance"]}, values)


# What each alert must say, written out for the rules `rendered` makes (env/cpu's copy with
# marks, monitoring's default windows; env/cpu's health timeouts), not read from the rules:
# {root} and {env} are the checkout and the env dir, {value} the alert's value as Prometheus
# prints it, {value0} the same rounded to a whole number, the rest the alert's labels.
RUN = "{root}/launch/pd"
TRIAGE = "{root}/bench/triage --env-dir {env}"
ANNOTATIONS = {
    "PDRequestsStuckBeforeIdleEngines": (
        f"Requests held by the router, engines idle. Run: {TRIAGE}",
        "The router has had {value} call(s) out to its engines (a PD request makes one to a "
        "prefill and one to a decode) for 120s while every engine held no request, running, "
        "waiting or in a PD queue (sglang:pd_queue_requests, refreshed with its load snapshot), "
        "and ran no forward step (realtime_tokens_total did not move), all engines answering "
        "their scrapes.",
    ),
    "PDPrefillKVPinned": (
        "A prefill room holds its KV past the inflight timeout. Run: "
        f"{RUN} verify --env-dir {{env}}; then {TRIAGE}",
        "{pd_instance}'s oldest room in the inflight queue (its KV sent or being sent, waiting "
        "for decode to conclude) has waited {value0} s: longer than "
        "SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT + 60s, which should have failed it and "
        "released its KV.",
    ),
    "PDDecodeTransferQueueStuck": (
        "A decode room waits for its KV past the waiting timeout. Run: "
        f"{RUN} verify --env-dir {{env}}; then {TRIAGE}",
        "{pd_instance}'s oldest room in the transfer queue has waited {value0} s for its KV: "
        "longer than SGLANG_DISAGGREGATION_WAITING_TIMEOUT + 60s, which should have failed it.",
    ),
    "PDDecodePreallocQueueStuck": (
        "A decode room waits to be admitted while decode runs no step. Run: "
        f"{RUN} verify --env-dir {{env}}; then {TRIAGE}",
        "{pd_instance}'s oldest room in the prealloc queue has waited {value0} s to bootstrap "
        "or for KV space, longer than prefill's SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT + 60s, "
        "and decode ran no decode step in that time (realtime_tokens_total).",
    ),
    "PDTokensHeldAfterTraffic": (
        f"KV tokens still used after the traffic stopped. Run: {RUN} metrics --env-dir {{env}}; "
        f"then {RUN} probe --env-dir {{env}}",
        "{pd_instance} still uses {value} KV tokens (sglang:pd_used_tokens) although it holds "
        "no request, running, waiting or in a PD queue, and has run no forward step for 300s.",
    ),
    "PDQueueMetricsFailing": (
        f"An engine's PD queue gauges are not refreshed. Run: {RUN} logs {{pd_instance}} "
        f"--env-dir {{env}}; then {RUN} probe --env-dir {{env}}",
        "{pd_instance} failed to refresh its PD queue gauges "
        "(sglang:pd_queue_metrics_errors_total) in the last 60s: they read NaN until a refresh "
        "succeeds, so the queue alerts cannot see its rooms meanwhile. Its log has the error "
        "(`PD queue metrics not refreshed`).",
    ),
    "PDSchedulerStalled": (
        f"An engine's scheduler stands still while its HTTP server answers. Run: {TRIAGE}; "
        f"then {RUN} probe --env-dir {{env}}",
        "{pd_instance} ({instance}) answers its scrape, and its scheduler has added no idle or "
        "stage time (sglang:scheduler_idle_seconds_total, sglang:scheduler_stage_seconds_total) "
        "for 120s: a running scheduler adds to them every second, busy or idle. Its /health "
        "answers 503 once its load snapshot is older than SGLANG_HEALTH_SCHEDULER_STALL_S (patch "
        "0033), and the router then stops routing to it; with that check off, /health keeps "
        "passing.",
    ),
    "PDInstanceDown": (
        f"A {{pd_role}} instance does not answer its scrape. Run: {RUN} status --env-dir {{env}}; "
        f"then {RUN} logs {{pd_instance}} --env-dir {{env}}",
        "{pd_instance} ({instance}) has not answered Prometheus for 120s, with no maintenance "
        "mark from launch/pd.",
    ),
    "PDTargetsAbsent": (
        f"Prometheus has no {{pd_role}} target for this stack. Run: {RUN} monitoring --env-dir "
        "{env} --out DIR --force, and compare DIR/targets with the files Prometheus reads",
        "Job sm120pd-cpu-{pd_role} has no target: its file_sd file is missing or empty, so "
        "nothing about the {pd_role} instances can alert.",
    ),
    "PDInstanceFlapping": (
        f"An instance keeps going down and coming back. Run: {RUN} status --env-dir {{env}}; "
        f"then {RUN} logs {{pd_instance}} --env-dir {{env}}",
        "{pd_instance} ({instance}) changed between answering and not answering its scrape "
        "{value} times in 900s, none of it under a maintenance mark: a crash loop can answer "
        "one scrape per cycle and never stay down long enough for PDInstanceDown.",
    ),
    "PDInstanceNotRouted": (
        f"An engine answers, but the router does not route to it. Run: {RUN} probe --env-dir "
        "{env}",
        "{pd_instance} ({worker}) answers its scrape, and the router has not listed it as a "
        "healthy worker for 240s, with no maintenance mark from launch/pd.",
    ),
    "PDKnobDrift": (
        "A knob or the build in a live process differs from the env files. Run: "
        f"{RUN} verify --env-dir {{env}}",
        "The last launch/pd verify --textfile failed its {layer} check{of_instance}"
        "{for_variable}: the live process or the installed build is not what the env files and "
        "this checkout say.",
    ),
    "PDVerifyCheckFailed": (
        "launch/pd verify could not pass a health, listen or access check. Run: "
        f"{RUN} verify --env-dir {{env}}",
        "The last launch/pd verify --textfile failed its {layer} check of {pd_instance}: an "
        "instance that does not answer, a port on an address the env files do not name, or a "
        "process whose environment it could not read.",
    ),
    "PDVerifyStale": (
        f"No recent launch/pd verify result for this stack. Run: {RUN} verify --env-dir {{env}} "
        "--textfile, and check its cron job or timer",
        "The newest verify result Prometheus has for sm120pd-cpu is older than 3600s, or there "
        "is none: PDKnobDrift cannot fire on results that do not arrive.",
    ),
}


def expect_in(rule: dict, labels: dict, value: str, env: Path) -> dict:
    """The alert promtool must see: the series' labels (without the name, without empty ones),
    the rule's labels, and its annotations as ANNOTATIONS writes them."""
    full = {k: v for k, v in labels.items() if v != ""} | rule["labels"]
    fill = {"pd_instance": "", "instance": "", "worker": "", "layer": "", "pd_role": ""} | full
    fill |= {
        "root": str(ROOT),
        "env": str(env),
        "value": value,
        "value0": f"{float(value):.0f}",
        "of_instance": f" of {full['pd_instance']}" if full.get("pd_instance") else "",
        "for_variable": f" for {full['variable']}" if full.get("variable") else "",
    }
    summary, description = ANNOTATIONS[rule["alert"]]
    return {
        "exp_labels": full,
        "exp_annotations": {
            "summary": summary.format(**fill),
            "description": description.format(**fill),
        },
    }


def case(name: str, inputs: list[dict], *checks: tuple[str, int, list[dict]]) -> dict:
    """One promtool test: the input series, and for each (alert, time, alerts) the alerts of
    that name that must be firing then (none: silent)."""
    return {
        "name": name,
        "interval": f"{STEP_S}s",
        "input_series": inputs,
        "alert_rule_test": [
            {"eval_time": f"{at}s", "alertname": alert, "exp_alerts": fired}
            for alert, at, fired in checks
        ],
    }


def changes(values: list[float], index: int, window: int) -> int:
    """changes(x[window]) at sample index, from series notation's samples STEP_S apart; the
    same whether the range includes its left end (Prometheus 2) or not (3), else an error."""
    n = window // STEP_S
    counts = {
        sum(values[i] != values[i - 1] for i in range(max(lo, 0) + 1, index + 1))
        for lo in (index - n, index - n + 1)
    }
    assert len(counts) == 1, "pick an index whose window does not start on a change"
    return counts.pop()


def rule_cases(rules: list[dict], health: dict[str, int], env: Path) -> list[dict]:
    def expect(rule: dict, labels: dict, value: str) -> dict:
        return expect_in(rule, labels, value, env)

    by = by_key(rules)
    cases = []

    # Router holding requests in front of idle engines.
    rule = by[("PDRequestsStuckBeforeIdleEngines", None)]
    alert, wait = rule["alert"], seconds(rule["for"])
    steps = (wait + 300) // STEP_S
    at = wait + 180

    def calls(n: float) -> list[dict]:
        """smg's calls out to each engine (a PD request makes one to each)."""
        return [series("up", ROUTER, flat(1, steps))] + [
            series("smg_worker_requests_active", ROUTER | {"worker": e["worker"]}, flat(n, steps))
            for e in (PREFILL, DECODE)
        ]

    def idle(sep: str = COLON, tokens=100, **decode) -> list[dict]:
        return engine(PREFILL, steps, sep=sep, tokens=tokens) + engine(
            DECODE, steps, sep=sep, tokens=tokens, **decode
        )

    fired = [expect(rule, {}, "2")]
    cases += [
        case(
            "stuck: fires with no step counter series at all (none since the engines started)",
            calls(1) + idle(tokens=None),
            (alert, at, fired),
        ),
        case(
            "stuck: fires with the step counters flat (OpenMetrics names)",
            calls(1) + idle(OPENMETRICS),
            (alert, at, fired),
        ),
        case(
            "stuck: decode runs a request",
            calls(1) + idle(requests={"running": 1}),
            (alert, at, []),
        ),
        case(
            "stuck: a room in decode's transfer queue",
            calls(1) + idle(requests={"decode_transfer": 1}, oldest={"decode_transfer": 40}),
            (alert, at, []),
        ),
        case(
            "stuck: decode runs steps (OpenMetrics names)",
            calls(1)
            + idle(OPENMETRICS, tokens=None)
            + [
                series(
                    "sglang_realtime_tokens_total", sg(DECODE) | {"mode": "decode"}, f"0+8x{steps}"
                )
            ],
            (alert, at, []),
        ),
        case("stuck: decode down is not idle", calls(1) + idle(up=0), (alert, at, [])),
        case("stuck: the router holds nothing", calls(0) + idle(), (alert, at, [])),
    ]

    # The oldest room of each PD queue (patch 0025), past its timeout and the slack.
    def queue_cases(key: str, queue: str, eng: dict, other: dict, timeout_name: str):
        rule = by[(key, None)]
        alert, window = rule["alert"], int(limit(rule))
        timeout = window - 60
        steps = (3 * window) // STEP_S
        at = window + 60
        stuck = {"requests": {queue: 1}, "oldest": {queue: f"0+{STEP_S}x{steps}"}}
        failed = {"requests": {queue: 1}, "oldest": {queue: sawtooth(timeout + STEP_S, steps)}}
        rest = [e for e in (PREFILL, DECODE) if e["pd_role"] != eng["pd_role"]]
        others = [s for e in rest for s in engine(e, steps)]
        fired = [expect(rule, sg(eng) | {"queue": queue}, f"{at}")]
        out = [
            case(
                f"{queue}: a room's age grows past the window; rooms failed by "
                f"{timeout_name} next to it do not fire",
                engine(eng, steps, tokens=None, **stuck)
                + engine(other, steps, tokens=None, **failed)
                + others,
                (alert, window, []),
                (alert, at, fired),
                (alert, 2 * window, [expect(rule, sg(eng) | {"queue": queue}, f"{2 * window}")]),
            ),
            case(
                f"{queue}: the same under OpenMetrics names",
                engine(eng, steps, sep=OPENMETRICS, **stuck)
                + engine(other, steps, sep=OPENMETRICS, **failed),
                (alert, at, fired),
            ),
            case(
                f"{queue}: one room failed by {timeout_name}, the queue empty since",
                engine(
                    eng,
                    steps,
                    requests={queue: f"1x{timeout // STEP_S} 0x{steps}"},
                    oldest={queue: f"0+{STEP_S}x{timeout // STEP_S} 0x{steps}"},
                ),
                (alert, at, []),
                (alert, 2 * window, []),
            ),
        ]
        return rule, out, steps, at, stuck, fired

    _, out, *_ = queue_cases(
        "PDPrefillKVPinned", "prefill_inflight", PREFILL, PREFILL2, "the inflight timeout"
    )
    cases += out
    rule, out, *_ = queue_cases(
        "PDDecodeTransferQueueStuck", "decode_transfer", DECODE, DECODE2, "the waiting timeout"
    )
    cases += out
    steps, at = (3 * int(limit(rule))) // STEP_S, int(limit(rule)) + 60
    cases.append(
        case(
            "decode_transfer: fires while decode runs steps for other requests",
            engine(
                DECODE,
                steps,
                requests={"decode_transfer": 1, "running": 3},
                oldest={"decode_transfer": f"0+{STEP_S}x{steps}"},
                tokens=f"0+40x{steps}",
            ),
            (rule["alert"], at, [expect(rule, sg(DECODE) | {"queue": "decode_transfer"}, f"{at}")]),
        )
    )
    rule, out, steps, at, stuck, fired = queue_cases(
        "PDDecodePreallocQueueStuck", "decode_prealloc", DECODE, DECODE2, "the bootstrap timeout"
    )
    cases += out
    alert = rule["alert"]
    cases += [
        case(
            "decode_prealloc: fires with decode's step counter flat",
            engine(DECODE, steps, tokens=500, **stuck),
            (alert, at, fired),
        ),
        case(
            "decode_prealloc: busy decode (its step counter moving) is silent",
            engine(DECODE, steps, tokens=f"500+40x{steps}", **stuck),
            (alert, at, []),
        ),
        case(
            "decode_prealloc: busy decode under OpenMetrics names is silent",
            engine(DECODE, steps, sep=OPENMETRICS, tokens=f"500+40x{steps}", **stuck),
            (alert, at, []),
        ),
        case(
            "decode_prealloc: another decode's steps do not silence this one",
            engine(DECODE, steps, tokens=500, **stuck)
            + engine(DECODE2, steps, tokens=f"500+40x{steps}"),
            (alert, at, fired),
        ),
        case(
            "decode_prealloc: busy decode whose step counter's spelling changes mid-window "
            "(a Prometheus or client upgrade) is silent",
            engine(DECODE, steps, tokens=None, **stuck)
            + switched_spelling(
                DECODE, "realtime_tokens_total", {"mode": "decode"}, steps, 40, at // STEP_S - 2
            ),
            (alert, at, []),
        ),
        case(
            "decode_prealloc: a flat step counter whose spelling changes mid-window still fires",
            engine(DECODE, steps, tokens=None, **stuck)
            + switched_spelling(
                DECODE, "realtime_tokens_total", {"mode": "decode"}, steps, 0, at // STEP_S - 2
            ),
            (alert, at, fired),
        ),
    ]

    # KV tokens still used after the traffic stopped.
    rule = by[("PDTokensHeldAfterTraffic", None)]
    alert, wait = rule["alert"], seconds(rule["for"])
    steps, at = 3 * wait // STEP_S, 2 * wait + 60
    fired = [expect(rule, sg(PREFILL), "64")]
    cases += [
        case(
            "held: fires with the step counters flat (OpenMetrics names); decode next to it "
            "freed its tokens",
            engine(PREFILL, steps, sep=OPENMETRICS, used=64)
            + engine(DECODE, steps, sep=OPENMETRICS),
            (alert, at, fired),
        ),
        case(
            "held: fires with no step counter series at all",
            engine(PREFILL, steps, used=64, tokens=None) + engine(DECODE, steps, tokens=None),
            (alert, at, fired),
        ),
        case("held: freed", engine(PREFILL, steps, used=0), (alert, at, [])),
        case(
            "held: a request still running",
            engine(PREFILL, steps, used=64, requests={"running": 1}),
            (alert, at, []),
        ),
        case(
            "held: a room still in prefill's inflight queue",
            engine(PREFILL, steps, used=64, requests={"prefill_inflight": 1}),
            (alert, at, []),
        ),
        case(
            "held: forward steps within the window",
            engine(PREFILL, steps, used=64, tokens=f"100+16x{steps}"),
            (alert, at, []),
        ),
    ]

    # PD queue gauges whose refresh fails (patch 0025 counts each failure).
    rule = by[("PDQueueMetricsFailing", None)]
    alert = rule["alert"]
    steps = 40
    errors = "sglang{}pd_queue_metrics_errors_total"
    # Failing from 150 s to 300 s (a failure per 15 s scrape), then refreshed again.
    failing = f"0x10 1+1x10 {flat(11, steps - 20)}"
    fired = [expect(rule, sg(DECODE), "4")]
    cases += [
        case(
            "queue metrics: fires while decode's refreshes fail, resolves a window after",
            [
                series(errors.format(OPENMETRICS), sg(PREFILL), flat(0, steps)),
                series(errors.format(OPENMETRICS), sg(DECODE), failing),
            ],
            (alert, 120, []),
            (alert, 240, fired),
            (alert, 300 + 60 + 15, []),
        ),
        case(
            "queue metrics: fires under sglang's own spelling too",
            [series(errors.format(COLON), sg(DECODE), failing)],
            (alert, 240, fired),
        ),
    ]

    # A scheduler whose time counters stand still while its engine answers its scrape.
    rule = by[("PDSchedulerStalled", None)]
    (window,) = ranges(rule)
    steps = 3 * window // STEP_S
    at = 2 * window

    def scheduler(eng: dict, values: str, sep: str = OPENMETRICS) -> list[dict]:
        """The two counters as sglang labels them: idle, and stage by category (idle among
        them) and forward overlap; `values` for idle and the idle stage, run_batch flat."""
        labels = sg(eng)
        stage = f"sglang{sep}scheduler_stage_seconds_total"
        return [
            series(f"sglang{sep}scheduler_idle_seconds_total", labels, values),
            series(stage, labels | {"category": "idle", "forward_overlap": "none"}, values),
            series(stage, labels | {"category": "run_batch", "forward_overlap": "none"}, "3x99"),
        ]

    def switched_scheduler(step: int) -> list[dict]:
        """Decode's two counters (idle, and the idle stage) changing spelling 30 s before `at`,
        inside the window, each adding `step` per sample throughout."""
        idle_stage = {"category": "idle", "forward_overlap": "none"}
        switch = at // STEP_S - 2
        return switched_spelling(
            DECODE, "scheduler_idle_seconds_total", {}, steps, step, switch
        ) + switched_spelling(
            DECODE, "scheduler_stage_seconds_total", idle_stage, steps, step, switch
        )

    running = f"0+15x{steps}"
    up = [series("up", PREFILL, flat(1, steps)), series("up", DECODE, flat(1, steps))]
    stopped = [expect(rule, sg(DECODE), "0")]
    # Stopped at 150 s, looked at 90 s later: shorter than the window.
    short = f"0+15x10 {flat(150, steps)}"
    cases += [
        case(
            "stalled: fires for decode, not for prefill next to it",
            up + scheduler(PREFILL, running) + scheduler(DECODE, flat(500, steps)),
            (rule["alert"], at, stopped),
        ),
        case(
            "stalled: fires under sglang's own spelling too",
            up + scheduler(DECODE, flat(500, steps), COLON),
            (rule["alert"], at, stopped),
        ),
        case(
            "stalled: a stop shorter than the window",
            up + scheduler(PREFILL, running) + scheduler(DECODE, short),
            (rule["alert"], 150 + window - 30, []),
        ),
        case(
            "stalled: a failing scrape is PDInstanceDown's",
            [series("up", DECODE, flat(0, steps))] + scheduler(DECODE, flat(500, steps)),
            (rule["alert"], at, []),
        ),
        case(
            "stalled: a running scheduler whose counters change spelling mid-window is silent",
            up + switched_scheduler(15),
            (rule["alert"], at, []),
        ),
        case(
            "stalled: a stopped one whose counters change spelling mid-window still fires",
            up + switched_scheduler(0),
            (rule["alert"], at, [expect(rule, sg(DECODE), "0")]),
        ),
    ]

    # An instance down; a restart that comes back in time; a planned one under a mark.
    roles = (("prefill", PREFILL), ("decode", DECODE), ("router", ROUTER))
    for kind, labels in roles:
        rule = by[("PDInstanceDown", kind)]
        alert, wait = rule["alert"], seconds(rule["for"])
        # launch/pd's mark while it restarts the instance: its start + the health timeout + a
        # minute (maintenance.MARGIN_S).
        until = STEP_S + health[kind] + 60
        steps = (until + wait + 120) // STEP_S
        at = wait + 120
        fired = [expect(rule, labels, "0")]
        # Down from 15 s to 180 s (165 s, past the wait), back at 195 s.
        outage = f"1 0x11 1x{steps}"
        cases += [
            case(f"down {kind}: fires", [series("up", labels, f"1 0x{steps}")], (alert, at, fired)),
            case(
                f"down {kind}: fires under an in-service mark (0)",
                [series("up", labels, f"1 0x{steps}"), mark(labels, flat(0, steps))],
                (alert, at, fired),
            ),
            case(
                f"down {kind}: restarted in time",
                [series("up", labels, f"1 0x{(wait - 60) // STEP_S} 1x{steps}")],
                (alert, at, []),
            ),
            case(
                f"down {kind}: a planned restart under a mark",
                [series("up", labels, outage), mark(labels, f"0 {until}x11 0x{steps}")],
                (alert, 180, []),
            ),
            case(
                f"down {kind}: the same outage without a mark",
                [series("up", labels, outage), mark(labels, flat(0, steps))],
                (alert, 180, fired),
            ),
            case(
                f"down {kind}: still down when the mark runs out (launch/pd died half-way)",
                [series("up", labels, f"1 0x{steps}"), mark(labels, f"0 {until}x{steps}")],
                (alert, until + wait - 30, []),
                (alert, until + wait + 15, fired),
            ),
        ]
    rule = by[("PDInstanceDown", "decode")]
    cases.append(
        case(
            "down decode: stopped on purpose (mark +Inf)",
            [series("up", DECODE, "1 0x80"), mark(DECODE, "0 " + " ".join(["Inf"] * 80))],
            (rule["alert"], 1200, []),
        )
    )

    # Crash loops, and planned restarts that look like one.
    rule = by[("PDInstanceFlapping", None)]
    alert, (window,) = rule["alert"], ranges(rule)
    down_rules = [r for r in rules if r["alert"] == "PDInstanceDown"]
    down_wait = max(seconds(r["for"]) for r in down_rules)
    down = next(r for r in down_rules if r["labels"]["pd_role"] == "decode")
    # Healthy for 10 minutes, then a crash loop that answers one scrape in seven: down 90 s at a
    # time, never as long as PDInstanceDown waits.
    assert 6 * STEP_S < down_wait
    loop = [1.0] * 40 + ([0.0] * 6 + [1.0]) * 12
    index = 40 + 7 * 10 - 1  # the last down sample of the tenth cycle
    value = changes(loop, index, window)
    assert value >= 4
    healthy = [series("up", e, flat(1, len(loop))) for e in (PREFILL, ROUTER)]
    in_service = [mark(e, flat(0, len(loop))) for e in (PREFILL, DECODE, ROUTER)]
    cases.append(
        case(
            "flapping: a crash loop answering one scrape a cycle fires, PDInstanceDown does not",
            healthy + in_service + [series("up", DECODE, listed(loop))],
            (alert, index * STEP_S, [expect(rule, DECODE, f"{value}")]),
            (down["alert"], index * STEP_S, []),
        )
    )
    # Two restarts of decode 6 minutes apart, down 3 minutes each.
    twice = [1.0] * 40 + [0.0] * 12 + [1.0] * 12 + [0.0] * 12 + [1.0] * 30
    marks = [0.0] * len(twice)
    for start in (40, 64):
        until = start * STEP_S + health["decode"] + 60
        marks[start : start + 12] = [until] * 12
    assert changes(twice, 80, window) == 4
    inputs = healthy + [series("up", DECODE, listed(twice))]
    others = [mark(e, flat(0, len(twice))) for e in (PREFILL, ROUTER)]
    cases += [
        case(
            "flapping: two planned restarts under marks",
            inputs + others + [mark(DECODE, listed(marks))],
            (down["alert"], 75 * STEP_S, []),
            (alert, 80 * STEP_S, []),
            (alert, 100 * STEP_S, []),
        ),
        case(
            "flapping: the same outages without a mark",
            inputs + others + [mark(DECODE, flat(0, len(twice)))],
            (down["alert"], 75 * STEP_S, [expect(down, DECODE, "0")]),
            (alert, 80 * STEP_S, [expect(rule, DECODE, "4")]),
        ),
        case(
            "flapping: steady instances",
            [series("up", e, flat(1, 100)) for e in (PREFILL, DECODE, ROUTER)],
            (alert, 1200, []),
        ),
    ]

    # An engine the router does not route to.
    for kind, labels in (("prefill", PREFILL), ("decode", DECODE)):
        rule = by[("PDInstanceNotRouted", kind)]
        alert, wait = rule["alert"], seconds(rule["for"])
        steps = (wait + 600) // STEP_S
        at = wait + 300
        other = PREFILL if labels is DECODE else DECODE
        up = [series("up", labels, flat(1, steps)), series("up", ROUTER, flat(1, steps))]
        health_of = series(
            "smg_worker_health", ROUTER | {"worker": other["worker"]}, flat(1, steps)
        )
        in_rotation = series(
            "smg_worker_health", ROUTER | {"worker": labels["worker"]}, flat(1, steps)
        )
        router_down = [series("up", labels, flat(1, steps)), series("up", ROUTER, flat(0, steps))]
        cases += [
            case(
                f"unrouted {kind}: fires",
                up + [health_of, mark(labels, flat(0, steps))],
                (alert, at, [expect(rule, labels, "1")]),
            ),
            case(f"unrouted {kind}: listed", up + [health_of, in_rotation], (alert, at, [])),
            case(f"unrouted {kind}: router down", router_down + [health_of], (alert, at, [])),
            case(
                f"unrouted {kind}: out of rotation under a mark (rolling restart)",
                up + [health_of, mark(labels, flat(at + 600, steps))],
                (alert, at, []),
            ),
        ]

    # A job with no target at all.
    for kind, labels in roles:
        rule = by[("PDTargetsAbsent", kind)]
        alert, wait = rule["alert"], seconds(rule["for"])
        others = [series("up", e, flat(1, 20)) for _, e in roles if e is not labels]
        fired = [expect(rule, {"job": JOB[kind]}, "1")]
        cases.append(case(f"absent {kind}: no {kind} target", others, (alert, wait + 15, fired)))
    rule = by[("PDTargetsAbsent", "decode")]
    alert, wait = rule["alert"], seconds(rule["for"])
    everyone = [series("up", e, flat(1, 20)) for _, e in roles]
    emptied = [series("up", e, flat(1, 20)) for e in (PREFILL, ROUTER)]
    emptied.append(series("up", DECODE, "1x4 stale"))
    cases += [
        case("absent: every job has its target", everyone, (alert, wait + 15, [])),
        case(
            "absent decode: its targets file emptied (the series go stale)",
            emptied,
            (alert, 75 + wait - 15, []),
            (alert, 75 + wait + 15, [expect(rule, {"job": JOB["decode"]}, "1")]),
        ),
    ]

    # launch/pd verify --textfile's results: knob drift apart from checks that failed.
    drift = by[("PDKnobDrift", None)]
    failed = by[("PDVerifyCheckFailed", None)]
    stale = by[("PDVerifyStale", None)]
    wait = max(seconds(r["for"]) for r in (drift, failed))
    at, steps = wait + 30, 10
    knob = {"pd_instance": "decode", "layer": "env", "variable": "SGLANG_SM120_MMA_TARGET_CTAS"}
    build = {"pd_instance": "", "layer": "build", "variable": ""}
    health_check = {"pd_instance": "decode", "layer": "health", "variable": ""}
    environ = {"pd_instance": "decode", "layer": "env", "variable": ""}
    listen = {"pd_instance": "router", "layer": "listen", "variable": ""}
    run = [
        {"pd_instance": name, "layer": layer, "variable": ""}
        for name in ("prefill", "decode", "router")
        for layer in ("health", "listen")
    ]
    run += [
        {
            "pd_instance": "prefill",
            "layer": "env",
            "variable": "SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT",
        },
        knob,
        build,
    ]

    def verify(bad: dict | None, stack: str = STACK) -> list[dict]:
        """One verify run's textfile: every check, bad (if any) failed, and when it ran."""
        own = TEXTFILE | {"stack": stack}
        out = [
            series("sm120pd_verify_check_ok", own | c, flat(0 if c == bad else 1, steps))
            for c in [*run, *([bad] if bad and bad not in run else [])]
        ]
        out.append(series("sm120pd_verify_last_run_timestamp_seconds", own, flat(0, steps)))
        return out

    def labels_of(check: dict) -> dict:
        return TEXTFILE | {"stack": STACK} | check

    cases += [
        case(
            "verify: an env knob differs is drift, no failed check",
            verify(knob),
            (drift["alert"], at, [expect(drift, labels_of(knob), "0")]),
            (failed["alert"], at, []),
        ),
        case(
            "verify: the installed build differs is drift",
            verify(build),
            (drift["alert"], at, [expect(drift, labels_of(build), "0")]),
            (failed["alert"], at, []),
        ),
        case(
            "verify: a failed health check is no drift",
            verify(health_check),
            (drift["alert"], at, []),
            (failed["alert"], at, [expect(failed, labels_of(health_check), "0")]),
        ),
        case(
            "verify: an environment it could not read (permission) is no drift",
            verify(environ),
            (drift["alert"], at, []),
            (failed["alert"], at, [expect(failed, labels_of(environ), "0")]),
        ),
        case(
            "verify: a port on an address the env files do not name",
            verify(listen),
            (drift["alert"], at, []),
            (failed["alert"], at, [expect(failed, labels_of(listen), "0")]),
        ),
        case(
            "verify: every check passed",
            verify(None),
            (drift["alert"], at, []),
            (failed["alert"], at, []),
            (stale["alert"], at, []),
        ),
        case(
            "verify: another stack's failures",
            verify(None) + verify(knob, "sm120pd-other") + verify(health_check, "sm120pd-other"),
            (drift["alert"], at, []),
            (failed["alert"], at, []),
        ),
    ]

    # No recent verify result.
    alert, wait, after = stale["alert"], seconds(stale["for"]), int(limit(stale))
    last = "sm120pd_verify_last_run_timestamp_seconds"
    ours = TEXTFILE | {"stack": STACK}
    steps = (after + 300) // STEP_S
    late = after + wait + 30
    half_hourly = listed([1800 * (i * STEP_S // 1800) for i in range(steps + 1)])
    cases += [
        case(
            "verify stale: no result at all",
            [series("up", e, flat(1, 10)) for _, e in roles],
            (alert, wait + 15, [expect(stale, {"stack": STACK}, "1")]),
        ),
        case(
            "verify stale: only another stack's results",
            [series(last, TEXTFILE | {"stack": "sm120pd-other"}, flat(0, 10))],
            (alert, wait + 15, [expect(stale, {"stack": STACK}, "1")]),
        ),
        case(
            f"verify stale: the last run older than {after} s",
            [series(last, ours, flat(0, steps))],
            (alert, after, []),
            (alert, late, [expect(stale, {"stack": STACK}, f"{late}")]),
        ),
        case(
            "verify stale: a run every half hour",
            [series(last, ours, half_hourly)],
            (alert, late, []),
            (alert, steps * STEP_S, []),
        ),
    ]
    return cases


# ---- PDDecodeKVQuarantined, its expectations written out here rather than read from the rule ----

QUARANTINE_SINCE = "decode_kv_quarantine_oldest_timestamp_seconds"


def quarantined(eng: dict, values: str, sep: str = COLON) -> dict:
    """decode's KV quarantine (patch 0024): the Unix time its oldest room entered, 0 when none."""
    return series(f"sglang{sep}{QUARANTINE_SINCE}", sg(eng), values)


def quarantine_alert(env: Path, eng: dict, age: str) -> dict:
    """PDDecodeKVQuarantined for eng's quarantine, its oldest room age seconds in."""
    name, pd, triage = eng["pd_instance"], f"{ROOT}/launch/pd", f"{ROOT}/bench/triage"
    return {
        "exp_labels": sg(eng) | {"severity": "critical"},
        "exp_annotations": {
            "summary": f"A decode room's KV stays quarantined. Run: {pd} logs {name} "
            f"--env-dir {env}, whose KV quarantine lines name the prefill; then {triage} "
            f"--env-dir {env}",
            "description": f"{name} has held a room in its KV quarantine for {age} s: longer "
            "than monitoring's --quarantine-after (360s). The room's pages stay out of "
            "decode's free list until prefill acknowledges its abort (after it proved its "
            "writes to them drained) or is proven gone (decode's heartbeat declares it lost, "
            "or sees a new prefill instance id at the same bootstrap address). The default, "
            "360s, covers a prefill hung in a forward (sglang's --watchdog-timeout, 300 s, ends "
            "that process) plus decode's heartbeat. A prefill stopped whole (SIGSTOP of its "
            "process group, a frozen VM) holds the room as long as it is stopped: nothing can "
            "prove its writes stopped.",
        },
    }


def quarantine_cases(env: Path) -> list[dict]:
    """A room enters decode's quarantine at 600 s (time() then is 600) and leaves at 1200 s;
    the bound is 360 s, so the alert fires from 975 s (age 375) to 1185 s, not at 960 s (age
    360, not past the bound), and not while the gauge is 0 although time() - 0 is past it."""
    alert = "PDDecodeKVQuarantined"
    held = "0x39 600x39 0x20"  # 0 at 0-585 s, 600 at 600-1185 s, 0 at 1200-1500 s
    empty = "0x100"
    return [
        case(
            "quarantine: a room held past 360 s fires until it leaves; another decode's empty "
            "quarantine does not",
            [quarantined(DECODE, held), quarantined(DECODE2, empty)],
            (alert, 585, []),
            (alert, 960, []),
            (alert, 975, [quarantine_alert(env, DECODE, "375")]),
            (alert, 1185, [quarantine_alert(env, DECODE, "585")]),
            (alert, 1215, []),
            (alert, 1500, []),
        ),
        case(
            "quarantine: the same under OpenMetrics names, with decode busy",
            engine(DECODE, 100, sep=OPENMETRICS, requests={"running": 3}, tokens="0+40x100")
            + [quarantined(DECODE, held, OPENMETRICS)],
            (alert, 960, []),
            (alert, 975, [quarantine_alert(env, DECODE, "375")]),
            (alert, 1215, []),
        ),
        case(
            "quarantine: a room that leaves within 360 s",
            [quarantined(DECODE, "0x39 600x20 0x40")],
            (alert, 900, []),
            (alert, 975, []),
        ),
        case("quarantine: none ever", [quarantined(DECODE, empty)], (alert, 1500, [])),
    ]


def health_timeouts(env: Path) -> dict[str, int]:
    stack = load_stack(env, sim=False)
    return {
        kind: int(max(r.health_timeout_s for r in stack.of_kind(kind)))
        for kind in monitoring.ROLE_KINDS
    }


def test_every_alert_fires_on_its_failing_series_and_not_on_healthy_ones(
    rendered: Path, marked_env: Path, tmp_path: Path
):
    rules = rules_of(rendered)
    cases = rule_cases(rules, health_timeouts(marked_env), marked_env.resolve())
    cases += quarantine_cases(marked_env.resolve())
    names = [c["name"] for c in cases]
    assert len(names) == len(set(names)), Counter(names)
    tested = {t["alertname"] for c in cases for t in c["alert_rule_test"]}
    assert tested == {r["alert"] for r in rules}
    # Each rule (one per role for some alerts) has a case in which it fires.
    fired = Counter(t["alertname"] for c in cases for t in c["alert_rule_test"] if t["exp_alerts"])
    assert fired >= Counter(r["alert"] for r in rules), fired
    # Both spellings of sglang's names are in the inputs.
    inputs = {s["series"].split("{")[0] for c in cases for s in c["input_series"]}
    for name in (
        "pd_queue_oldest_seconds",
        "pd_queue_requests",
        "realtime_tokens_total",
        QUARANTINE_SINCE,
    ):
        assert {f"sglang:{name}", f"sglang_{name}"} <= inputs, name
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
    # sglang's series, under either spelling (sglang[:_]NAME, or each spelling in its own
    # range function), follow the instance variable.
    engine_panels = [p for p in panels if any("sglang" in t["expr"] for t in p.get("targets", []))]
    assert len(engine_panels) >= 6
    for panel in engine_panels:
        for target in panel["targets"]:
            expr = target["expr"]
            for name in monitoring.metric_names(expr):
                if name.startswith("sglang:"):
                    bare = name.removeprefix("sglang:")
                    either = f"sglang[:_]{bare}" in expr
                    assert either or f"sglang_{bare}{{" in expr, (name, expr)
            assert 'pd_instance=~"$pd_instance"' in expr, expr


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
    window = 600 + 60  # no inflight timeout: the alert waits 600 s, + the slack
    assert (
        "note: SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT is not set for prefill; "
        f"PDPrefillKVPinned waits {window:g} s"
    ) in done.stdout
    (pinned,) = [r for r in rules_of(out) if r["alert"] == "PDPrefillKVPinned"]
    assert limit(pinned) == window and seconds(pinned["for"]) == 0
    assert "is not set in the env files, so nothing bounds such a room" in str(pinned)
