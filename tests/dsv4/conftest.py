"""tests/dsv4 imports sglang's DSV4 kernel modules, which define Triton kernels.

TRITON_INTERPRET is read when a @triton.jit function is defined, and one pytest process must not
hold a mix of compiled and interpreted kernels: tests/kernel, collected after this folder, runs
ours in the interpreter, and kernels that this folder's modules defined without the variable
break it there ("Cannot call @triton.jit'd outside of the scope of a kernel", seen in a full
`pytest tests` run). So it is set here too, before this folder's test modules import sglang.
bench/dsv4_check and the engine test set it in their own processes as well.
"""

import os
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


@pytest.fixture(scope="module")
def c4c128_model() -> Path:
    """The standard tiny DSV4 with a c4 (indexer) and a c128 layer."""
    sys.path.insert(0, str(ROOT))
    from bench import dsv4_check

    return dsv4_check.standard_model("c4c128")
