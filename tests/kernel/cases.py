"""Synthetic DSV4 sparse-decode inputs in upstream's FP8 paged layout, shared by the
interpreter tests and the GPU checks.

A page holds page_size tokens of 576 data bytes (448 FP8 e4m3 nope values, 64 BF16 rope values)
followed by page_size x 8 scale bytes (7 UE8M0 exponents + 1 pad byte); the page's byte size is
rounded up to a multiple of 576, as in sglang's DSV4 KV pool.
"""

from dataclasses import dataclass

import torch

BYTES_PER_TOKEN = 584


def page_bytes_for(page_size: int) -> int:
    return -(-page_size * BYTES_PER_TOKEN // 576) * 576


def make_kv_cache(num_pages: int, page_size: int, gen: torch.Generator, device) -> torch.Tensor:
    """A [pages, page_size, 1, 584] float8 view of a random page buffer, like the pool's."""
    page_bytes = page_bytes_for(page_size)
    raw = torch.zeros(num_pages, page_bytes, dtype=torch.uint8)
    data = raw[:, : page_size * 576].view(num_pages, page_size, 576)
    nope = (torch.randn(num_pages, page_size, 448, generator=gen) * 2).to(torch.float8_e4m3fn)
    data[..., :448] = nope.view(torch.uint8)
    rope = torch.randn(num_pages, page_size, 64, generator=gen).to(torch.bfloat16)
    data[..., 448:] = rope.view(torch.uint8).view(num_pages, page_size, 128)
    scales = raw[:, page_size * 576 : page_size * 584].view(num_pages, page_size, 8)
    # Exponents around 2^0 so that no dimension group dominates every score.
    scales[..., :7] = torch.randint(122, 130, (num_pages, page_size, 7), generator=gen).to(
        torch.uint8
    )
    raw = raw.to(device)
    return raw.view(torch.float8_e4m3fn).as_strided(
        (num_pages, page_size, 1, BYTES_PER_TOKEN),
        (page_bytes, BYTES_PER_TOKEN, BYTES_PER_TOKEN, 1),
    )


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    swa_topk: int
    swa_page_size: int = 64
    extra_topk: int = 0
    extra_page_size: int = 64
    with_lengths: bool = True
    sink: bool = True
    empty_row: bool = False
    seed: int = 0

    def __str__(self) -> str:
        extra = f"+extra{self.extra_topk}p{self.extra_page_size}" if self.extra_topk else ""
        return (
            f"B{self.batch}-H{self.heads}-swa{self.swa_topk}p{self.swa_page_size}{extra}"
            f"{'-len' if self.with_lengths else ''}{'-sink' if self.sink else ''}"
            f"{'-empty' if self.empty_row else ''}"
        )


def _indices(batch, topk, num_tokens, gen, device):
    idx = torch.randint(0, num_tokens, (batch, 1, topk), generator=gen, dtype=torch.int32)
    # About one index in eight is -1 (a hole the kernel must skip).
    holes = torch.rand(batch, 1, topk, generator=gen) < 0.125
    return idx.masked_fill(holes, -1).to(device)


def _lengths(batch, topk, gen, device):
    # Between half the list and the whole list, so tiles past the length must be skipped.
    return torch.randint(topk // 2, topk + 1, (batch,), generator=gen, dtype=torch.int32).to(device)


def make_inputs(case: Case, device="cpu") -> dict:
    """Keyword arguments for flash_mla_with_kvcache_sm120 (upstream's names)."""
    gen = torch.Generator().manual_seed(case.seed)
    swa_pages = 3
    kwargs = {
        "q": torch.randn(case.batch, 1, case.heads, 512, generator=gen).to(torch.bfloat16),
        "k_cache": make_kv_cache(swa_pages, case.swa_page_size, gen, device),
        "indices": _indices(case.batch, case.swa_topk, swa_pages * case.swa_page_size, gen, device),
        "topk_length": (
            _lengths(case.batch, case.swa_topk, gen, device) if case.with_lengths else None
        ),
        "attn_sink": torch.randn(case.heads, generator=gen).to(device) if case.sink else None,
        "head_dim_v": 512,
        "softmax_scale": 512**-0.5,
        "extra_k_cache": None,
        "extra_indices_in_kvcache": None,
        "extra_topk_length": None,
    }
    kwargs["q"] = kwargs["q"].to(device)
    if case.extra_topk:
        extra_pages = 4
        kwargs["extra_k_cache"] = make_kv_cache(extra_pages, case.extra_page_size, gen, device)
        kwargs["extra_indices_in_kvcache"] = _indices(
            case.batch, case.extra_topk, extra_pages * case.extra_page_size, gen, device
        )
        if case.with_lengths:
            kwargs["extra_topk_length"] = _lengths(case.batch, case.extra_topk, gen, device)
    if case.empty_row:
        # The last request has no valid token at all: every index is -1.
        kwargs["indices"][-1] = -1
        if case.extra_topk:
            kwargs["extra_indices_in_kvcache"][-1] = -1
    return kwargs


def reference_args(kwargs: dict) -> tuple:
    """Positional arguments of upstream's _sm120_sparse_decode_fwd for the same inputs."""
    return (
        kwargs["q"],
        kwargs["k_cache"],
        kwargs["indices"],
        kwargs["topk_length"],
        kwargs["attn_sink"],
        kwargs["head_dim_v"],
        kwargs["softmax_scale"],
        kwargs["extra_k_cache"],
        kwargs["extra_indices_in_kvcache"],
        kwargs["extra_topk_length"],
    )


def assert_matches_reference(out, lse, ref_out, ref_lse) -> None:
    """bf16 output within bf16 rounding of P (and of the output itself); lse to fp32 noise."""
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    o, r = out.float(), ref_out.float()
    tol = 1e-2 * r.abs().amax().clamp(min=1.0) + 1e-2 * r.abs()
    bad = ((o - r).abs() > tol) | (o.isnan() != r.isnan())
    assert not bad.any(), f"{int(bad.sum())} output values off, max abs err {(o - r).abs().max()}"
    lse = lse.reshape(ref_lse.shape)
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite), "rows with/without valid tokens differ"
    assert torch.equal(lse[~finite], ref_lse[~finite])
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-4, atol=1e-4)
