"""DeepSeek-V4's c4/c128 KV compressor in torch, for CPU tensors.

A compressing layer (ratio 4 with its indexer, or 128) folds every `ratio` tokens of the layer's
`wkv_gate` output into one compressed KV entry: a softmax over the window's scores (plus the
learned position bias `ape`) weights the window's KV rows. Rows that a later window still needs
wait in a per-layer state ring. Upstream does this with JIT CUDA only (`jit/csrc/deepseek_v4/`:
`c_plan.cuh`, `c4_v2.cuh`, `c128_v2.cuh`, `fused_norm_rope_v2.cuh`), called from
`kernels/ops/attention/dsv4/compress.py`. Patch 0018 sends those calls here when their tensors
are on the CPU; nothing here is reached for a CUDA tensor.

Every function follows the kernel it stands in for, including its data layout, so that the
attention backend's metadata, the KV pools and the state pools are used exactly as on a GPU:

- **Plans** are the kernels' packed structs, as uint8 rows (`compress_v2.cuh`):
  `DecodePlan` (16 B: u32 seq_len, i32 write_loc, i32 read_page_0, i32 read_page_1),
  `CompressPlan` (16 B: u32 seq_len, u16 ragged_id, u16 buffer_len, i32 read_page_0,
  i32 read_page_1; invalid = seq_len 0xFFFFFFFF) and `WritePlan` (8 B: u32 ragged_id,
  i32 write_loc; invalid = ragged_id 0xFFFFFFFF).
- **State slots.** c128 (and c4 with a per-request ring) use `rid * ring + pos % ring`; c4
  otherwise maps the token's SWA slot `s` to `(s // swa_page_size) * ring + s % ring`. A read
  page is a slot divided by the ratio.
- **c4** reads an 8-row window: rows 0-3 are the previous 4 tokens' "overlap" halves, rows 4-7
  the current 4 tokens' own halves. A state row is `[kv_overlap | kv | score_overlap | score]`
  (4 x head_dim). The first window of a sequence has no overlap rows (kv 0, score -FLT_MAX).
  **c128** reads 128 rows of `[kv | score]`.
- In prefill, a window's first `buffer_len` rows come from the state ring (earlier chunks), the
  rest from this forward's ragged input; the compress step reads the ring before the write step
  refreshes it. In decode the token's row is written first, then the window is read back, and
  only a sequence whose length is a multiple of the ratio produces an entry.
- **Norm, RoPE, store** of each entry at position `seq_len - ratio`: RMS norm (weight in the
  entry's dtype), RoPE on the last 64 values, then
  - head_dim 512: the V4 584-byte page, as the main KV store writes it, except that the 448
    "nope" values are rounded to bf16 before their FP8 quantization (the kernel does);
  - head_dim 128 (the indexer's keys): a Walsh-Hadamard transform scaled by 1/sqrt(128), then
    FP8 e4m3 with one fp32 scale (absolute maximum, at least 1e-4, / 448) per row, in pages of
    `page_size` rows of 128 bytes followed by `page_size` 4-byte scales.
"""

from __future__ import annotations

import torch
from sglang.kernels.ops.attention.dsv4 import cpu_norm_rope

INVALID_U32 = 0xFFFFFFFF
FLT_MAX = torch.finfo(torch.float32).max
INDEX_DIM = 128
INDEX_ROW_BYTES = INDEX_DIM + 4  # 128 FP8 + one fp32 scale


def _window(ratio: int) -> int:
    return ratio * (2 if ratio == 4 else 1)


# --- plans -------------------------------------------------------------------------------


def _pack(rows: list[tuple[int, ...]], width: int) -> torch.Tensor:
    """Rows of 32-bit words (each taken mod 2**32) -> uint8 [n, 4 * width], little-endian."""
    words = torch.tensor(rows, dtype=torch.int64).reshape(-1, width) & INVALID_U32
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).view(torch.uint8).reshape(-1, 4 * width)


def _pack_c(rows: list[tuple[int, int, int, int, int]]) -> torch.Tensor:
    """CompressPlan rows: (seq_len, ragged_id, buffer_len, read_page_0, read_page_1)."""
    return _pack([(s, r | (b << 16), p0, p1) for s, r, b, p0, p1 in rows], 4)


def unpack_plan(plan: torch.Tensor) -> dict[str, torch.Tensor]:
    """A plan tensor's fields as int64 columns (DecodePlan, CompressPlan or WritePlan)."""
    plan = plan.contiguous()
    if plan.shape[-1] == 8:
        w = plan.view(torch.int32).long()
        return {"ragged_id": w[:, 0] & INVALID_U32, "write_loc": w[:, 1]}
    i32 = plan.view(torch.int32).long()
    fields = {
        "seq_len": i32[:, 0] & INVALID_U32,
        "read_page_0": i32[:, 2],
        "read_page_1": i32[:, 3],
    }
    u16 = plan.view(torch.int16).long() & 0xFFFF
    fields.update(ragged_id=u16[:, 2], buffer_len=u16[:, 3], write_loc=i32[:, 1])
    return fields


class _Slots:
    """Token position -> state-ring slot, as `c_plan.cuh` computes it."""

    def __init__(self, ratio, req_to_token, full_to_state, swa_page_size, ring_size, use_req_ring):
        self.ratio, self.ring, self.swa_page = ratio, ring_size, swa_page_size
        self.req_ring = ratio == 128 or use_req_ring
        self.r2t, self.f2s = req_to_token, full_to_state

    def loc(self, rid: int, pos: int) -> int:
        if self.req_ring:
            return rid * self.ring + pos % self.ring
        swa = int(self.f2s[int(self.r2t[rid, pos])])
        return (swa // self.swa_page) * self.ring + swa % self.ring

    def page(self, rid: int, pos: int) -> int:
        return self.loc(rid, pos) // self.ratio


def _check_ratio(ratio: int, swa_page_size: int, ring_size: int, use_req_ring: bool) -> None:
    if ratio not in (4, 128):
        raise ValueError(f"compress ratio {ratio}: the compressor has ratios 4 and 128")
    if use_req_ring and ratio != 4:
        raise ValueError("a per-request ring is a c4 option")
    if swa_page_size % ring_size or ring_size % ratio:
        raise ValueError(
            f"ring size {ring_size} must divide the SWA page size {swa_page_size} "
            f"and be a multiple of the ratio {ratio}"
        )


def plan_decode(
    req_pool_indices, req_to_token, full_to_state, seq_lens, ratio, swa_page_size, ring_size,
    use_req_ring=False,
) -> torch.Tensor:  # fmt: skip
    """DecodePlan rows [bs, 16] for one decode token per request."""
    _check_ratio(ratio, swa_page_size, ring_size, use_req_ring)
    slots = _Slots(ratio, req_to_token, full_to_state, swa_page_size, ring_size, use_req_ring)
    rows = []
    for rid, seq_len in zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True):
        pos1 = seq_len - 1
        pos0 = max(pos1 - ratio, 0)
        write_loc = slots.loc(rid, pos1)
        rows.append((seq_len, write_loc, slots.page(rid, pos0), write_loc // ratio))
    return _pack(rows, 4).to(req_pool_indices.device)


def plan_prefill(
    req_pool_indices, req_to_token, full_to_state, seq_lens, extend_lens, num_q_tokens, ratio,
    swa_page_size, ring_size, use_req_ring=False, use_cuda_graph=False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(CompressPlan rows [num_c, 16], WritePlan rows [num_w, 8]) for a ragged extend batch.

    A compress row per token that closes a window; a write row per token a later forward
    still reads from the ring. With `use_cuda_graph` both are padded to num_q_tokens with
    invalid rows, as the kernel pads them.
    """
    _check_ratio(ratio, swa_page_size, ring_size, use_req_ring)
    slots = _Slots(ratio, req_to_token, full_to_state, swa_page_size, ring_size, use_req_ring)
    overlap = ratio == 4
    window = _window(ratio)
    mtp_pad = ring_size - window + 2 if ring_size > window else 0
    plan_c, plan_w = [], []
    ragged = 0
    for b, (rid, seq_len, ext) in enumerate(
        zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_lens.tolist(), strict=True)
    ):
        if not 0 < ext <= seq_len:
            raise ValueError(f"request {b}: extend length {ext} outside (0, {seq_len}]")
        prefix = seq_len - ext
        first_w = min(seq_len // ratio * ratio - (ratio if overlap else 0), seq_len - mtp_pad)
        for j in range(ext):
            pos = prefix + j
            if (pos + 1) % ratio == 0:
                buffer_len = window - min(j + 1, window)
                pages = (-1, b)
                if buffer_len > 0:
                    pages = (slots.page(rid, max(pos - ratio, 0)), slots.page(rid, pos))
                plan_c.append((pos + 1, ragged + j, buffer_len, *pages))
            tail = overlap and not slots.req_ring and pos % swa_page_size >= swa_page_size - ratio
            if pos >= first_w or tail:
                plan_w.append((ragged + j, slots.loc(rid, pos)))
        ragged += ext
    if ragged != num_q_tokens:
        raise ValueError(f"extend lengths sum to {ragged}, not num_q_tokens {num_q_tokens}")
    if use_cuda_graph:
        plan_c += [(INVALID_U32, 0, 0, -1, -1)] * (num_q_tokens - len(plan_c))
        plan_w += [(INVALID_U32, -1)] * (num_q_tokens - len(plan_w))
    device = req_pool_indices.device
    return _pack_c(plan_c).to(device), _pack(plan_w, 2).to(device)


# --- compress ----------------------------------------------------------------------------


def _row_layout(ratio: int, head_dim: int) -> dict[str, slice]:
    d = head_dim
    if ratio == 4:
        return {
            "kv0": slice(0, d),
            "kv": slice(d, 2 * d),
            "s0": slice(2 * d, 3 * d),
            "s": slice(3 * d, 4 * d),
        }
    return {"kv": slice(0, d), "s": slice(d, 2 * d)}


def _compress_one(buffer, inputs, ape, ratio, head_dim, seq_len, ragged, buffer_len, p0, p1):
    """One window -> one compressed row (fp32), as c4_forward / c128_forward compute it."""
    lay = _row_layout(ratio, head_dim)
    dt = inputs.dtype
    kvs, scores = [], []
    if ratio == 4:
        for i in range(4):  # the previous window's overlap halves
            if seq_len <= 4:
                kvs.append(torch.zeros(head_dim, dtype=dt))
                scores.append(torch.full((head_dim,), -FLT_MAX, dtype=dt))
                continue
            src = buffer[p0, i].to(dt) if i < buffer_len else inputs[ragged - 7 + i]
            kvs.append(src[lay["kv0"]])
            scores.append(src[lay["s0"]])
        for i in range(4):
            src = buffer[p1, i].to(dt) if i + 4 < buffer_len else inputs[ragged - 3 + i]
            kvs.append(src[lay["kv"]])
            scores.append(src[lay["s"]])
    else:
        for j in range(128):
            src = buffer[p1, j].to(dt) if j < buffer_len else inputs[ragged - 127 + j]
            kvs.append(src[lay["kv"]])
            scores.append(src[lay["s"]])
    kv = torch.stack(kvs).float()
    score = torch.stack(scores).float() + ape.float()
    weight = torch.softmax(score, dim=0)
    return (kv * weight).sum(0)


def compress_decode(kv_buffer, kv_input, out, ape, plan_d, ratio: int, head_dim: int) -> None:
    """Write each request's row into its ring slot, then compress the windows that close."""
    flat = kv_buffer.view(-1, kv_buffer.shape[-1])
    plan = unpack_plan(plan_d)
    out.zero_()
    for b in range(plan_d.shape[0]):
        flat[int(plan["write_loc"][b])] = kv_input[b].to(kv_buffer.dtype)
    for b in range(plan_d.shape[0]):
        seq_len = int(plan["seq_len"][b])
        closes = seq_len % 4 == 0 if ratio == 4 else int(plan["write_loc"][b]) % 128 == 127
        if closes:
            p0, p1 = int(plan["read_page_0"][b]), int(plan["read_page_1"][b])
            row = _compress_one(
                kv_buffer, kv_input, ape, ratio, head_dim, seq_len, b, _window(ratio), p0, p1
            )
            out[b] = row.to(out.dtype)


def compress_prefill(
    kv_buffer, kv_input, out, ape, plan_c, plan_w, ratio: int, head_dim: int
) -> None:
    """Compress every closing window (reading the ring as it was), then refresh the ring."""
    c = unpack_plan(plan_c)
    for k in range(plan_c.shape[0]):
        seq_len = int(c["seq_len"][k])
        if seq_len == INVALID_U32:
            continue
        row = _compress_one(
            kv_buffer, kv_input, ape, ratio, head_dim, seq_len, int(c["ragged_id"][k]),
            int(c["buffer_len"][k]), int(c["read_page_0"][k]), int(c["read_page_1"][k]),
        )  # fmt: skip
        out[k] = row.to(out.dtype)
    w = unpack_plan(plan_w)
    keep = w["ragged_id"] != INVALID_U32
    flat = kv_buffer.view(-1, kv_buffer.shape[-1])
    flat[w["write_loc"][keep]] = kv_input[w["ragged_id"][keep]].to(kv_buffer.dtype)


def compress_forward(kv_buffer, kv_input, out, ape, plan, ratio: int, head_dim: int) -> None:
    """`compress.py`'s compress_forward for CPU tensors (`plan` is the plan NamedTuple)."""
    if ape.shape != (_window(ratio), head_dim):
        raise ValueError(f"ape {tuple(ape.shape)}: expected {(_window(ratio), head_dim)}")
    if plan.is_decode:
        compress_decode(kv_buffer, kv_input, out, ape, plan[1], ratio, head_dim)
    else:
        compress_prefill(kv_buffer, kv_input, out, ape, plan[1], plan[2], ratio, head_dim)


# --- norm, RoPE, store ---------------------------------------------------------------------


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard transform (Sylvester order) of the last dim, scaled by 1/sqrt(n)."""
    n = x.shape[-1]
    y = x.reshape(-1, n).clone()
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(x.shape) * n**-0.5


def _entries(plan, ratio: int, out_loc: torch.Tensor):
    """(row indices into kv, positions, out locations) of the entries the store writes."""
    f = unpack_plan(plan[1])
    seq = f["seq_len"]
    if plan.is_decode:
        rows = torch.nonzero(seq % ratio == 0).flatten()
        loc = out_loc[rows]
    else:
        rows = torch.nonzero(seq != INVALID_U32).flatten()
        loc = out_loc[f["ragged_id"][rows]]
    return rows, seq[rows] - ratio, loc.long()


def _index_k_bytes(loc: torch.Tensor, kvcache: torch.Tensor, page_size: int):
    """(pages [num_pages, page bytes] uint8, page [n, 1], data bytes [n, 128], scale bytes
    [n, 4]) of the indexer's key rows at `loc`: a page holds `page_size` rows of 128 FP8
    bytes, then `page_size` fp32 scales."""
    pages = kvcache.view(torch.uint8).reshape(-1, page_size * INDEX_ROW_BYTES)
    loc = loc.long()
    page, slot = loc // page_size, loc % page_size
    data = slot[:, None] * INDEX_DIM + torch.arange(INDEX_DIM)
    scale_at = page_size * INDEX_DIM + slot[:, None] * 4 + torch.arange(4)
    return pages, page[:, None], data, scale_at


def store_index_k(
    x: torch.Tensor, loc: torch.Tensor, kvcache: torch.Tensor, page_size: int
) -> None:
    """x [n, 128] fp32 -> FP8 rows with an fp32 scale each, in the indexer's paged layout."""
    scale = x.abs().amax(-1).clamp_min(1e-4) / cpu_norm_rope.FP8_MAX
    q = (x / scale[:, None]).clamp(-cpu_norm_rope.FP8_MAX, cpu_norm_rope.FP8_MAX)
    pages, page, data, scale_at = _index_k_bytes(loc, kvcache, page_size)
    pages[page, data] = q.to(torch.float8_e4m3fn).view(torch.uint8)
    pages[page, scale_at] = scale.float().view(-1, 1).view(torch.uint8)


def load_index_k(loc: torch.Tensor, kvcache: torch.Tensor, page_size: int) -> torch.Tensor:
    """`store_index_k`'s rows at `loc` read back: each FP8 row times its scale, [n, 128] fp32."""
    pages, page, data, scale_at = _index_k_bytes(loc, kvcache, page_size)
    fp8 = pages[page, data].view(torch.float8_e4m3fn).float()
    return fp8 * pages[page, scale_at].contiguous().view(torch.float32)


def compress_norm_rope_store(
    kv, plan, norm_weight, norm_eps, freq_cis, out_loc, kvcache, page_size
) -> None:
    """`compress.py`'s compress_norm_rope_store for CPU tensors (V4 layout, FP8 caches)."""
    rows, positions, loc = _entries(plan, plan.compress_ratio, out_loc)
    if rows.numel() == 0:
        return
    weight = norm_weight.to(kv.dtype)
    x = cpu_norm_rope._normed_roped(kv[rows], weight, norm_eps, freq_cis, positions)
    if kv.shape[-1] == INDEX_DIM:
        store_index_k(hadamard(x), loc, kvcache, page_size)
        return
    x = torch.cat(
        [x[:, : cpu_norm_rope.NOPE].to(torch.bfloat16).float(), x[:, cpu_norm_rope.NOPE :]], -1
    )
    cpu_norm_rope.store_v4_rows(x, loc, kvcache, page_size)
