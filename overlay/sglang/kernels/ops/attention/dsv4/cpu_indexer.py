"""DeepSeek-V4's c4 indexer query op in torch, for CPU tensors.

The c4 layers' indexer scores every compressed entry with FP8 queries against the FP8 index keys
that the compressor stores (`cpu_compress.py`). Upstream makes its queries with a JIT CUDA kernel
(`fused_q_indexer_rope_hadamard_quant` in `jit/csrc/deepseek_v4/main_norm_rope.cuh`); patch 0019
sends CPU tensors here. The scoring itself already has a torch path
(`SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1`, `--dsa-topk-backend torch`).

As the kernel does, per (token, head) row of 128 values, in fp32 and without a norm: RoPE on the
last 64 values (interleaved pairs), the Walsh-Hadamard transform scaled by 1/sqrt(128), then FP8
e4m3 with one scale (absolute maximum, at least 1e-4, / 448). The scale is not returned: it is
folded into the head's weight, `weights_out = weight * weight_scale * scale`.
"""

from __future__ import annotations

import torch
from sglang.kernels.ops.attention.dsv4 import cpu_norm_rope
from sglang.kernels.ops.attention.dsv4.cpu_compress import hadamard


def q_indexer_rope_hadamard_quant(
    q_input: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: float,
    freqs_cis: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_input [T, H, 128], weight [T, H] -> (q FP8 [T, H, 128], weights [T, H, 1] fp32)."""
    rope_dim = 2 * freqs_cis.shape[-1]
    x = q_input.float()
    fr, fi = cpu_norm_rope._freqs(freqs_cis, positions)
    rope = cpu_norm_rope._rotated(x[..., -rope_dim:], fr, fi, inverse=False)
    x = hadamard(torch.cat([x[..., :-rope_dim], rope], dim=-1))
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-4) / cpu_norm_rope.FP8_MAX
    q = (x / scale).clamp(-cpu_norm_rope.FP8_MAX, cpu_norm_rope.FP8_MAX).to(torch.float8_e4m3fn)
    weights = weight.float().unsqueeze(-1) * float(weight_scale) * scale
    return q, weights
