"""DeepSeek-V4's hyper-connection (mHC) ops in torch, for CPU tensors.

On a CUDA device these are TileLang (`hc_split_sinkhorn`) and Triton (`mhc_combine`,
`fused_hc_head`) kernels. Patch 0012 sends CPU tensors here instead, so that a tiny DSV4 runs
sglang's real model path without a GPU and without upstream Triton kernels in the interpreter.
Two of the three are upstream's own pure-torch equivalents, taken as they are, not copied:
`sglang.test.kernels.mhc.hc_split_sinkhorn_torch` (documented to mirror the kernel's layout:
pre, post, then the comb matrix in each row of `mixes`) and `hc_head_torch` in
`srt/models/deepseek_v4.py` (the model's own path for an empty batch). The third, `mhc_combine`,
is written here; tests/dsv4/test_cpu_ops.py holds it (and the sinkhorn's `pre`) to the streams
that transformers' `DeepseekV4HyperConnection` collapses.
"""

from __future__ import annotations

import torch


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    from sglang.test.kernels.mhc import hc_split_sinkhorn_torch

    return hc_split_sinkhorn_torch(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, eps)


def mhc_combine(
    x_flat: torch.Tensor, pre: torch.Tensor, hc: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """y[m, h] = sum_k pre[m, k] * x_flat[m, k * H + h], in fp32, rounded once."""
    x = x_flat.reshape(x_flat.shape[0], hc, -1).float()
    return (pre.float().unsqueeze(-1) * x).sum(1).to(out_dtype)


def fused_hc_head(x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps) -> torch.Tensor:
    from sglang.srt.models.deepseek_v4 import hc_head_torch

    return hc_head_torch(x, hc_fn, hc_scale, hc_base, norm_eps=norm_eps, hc_eps=hc_eps)
