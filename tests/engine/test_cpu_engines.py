"""Real sglang engines on CPU through the normal launch path: env/cpu, patches 0006 and 0007.

One real stack per module (prefill and decode are `python -m sglang.launch_server` from our
patched wheel on the CPU, KV moving between them over NIXL on loopback, the real smg router in
front), started with `launch/pd --env-dir COPY up` from a copy of env/cpu on free loopback ports.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PD = ROOT / "launch" / "pd"
sys.path.insert(0, str(ROOT))

from launch.pdlib import envfiles  # noqa: E402
from launch.pdlib.stack import free_loopback_ports  # noqa: E402

UP_TIMEOUT_S = 420


def pd(env_dir: Path, *args: str, timeout: float = UP_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(PD), *args, "--env-dir", str(env_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def cpu_stack(tmp_path_factory):
    model = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_tiny_model.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert model.returncode == 0, model.stderr[-3000:]
    tmp = tmp_path_factory.mktemp("cpu-stack")
    env_dir = tmp / "env"
    shutil.copytree(ROOT / "env" / "cpu", env_dir)
    prefill, boot, decode, router, prom = free_loopback_ports(5)
    envfiles.set_values(
        env_dir / "common.env",
        {
            "PREFILL_PORT": str(prefill),
            "PREFILL_BOOTSTRAP_PORT": str(boot),
            "DECODE_PORT": str(decode),
            "ROUTER_PORT": str(router),
            "ROUTER_PROMETHEUS_PORT": str(prom),
            "PD_RUN_DIR": str(tmp / "run"),
        },
    )
    up = pd(env_dir, "up")
    if up.returncode != 0:
        logs = "\n".join(
            pd(env_dir, "logs", role, "-n", "40", timeout=30).stdout
            for role in ("prefill", "decode", "router")
        )
        pd(env_dir, "down", timeout=120)
        pytest.fail(f"launch/pd up failed:\n{up.stdout[-3000:]}{up.stderr[-2000:]}\n{logs}")
    urls = {
        "router": f"http://127.0.0.1:{router}",
        "prefill": f"http://127.0.0.1:{prefill}",
        "decode": f"http://127.0.0.1:{decode}",
    }
    yield env_dir, urls
    down = pd(env_dir, "down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr


def test_verify_reads_the_real_engines_processes_and_manifest(cpu_stack):
    env_dir, _ = cpu_stack
    done = pd(env_dir, "verify", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for role in ("prefill", "decode"):
        assert f"ok   {role} SGLANG_USE_CPU_ENGINE=1 live in pid" in done.stdout
    assert "ok   decode SGLANG_SM120_MMA_TARGET_CTAS=512 live in pid" in done.stdout
    assert "patched build" in done.stdout and "FAIL" not in done.stdout


def test_probe_through_the_router(cpu_stack):
    env_dir, _ = cpu_stack
    done = pd(env_dir, "probe", timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr


def _counter(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return envfiles_free_sum(text, name)


def envfiles_free_sum(text: str, name: str) -> float:
    from launch.pdlib.promtext import sample_sums

    return sample_sums(text).get(name, 0.0)


def test_a_request_is_prefilled_on_one_engine_and_decoded_on_the_other(cpu_stack):
    _, urls = cpu_stack
    body = {
        "text": "hello world the quick brown fox",
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
    }
    prompt_before = _counter(urls["prefill"], "sglang:prompt_tokens_total")
    gen_before = _counter(urls["decode"], "sglang:generation_tokens_total")
    first = _post(urls["router"] + "/generate", body)
    second = _post(urls["router"] + "/generate", body)
    assert len(first["output_ids"]) == 12
    # Greedy: the same prompt gives the same tokens, KV moved over NIXL each time.
    assert first["output_ids"] == second["output_ids"]
    assert _counter(urls["prefill"], "sglang:prompt_tokens_total") > prompt_before
    assert _counter(urls["decode"], "sglang:generation_tokens_total") >= gen_before + 2 * 11


def test_multiround_4x6_through_the_router(cpu_stack):
    env_dir, urls = cpu_stack
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "multiround"),
            "--url",
            urls["router"],
            "--env-dir",
            str(env_dir),
            "--sessions",
            "4",
            "--rounds",
            "6",
            "--max-tokens",
            "16",
            "--first-words",
            "40",
            "--turn-words",
            "10",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "24/24 rounds ok" in done.stdout


def test_co_restart_brings_the_real_stack_back(cpu_stack):
    env_dir, _ = cpu_stack
    done = pd(env_dir, "co-restart")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    probe = pd(env_dir, "probe", timeout=180)
    assert probe.returncode == 0, probe.stdout + probe.stderr
