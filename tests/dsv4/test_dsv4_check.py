"""bench/dsv4_check end to end: sglang's real DSV4 path on CPU into the mma kernel.

The check itself fails (exit 1) when a kernel call is missing or skipped (it counts them: one
per layer per forward), when a call's cache, index lists, lengths or sink are not the backend's,
when the kernel's output leaves its reference (for mma upstream's torch reference; for the torch
backend, which runs that reference as its kernel, a dense one the check writes out over the
pool's keys read back through upstream's dequantizer), or when the logits leave the torch
backend's or transformers' beyond its thresholds; this test runs it and reads its JSON.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "dsv4_check.py"
STEPS = 4
sys.path.insert(0, str(ROOT))

from bench import dsv4_check  # noqa: E402
from launch.pdlib.stack import free_loopback_ports  # noqa: E402


def _run(*args, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECK), *args], capture_output=True, text=True, timeout=timeout
    )


def _check(model: Path, out: Path, *args: str) -> dict:
    """bench/dsv4_check on one model: its JSON and stdout."""
    proc = _run("--model", str(model), "--json", str(out), *args)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return {**json.loads(out.read_text()), "stdout": proc.stdout}


@pytest.fixture(scope="module")
def checked(swa_model, tmp_path_factory) -> dict:
    """The SWA model, prompt longer than the window, once for the module."""
    out = tmp_path_factory.mktemp("check") / "check.json"
    return _check(swa_model, out, "--steps", str(STEPS))


def _through_the_kernel(model: Path, got: dict, steps: int) -> None:
    assert "dsv4_check: PASS" in got["stdout"]
    assert got["failures"] == [] and got["prompt_len"] > 128  # longer than the window
    ratios = json.loads((model / "config.json").read_text())["compress_ratios"]
    layers = len(ratios)
    for backend in ("mma", "torch"):
        calls = got["calls"][backend]
        # Every layer's attention went through the kernel in the prefill and each decode step.
        assert len(calls) == layers * (steps + 1), (backend, len(calls))
        assert sorted({c["layer"] for c in calls}) == list(range(layers))
        assert [c["ratio"] for c in calls[:layers]] == ratios
        assert [c["rows"] for c in calls[:layers]] == [got["prompt_len"]] * layers
        assert all(c["rows"] == 1 for c in calls[layers:])
        assert all(not c["failed"] for c in calls)
        reference = "upstream's torch reference" if backend == "mma" else "the dense reference"
        assert {c["reference"] for c in calls} == {reference}
    # Greedy tokens differ only at a near-tie, which the check reports and does not count.
    ties = got["stdout"].count("near-tie, not counted")
    pairs = zip(got["tokens"]["mma"], got["tokens"]["torch"], strict=True)
    same = sum(a == b for a, b in pairs)
    assert same >= steps + 1 - ties, got["stdout"]
    # Only our kernel runs in the Triton interpreter; every op that is not ours runs in torch,
    # except upstream's compressed-metadata kernel, which has no torch twin.
    metadata = "sglang.kernels.ops.attention.dsv4.metadata_kernel"
    compressed = any(ratios)
    ours = {"sglang.kernels.ops.attention.flash_mla_sm120_mma"} | (
        {metadata} if compressed else set()
    )
    assert {k.rsplit(".", 1)[0] for k in got["triton"]["mma"]} == ours
    assert {k.rsplit(".", 1)[0] for k in got["triton"]["torch"]} == ours - {
        "sglang.kernels.ops.attention.flash_mla_sm120_mma"
    }


def test_swa_model_through_the_mma_kernel(swa_model, checked):
    _through_the_kernel(swa_model, checked, STEPS)


def test_c4c128_model_through_the_mma_kernel(c4c128_model, c4c128_checked):
    """The prompt leaves the sequence 4 tokens short of 256, so the decode steps close a c128
    window (the compressor's decode path) and several c4 ones; the c4 layer has 63 entries
    before decode (conftest.py runs the check once per session)."""
    got = c4c128_checked
    _through_the_kernel(c4c128_model, got, got["steps"])
    # Every compressed entry of the fed tokens, in each pool, matched transformers' compressors
    # (the check fails otherwise); the table names them.
    fed = got["prompt_len"] + got["steps"]
    for key, ratio in (("1:index", 4), ("1:kv", 4), ("2:kv", 128)):
        assert f"layer {key:<8} c{ratio:<3} {fed // ratio:>3} entries" in got["stdout"]
    assert got["prompt_len"] < 256 <= fed  # a c128 window closed in decode


def test_a_model_directory_missing_a_file_is_named(swa_model, tmp_path):
    broken = tmp_path / "m"
    shutil.copytree(swa_model, broken)
    (broken / "tokenizer.json").unlink()
    proc = _run("--model", str(broken))
    assert proc.returncode == 2
    assert f"{broken}: missing tokenizer.json" in proc.stderr


def test_a_compress_ratio_sglang_does_not_support_is_named(swa_model, tmp_path):
    bad = tmp_path / "m"
    shutil.copytree(swa_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["compress_ratios"] = [0, 8]
    (bad / "config.json").write_text(json.dumps(cfg))
    proc = _run("--model", str(bad))
    assert proc.returncode == 2
    assert "compress ratio(s) [8] are not ones sglang's DSV4 supports" in proc.stderr


def test_a_model_that_is_not_dsv4_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    proc = _run("--model", str(tmp_path))
    assert proc.returncode == 2 and "model_type is 'llama', not 'deepseek_v4'" in proc.stderr


def test_a_standalone_cpu_engine_serves_the_checks_tokens(swa_model, checked, tmp_path):
    """sglang.launch_server on the same model, SGLANG_CPU_SM120_PATH=1 and the mma backend:
    greedy tokens for the check's prompt equal the check's, and the scheduler's log shows the
    SM120 path taken and the mma kernel launched (its split choice is logged per launch shape)."""
    (port,) = free_loopback_ports(1)
    env = {
        **os.environ,
        **dsv4_check.CPU_ENV,
        "SGLANG_CPU_SM120_PATH": "1",
        "SGLANG_SM120_FLASHMLA_BACKEND": "mma",
    }
    log_path = tmp_path / "engine.log"
    log = log_path.open("wb")
    server = subprocess.Popen(
        [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(swa_model),
            "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
            "--disable-cuda-graph", "--sampling-backend", "pytorch", "--max-total-tokens", "8192",
            "--swa-full-tokens-ratio", "0.5", "--max-running-requests", "4",
            "--skip-server-warmup",
        ],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log_path.read_text()[-3000:]
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the engine did not answer /health in 300 s"
            time.sleep(2)
        body = {
            "input_ids": checked["prompt_ids"],
            "sampling_params": {"temperature": 0, "max_new_tokens": STEPS + 1},
        }
        request = urllib.request.Request(
            url + "/generate", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as resp:
            served = json.loads(resp.read())["output_ids"]
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
        log.close()
    assert served == checked["tokens"]["mma"]
    text = log_path.read_text()
    assert "SGLANG_CPU_SM120_PATH=1: this CPU scheduler takes the SM120 DSV4 attention path" in text
    assert "SGLANG_SM120_MMA_TARGET_CTAS=auto (unset): batch 1," in text  # a decode launch
