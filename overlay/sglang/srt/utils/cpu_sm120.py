"""SGLANG_CPU_SM120_PATH: a CPU engine takes DeepSeek-V4's SM120 attention path.

On a GPU the device decides whether DSV4 attention goes through `flash_mla_with_kvcache_sm120`
(`get_platform().is_sm120`). A CPU engine has no such device, so it would take a path that needs
FlashMLA's CUDA kernels. With `SGLANG_CPU_SM120_PATH=1` on a CPU engine (`SGLANG_USE_CPU_ENGINE=1`,
`--device cpu`), patch 0016 calls `select_cpu_sm120_path` at the start of each scheduler process,
which sets `is_sm120` there with upstream's `override_platform`, so the engine's DSV4 backend and
model take the SM120 path, and `SGLANG_SM120_FLASHMLA_BACKEND` picks the kernel (`mma`: ours, in
the Triton interpreter with `TRITON_INTERPRET=1`). Only the scheduler processes are affected: the
HTTP server and the tokenizer do not run attention. Unset or 0: nothing changes. Any other value,
or 1 on an engine that is not a CPU engine, stops the scheduler with an error naming the variable.
"""

from __future__ import annotations

import logging
import os

ENV = "SGLANG_CPU_SM120_PATH"
logger = logging.getLogger(__name__)


def select_cpu_sm120_path() -> bool:
    """Set is_sm120 in this process when SGLANG_CPU_SM120_PATH=1 on a CPU engine."""
    value = os.environ.get(ENV, "").strip()
    if value in ("", "0"):
        return False
    if value != "1":
        raise ValueError(f"{ENV}={value!r}: expected 1 (take the SM120 path on CPU) or 0")
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.utils import is_cpu

    if not is_cpu():
        raise ValueError(
            f"{ENV}=1 is for a CPU engine (SGLANG_USE_CPU_ENGINE=1, --device cpu); on a GPU "
            "the device decides the attention path: unset it"
        )
    override_platform(is_sm120=True).install()
    backend = os.environ.get("SGLANG_SM120_FLASHMLA_BACKEND", "flashinfer")
    logger.info(
        "%s=1: this CPU scheduler takes the SM120 DSV4 attention path "
        "(SGLANG_SM120_FLASHMLA_BACKEND=%s)",
        ENV,
        backend,
    )
    return True
