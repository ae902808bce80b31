"""env/cpu-dsv4: a tiny DeepSeek-V4 in PD on real CPU engines, over NIXL, behind the real smg.

The stack comes up with launch/pd from a copy of env/cpu-dsv4 (free loopback ports, its own run
directory). Greedy tokens through the router must equal bench/dsv4_check's in-process tokens for
the same prompt: every row decode reads arrived over NIXL (patches 0007 and 0017). Decode's log
must show the mma kernel's decode launches with the env file's split target.

The model is env/cpu-dsv4's, the c4c128 standard (a c4 layer with its indexer, a c128 layer).
Its 252-token prompt is longer than the 128-token window and fills compressed entries in
prefill: 63 c4 entries and their index keys, one c128 entry, and 124 rows of the c128 state ring
that decode needs when it closes the next window at 256 tokens. So the SWA rows, both compressed
pools, the indexer's keys and the compressor states must all arrive for the tokens to match.
`DSV4_PD_STANDARD=swa` runs the same tests on the SWA-only model (160-token prompt).
"""

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import dsv4_check  # noqa: E402
from launch.pdlib import envfiles  # noqa: E402
from launch.pdlib.stack import free_loopback_ports  # noqa: E402

PD = ROOT / "launch" / "pd"
STANDARD = os.environ.get("DSV4_PD_STANDARD", "c4c128")
SWA_PROMPT, SWA_STEPS = 160, 6  # c4c128: conftest's session check (252 tokens, 6 steps)


@pytest.fixture(scope="module")
def model(c4c128_model, request) -> Path:
    if STANDARD == "swa":
        return request.getfixturevalue("swa_model")
    return c4c128_model


@pytest.fixture(scope="module")
def reference(model, request, tmp_path_factory) -> dict:
    """bench/dsv4_check's in-process mma run on the PD test's prompt: its prompt ids and
    tokens. Taken before the stack is up (the stack fixture depends on it)."""
    if STANDARD == "c4c128":
        got = request.getfixturevalue("c4c128_checked")
        return {"ids": got["prompt_ids"], "tokens": got["tokens"]["mma"]}
    cfg = json.loads((model / "config.json").read_text())
    ids = dsv4_check.prompt_ids(cfg, SWA_PROMPT, 1)
    out = tmp_path_factory.mktemp("reference") / "mma.pt"
    check = dsv4_check.run_backend("mma", model, ids, SWA_STEPS, None, out, 600)
    return {"ids": ids, "tokens": check["tokens"]}


def pd(env_dir: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(PD), *args, "--env-dir", str(env_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def dsv4_stack(model, reference, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cpu-dsv4")
    env_dir = tmp / "env"
    shutil.copytree(ROOT / "env" / "cpu-dsv4", env_dir)
    prefill, boot, decode, router, prom = free_loopback_ports(5)
    envfiles.set_values(
        env_dir / "common.env",
        {
            "MODEL_PATH": str(model),
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
    yield env_dir, tmp / "run", router
    down = pd(env_dir, "down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr


def test_greedy_through_pd_equals_the_in_process_check(model, reference, dsv4_stack):
    env_dir, run_dir, router = dsv4_stack
    cfg = json.loads((model / "config.json").read_text())
    ids, steps = reference["ids"], len(reference["tokens"]) - 1
    assert ids == dsv4_check.prompt_ids(cfg, len(ids), 1)
    assert len(ids) > cfg["window_size"]
    if STANDARD == "c4c128":  # decode closes a c128 window from the ring prefill filled
        assert len(ids) < 256 <= len(ids) + steps
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": steps + 1}}
    request = urllib.request.Request(
        f"http://127.0.0.1:{router}/generate",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        through_pd = json.loads(resp.read())["output_ids"]
    assert through_pd == reference["tokens"], (through_pd, reference["tokens"])
    decode_log = (run_dir / "decode.log").read_text()
    assert "SGLANG_CPU_SM120_PATH=1: this CPU scheduler takes the SM120 DSV4" in decode_log
    # env/cpu-dsv4's SGLANG_SM120_MMA_TARGET_CTAS=512 on decode, seen by the mma launcher.
    assert "SGLANG_SM120_MMA_TARGET_CTAS=512 (set): batch 1," in decode_log
    verify = pd(env_dir, "verify", timeout=180)
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-2000:]


def test_co_restart_puts_a_changed_split_target_live_in_decode(model, dsv4_stack):
    """The operator's loop on DSV4: change SGLANG_SM120_MMA_TARGET_CTAS in decode.env and
    co-restart (each role in order, health-gated, then verify). The new value is in decode's
    process (verify reads it live) and in the mma launcher's split choice for the next request;
    the restarted stack serves through the router."""
    env_dir, run_dir, router = dsv4_stack
    log = run_dir / "decode.log"
    offset = len(log.read_text())
    envfiles.set_values(env_dir / "decode.env", {"SGLANG_SM120_MMA_TARGET_CTAS": "64"})
    done = pd(env_dir, "co-restart", timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "ok   decode SGLANG_SM120_MMA_TARGET_CTAS=64 live in pid" in done.stdout, done.stdout
    cfg = json.loads((model / "config.json").read_text())
    body = {
        "input_ids": dsv4_check.prompt_ids(cfg, 16, 2),
        "sampling_params": {"temperature": 0, "max_new_tokens": 3},
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{router}/generate",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        assert len(json.loads(resp.read())["output_ids"]) == 3
    text = log.read_text()
    since = text[offset:] if len(text) >= offset else text  # appended, or a fresh log
    # The restarted decode's launches (its warm-up's and this request's) use the new target.
    assert "SGLANG_SM120_MMA_TARGET_CTAS=64 (set): batch 1," in since
    assert "SGLANG_SM120_MMA_TARGET_CTAS=512" not in since
