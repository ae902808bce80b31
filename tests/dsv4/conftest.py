"""tests/dsv4 imports sglang's DSV4 kernel modules, which define Triton kernels.

TRITON_INTERPRET is read when a @triton.jit function is defined, and one pytest process must not
hold a mix of compiled and interpreted kernels: tests/kernel, collected after this folder, runs
ours in the interpreter, and kernels that this folder's modules defined without the variable
break it there ("Cannot call @triton.jit'd outside of the scope of a kernel", seen in a full
`pytest tests` run). So it is set here too, before this folder's test modules import sglang.
bench/dsv4_check and the engine test set it in their own processes as well.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def swa_model() -> Path:
    """The SWA-only standard tiny DSV4, made or reused the way bench/dsv4_check does it."""
    sys.path.insert(0, str(ROOT))
    from bench import dsv4_check

    return dsv4_check.standard_model("swa")


@pytest.fixture(scope="session")
def c4c128_model() -> Path:
    """The standard tiny DSV4 with a c4 (indexer) and a c128 layer."""
    sys.path.insert(0, str(ROOT))
    from bench import dsv4_check

    return dsv4_check.standard_model("c4c128")


# bench/dsv4_check on the c4c128 model: a 252-token prompt, 6 decode steps (the sequence reaches
# 258 tokens, so decode closes a c128 window at 256). test_dsv4_check.py asserts on it, and
# test_pd_dsv4.py takes its mma tokens as the reference for the same prompt through PD: one
# run per session, made before any stack is up (PD engines poll their queues, a core each).
C4C128_PROMPT, C4C128_STEPS = 252, 6


@pytest.fixture(scope="session")
def c4c128_checked(c4c128_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("c4c128-check") / "check.json"
    cmd = [
        sys.executable, str(ROOT / "bench" / "dsv4_check.py"), "--model", str(c4c128_model),
        "--prompt-len", str(C4C128_PROMPT), "--steps", str(C4C128_STEPS), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return {**json.loads(out.read_text()), "stdout": proc.stdout}


# A tiny DSV4 with top-k routing: the c4c128 standard's layers (SWA, c4 with its indexer, c128),
# the first routed by the token-id hash, the other two sending each token to 2 of 8 experts (the
# real model's kind of routing). Its routers land on different sides of near-ties in bf16 and
# float32, and in two bf16 runs alike; a flip then moves the compressed entries every later
# token reads. This is the held-out model on which the check used to fail at TP 2.
TOPK_ARGS = ["--experts", "8", "--experts-per-token", "2"]
TOPK_NAME = "tiny-dsv4-r0-4-128-h8-d256-e8k2x1-s1"


@pytest.fixture(scope="session")
def topk_model() -> Path:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "dsv4", *TOPK_ARGS],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    sys.path.insert(0, str(ROOT))
    from tools import make_tiny_model

    model = make_tiny_model.cache_dir() / TOPK_NAME
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["num_experts_per_tok"] < cfg["n_routed_experts"], cfg
    return model


@pytest.fixture(scope="session")
def topk_tp2_checked(topk_model, tmp_path_factory) -> dict:
    """bench/dsv4_check --tp 2 on the top-k model, a 160-token prompt (past the 128-token window,
    a c128 entry closed) and 2 decode steps: the mma run at TP1, then mma and torch at TP2
    replaying its expert choices, then transformers replaying them too. Without the replay this
    run fails at step 1 (TP2 against TP1 logits cosine 0.907: a router flip between the runs).
    test_cpu_tp.py asserts on its TP checks, test_dsv4_routing.py on its routing: one run."""
    out = tmp_path_factory.mktemp("topk-tp2") / "check.json"
    cmd = [
        sys.executable, str(ROOT / "bench" / "dsv4_check.py"), "--model", str(topk_model),
        "--tp", "2", "--prompt-len", "160", "--steps", "2", "--timeout", "600", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return {**json.loads(out.read_text()), "stdout": proc.stdout}
