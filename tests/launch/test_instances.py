"""Several prefill and decode instances (2P2D) behind the real smg, which takes its workers
from the discovery file pd writes; rolling-restart under load. Simulated engines, loopback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from launch_harness import (
    PD,
    ROOT,
    SECRET,
    SimStack,
    kill_all,
    make_env_dir,
    run_pd,
    set_values,
)

from bench.lib.restart_load import restart_under_load
from launch.pdlib.envfiles import EnvDir
from launch.pdlib.stack import free_loopback_ports


def add_instances(env: Path, prefills: int, decodes: int, **overrides: dict[str, str]) -> None:
    """ROLE.N.env files on free loopback ports; overrides["decode_2"] adds lines to decode.2.env."""
    ports = iter(free_loopback_ports(2 * prefills + decodes))
    for role, count in (("prefill", prefills), ("decode", decodes)):
        for n in range(1, count + 1):
            lines = [f"# {role} instance {n}", f"{role.upper()}_PORT={next(ports)}"]
            if role == "prefill":
                lines.append(f"PREFILL_BOOTSTRAP_PORT={next(ports)}")
            lines.append(f"CUDA_VISIBLE_DEVICES={2 * n - 2},{2 * n - 1}")
            lines += [f"{k}={v}" for k, v in overrides.get(f"{role}_{n}", {}).items()]
            (env / f"{role}.{n}.env").write_text("\n".join(lines) + "\n")


def router_workers(stack: SimStack) -> dict[str, dict]:
    req = urllib.request.Request(
        stack.url("router") + "/workers", headers={"Authorization": f"Bearer {SECRET}"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        workers = json.loads(resp.read())["workers"]
    return {w["labels"]["smg.ai/discovery-id"]: w for w in workers}


def listed(stack: SimStack) -> list[str]:
    return [
        w["id"] for w in json.loads((stack.run_dir / "router-workers.json").read_text())["workers"]
    ]


class InstanceStack(SimStack):
    def __init__(self, tmp: Path, **overrides: dict[str, str]):
        super().__init__(tmp)
        add_instances(self.env, 2, 2, **overrides)
        set_values(self.env / "common.env", PD_POLL_INTERVAL_S="0.25")

    def url_of(self, name: str) -> str:
        kind, n = name.split("/")
        port = EnvDir(self.env).role_env(kind, int(n))[f"{kind.upper()}_PORT"]
        return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def stack_2p2d(tmp_path_factory):
    stack = InstanceStack(tmp_path_factory.mktemp("2p2d"))
    try:
        up = stack.pd("up", timeout=240)
        assert up.returncode == 0, up.stdout + up.stderr
        yield stack
    finally:
        stack.pd("down", timeout=120)
        kill_all(stack.env, stack.run_dir)


def test_2p2d_up_routes_every_instance_verifies_probes(stack_2p2d: InstanceStack):
    assert sorted(listed(stack_2p2d)) == ["decode/1", "decode/2", "prefill/1", "prefill/2"]
    workers = router_workers(stack_2p2d)
    assert sorted(workers) == ["decode/1", "decode/2", "prefill/1", "prefill/2"]
    assert all(w["is_healthy"] for w in workers.values())
    for n in range(1, 3):
        assert (stack_2p2d.run_dir / f"decode-{n}.pid").is_file()

    verify = stack_2p2d.pd("verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    for name, knob in (
        ("decode/1", "CUDA_VISIBLE_DEVICES=0,1"),
        ("decode/2", "CUDA_VISIBLE_DEVICES=2,3"),
    ):
        assert f"ok   {name} {knob} live in pid" in verify.stdout
    assert "ok   prefill/2 SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT=60 live in pid" in verify.stdout
    assert "skip" not in verify.stdout

    for _ in range(2):
        probe = stack_2p2d.pd("probe")
        assert probe.returncode == 0, probe.stdout + probe.stderr
    assert "decode/1 load when sent:" in probe.stdout and "decode/2 load when sent:" in probe.stdout
    served = [
        len(json.loads(urllib.request.urlopen(stack_2p2d.url_of(name) + "/sim/requests").read()))
        for name in ("decode/1", "decode/2")
    ]
    assert all(n >= 1 for n in served), served

    status = stack_2p2d.pd("status", "decode/2")
    assert (
        status.returncode == 0 and "decode/2" in status.stdout and "decode/1" not in status.stdout
    )
    metrics = stack_2p2d.pd("metrics", "prefill")
    assert "prefill/1: num_running_reqs=" in metrics.stdout and "decode" not in metrics.stdout
    assert SECRET not in verify.stdout + probe.stdout + status.stdout + metrics.stdout


def test_instances_of_another_host_are_reported_not_checked_nor_touched(stack_2p2d):
    other = {"PD_HOST": "gpu-b.example"}
    verify = run_pd(
        "verify", "--env-dir", str(stack_2p2d.env), "--sim", env_extra=stack_2p2d.extra | other
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    skipped = [ln for ln in verify.stdout.splitlines() if ln.startswith("skip")]
    # Each engine's knobs, and every instance's listening sockets, the router's included.
    assert len(skipped) == 4 + 5
    assert all("a remote /proc cannot be read from here" in ln for ln in skipped)
    assert "9 not checked from this host" in verify.stdout
    pid = stack_2p2d.pid("decode-1")
    down = run_pd("down", "decode", "--env-dir", str(stack_2p2d.env), "--sim", env_extra=other)
    assert "decode/1: on 127.0.0.1, not this host (PD_HOST=gpu-b.example); skipped" in down.stdout
    assert stack_2p2d.pid("decode-1") == pid
    assert router_workers(stack_2p2d).keys() == {"decode/1", "decode/2", "prefill/1", "prefill/2"}


def test_rolling_restart_of_both_decodes_under_c16_load_fails_no_request(stack_2p2d):
    set_values(stack_2p2d.env / "decode.env", SGLANG_SM120_MMA_TARGET_CTAS="256")
    old = {n: stack_2p2d.pid(f"decode-{n}") for n in (1, 2)}
    command = [str(PD), "rolling-restart", "decode", "--env-dir", str(stack_2p2d.env), "--sim"]
    result = asyncio.run(
        restart_under_load(
            stack_2p2d.url("router"), command, 16, SECRET, max_requests=5000, request_timeout_s=60
        )
    )
    assert result.returncode == 0, result.output
    assert result.sent >= 16 and result.failed == 0, result.summary()
    for n in (1, 2):
        assert f"ok   decode/{n} SGLANG_SM120_MMA_TARGET_CTAS=256 live in pid" in result.output
        assert f"the router routes to decode/{n} again" in result.output
        assert stack_2p2d.pid(f"decode-{n}") != old[n]
    assert result.output.index("decode/1 1/2") < result.output.index("decode/2 2/2")
    verify = stack_2p2d.pd("verify", "decode")
    assert verify.returncode == 0 and verify.stdout.count("TARGET_CTAS=256 live in pid") == 2


def test_one_frozen_decode_of_two_is_named_by_triage_and_by_probe(stack_2p2d):
    """decode/2's process group stopped: bench/triage and launch/pd probe both name decode/2,
    and the three other instances as answering; thawed, the router routes to it again."""
    frozen = stack_2p2d.pid("decode-2")
    url = stack_2p2d.url_of("decode/2")
    os.killpg(frozen, signal.SIGSTOP)
    try:
        triage = subprocess.run(
            [
                sys.executable,
                "bench/triage",
                "--url",
                stack_2p2d.url("router"),
                "--env-dir",
                str(stack_2p2d.env),
                "--probe-timeout-s",
                "3",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        probe = stack_2p2d.pd("probe", "--probe-timeout", "10", timeout=60)
    finally:
        os.killpg(frozen, signal.SIGCONT)
    assert triage.returncode == 0, triage.stdout + triage.stderr
    assert "triage verdict: engine unresponsive" in triage.stdout
    assert (
        f"because: decode/2 ({url}) did not answer: /metrics: no answer within 3 s; /health: "
        "no answer within 3 s; prefill/1, prefill/2, decode/1 answered"
    ) in triage.stdout, triage.stdout
    assert "  - decode/2: listed " in triage.stdout
    assert probe.returncode == 1, probe.stdout + probe.stderr
    assert (
        f"verdict: engine unresponsive: decode/2 ({url}) did not answer: /metrics: no answer "
        "within 5 s; /health: no answer within 5 s; prefill/1, prefill/2, decode/1 answered"
    ) in probe.stdout, probe.stdout
    assert "router on decode/2: listed " in probe.stdout
    assert SECRET not in triage.stdout + probe.stdout
    deadline = time.monotonic() + 30
    while not all(w["is_healthy"] for w in router_workers(stack_2p2d).values()):
        assert time.monotonic() < deadline, router_workers(stack_2p2d)
        time.sleep(0.5)
    probe = stack_2p2d.pd("probe")
    assert probe.returncode == 0, probe.stdout + probe.stderr


def test_rolling_restart_refuses_a_role_with_one_instance(env_dir):
    done = run_pd("rolling-restart", "decode", "--env-dir", str(env_dir))
    assert done.returncode == 2
    assert "decode has a single instance" in done.stderr and "co-restart" in done.stderr


def test_rolling_restart_stops_at_an_instance_that_never_gets_healthy(tmp_path):
    stack = InstanceStack(tmp_path)
    try:
        up = stack.pd("up", timeout=240)
        assert up.returncode == 0, up.stdout + up.stderr
        # From now on decode/2 starts but never answers /health with 200.
        set_values(stack.env / "decode.2.env", PD_SIM_STARTUP_S="3600")
        old_first = stack.pid("decode-1")
        done = run_pd(
            "rolling-restart",
            "decode",
            "--env-dir",
            str(stack.env),
            "--sim",
            "--timeout",
            "10",
            env_extra=stack.extra,
            timeout=240,
        )
        assert done.returncode == 1, done.stdout + done.stderr
        assert "the router routes to decode/1 again" in done.stdout
        assert stack.pid("decode-1") != old_first
        assert "rolling-restart stopped at decode/2" in done.stderr
        assert "decode/2 is OUT of rotation" in done.stderr
        assert "decode/2" not in listed(stack) and "decode/1" in listed(stack)
        workers = router_workers(stack)
        assert "decode/2" not in workers and workers["decode/1"]["is_healthy"]
        probe = stack.pd("probe")
        assert probe.returncode == 0, probe.stdout + probe.stderr
        # With decode/2 out, taking decode/1 out would stop the service: refused, untouched.
        pid = stack.pid("decode-1")
        again = stack.pd("rolling-restart", "decode")
        assert again.returncode == 1
        assert "stopped before decode/1: no other decode instance is in rotation" in again.stderr
        assert stack.pid("decode-1") == pid and "decode/1" in listed(stack)
    finally:
        stack.pd("down", timeout=120)
        kill_all(stack.env, stack.run_dir)


@pytest.mark.parametrize(
    ("instance_file", "line", "expected", "named_file"),
    [
        (
            "decode.2.env",
            "DECODE_PORT={prefill_port}",
            "is already prefill/1's PREFILL_PORT",
            "decode.2.env",
        ),
        (
            "decode.2.env",
            "DECODE_HOST=gpu-b.invalid",
            "host 'gpu-b.invalid' of decode/2 does not resolve",
            "decode.2.env",
        ),
        (
            "decode.2.env",
            "DECODE_HOST=10.0.0.2",
            "prefill/1 listens on loopback 127.0.0.1, so decode/2 on 10.0.0.2 cannot reach",
            "common.env",
        ),
    ],
)
def test_env_check_refuses_a_bad_topology_naming_file_and_variable(
    tmp_path, instance_file, line, expected, named_file
):
    env = make_env_dir(tmp_path)
    add_instances(env, 2, 2)
    prefill_port = (env / "prefill.1.env").read_text().split("PREFILL_PORT=")[1].split()[0]
    key, value = line.format(prefill_port=prefill_port).split("=")
    set_values(env / instance_file, **{key: value})
    done = run_pd("env", "check", "--env-dir", str(env))
    assert done.returncode == 1, done.stdout
    problem = next(ln for ln in done.stdout.splitlines() if expected in ln)
    assert problem.startswith(f"FAIL {env / named_file}:")


def test_units_render_one_unit_per_instance(tmp_path):
    env = make_env_dir(tmp_path)
    add_instances(env, 2, 2)
    out = tmp_path / "units"
    done = run_pd("units", "--out", str(out), "--env-dir", str(env))
    assert done.returncode == 0, done.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        f"sm120pd-{k}.service" for k in ("decode-1", "decode-2", "prefill-1", "prefill-2", "router")
    ]
    unit = (out / "sm120pd-decode-2.service").read_text()
    assert f"ExecStart={ROOT}/launch/decode.sh --env-dir {env.resolve()} --instance 2\n" in unit
    assert f"EnvironmentFile={env.resolve()}/decode.2.env" in unit
    assert "After=network-online.target sm120pd-prefill-1.service sm120pd-prefill-2.service" in unit


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: host A 10.231.0.1, host B 10.231.0.2."""
    tag = f"pd{os.getpid() % 100000}"
    names = {"a": f"{tag}a", "b": f"{tag}b"}
    made = _ip("netns", "add", names["a"])
    if made.returncode != 0:
        pytest.skip(f"`ip netns add` is not permitted here ({made.stderr.strip()}); needs root")
    try:
        _ip("netns", "add", names["b"])
        steps = [
            ("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb"),
            ("link", "set", f"{tag}va", "netns", names["a"]),
            ("link", "set", f"{tag}vb", "netns", names["b"]),
        ]
        for host, address in (("a", "10.231.0.1"), ("b", "10.231.0.2")):
            ns = ("-n", names[host])
            steps += [
                (*ns, "addr", "add", f"{address}/24", "dev", f"{tag}v{host}"),
                (*ns, "link", "set", f"{tag}v{host}", "up"),
                (*ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        yield names
    finally:
        for ns in names.values():
            _ip("netns", "del", ns)


def test_2p2d_over_two_hosts_in_network_namespaces(tmp_path, two_hosts):
    stack = InstanceStack(tmp_path)
    hosts = {"a": "10.231.0.1", "b": "10.231.0.2"}
    for role, n, host in (
        ("prefill", 1, "a"),
        ("decode", 1, "a"),
        ("prefill", 2, "b"),
        ("decode", 2, "b"),
    ):
        set_values(stack.env / f"{role}.{n}.env", **{f"{role.upper()}_HOST": hosts[host]})
    set_values(stack.env / "common.env", ROUTER_HOST=hosts["a"])

    def pd_on(host: str, *args: str, timeout: float = 240.0):
        extra = stack.extra | {"PD_HOST": hosts[host]}
        command = ["ip", "netns", "exec", two_hosts[host], str(PD), *args]
        env = dict(os.environ) | extra
        return subprocess.run(
            [*command, "--env-dir", str(stack.env), "--sim"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )

    try:
        up_b = pd_on("b", "up")
        assert up_b.returncode == 0, up_b.stdout + up_b.stderr
        assert "router: on 10.231.0.1, not this host (PD_HOST=10.231.0.2); skipped" in up_b.stdout
        up_a = pd_on("a", "up")
        assert up_a.returncode == 0, up_a.stdout + up_a.stderr
        assert "router: routes to every listed instance" in up_a.stdout
        for host, here, there in (("a", "1", "2"), ("b", "2", "1")):
            verify = pd_on(host, "verify")
            assert verify.returncode == 0, verify.stdout + verify.stderr
            assert (
                f"ok   decode/{here} SGLANG_SM120_MMA_TARGET_CTAS=512 live in pid" in verify.stdout
            )
            skipped = [ln for ln in verify.stdout.splitlines() if ln.startswith("skip")]
            # The other host's engines (knobs and listening sockets) and, from b, the router's.
            remote = [f"prefill/{there}", f"decode/{there}"] + ["router"] * (host == "b")
            assert len(skipped) == 2 + len(remote), skipped
            assert all(ln.split()[1].rstrip(":") in remote for ln in skipped), skipped
            assert f"ok   decode/{here} listens only on DECODE_HOST={hosts[host]}: " in (
                verify.stdout
            )
        for _ in range(4):
            probe = pd_on("a", "probe")
            assert probe.returncode == 0, probe.stdout + probe.stderr
        metrics = pd_on("a", "metrics", "decode/2")
        assert metrics.returncode == 0 and "decode/2: num_running_reqs=" in metrics.stdout
        # Round robin over both decodes: each served some of the probes, decode/2 across the link.
        count = (
            "import json, sys, urllib.request as u; "
            "print(len(json.load(u.urlopen(sys.argv[1] + '/sim/requests', timeout=10))))"
        )
        for n, host in ((1, "a"), (2, "b")):
            url = f"http://{hosts[host]}:{EnvDir(stack.env).role_env('decode', n)['DECODE_PORT']}"
            done = subprocess.run(
                ["ip", "netns", "exec", two_hosts["a"], sys.executable, "-c", count, url],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert done.returncode == 0 and int(done.stdout) >= 1, done.stdout + done.stderr
    finally:
        pd_on("a", "down", timeout=120)
        pd_on("b", "down", timeout=120)
        kill_all(stack.env, stack.run_dir)


def test_scripts_read_the_instance_file_last_and_the_router_takes_the_discovery_file(env_dir):
    add_instances(env_dir, 2, 2, decode_2={"SGLANG_SM120_MMA_TARGET_CTAS": "auto"})
    port = EnvDir(env_dir).role_env("decode", 2)["DECODE_PORT"]

    def dry_run(script: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(ROOT / "launch" / script), "--env-dir", str(env_dir), *args, "--dry-run"],
            capture_output=True,
            text=True,
            timeout=30,
        )

    decode = dry_run("decode.sh", "--instance", "2")
    assert decode.returncode == 0, decode.stderr
    assert "SGLANG_SM120_MMA_TARGET_CTAS=auto" in decode.stdout
    assert "CUDA_VISIBLE_DEVICES=2,3" in decode.stdout
    assert f"--port {port} " in decode.stdout.splitlines()[-1]
    single = dry_run("decode.sh")
    assert "SGLANG_SM120_MMA_TARGET_CTAS=512" in single.stdout
    router = dry_run("router.sh").stdout.splitlines()[-1]
    run_dir = EnvDir(env_dir).common()["PD_RUN_DIR"]
    discovery = "--discovery-provider file --discovery-check-interval-secs 5 --discovery-file"
    assert f"{discovery} {run_dir}/router-workers.json" in router
    assert "--prefill" not in router and "--decode" not in router
    for script, args in (("decode.sh", ("--instance", "0")), ("router.sh", ("--instance", "1"))):
        refused = dry_run(script, *args)
        assert refused.returncode == 2 and "--instance needs a number N" in refused.stderr
