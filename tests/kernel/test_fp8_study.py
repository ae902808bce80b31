"""bench/kernel/fp8_study: the toolchain facts behind keeping the FP8 dequantization.

The kernel uses bf16 MMA on dequantized KV. If a Triton upgrade changes what tl.dot_scaled
compiles to (for instance a mixed bf16 x e4m3 block-scaled MMA on sm_120, which would keep q in
bf16), this fails and the choice should be made again.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.kernel.fp8_study import mx_e4m3

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kinds():
    """The probe's MMA instructions per (arch, lhs format), compiled in a process of its own
    (this one runs Triton's interpreter, see conftest.py)."""
    code = (
        "import json; from bench.kernel.fp8_study import mma_kinds; print(json.dumps("
        "{f'{a} {l}': mma_kinds(a, l) for a in (120, 121, 90) for l in ('e4m3', 'bf16')}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _block_scaled(kinds: list[str]) -> bool:
    return any(".SF" in k for k in kinds)


def test_e4m3_dot_scaled_is_block_scaled_mma_on_sm120_and_sm121_only(kinds):
    assert _block_scaled(kinds["120 e4m3"])
    assert _block_scaled(kinds["121 e4m3"])
    assert not _block_scaled(kinds["90 e4m3"])


def test_bf16_query_with_e4m3_keys_is_upcast_to_bf16_mma_on_sm120(kinds):
    for arch in (120, 121):
        got = kinds[f"{arch} bf16"]
        assert not _block_scaled(got) and any(k.startswith("HMMA") for k in got)


def test_mx_rounding_keeps_each_block_within_e4m3_range_with_a_power_of_two_scale():
    x = torch.randn(4, 448) * torch.logspace(-3, 3, 448)
    q = mx_e4m3(x)
    blocks, qb = x.reshape(4, 14, 32), q.reshape(4, 14, 32)
    # e4m3 keeps 3 mantissa bits: each value within 2^-4 of itself, or below the block's
    # subnormal step.
    step = 2.0 ** torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True) / 448)) * 2**-9
    assert torch.all((qb - blocks).abs() <= blocks.abs() * 2**-4 + step)
