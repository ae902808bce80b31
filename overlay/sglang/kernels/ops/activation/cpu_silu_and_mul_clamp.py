"""DeepSeek-V4's clamped SwiGLU in torch, for CPU tensors.

`silu_and_mul_clamp` (`kernels/ops/activation/silu_and_mul_clamp.py`) is a JIT-compiled CUDA
kernel; patch 0012 sends CPU tensors here. As the kernel does (`SiluAndMulClampKernel`): the gate
(first half of the row) is clamped above at `limit` and the up half to [-limit, limit] in the
input dtype, then silu(gate) * up is computed in fp32 and rounded once to the output dtype.
"""

from __future__ import annotations

import torch


def silu_and_mul_clamp(input: torch.Tensor, output: torch.Tensor, swiglu_limit: float) -> None:
    d = input.shape[-1] // 2
    limit = float(swiglu_limit)
    gate = input[..., :d].clamp(max=limit).float()
    up = input[..., d:].clamp(min=-limit, max=limit).float()
    output.copy_((gate / (1.0 + torch.exp(-gate)) * up).to(output.dtype))
