"""The whole stack on loopback: simulated engines behind the real smg router, driven by pd."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import psutil
from launch_harness import ROOT, SECRET, SimStack, kill_all, processes_using, set_values
from prometheus_client.parser import text_string_to_metric_families

from launch.pdlib import envfiles


def get_json(url: str, key: str = ""):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def chat(url: str, max_tokens: int, key: str = SECRET, timeout: float = 30.0):
    body = json.dumps(
        {
            "model": "deepseek-v4-flash",
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello " * 50}],
        }
    ).encode()
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def assert_no_secret(done):
    assert SECRET not in done.stdout + done.stderr


def test_co_restart_restarts_in_order_then_verifies_and_probes(sim_stack: SimStack):
    old = {role: sim_stack.pid(role) for role in ("prefill", "decode", "router")}
    done = sim_stack.pd("co-restart")
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert_no_secret(done)
    order = [out.index(f"[{role}] healthy after") for role in ("prefill", "decode", "router")]
    assert order == sorted(order)
    assert "seen " in out and "after it reported ready" in out
    assert "ok   decode SGLANG_SM120_MMA_TARGET_CTAS=512 live in pid" in out
    assert "ok   prefill SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT=60 live in pid" in out
    assert "ok   patched build" in out
    assert "/v1/chat/completions: HTTP 200" in out and ", 16 completion tokens" in out
    assert "co-restart done" in out
    for role, pid in old.items():
        assert sim_stack.pid(role) != pid
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_router_pairs_prefill_and_decode_on_the_same_bootstrap_room(sim_stack: SimStack):
    router = sim_stack.url("router")
    for _ in range(3):
        status, body = chat(router, 4)
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 4
    prefill_rooms = [r["room"] for r in get_json(sim_stack.url("prefill") + "/sim/requests")]
    decode_rooms = [r["room"] for r in get_json(sim_stack.url("decode") + "/sim/requests")]
    assert len(decode_rooms) >= 3 and None not in decode_rooms
    assert set(decode_rooms[-3:]) <= set(prefill_rooms)
    assert len(set(decode_rooms[-3:])) == 3


def test_each_role_is_a_process_group_of_its_own_in_the_callers_session(sim_stack: SimStack):
    """Stopped as a group, scheduled with its caller: in a session of its own (its own autogroup
    under the kernel's autogroup scheduling) a nice-19 NIXL progress thread polling in an idle
    engine would take a whole group's share of the CPU (launch/pdlib/supervise.py)."""
    for role in ("prefill", "decode", "router"):
        pid = sim_stack.pid(role)
        assert os.getpgid(pid) == pid, role
        assert os.getsid(pid) == os.getsid(0), role


def test_verify_status_probe_metrics_report_a_healthy_stack_without_the_secret(sim_stack):
    for verb in ("verify", "status", "probe", "metrics"):
        done = sim_stack.pd(verb)
        assert done.returncode == 0, f"{verb}: {done.stdout}{done.stderr}"
        assert_no_secret(done)
    probe = sim_stack.pd("probe").stdout
    assert "HTTP 200 in" in probe and "decode load when sent: running=" in probe
    metrics = sim_stack.pd("metrics").stdout
    assert "decode: num_running_reqs=" in metrics and "router: " in metrics
    for role in ("prefill", "decode", "router"):
        logs = sim_stack.pd("logs", role)
        assert logs.returncode == 0 and logs.stdout
        assert_no_secret(logs)
    # The key reaches the sim (through sglang's --config) and smg (smg_keyfile.py) by files.
    everyone = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    assert SECRET not in everyone.stdout
    assert "--config" in psutil.Process(sim_stack.pid("decode")).cmdline()


def test_verify_fails_when_a_knob_is_only_in_the_file(sim_stack: SimStack):
    decode_env = sim_stack.env / "decode.env"
    before = decode_env.read_text()
    try:
        set_values(decode_env, SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="301")
        done = sim_stack.pd("verify")
        assert done.returncode == 1
        line = next(
            ln for ln in done.stdout.splitlines() if "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT" in ln
        )
        assert line.startswith("FAIL decode")
        assert "missing from the environment of pid" in line
        assert "ok   decode SGLANG_SM120_MMA_TARGET_CTAS=512" in done.stdout
    finally:
        decode_env.write_text(before)


def test_verify_names_a_socket_that_listens_beyond_its_instances_host(sim_stack: SimStack):
    """verify's listen layer: every socket of every instance's processes is on the host the env
    files give it. smg's Prometheus endpoint moved to every interface (a --prometheus-host in
    ROUTER_ARGS, which comes last and wins) fails the router's check, naming the process, the
    address and the port; the engines' checks still pass."""
    done = sim_stack.pd("verify")
    for role in ("prefill", "decode", "router"):
        assert f"ok   {role} listens only on {role.upper()}_HOST=127.0.0.1: " in done.stdout
    router_env = sim_stack.env / "router.env"
    before = router_env.read_text()
    prom = envfiles.EnvDir(sim_stack.env).common()["ROUTER_PROMETHEUS_PORT"]
    args = envfiles.EnvDir(sim_stack.env).role_env("router")["ROUTER_ARGS"]
    try:
        set_values(router_env, ROUTER_ARGS=envfiles.quote(f"{args} --prometheus-host 0.0.0.0"))
        moved = sim_stack.pd("restart", "router")
        assert moved.returncode == 0, moved.stdout + moved.stderr
        pid = sim_stack.pid("router")
        done = sim_stack.pd("verify")
    finally:
        router_env.write_text(before)
        back = sim_stack.pd("restart", "router")
    assert back.returncode == 0, back.stdout + back.stderr
    assert done.returncode == 1, done.stdout
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("FAIL router"))
    assert re.fullmatch(
        rf"FAIL router: 1 of 2 listening socket\(s\) not on ROUTER_HOST=127\.0\.0\.1: pid {pid} "
        rf"\(.+\) on 0\.0\.0\.0:{prom}/tcp \(every interface\)",
        line,
    ), line
    assert "ok   prefill listens only on" in done.stdout
    assert "ok   decode listens only on" in done.stdout


def test_verify_textfile_has_one_gauge_per_check_and_no_value(sim_stack: SimStack, tmp_path):
    """`verify --textfile PATH` (for node_exporter's textfile collector, and the knob-drift
    alert): a knob only in the file reads 0, a live one 1, labelled by instance, layer and
    variable; the file parses as the Prometheus text format and holds no value of any knob."""
    decode_env = sim_stack.env / "decode.env"
    before = decode_env.read_text()
    path = tmp_path / "sm120pd_verify.prom"
    try:
        set_values(decode_env, SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="301")
        done = sim_stack.pd("verify", "--textfile", str(path))
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"verify: results written to {path}" in done.stdout
    finally:
        decode_env.write_text(before)
    text = path.read_text()
    stack = envfiles.EnvDir(sim_stack.env).common()["PD_UNIT_PREFIX"]
    assert SECRET not in text
    # No knob's value in any form (decode.env's file 301, its live 512): a label value, a
    # sample or a comment would each hold the digits. The run's time alone may hold them.
    for line in text.splitlines():
        if not line.startswith("sm120pd_verify_last_run_timestamp_seconds{"):
            assert "301" not in line and "512" not in line, line
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    samples = {}
    for family in text_string_to_metric_families(text):
        assert family.type == "gauge", family
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def check(instance: str, layer: str, variable: str = "") -> float:
        labels = (
            ("layer", layer),
            ("pd_instance", instance),
            ("stack", stack),
            ("variable", variable),
        )
        return samples[("sm120pd_verify_check_ok", labels)]

    assert check("decode", "env", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT") == 0
    assert check("decode", "env", "SGLANG_SM120_MMA_TARGET_CTAS") == 1
    for role in ("prefill", "decode", "router"):
        assert check(role, "health") == 1
        assert check(role, "listen") == 1
    assert check("", "build") == 1
    assert samples[("sm120pd_verify_checks", (("result", "failed"), ("stack", stack)))] == 1
    ok = samples[("sm120pd_verify_checks", (("result", "ok"), ("stack", stack)))]
    assert ok == sum(v for (name, _), v in samples.items() if name == "sm120pd_verify_check_ok")
    stamp = samples[("sm120pd_verify_last_run_timestamp_seconds", (("stack", stack),))]
    assert abs(stamp - time.time()) < 120


def test_verify_textfile_in_a_missing_directory_is_refused_before_any_check(sim_stack, tmp_path):
    path = tmp_path / "nowhere" / "sm120pd_verify.prom"
    done = sim_stack.pd("verify", "--textfile", str(path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"verify: --textfile {path}: no directory {path.parent}" in done.stderr
    assert "ok   " not in done.stdout and not path.parent.exists()


def test_verify_textfile_with_no_path_writes_the_stacks_own_file_in_pd_textfile_dir(
    sim_stack: SimStack, tmp_path
):
    """`verify --textfile` with no PATH writes PD_TEXTFILE_DIR/sm120pd_verify_<PD_UNIT_PREFIX>
    .prom: the directory launch/pd writes its maintenance marks into, and a name per stack, so
    two stacks on one node_exporter keep their own results. A PATH that is not a .prom file (a
    target name taken for PATH) and no PD_TEXTFILE_DIR are refused before any check runs."""
    common = sim_stack.env / "common.env"
    before = common.read_text()
    prefix = envfiles.EnvDir(sim_stack.env).common()["PD_UNIT_PREFIX"]
    path = tmp_path / f"sm120pd_verify_{prefix}.prom"
    try:
        set_values(common, PD_TEXTFILE_DIR=str(tmp_path))
        done = sim_stack.pd("verify", "--textfile")
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"verify: results written to {path}" in done.stdout
        assert f'stack="{prefix}"' in path.read_text()
        named = sim_stack.pd("verify", "--textfile", "decode")
        assert named.returncode == 2, named.stdout + named.stderr
        assert "verify: --textfile decode: not a .prom file" in named.stderr
        assert "ok   " not in named.stdout and not (ROOT / "decode").exists()
        set_values(common, PD_TEXTFILE_DIR="")
        unset = sim_stack.pd("verify", "--textfile")
        assert unset.returncode == 2, unset.stdout + unset.stderr
        assert "which common.env does not set" in unset.stderr and "ok   " not in unset.stdout
    finally:
        common.write_text(before)


def test_verify_fails_on_plain_upstream_sglang_without_crashing(
    sim_stack: SimStack, tmp_path: Path
):
    done = run_with_plain_upstream_metadata(sim_stack, tmp_path, "verify")
    assert done.returncode == 1
    assert "FAIL patched build" in done.stdout
    assert "no sm120pd_manifest.json" in done.stdout
    assert "Traceback" not in done.stderr


def run_with_plain_upstream_metadata(stack: SimStack, tmp: Path, verb: str):
    """Run pd where importlib.metadata finds upstream's sglang dist-info (no manifest) first."""
    from launch_harness import run_pd

    info = tmp / "site" / "sglang-0.5.23.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.4\nName: sglang\nVersion: 0.5.23\n")
    return run_pd(
        verb, "--env-dir", str(stack.env), "--sim", env_extra={"PYTHONPATH": str(info.parent)}
    )


def test_co_restart_stops_at_a_role_that_never_gets_healthy(sim_stack: SimStack):
    decode_env = sim_stack.env / "decode.env"
    before = decode_env.read_text()
    router_pid = sim_stack.pid("router")
    try:
        set_values(decode_env, PD_SIM_STARTUP_S="3600")
        done = sim_stack.pd("co-restart", "--timeout", "3")
        assert done.returncode == 1
        assert "[prefill] healthy after" in done.stdout
        assert "[decode] healthy" not in done.stdout
        assert "decode: not healthy within 3 s (last: HTTP 503)" in done.stderr
        assert "last 30 lines of the decode log" in done.stderr
        assert "launch/pd starting decode" in done.stderr
        assert "co-restart stopped at decode" in done.stderr
        assert "[router]" not in done.stdout
        assert sim_stack.pid("router") == router_pid and psutil.pid_exists(router_pid)
        assert_no_secret(done)
    finally:
        decode_env.write_text(before)
    recovered = sim_stack.pd("co-restart")
    assert recovered.returncode == 0, recovered.stdout + recovered.stderr


def test_decode_killed_mid_stream_is_reported_and_co_restart_recovers(sim_stack: SimStack):
    port = int(sim_stack.values()["ROUTER_PORT"])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    body = json.dumps(
        {
            "model": "deepseek-v4-flash",
            "max_tokens": 3000,
            "stream": True,
            "messages": [{"role": "user", "content": "count"}],
        }
    )
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    chunks = []
    killed = threading.Event()
    deadline = time.time() + 30
    try:
        while time.time() < deadline:
            line = resp.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                chunks.append(line)
                if len(chunks) == 5 and not killed.is_set():
                    os.kill(sim_stack.pid("decode"), signal.SIGKILL)
                    killed.set()
    except (OSError, http.client.HTTPException):
        pass
    finally:
        conn.close()
    assert killed.is_set()
    # smg turns the broken upstream into an error event; no chunk ever finishes the request.
    events = [json.loads(c[6:]) for c in chunks if not c.startswith(b"data: [DONE]")]
    assert events[-1]["error"]["type"] == "stream_error"
    assert not any(choice.get("finish_reason") for e in events for choice in e.get("choices", []))
    assert len(events) < 3000

    status = sim_stack.pd("status")
    assert status.returncode == 1
    decode_line = next(ln for ln in status.stdout.splitlines() if ln.startswith("decode"))
    assert "not running" in decode_line and "Connection refused" in decode_line
    code, text = chat(sim_stack.url("router"), 2, timeout=20)
    assert code >= 500 and str(int(sim_stack.values()["DECODE_PORT"])) in text

    done = sim_stack.pd("co-restart", "--probe-max-tokens", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert ", 3 completion tokens" in done.stdout, done.stdout
    code, _ = chat(sim_stack.url("router"), 2)
    assert code == 200


def test_router_stop_lets_a_short_request_finish_and_ends_well_before_smgs_default_drain(
    sim_stack: SimStack,
):
    # smg rewrites its process title, so the flag is checked by what smg does with it.
    from launch.pdlib.envfiles import EnvDir

    grace_s = int(EnvDir(sim_stack.env).role_env("router")["ROUTER_SHUTDOWN_GRACE_S"])
    port = int(sim_stack.values()["ROUTER_PORT"])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    body = {
        "model": "deepseek-v4-flash",
        "max_tokens": 20,
        "stream": True,
        "messages": [{"role": "user", "content": "count"}],
    }
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(body),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: "), first
    lines: list[bytes] = []

    def read_rest():
        try:
            for _ in range(200):
                line = resp.readline()
                if not line:
                    break
                lines.append(line)
        except (OSError, http.client.HTTPException):
            pass

    reader = threading.Thread(target=read_rest)
    reader.start()
    # The signal launch/pd sends; timed to smg's own exit, not to when this machine's init
    # reaps it.
    router = psutil.Process(sim_stack.pid("router"))
    started = time.perf_counter()
    os.killpg(router.pid, signal.SIGTERM)
    while (took_s := time.perf_counter() - started) < 30:
        try:
            if router.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    reader.join(timeout=20)
    conn.close()
    try:
        assert b"data: [DONE]\n" in lines, lines[-3:]
        events = [json.loads(ln[6:]) for ln in [first, *lines] if ln.startswith(b"data: {")]
        finished = [c["finish_reason"] for e in events for c in e.get("choices", [])]
        assert finished[-1] == "length"
        # smg drains /readiness for half the grace, at most 5 s (its default grace is 180 s).
        assert min(grace_s / 2, 5.0) <= took_s < 5.0, took_s
    finally:
        up = sim_stack.pd("up", "router")
        assert up.returncode == 0, up.stdout + up.stderr


def test_down_leaves_no_process_behind(tmp_path):
    stack = SimStack(tmp_path)
    try:
        up = stack.pd("up")
        assert up.returncode == 0, up.stdout + up.stderr
        pids = [stack.pid(r) for r in ("prefill", "decode", "router")]
        tree = [
            p
            for pid in pids
            for p in [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
        ]
        down = stack.pd("down")
        assert down.returncode == 0, down.stderr
        assert [ln.split(":")[0] for ln in down.stdout.splitlines()] == [
            "router",
            "decode",
            "prefill",
        ]
        gone, alive = psutil.wait_procs(tree, timeout=5)
        assert not alive
        assert not processes_using(stack.env)
        assert not list(stack.run_dir.glob("*.pid"))
        assert stack.pd("status").returncode == 1
    finally:
        kill_all(stack.env, stack.run_dir)
