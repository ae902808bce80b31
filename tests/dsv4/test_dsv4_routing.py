"""bench/dsv4_check on a tiny DSV4 with top-k routing (2 of 4 experts per token, one hash layer).

sglang (bf16) and transformers (float32) land on different sides of router near-ties there:
before the check followed sglang's choice at those ties, this model failed the check for both
backends alike. Both directions:
- the model path is right: the check passes and reports each near-tie (layer, token, margin);
- a real error in sglang's compressor (noise on layer 1's `wkv_gate`, sglang only) still fails
  it, routing aligned or not.

Heavy (two c4c128 runs, about 3 minutes on 2 idle cores), so opt-in: DSV4_ROUTING_TESTS=1
(see bench/README.md, "Top-k routing").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "dsv4_check.py"

pytestmark = pytest.mark.skipif(
    os.environ.get("DSV4_ROUTING_TESTS") != "1",
    reason="heavy: set DSV4_ROUTING_TESTS=1 (two c4c128 runs, about 3 minutes)",
)


@pytest.fixture(scope="module")
def topk_model() -> Path:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "dsv4",
         "--experts-per-token", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    sys.path.insert(0, str(ROOT))
    from tools import make_tiny_model

    model = make_tiny_model.cache_dir() / "tiny-dsv4-r0-4-128-h8-d256-e4k2x1-s1"
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["num_experts_per_tok"] < cfg["n_routed_experts"]
    return model


def _check(model: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECK), "--model", str(model), "--steps", "4", "--json", str(out),
         *args],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def test_router_near_ties_are_followed_and_reported_not_failed(topk_model, tmp_path):
    proc = _check(topk_model, tmp_path / "c.json")
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    got = json.loads((tmp_path / "c.json").read_text())
    assert got["failures"] == []
    ties = got["router_ties"]
    assert ties, "no near-tie on this model: the test no longer exercises what it is for"
    for tie in ties:
        assert tie["layer"] >= 1  # layer 0 is a hash layer: its choice is the token id's
        assert tie["hf"] != tie["sglang"] and 0 <= tie["margin"] <= 0.05
    assert "router near-tie, the reference follows sglang: layer" in proc.stdout


def test_a_compressor_error_in_sglang_still_fails(topk_model, tmp_path):
    proc = _check(topk_model, tmp_path / "c.json", "--perturb", "layers.1.self_attn.compressor")
    print(proc.stdout)
    assert proc.returncode == 1, proc.stdout
    failures = json.loads((tmp_path / "c.json").read_text())["failures"]
    assert any("1:kv" in f or "1:index" in f for f in failures), failures
