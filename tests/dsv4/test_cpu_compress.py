"""The c4/c128 compressor and the c4 indexer query on CPU (patches 0018, 0019).

What each test holds the CPU path to, and where that reference comes from:
- Plans: c4's state slot of every write and read is the one upstream's own kernel-test context
  (`sglang.test.kernels.deepseek_v4.common.PagedContext.state_loc`) computes on the SWA ring.
  c128's ring is per request (`c_plan.cuh`): its slots are checked against the ring walked
  token by token (written here, no modulo) and against slots worked out by hand.
- Compression: every compressed entry, however the sequence arrives (one prefill, chunked
  prefill, prefill then decode, with SWA slots out of order), equals the entry computed directly
  from the whole sequence by the definition (written here as transformers' compressors state
  it: the window's rows stacked, one softmax over their scores plus `ape`), so the ring carries
  exactly what a later forward reads.
- Norm and RoPE of the stored entries: transformers' `DeepseekV4RMSNorm`, and RoPE as
  DeepSeek's inference code writes it (interleaved pairs as complex numbers times freqs_cis),
  not `cpu_norm_rope`'s helpers.
- The c4 indexer: keys stored by the compressor and queries made by the indexer op, scored by
  upstream's own torch reader (`fp8_paged_mqa_logits_torch`), rank entries as float math does.
- The indexer's key store: its bytes at offsets worked out by hand, and `load_index_k` gives
  back values chosen to be exact in FP8.
- The main compressed KV store reads back through upstream's V4 dequantizer.
The whole model with these ops against transformers' DSV4 is `test_dsv4_check.py`'s c4c128 test.
"""

import pytest
import torch
from sglang.kernels.ops.attention.dsv4 import (
    CompressorDecodePlan,
    CompressorPrefillPlan,
    compress_forward,
    compress_norm_rope_store,
    cpu_compress,
)
from sglang.kernels.ops.attention.dsv4.rope import precompute_freqs_cis

SWA_PAGE = 256
RING = {4: 8, 128: 128}


def _c128_ring_slot(rid: int, pos: int) -> int:
    """c128's per-request ring walked token by token: request rid owns the rid-th block of
    RING[128] state slots, fills it in token order from its first slot and wraps back to it."""
    first = rid * RING[128]
    slot = first
    for _ in range(pos):
        slot += 1
        if slot == first + RING[128]:
            slot = first
    return slot


class Pool:
    """Requests' tokens on a shuffled full pool and a shuffled SWA mapping, as a radix cache
    and an SWA allocator leave them; one state buffer per ratio."""

    def __init__(self, ratio: int, head_dim: int, reqs: int = 2, tokens: int = 1024, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ratio, self.head_dim = ratio, head_dim
        full = torch.randperm(reqs * tokens, generator=g).to(torch.int32)
        self.req_to_token = full.view(reqs, tokens).contiguous()
        # Whole SWA pages move together (the ring is laid out per SWA page), in shuffled order.
        pages = torch.randperm(reqs * tokens // SWA_PAGE, generator=g)
        swa = (pages[:, None] * SWA_PAGE + torch.arange(SWA_PAGE)).flatten()
        self.full_to_swa = torch.empty(reqs * tokens, dtype=torch.int64)
        self.full_to_swa[full.long()] = swa
        width = head_dim * (4 if ratio == 4 else 2)
        slots = reqs * tokens // SWA_PAGE * RING[ratio]
        self.buffer = torch.zeros(slots // ratio, ratio, width)

    def slot(self, rid: int, pos: int) -> int:
        if self.ratio == 128:
            return _c128_ring_slot(rid, pos)
        from sglang.test.kernels.deepseek_v4.common import PagedContext

        ctx = PagedContext(
            bs=1, head_dim=self.head_dim, compress_ratio=4, swa_page_size=SWA_PAGE, ring_size=8,
            num_swa_pages_per_req=0, req_pool_indices=torch.tensor([rid]),
            req_to_token=self.req_to_token, full_to_swa=self.full_to_swa,
        )  # fmt: skip
        return ctx.state_loc(0, pos)

    def plan(self, rids, seq_lens, extend_lens=None):
        common = dict(
            compress_ratio=self.ratio,
            req_pool_indices=torch.tensor(rids, dtype=torch.int64),
            req_to_token=self.req_to_token,
            full_to_state=self.full_to_swa,
            swa_page_size=SWA_PAGE,
            ring_size=RING[self.ratio],
        )
        seq = torch.tensor(seq_lens, dtype=torch.int64)
        if extend_lens is None:
            return CompressorDecodePlan.generate(seq_lens=seq, **common)
        ext = torch.tensor(extend_lens, dtype=torch.int64)
        return CompressorPrefillPlan.generate(
            seq_lens=seq, extend_lens=ext, num_q_tokens=int(ext.sum()), **common
        )

    def run(self, plan, rows, ape):
        return compress_forward(
            self.buffer, rows, ape, plan, head_dim=self.head_dim, compress_ratio=self.ratio
        )


def _inputs(ratio, head_dim, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    coff = 2 if ratio == 4 else 1
    rows = torch.randn(tokens, 2 * coff * head_dim, generator=g)
    ape = torch.randn(coff * ratio, head_dim, generator=g)  # after upstream's ape hot-fix
    return rows, ape


def _reference(rows, ape, ratio, head_dim, n):
    """Entry n (tokens [ratio*n, ratio*n + ratio)) from the definition."""
    d, lo = head_dim, ratio * n
    if ratio == 128:
        kv, score = rows[lo : lo + 128, :d], rows[lo : lo + 128, d:]
    else:
        own_kv, own_s = rows[lo : lo + 4, d : 2 * d], rows[lo : lo + 4, 3 * d :]
        if n == 0:
            prev_kv, prev_s = torch.zeros(4, d), torch.full((4, d), -cpu_compress.FLT_MAX)
        else:
            prev_kv, prev_s = rows[lo - 4 : lo, :d], rows[lo - 4 : lo, 2 * d : 3 * d]
        kv, score = torch.cat([prev_kv, own_kv]), torch.cat([prev_s, own_s])
    return (kv * torch.softmax(score + ape, dim=0)).sum(0)


@pytest.mark.parametrize("ratio", [4, 128])
def test_plans_put_each_token_in_its_state_slot(ratio):
    pool = Pool(ratio, 128)
    plan = pool.plan([1, 0], seq_lens=[300, 41], extend_lens=[100, 41])
    c = cpu_compress.unpack_plan(plan.plan_c)
    w = cpu_compress.unpack_plan(plan.plan_w)
    rid_of = [1] * 100 + [0] * 41
    pos_of = list(range(200, 300)) + list(range(41))
    closing = [k for k, p in enumerate(pos_of) if (p + 1) % ratio == 0]
    assert c["ragged_id"].tolist() == closing
    assert c["seq_len"].tolist() == [pos_of[k] + 1 for k in closing]
    window = 8 if ratio == 4 else 128
    for k, ragged in enumerate(closing):
        rid, pos = rid_of[ragged], pos_of[ragged]
        j = pos - (200 if rid == 1 else 0)
        assert c["buffer_len"][k] == window - min(j + 1, window)
        if c["buffer_len"][k]:
            assert c["read_page_1"][k] == pool.slot(rid, pos) // ratio
            assert c["read_page_0"][k] == pool.slot(rid, max(pos - ratio, 0)) // ratio
    for ragged, loc in zip(w["ragged_id"].tolist(), w["write_loc"].tolist(), strict=True):
        assert loc == pool.slot(rid_of[ragged], pos_of[ragged])
    # The last window's rows, and for c4 the overlap rows before them, stay in the ring.
    kept = {pos_of[r] for r in w["ragged_id"].tolist() if rid_of[r] == 1}
    assert set(range(300 // ratio * ratio - (4 if ratio == 4 else 0), 300)) <= kept

    d = cpu_compress.unpack_plan(pool.plan([1, 0], seq_lens=[301, 42]).plan_d)
    assert d["write_loc"].tolist() == [pool.slot(1, 300), pool.slot(0, 41)]
    assert d["read_page_1"].tolist() == [pool.slot(1, 300) // ratio, pool.slot(0, 41) // ratio]
    if ratio == 128:
        # By hand: request 1's block is slots 128-255, and token 300 is 44 past its 256th.
        assert d["write_loc"].tolist() == [128 + 44, 41]
        assert d["read_page_1"].tolist() == [1, 0]  # one state page of 128 rows per request
        assert c["read_page_1"][c["seq_len"] == 256].tolist() == [1]  # 200-255 in the ring


def test_graph_plans_are_padded_with_invalid_rows():
    pool = Pool(4, 128)
    common = dict(
        req_pool_indices=torch.tensor([0]), req_to_token=pool.req_to_token,
        full_to_state=pool.full_to_swa, seq_lens=torch.tensor([10]),
        extend_lens=torch.tensor([10]), num_q_tokens=10, compress_ratio=4,
        swa_page_size=SWA_PAGE, ring_size=8,
    )  # fmt: skip
    plan = CompressorPrefillPlan.generate(use_cuda_graph=True, **common)
    assert plan.plan_c.shape == (10, 16) and plan.plan_w.shape == (10, 8)
    c = cpu_compress.unpack_plan(plan.plan_c)
    assert c["seq_len"].tolist() == [4, 8] + [cpu_compress.INVALID_U32] * 8
    with pytest.raises(ValueError, match="ring size"):
        CompressorPrefillPlan.generate(**{**common, "ring_size": 12})


SCHEDULES = {
    "one prefill": [300],
    "chunked prefill": [100, 77, 123],
    "prefill then decode": [250] + [1] * 50,
    "short prefill, long decode": [3] + [1] * 261,
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("ratio", [4, 128])
def test_every_entry_matches_the_definition_however_the_tokens_arrive(ratio, schedule):
    head_dim = 128
    steps = SCHEDULES[schedule]
    total = sum(steps)
    rows, ape = _inputs(ratio, head_dim, total, seed=ratio)
    other_rows, _ = _inputs(ratio, head_dim, total, seed=99)
    pool = Pool(ratio, head_dim)
    got = {}
    done = 0
    for ext in steps:
        # Request 1 is ours; request 0 runs alongside in the same batch, in the same pools.
        if ext == 1:
            plan = pool.plan([0, 1], seq_lens=[done + 1, done + 1])
            out = pool.run(plan, torch.stack([other_rows[done], rows[done]]), ape)
            if (done + 1) % ratio == 0:
                got[(done + 1) // ratio - 1] = out[1]
        else:
            plan = pool.plan([1, 0], seq_lens=[done + ext] * 2, extend_lens=[ext] * 2)
            batch = torch.cat([rows[done : done + ext], other_rows[done : done + ext]])
            out = pool.run(plan, batch, ape)
            c = cpu_compress.unpack_plan(plan.plan_c)
            for k, ragged in enumerate(c["ragged_id"].tolist()):
                if ragged < ext:
                    got[(done + ragged + 1) // ratio - 1] = out[k]
        done += ext
    assert sorted(got) == list(range(total // ratio))
    for n, entry in got.items():
        want = _reference(rows, ape, ratio, head_dim, n)
        torch.testing.assert_close(entry, want, rtol=1e-5, atol=1e-5, msg=f"entry {n}")


def _freqs():
    return precompute_freqs_cis(64, 4096, 0, 160000.0, 1, 32, 1)


def _deepseek_rope(x, positions):
    """DeepSeek's RoPE: the last 64 values as 32 interleaved (real, imag) pairs, times
    freqs_cis at each row's position."""
    pairs = torch.view_as_complex(x[..., -64:].float().reshape(*x.shape[:-1], 32, 2).contiguous())
    f = _freqs()[positions.long()]
    f = f.reshape(f.shape[0], *([1] * (x.dim() - 2)), 32)
    return torch.cat([x[..., :-64].float(), torch.view_as_real(pairs * f).flatten(-2)], -1)


def _normed_roped(kv, weight, eps, positions):
    """A compressed entry's norm (transformers' DeepseekV4RMSNorm) and RoPE (DeepSeek's)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

    norm = DeepseekV4RMSNorm(kv.shape[-1], eps=eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return _deepseek_rope(norm(kv.float()), positions)


def test_index_keys_and_queries_score_as_float_math_does():
    """Keys through the compressor's store, queries through the indexer op, scores through
    upstream's torch reader: the top 16 of 128 entries agree with float scoring."""
    from sglang.kernels.ops.attention.dsv4.norm_rope import fused_q_indexer_rope_hadamard_quant
    from sglang.srt.layers.attention.dsv4.indexer import fp8_paged_mqa_logits_torch

    g = torch.Generator().manual_seed(3)
    n, heads, page = 128, 4, 64
    kv = torch.randn(n, 128, generator=g)
    norm_w = 1 + 0.1 * torch.randn(128, generator=g)
    pool = Pool(4, 128)
    plan = pool.plan([0], seq_lens=[4 * n], extend_lens=[4 * n])
    loc = torch.full((4 * n,), -1, dtype=torch.int64)
    c = cpu_compress.unpack_plan(plan.plan_c)
    loc[c["ragged_id"]] = torch.arange(n)  # entry k goes to index slot k
    cache = torch.zeros(n // page, page * 132, dtype=torch.uint8)
    compress_norm_rope_store(
        kv, plan, norm_weight=norm_w, norm_eps=1e-6, freq_cis=_freqs(), out_loc=loc,
        kvcache=cache, page_size=page,
    )  # fmt: skip

    q = torch.randn(1, heads, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(1, heads, generator=g).to(torch.bfloat16)
    pos = torch.tensor([4 * n])
    q_fp8, weights = fused_q_indexer_rope_hadamard_quant(q, w, 0.5, _freqs(), pos)
    logits = fp8_paged_mqa_logits_torch(
        q_fp8.unsqueeze(1), cache.view(n // page, page, 1, 132), weights.squeeze(-1),
        torch.tensor([n]), torch.arange(n // page).unsqueeze(0), None, n, clean_logits=False,
    )[0]  # fmt: skip

    k_ref = _normed_roped(kv, norm_w, 1e-6, c["seq_len"] - 4)
    q_ref = _deepseek_rope(q, pos)
    want = (torch.relu(q_ref[0] @ k_ref.T) * (w.float()[0, :, None] * 0.5)).sum(0)
    assert torch.nn.functional.cosine_similarity(logits, want, dim=0) > 0.995
    top_got, top_want = set(logits.topk(16).indices.tolist()), set(want.topk(16).indices.tolist())
    assert len(top_got & top_want) >= 14, (sorted(top_got), sorted(top_want))


def test_compressed_kv_store_reads_back_through_upstreams_dequantizer():
    from sglang.test.kernels.deepseek_v4.k_cache_reference import dequantize_k_cache_paged_ref

    g = torch.Generator().manual_seed(5)
    pool = Pool(128, 512)
    plan = pool.plan([0], seq_lens=[3 * 128], extend_lens=[3 * 128])
    kv = torch.randn(3, 512, generator=g)
    norm_w = 1 + 0.1 * torch.randn(512, generator=g)
    page = 64
    loc = torch.full((3 * 128,), -1, dtype=torch.int64)
    loc[[127, 255, 383]] = torch.tensor([5, 0, 2])
    cache = torch.zeros(4, page * 584, dtype=torch.uint8)
    compress_norm_rope_store(
        kv, plan, norm_weight=norm_w, norm_eps=1e-6, freq_cis=_freqs(), out_loc=loc,
        kvcache=cache, page_size=page,
    )  # fmt: skip
    got = dequantize_k_cache_paged_ref(cache, torch.tensor([5, 0, 2]), page).reshape(3, 512)
    want = _normed_roped(kv, norm_w, 1e-6, torch.tensor([0, 128, 256]))
    torch.testing.assert_close(got[:, 448:].float(), want[:, 448:], rtol=1e-2, atol=1e-2)
    # nope: rounded to bf16, then e4m3 (half a step, 2^-4 relative, or near zero half the
    # smallest subnormal step of the tile's scale)
    tiles = want[:, :448].reshape(3, 7, 64)
    scale = tiles.abs().amax(-1, keepdim=True) / 448
    err = (got[:, :448].float().reshape_as(tiles) - tiles).abs()
    assert (err <= tiles.abs() * (2**-4 + 2**-8) + scale * 2**-6 * 2).all(), err.max()


def test_index_keys_are_stored_at_their_page_offsets_and_read_back():
    """store_index_k's bytes at offsets worked out by hand (a page of 64 keys: 64 rows of 128
    FP8 bytes, then 64 fp32 scales), and load_index_k gives the stored rows back: exactly for
    rows of e4m3 values times a power of two, within e4m3's half step for any row."""
    page = 64
    g = torch.Generator().manual_seed(11)
    fp8 = torch.float8_e4m3fn
    v = (torch.randn(3, 128, generator=g) * 100).clamp(-440, 440).to(fp8).float()
    v[:, 7] = 448.0  # each row's largest, so its scale is amax / 448 = the power of two
    x = v * torch.tensor([2.0**-3, 1.0, 2.0**5])[:, None]
    loc = torch.tensor([70, 0, 127])
    cache = torch.zeros(2, page * 132, dtype=torch.uint8)
    cpu_compress.store_index_k(x, loc, cache, page)
    # key 70: page 1, row 6, bytes 768-895, scale at 64 * 128 + 6 * 4 = 8216
    # key 0: page 0, row 0, bytes 0-127, scale at 8192
    # key 127: page 1, row 63, bytes 8064-8191, scale at 8192 + 63 * 4 = 8444
    written = torch.zeros_like(cache, dtype=torch.bool)
    for row, (p, at, scale_at, scale) in enumerate(
        [(1, 768, 8216, 2.0**-3), (0, 0, 8192, 1.0), (1, 8064, 8444, 2.0**5)]
    ):
        assert torch.equal(cache[p, at : at + 128].view(fp8).float(), v[row]), row
        assert cache[p, scale_at : scale_at + 4].view(torch.float32).item() == scale, row
        written[p, at : at + 128] = written[p, scale_at : scale_at + 4] = True
    assert not cache[~written].any()  # nothing else written
    assert torch.equal(cpu_compress.load_index_k(loc, cache, page), x)

    y = torch.randn(5, 128, generator=g) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 300.0])[:, None]
    at = torch.tensor([3, 64, 65, 100, 2])
    cpu_compress.store_index_k(y, at, cache, page)
    got = cpu_compress.load_index_k(at, cache, page)
    scale = y.abs().amax(-1, keepdim=True) / 448
    assert ((got - y).abs() <= y.abs() * 2**-4 + scale * 2**-10).all()
    assert torch.equal(cpu_compress.load_index_k(loc, cache, page), x)  # the others kept
