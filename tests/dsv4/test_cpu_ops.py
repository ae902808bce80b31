"""The CPU fallbacks of patches 0011-0013, each against a reference that is not the code under
test: upstream's or transformers' code where they have one, else the formula written out here.

- RoPE: DeepSeek's formulation (interleaved pairs as complex numbers times freqs_cis), written
  here as DeepSeek's inference code writes it, and transformers' DSV4 `apply_rotary_pos_emb`
  with cos/sin from the same table.
- The norms: the RMS norm written out here (mean of squares, rsqrt, weight), with the query
  norm's rounding to the input dtype before RoPE that the kernel makes.
- The V4 KV store: upstream's byte-level store (`set_k_and_s_torch`) and dequantizer
  (`dequantize_k_cache_paged_ref`) for the page layout; FP8 error within e4m3's half step.
- mHC: transformers' `DeepseekV4HyperConnection` (sinkhorn's post and comb, and the collapse of
  the streams with pre that `mhc_combine` makes) and `DeepseekV4HyperHead` (`fused_hc_head`).
- The clamped SwiGLU: transformers' DSV4 experts' gate (`DeepseekV4Experts._apply_gate`).
Each is called through sglang's own op (the patched hook), so the dispatch is tested too.
"""

import pytest
import torch
from sglang.kernels.ops.attention.dsv4 import norm_rope
from sglang.kernels.ops.attention.dsv4.rope import precompute_freqs_cis

ROPE = 64
GEN = torch.Generator().manual_seed(7)


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN).to(dtype)


def _freqs():
    return precompute_freqs_cis(ROPE, 4096, 0, 10000.0, 1, 32, 1)


def _deepseek_rope(x, freqs_cis, positions, inverse=False):
    """DeepSeek's reference: pairs as complex numbers, times freqs_cis (conj for inverse)."""
    f = freqs_cis[positions]
    f = f.conj() if inverse else f
    shape = (f.shape[0],) + (1,) * (x.dim() - 2) + (f.shape[1],)
    c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(c * f.reshape(shape)).flatten(-2)


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_inplace_is_deepseeks_rotation(inverse):
    freqs, pos = _freqs(), torch.tensor([0, 5, 127, 128, 4000])
    q = _randn(5, 8, 512, dtype=torch.bfloat16)
    k = _randn(5, 1, 512, dtype=torch.bfloat16)
    want_q = _deepseek_rope(q[..., -ROPE:], freqs, pos, inverse)
    want_k = _deepseek_rope(k[..., -ROPE:], freqs, pos, inverse)
    nope = q[..., :-ROPE].clone()
    norm_rope.fused_rope_inplace(q[..., -ROPE:], k[..., -ROPE:], freqs, pos, inverse=inverse)
    torch.testing.assert_close(q[..., -ROPE:].float(), want_q, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(k[..., -ROPE:].float(), want_k, atol=2e-2, rtol=1e-2)
    assert torch.equal(q[..., :-ROPE], nope)  # only the rope tail moves


def test_rope_matches_transformers_apply_rotary_pos_emb():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    freqs, pos = _freqs(), torch.arange(0, 300, 7)
    x = _randn(len(pos), 4, 512)
    cos, sin = freqs[pos].real.unsqueeze(0), freqs[pos].imag.unsqueeze(0)
    want = apply_rotary_pos_emb(x.unsqueeze(0).transpose(1, 2), cos, sin).transpose(1, 2)[0]
    got = x.clone()
    norm_rope.fused_rope_inplace(got[..., -ROPE:], None, freqs, pos)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("eps", [1e-6, None])
def test_q_norm_rope(eps):
    freqs, pos = _freqs(), torch.tensor([3, 200, 1000])
    q = _randn(3, 8, 512, dtype=torch.bfloat16) * 3
    out = torch.empty_like(q)
    norm_rope.fused_q_norm_rope(q, out, eps, freqs, pos)
    x = q.float()
    if eps is not None:
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).bfloat16().float()
    torch.testing.assert_close(out[..., :-ROPE].float(), x[..., :-ROPE], atol=0, rtol=0)
    want = _deepseek_rope(x[..., -ROPE:], freqs, pos)
    torch.testing.assert_close(out[..., -ROPE:].float(), want, atol=2e-2, rtol=1e-2)


def test_norm_rope_inplace_with_weight():
    freqs, pos = _freqs(), torch.tensor([1, 2, 300])
    kv, w = _randn(3, 512, dtype=torch.bfloat16), _randn(512) * 0.1 + 1
    x = kv.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    want = torch.cat([x[..., :-ROPE], _deepseek_rope(x[..., -ROPE:], freqs, pos)], -1)
    norm_rope.fused_norm_rope_inplace(kv, w.bfloat16(), 1e-6, freqs, pos)
    torch.testing.assert_close(kv.float(), want, atol=3e-2, rtol=1e-2)


def _store(page_size=64, pages=4, locs=(0, 5, 63, 64, 130, 255)):
    freqs = _freqs()
    loc = torch.tensor(locs)
    pos = torch.tensor([10, 11, 12, 500, 900, 3000])[: len(locs)]
    kv = _randn(len(locs), 512, dtype=torch.bfloat16) * 4
    w = (_randn(512) * 0.1 + 1).bfloat16()
    cache = torch.zeros(pages, page_size * 584, dtype=torch.uint8)
    norm_rope.fused_k_norm_rope_flashmla(kv, w, 1e-6, freqs, pos, loc, cache, page_size)
    x = kv.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    want = torch.cat([x[..., :-ROPE], _deepseek_rope(x[..., -ROPE:], freqs, pos)], -1)
    return cache, loc, want, page_size


def test_kv_store_reads_back_through_upstreams_dequantizer():
    from sglang.test.kernels.deepseek_v4.k_cache_reference import dequantize_k_cache_paged_ref

    cache, loc, want, page_size = _store()
    got = dequantize_k_cache_paged_ref(cache, loc, page_size).reshape(len(loc), 512).float()
    # rope: bf16 of the rotated fp32 value; nope: e4m3 keeps 3 mantissa bits, so a value is
    # within half a step (2^-4 relative) or, near zero, half the smallest subnormal step.
    torch.testing.assert_close(got[:, 448:], want[:, 448:], atol=2e-2, rtol=8e-3)
    tiles = want[:, :448].reshape(len(loc), 7, 64)
    scale = tiles.abs().amax(-1, keepdim=True) / 448
    err = (got[:, :448].reshape_as(tiles) - tiles).abs()
    assert (err <= tiles.abs() * 2**-4 + scale * 2**-6 * 2).all(), err.max()
    # Untouched rows stay zero: only the six locations were written.
    other = torch.tensor(sorted(set(range(256)) - set(loc.tolist())))
    assert dequantize_k_cache_paged_ref(cache, other, page_size).abs().sum() == 0


def test_kv_store_bytes_are_upstreams_layout():
    """The same quantized row through upstream's byte-level V4 store gives identical pages."""
    from sglang.kernels.ops.attention.dsv4.cpu_norm_rope import quantize_nope
    from sglang.kernels.ops.kvcache.dsv4_main_kv_store import NopeFp8RopeBf16Pack
    from sglang.test.kernels.deepseek_v4.k_cache_reference import set_k_and_s_torch

    cache, loc, want, page_size = _store()
    nope, scales = quantize_nope(want[:, :448])
    pack = NopeFp8RopeBf16Pack(
        k_nope_fp8=nope, k_rope_bf16=want[:, 448:].bfloat16(), scale_k_nope_ue8m0=scales
    )
    ref = torch.zeros_like(cache)
    set_k_and_s_torch(ref, loc, pack, page_size)
    assert torch.equal(cache, ref)


def test_kv_store_skips_rows_without_a_slot():
    cache, _, _, page_size = _store(locs=(-1, 3, -1))
    rows = cache.reshape(4, -1)[0, : page_size * 576].reshape(page_size, 576)
    assert rows[3].any() and not rows[[0, 1, 2, 4]].any()


def _hyper_connection(streams):
    """transformers' DeepseekV4HyperConnection with random weights on streams [2, 3, 4, 64]:
    its (post, comb, collapsed), and sglang's hc_split_sinkhorn (pre, post, comb) on the same
    mixes (the layer's own projection of its normed, flattened streams)."""
    from sglang.kernels.ops.layernorm.mhc import hc_split_sinkhorn
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4HyperConnection,
    )

    cfg = DeepseekV4Config(hidden_size=64, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6)
    hc = DeepseekV4HyperConnection(cfg)
    with torch.no_grad():
        for p in hc.parameters():
            p.copy_(_randn(*p.shape) * 0.5)
        want = hc(streams)
        mixes = torch.nn.functional.linear(hc.input_norm(streams.view(2, 3, -1).float()), hc.fn)
        return want, hc_split_sinkhorn(mixes, hc.scale, hc.base, 4, 20, 1e-6)


def test_hc_split_sinkhorn_matches_transformers_hyper_connection():
    from sglang.kernels.ops.layernorm.mhc import mhc_combine

    streams = _randn(2, 3, 4, 64)
    (post, comb, collapsed), (pre, post2, comb2) = _hyper_connection(streams)
    torch.testing.assert_close(post2, post, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(comb2, comb, atol=1e-5, rtol=1e-5)
    # pre: transformers keeps it to itself, and returns the streams it collapsed with it.
    got = mhc_combine(streams.reshape(6, 4 * 64), pre.reshape(6, 4), 4, torch.float32)
    torch.testing.assert_close(got, collapsed.reshape(6, 64))


def test_mhc_combine_collapses_the_streams_as_transformers_hyper_connection_does():
    """bf16 streams weighted by sglang's pre (from hc_split_sinkhorn): transformers sums them
    in fp32 and rounds once, as mhc_combine does, so the two agree within one bf16 step."""
    from sglang.kernels.ops.layernorm.mhc import mhc_combine

    streams = _randn(2, 3, 4, 64, dtype=torch.bfloat16)
    (_, _, collapsed), (pre, _, _) = _hyper_connection(streams)
    got = mhc_combine(streams.reshape(6, 4 * 64), pre.reshape(6, 4), 4, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, collapsed.reshape(6, 64), atol=0, rtol=2**-7)


def test_silu_and_mul_clamp_matches_transformers_experts_gate():
    from sglang.kernels.ops.activation.silu_and_mul_clamp import silu_and_mul_clamp
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    cfg = DeepseekV4Config(
        hidden_size=64, intermediate_size=96, num_local_experts=1, swiglu_limit=10.0
    )
    x = (_randn(5, 2 * 96) * 8).bfloat16()
    out = torch.empty(5, 96, dtype=torch.bfloat16)
    silu_and_mul_clamp(x, out, 10.0)
    want = DeepseekV4Experts(cfg)._apply_gate(x.float())
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
    assert (x[:, :96].float() > 10).any() and (x[:, 96:].float().abs() > 10).any()  # clamped


def test_fused_hc_head_matches_transformers_hyper_head():
    from sglang.kernels.ops.layernorm.mhc_head import fused_hc_head
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    cfg = DeepseekV4Config(hidden_size=64, hc_mult=4, hc_eps=1e-6, rms_norm_eps=1e-6)
    head = DeepseekV4HyperHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(_randn(*p.shape) * 0.5)
    x = _randn(5, 4, 64)
    got = fused_hc_head(x, head.hc_fn, head.hc_scale, head.hc_base, 1e-6, 1e-6)
    torch.testing.assert_close(got, head(x.unsqueeze(0))[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "value, message",
    [
        ("yes", "SGLANG_CPU_SM120_PATH='yes': expected 1"),
        ("1", "SGLANG_CPU_SM120_PATH=1 is for a CPU engine"),  # this pytest process is not one
    ],
)
def test_cpu_sm120_path_refuses_a_bad_value_or_a_non_cpu_engine(monkeypatch, value, message):
    from sglang.srt.runtime_context import get_platform
    from sglang.srt.utils import cpu_sm120

    monkeypatch.setenv("SGLANG_CPU_SM120_PATH", value)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    with pytest.raises(ValueError, match=message):
        cpu_sm120.select_cpu_sm120_path()
    monkeypatch.setenv("SGLANG_CPU_SM120_PATH", "0")
    assert cpu_sm120.select_cpu_sm120_path() is False
    assert "is_sm120" not in object.__getattribute__(get_platform(), "_overrides")
