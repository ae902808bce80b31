"""DeepSeek-V4's norm, RoPE and main KV-store ops in torch, for CPU tensors.

The DSV4 attention path (`MQALayer._forward_prepare` and the inverse RoPE after attention) calls
four ops of `kernels/ops/attention/dsv4/norm_rope.py` that are JIT-compiled CUDA only. Patch 0011
sends them here when their input is a CPU tensor, so that a tiny DSV4 runs the real model path on
a machine without a GPU. Nothing here is reached for a CUDA tensor.

Each function follows the CUDA kernel it stands in for (`jit/csrc/deepseek_v4/main_norm_rope.cuh`,
`rope.cuh`, `fused_norm_rope.cuh`), including where it rounds:
- RoPE rotates interleaved (real, imag) pairs of the last `rope_dim` values by `freqs_cis[pos]`,
  in fp32, and rounds once; `inverse` rotates by the conjugate.
- The query norm is an RMS norm without weight over the head (`eps=None`: no norm), rounded to
  the input dtype before the rotation, as the kernel does.
- The KV store (`k_norm_rope_store`) norms with the weight in fp32, rotates the last 64 values
  and keeps them in bf16, and quantizes the first 448 to FP8 e4m3 in 7 tiles of 64, each with a
  UE8M0 (power-of-two) scale from the tile's absolute maximum (at least 1e-4) / 448. It writes
  the V4 page layout: per page, `page_size` rows of 448 FP8 bytes + 64 bf16, then `page_size`
  rows of 8 scale bytes (7 used). A row whose location is negative is not written.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
NOPE, ROPE, TILE = 448, 64, 64
ROW_BYTES = NOPE + 2 * ROPE  # 576
SCALE_BYTES = 8  # 7 tiles, padded


def _freqs(freqs_cis: torch.Tensor, positions: torch.Tensor):
    f = freqs_cis[positions.long()]
    return f.real.float(), f.imag.float()


def _rotated(x: torch.Tensor, fr: torch.Tensor, fi: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x [T, ..., rope_dim] in fp32; fr, fi [T, rope_dim // 2]."""
    shape = (fr.shape[0],) + (1,) * (x.dim() - 2) + (fr.shape[1],)
    fr, fi = fr.reshape(shape), fi.reshape(shape)
    xr, xi = x[..., 0::2], x[..., 1::2]
    if inverse:
        out = (xr * fr + xi * fi, xi * fr - xr * fi)
    else:
        out = (xr * fr - xi * fi, xr * fi + xi * fr)
    return torch.stack(out, dim=-1).flatten(-2)


def rope_inplace(
    x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor, inverse: bool = False
) -> None:
    """x: [T, rope_dim] or [T, H, rope_dim] (a view is fine), rotated in place."""
    fr, fi = _freqs(freqs_cis, positions)
    x.copy_(_rotated(x.float(), fr, fi, inverse).to(x.dtype))


def q_norm_rope(
    q_input: torch.Tensor,
    q_output: torch.Tensor,
    eps: float | None,
    freqs_cis: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """q_input [T, H, head_dim] -> q_output (same shape, its own dtype)."""
    rope_dim = 2 * freqs_cis.shape[-1]
    x = q_input.float()
    if eps is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        x = x.to(q_input.dtype).float()  # the kernel stores the normed row, then rotates it
    fr, fi = _freqs(freqs_cis, positions)
    rope = _rotated(x[..., -rope_dim:], fr, fi, inverse=False)
    out = torch.cat([x[..., :-rope_dim].to(q_input.dtype), rope.to(q_input.dtype)], dim=-1)
    q_output.copy_(out)


def norm_rope_inplace(
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    freqs_cis: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """kv [T, head_dim]: RMS norm with `weight`, then RoPE on the last rope_dim, in place."""
    kv.copy_(_normed_roped(kv, weight, eps, freqs_cis, positions).to(kv.dtype))


def _normed_roped(kv, weight, eps, freqs_cis, positions) -> torch.Tensor:
    rope_dim = 2 * freqs_cis.shape[-1]
    x = kv.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    fr, fi = _freqs(freqs_cis, positions)
    return torch.cat([x[..., :-rope_dim], _rotated(x[..., -rope_dim:], fr, fi, False)], -1)


def quantize_nope(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 448] fp32 -> (FP8 e4m3 [T, 448], UE8M0 exponents uint8 [T, 7])."""
    tiles = x.reshape(x.shape[0], NOPE // TILE, TILE)
    scale_raw = tiles.abs().amax(-1).clamp_min(1e-4) / FP8_MAX
    bits = scale_raw.view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # ceil to 2^k
    inv_scale = torch.exp2((127 - exp).float())
    q = (tiles * inv_scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return q.reshape_as(x).to(torch.float8_e4m3fn), exp.to(torch.uint8)


def k_norm_rope_store(
    kv: torch.Tensor,
    kv_weight: torch.Tensor,
    eps: float,
    freqs_cis: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    page_size: int,
) -> None:
    """RMS norm + RoPE of kv [T, 512], written as V4 rows of `kvcache` at `out_loc`."""
    x = _normed_roped(kv, kv_weight, eps, freqs_cis, positions)
    store_v4_rows(x, out_loc, kvcache, page_size)


def store_v4_rows(x: torch.Tensor, out_loc: torch.Tensor, kvcache, page_size: int) -> None:
    """Normed, rotated rows x [T, 512] (fp32) -> V4 rows of `kvcache` at `out_loc`."""
    keep = out_loc >= 0
    x, loc = x[keep], out_loc[keep].long()
    if loc.numel() == 0:
        return
    nope, scales = quantize_nope(x[:, :NOPE])
    rope = x[:, NOPE:].to(torch.bfloat16)
    rows = torch.cat([nope.view(torch.uint8), rope.view(torch.uint8)], dim=-1)
    pages = kvcache.view(torch.uint8).reshape(kvcache.shape[0], -1)
    page, slot = loc // page_size, loc % page_size
    data = slot[:, None] * ROW_BYTES + torch.arange(ROW_BYTES)
    pages[page[:, None], data] = rows
    scale_at = page_size * ROW_BYTES + slot[:, None] * SCALE_BYTES + torch.arange(NOPE // TILE)
    pages[page[:, None], scale_at] = scales


# The entry points patch 0011 calls, with the signatures of norm_rope.py's ops.


def fused_rope_inplace(q, k, freqs_cis, positions, inverse=False) -> None:
    rope_inplace(q, freqs_cis, positions, inverse)
    if k is not None:
        rope_inplace(k, freqs_cis, positions, inverse)


def fused_k_norm_rope_flashmla(
    kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size, layout, q=None
) -> None:
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    if KVLayout.parse(layout) is not KVLayout.V4 or q is not None:
        raise NotImplementedError(
            f"the CPU KV store writes the V4 layout without a fused query RoPE "
            f"(asked: layout {layout}, q {'given' if q is not None else 'None'})"
        )
    k_norm_rope_store(kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size)
