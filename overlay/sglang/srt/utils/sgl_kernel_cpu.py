"""sgl_kernel's CPU ops, with torch fallbacks where sgl_kernel's CPU build is not installed.

On a CPU engine (`SGLANG_USE_CPU_ENGINE=1`, `--device cpu`) several modules import `*_cpu` ops
from sgl_kernel at import time, and PyPI has no CPU build of sgl_kernel, so the server cannot
even start without one. Patch 0006 takes those names from here instead: sgl_kernel's own op when
it is installed, else a torch implementation of the same contract for the ops a plain (non-
speculative) CPU server runs, else a function that raises a clear error when called. Nothing
here is used on a CUDA device: the imports it replaces are all under `if _is_cpu`.
"""

from __future__ import annotations

import ctypes

import torch


def assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] takes the next
    end - start entries of out_cache_loc, request after request (as upstream's Triton kernel
    `assign_req_to_token_pool` in srt/mem_cache/allocation.py does)."""
    del pool_len  # the row length is req_to_token's
    taken = 0
    for req, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[taken : taken + n].to(req_to_token.dtype)
        taken += n


def copy_all_layer_kv_cache(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every buffer b (address data_ptrs[b], row size strides[b] bytes), copy row src_loc[i]
    to row tgt_loc[i] (as upstream's Triton kernel `copy_all_layer_kv_cache_tiled` does)."""
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for tgt, src in zip(tgt_loc.tolist(), src_loc.tolist(), strict=True):
            ctypes.memmove(ptr + tgt * stride, ptr + src * stride, stride)


_FALLBACKS = {
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool,
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache,
}


def _missing(name: str):
    def refuse(*_args, **_kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is needed here (speculative decoding on a CPU engine), and "
            "sgl_kernel's CPU build is not installed; it has no torch fallback"
        )

    refuse.__name__ = name
    return refuse


def cpu_op(name: str):
    """sgl_kernel's `name`, else our torch fallback for it, else a function that refuses."""
    try:
        import sgl_kernel

        return getattr(sgl_kernel, name)
    except (ImportError, AttributeError):
        return _FALLBACKS.get(name) or _missing(name)
