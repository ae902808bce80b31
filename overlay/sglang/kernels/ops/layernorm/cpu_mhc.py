"""DeepSeek-V4's hyper-connection (mHC) ops for CPU tensors.

`hc_split_sinkhorn` (`kernels/ops/layernorm/mhc.py`) is a TileLang kernel, and TileLang is CUDA
only here; patch 0012 sends CPU tensors to upstream's own pure-torch equivalent of that kernel
(`sglang.test.kernels.mhc.hc_split_sinkhorn_torch`, documented there to mirror the kernel's
layout: pre, post, then the comb matrix in each row of `mixes`). It is taken as it is, not
copied, so it stays upstream's.
"""

from __future__ import annotations


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    from sglang.test.kernels.mhc import hc_split_sinkhorn_torch

    return hc_split_sinkhorn_torch(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, eps)
