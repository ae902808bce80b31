"""Kernel tests run the Triton kernels in Triton's interpreter on CPU tensors.

TRITON_INTERPRET is read when a @triton.jit function is defined, so it is set here, before any
test module imports sglang's kernels, and it holds for the whole pytest process. That is
acceptable because no other test folder runs Triton code; the compiled GPU checks need it unset
and therefore run in a subprocess (see test_gpu.py).
"""

import os
import sys
from pathlib import Path

_KERNEL_MODULES = (
    "sglang.kernels.ops.attention.flash_mla_sm120",
    "sglang.kernels.ops.attention.flash_mla_sm120_mma",
)
_already = [name for name in _KERNEL_MODULES if name in sys.modules]
if _already and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError(
        f"{_already} were imported before tests/kernel/conftest.py could set TRITON_INTERPRET=1; "
        "run the kernel tests in their own pytest process"
    )
os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent))
