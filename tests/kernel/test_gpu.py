"""The mma backend compiled for a real GPU (skipped without CUDA).

The checks run in a subprocess without TRITON_INTERPRET, which this test process has set for
the interpreter tests (see conftest.py).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CHECK = Path(__file__).with_name("gpu_check.py")


def _gpu_check(mode: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(CHECK), mode], env=env, capture_output=True, text=True, timeout=900
    )


def test_compiled_mma_matches_upstream_reference():
    done = _gpu_check("compare")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("ok compare") == 32


def test_cuda_graph_replay_matches_eager():
    done = _gpu_check("graph")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("ok graph") == 2
