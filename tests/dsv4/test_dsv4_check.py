"""bench/dsv4_check end to end: sglang's real DSV4 path on CPU into the mma kernel.

The check itself fails (exit 1) when a kernel call is missing or skipped (it counts them: one
per layer per forward), when a call's cache, index lists, lengths or sink are not the backend's,
when the kernel's output leaves upstream's torch reference, or when the logits leave the torch
backend's or transformers' beyond its thresholds; this test runs it and reads its JSON.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "dsv4_check.py"


def _run(*args, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECK), *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def swa_model() -> Path:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "dsv4", "--standard", "swa"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    sys.path.insert(0, str(ROOT))
    from tools import make_tiny_model, tiny_dsv4

    return make_tiny_model.cache_dir() / tiny_dsv4.STANDARD["swa"].name


def test_swa_model_through_the_mma_kernel(swa_model, tmp_path):
    steps = 4
    out = tmp_path / "check.json"
    proc = _run("--model", str(swa_model), "--steps", str(steps), "--json", str(out))
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "dsv4_check: PASS" in proc.stdout
    got = json.loads(out.read_text())
    assert got["failures"] == [] and got["prompt_len"] > 128  # longer than the window
    layers = len(json.loads((swa_model / "config.json").read_text())["compress_ratios"])
    for backend in ("mma", "torch"):
        calls = got["calls"][backend]
        # Every layer's attention went through the kernel in the prefill and each decode step.
        assert len(calls) == layers * (steps + 1), (backend, len(calls))
        assert sorted({c["layer"] for c in calls}) == list(range(layers))
        assert [c["rows"] for c in calls[:layers]] == [got["prompt_len"]] * layers
        assert all(c["rows"] == 1 for c in calls[layers:])
        assert all(not c["failed"] for c in calls)
    assert got["tokens"]["mma"] == got["tokens"]["torch"]
    # Only our kernel runs in the Triton interpreter; every op that is not ours runs in torch.
    assert {k.rsplit(".", 1)[0] for k in got["triton"]["mma"]} == {
        "sglang.kernels.ops.attention.flash_mla_sm120_mma"
    }
    assert got["triton"]["torch"] == {}


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
