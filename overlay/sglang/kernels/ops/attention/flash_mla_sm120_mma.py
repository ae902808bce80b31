"""SM120 sparse MLA decode for DeepSeek-V4: head-blocked tensor-core MMA, split-K, exact combine.

Selected with ``SGLANG_SM120_FLASHMLA_BACKEND=mma`` through ``flash_mla_with_kvcache_sm120``.
Upstream's Triton kernel runs one program per (request, head) and so reads the request's shared
MLA KV once per head. Here one program serves a block of BLOCK_H query heads: every KV tile is
gathered and dequantized once per head block, and scores and P.V are ``tl.dot`` calls (mma.sync
on SM80/SM90/SM120).

Stage 1, grid (head_blocks, splits, batch): a program walks its contiguous share of the request's
KV tiles (the SWA index list, then the extra index list, each cut into BLOCK_T-token tiles), keeps
an online softmax in base 2, and writes the split's normalised fp32 output and log2-sum-exp. With
a single split it folds in the attention sink and writes the final output itself.
Stage 2, grid (head_blocks, batch): merges the splits exactly (LSE-weighted) and folds in the sink.

Launch configuration: BLOCK_T, warps and stages come from the device as Triton sees it (the
active driver's architecture and shared memory per block; ``sm120_mma_fit.config_for``), so the
same code path runs on a GPU, on the audit's virtual devices and under the interpreter. The
automatic split count counts the compiled kernel's resident CTAs per SM on that device.

Page layout of both caches (``k_cache`` is a ``[pages, page_size, 1, 584]`` byte view whose
stride(0) is the page's byte size), per token t of a page:
  bytes [t*576, t*576+448)          448 FP8 e4m3 "nope" values
  bytes [t*576+448, t*576+576)      64 BF16 "rope" values
  bytes [page_size*576 + t*8, +7)   7 UE8M0 scales, one per 64 nope values (byte 8 is padding)

The launch depends only on shapes (topk lengths and -1 indices are handled in the kernel), and
nothing reads device memory on the host, so it can be captured in a CUDA graph.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from sglang.kernels.ops.attention.sm120_mma_fit import (
    ArchLimits,
    LaunchConfig,
    config_for,
    limits_for_arch,
    occupancy,
)
from sglang.kernels.ops.attention.sm120_mma_splits import resolve_split_count

LOG2E = tl.constexpr(1.4426950408889634)

_NOPE_DIM = 448
_ROPE_DIM = 64
_D = _NOPE_DIM + _ROPE_DIM  # 512: the key and value width the kernel computes
_TOKEN_DATA_STRIDE = _NOPE_DIM + 2 * _ROPE_DIM  # 576
_SCALE_STRIDE = 8
_BYTES_PER_TOKEN = _TOKEN_DATA_STRIDE + _SCALE_STRIDE  # 584

_COMBINE_WARPS = 4
_COMBINE_BLOCK_H = 16

# Triton's interpreter mis-evaluates tl.dot on bf16 operands (it multiplies the raw bits), so
# interpreted runs widen the operands to fp32 first. The widening is exact and p is still rounded
# to bf16, so interpreted and compiled runs compute the same products.
_DOT_DTYPE = tl.float32 if triton.knobs.runtime.interpret else tl.bfloat16


@triton.jit
def _load_kv_tile(
    fp8_ptr,
    i64_ptr,
    bf16_ptr,
    idx_row_ptr,
    pos0,
    valid_len,
    page_size,
    page_bytes,
    BLOCK_T: tl.constexpr,
    D: tl.constexpr,
    NOPE_DIM: tl.constexpr,
):
    """Gather and dequantize tokens [pos0, pos0 + BLOCK_T) of one index list.

    Returns (kv bf16 [BLOCK_T, D], valid [BLOCK_T]); invalid rows are zero. Each load reads
    whole rows of contiguous bytes from 16-byte-aligned starts, so the compiler can use 128-bit
    loads, and a token's 8 scale bytes come in as one 64-bit word.
    """
    pos = pos0 + tl.arange(0, BLOCK_T)
    in_list = pos < valid_len
    idx = tl.load(idx_row_ptr + pos, mask=in_list, other=-1)
    valid = in_list & (idx >= 0)
    safe = tl.where(valid, idx, 0)
    page = (safe // page_size).to(tl.int64)
    slot = (safe % page_size).to(tl.int64)

    d = tl.arange(0, D)
    is_nope = d < NOPE_DIM
    nope = tl.load(
        fp8_ptr + (page * page_bytes + slot * 576)[:, None] + d[None, :],
        mask=valid[:, None] & is_nope[None, :],
        other=0.0,
    )
    # Word t of the page's footer holds token t's 7 UE8M0 exponents (biased powers of two), byte
    # g for nope columns [64 g, 64 g + 64); 0x7F is 2^0, for masked rows.
    word = page * (page_bytes // 8) + page_size * 72 + slot
    words = tl.load(i64_ptr + word, mask=valid, other=0x7F7F7F7F7F7F7F7F)
    exponent = (words[:, None] >> ((d // 64) * 8).to(tl.int64)[None, :]) & 0xFF
    nope = nope.to(tl.float32) * tl.math.exp2(exponent.to(tl.float32) - 127.0)
    # Rope starts at byte NOPE_DIM of the token's data. Spelled in bf16 elements so the compiler
    # can prove 16-byte alignment and vectorize the load.
    rope_elem = page * (page_bytes // 2) + slot * 288 + NOPE_DIM // 2
    rope = tl.load(
        bf16_ptr + rope_elem[:, None] + (d - NOPE_DIM)[None, :],
        mask=valid[:, None] & (d >= NOPE_DIM)[None, :],
        other=0.0,
    )
    kv = tl.where(is_nope[None, :], nope, rope.to(tl.float32)).to(tl.bfloat16)
    return kv, valid


@triton.jit
def _attend_tile(q, kv, valid, m_i, l_i, acc, qk_scale_log2, DOT_DTYPE: tl.constexpr):
    """One online-softmax step (base 2) of a head block over one KV tile; K and V are both kv."""
    kv = kv.to(DOT_DTYPE)
    s = tl.dot(q.to(DOT_DTYPE), tl.trans(kv)) * qk_scale_log2
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows that have seen no valid token yet keep m = -inf; shift them by 0 to avoid inf - inf.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_shift)
    p = tl.math.exp2(s - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(tl.bfloat16).to(DOT_DTYPE), kv, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _sink_weight(lse2, sink_ptr, offs_h, h_mask, HAS_SINK: tl.constexpr):
    """The factor exp2(lse2 - lse2_with_sink) that folds the sink into a normalised output.

    lse2 = -inf (no valid token) gives 0: the output is zero, as in upstream's reference.
    """
    empty = lse2 == float("-inf")
    weight = tl.where(empty, 0.0, 1.0)
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32) * LOG2E
        top = tl.maximum(lse2, sink2)
        total2 = top + tl.math.log2(tl.math.exp2(lse2 - top) + tl.math.exp2(sink2 - top))
        weight = tl.where(empty, 0.0, tl.math.exp2(lse2 - total2))
    return weight


@triton.jit(do_not_specialize=["num_splits", "tiles_per_split"])
def _sparse_decode_split_kernel(
    Q,
    stride_qb,
    stride_qh,
    swa_fp8,
    swa_i64,
    swa_bf16,
    swa_idx,
    stride_swa_ib,
    swa_len_ptr,
    swa_topk,
    swa_page_size,
    swa_page_bytes,
    ext_fp8,
    ext_i64,
    ext_bf16,
    ext_idx,
    stride_ext_ib,
    ext_len_ptr,
    ext_topk,
    ext_page_size,
    ext_page_bytes,
    O_ptr,
    LSE_ptr,
    sink_ptr,
    qk_scale_log2,
    H,
    head_dim_v,
    num_splits,
    swa_tiles,
    tiles_per_split,
    HAS_SWA_LEN: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    HAS_EXT_LEN: tl.constexpr,
    HAS_SINK: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    D: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    d = tl.arange(0, D)
    q = tl.load(
        Q + pid_b * stride_qb + offs_h[:, None] * stride_qh + d[None, :],
        mask=h_mask[:, None],
        other=0.0,
    )

    swa_len = swa_topk
    if HAS_SWA_LEN:
        swa_len = tl.minimum(tl.load(swa_len_ptr + pid_b).to(tl.int32), swa_topk)
    tile_lo = pid_s * tiles_per_split
    tile_hi = tile_lo + tiles_per_split

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)

    # Tiles past the request's topk length are skipped here, in the kernel, so the launch
    # stays shape-only.
    swa_row = swa_idx + pid_b * stride_swa_ib
    swa_hi = tl.minimum(tile_hi, tl.minimum(swa_tiles, tl.cdiv(swa_len, BLOCK_T)))
    for tile in range(tile_lo, swa_hi):
        kv, valid = _load_kv_tile(
            swa_fp8,
            swa_i64,
            swa_bf16,
            swa_row,
            tile * BLOCK_T,
            swa_len,
            swa_page_size,
            swa_page_bytes,
            BLOCK_T,
            D,
            NOPE_DIM,
        )
        m_i, l_i, acc = _attend_tile(q, kv, valid, m_i, l_i, acc, qk_scale_log2, DOT_DTYPE)

    if HAS_EXTRA:
        ext_len = ext_topk
        if HAS_EXT_LEN:
            ext_len = tl.minimum(tl.load(ext_len_ptr + pid_b).to(tl.int32), ext_topk)
        ext_row = ext_idx + pid_b * stride_ext_ib
        ext_lo = tl.maximum(tile_lo, swa_tiles)
        ext_hi = tl.minimum(tile_hi, swa_tiles + tl.cdiv(ext_len, BLOCK_T))
        for tile in range(ext_lo, ext_hi):
            kv, valid = _load_kv_tile(
                ext_fp8,
                ext_i64,
                ext_bf16,
                ext_row,
                (tile - swa_tiles) * BLOCK_T,
                ext_len,
                ext_page_size,
                ext_page_bytes,
                BLOCK_T,
                D,
                NOPE_DIM,
            )
            m_i, l_i, acc = _attend_tile(q, kv, valid, m_i, l_i, acc, qk_scale_log2, DOT_DTYPE)

    has_tokens = l_i > 0.0
    safe_l = tl.where(has_tokens, l_i, 1.0)
    lse2 = tl.where(has_tokens, m_i + tl.math.log2(safe_l), float("-inf"))
    if SINGLE_SPLIT:
        # Normalise and fold the sink in one factor; lse is natural-log and without the sink.
        # O_ptr and LSE_ptr are the call's out [B, H, head_dim_v] bf16 and lse [B, H] fp32.
        rows = pid_b * H + offs_h
        weight = _sink_weight(lse2, sink_ptr, offs_h, h_mask, HAS_SINK) / safe_l
        tl.store(
            O_ptr + rows[:, None] * head_dim_v + d[None, :],
            (acc * weight[:, None]).to(tl.bfloat16),
            mask=h_mask[:, None] & (d < head_dim_v)[None, :],
        )
        tl.store(LSE_ptr + rows, lse2 / LOG2E, mask=h_mask)
    else:
        # O_ptr and LSE_ptr are the fp32 partials [B, H, splits, D] and log2-sum-exps.
        part = (pid_b * H + offs_h) * num_splits + pid_s
        tl.store(
            O_ptr + part[:, None] * D + d[None, :], acc / safe_l[:, None], mask=h_mask[:, None]
        )
        tl.store(LSE_ptr + part, lse2, mask=h_mask)


@triton.jit
def _combine_splits_kernel(
    O_part,
    LSE_part,
    Out,
    LSE,
    sink_ptr,
    H,
    head_dim_v,
    num_splits,
    HAS_SINK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
):
    """lse2 = log2sumexp2_s(lse2_s); out = sum_s exp2(lse2_s - lse2) * out_s; then the sink."""
    pid_h = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    rows = pid_b * H + offs_h
    d = tl.arange(0, D)

    top = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for s in range(num_splits):
        part_lse = tl.load(LSE_part + rows * num_splits + s, mask=h_mask, other=float("-inf"))
        top = tl.maximum(top, part_lse)
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for s in range(num_splits):
        part = rows * num_splits + s
        w = tl.math.exp2(tl.load(LSE_part + part, mask=h_mask, other=float("-inf")) - shift)
        total += w
        acc += w[:, None] * tl.load(
            O_part + part[:, None] * D + d[None, :], mask=h_mask[:, None], other=0.0
        )
    has_tokens = total > 0.0
    safe_total = tl.where(has_tokens, total, 1.0)
    lse2 = tl.where(has_tokens, shift + tl.math.log2(safe_total), float("-inf"))
    weight = _sink_weight(lse2, sink_ptr, offs_h, h_mask, HAS_SINK) / safe_total
    tl.store(
        Out + rows[:, None] * head_dim_v + d[None, :],
        (acc * weight[:, None]).to(tl.bfloat16),
        mask=h_mask[:, None] & (d < head_dim_v)[None, :],
    )
    tl.store(LSE + rows, lse2 / LOG2E, mask=h_mask)


def _typed_views(k_cache: torch.Tensor):
    """fp8, int64 and bf16 flat views of a page buffer, plus (page_size, page_bytes)."""
    if k_cache.dim() != 4 or k_cache.shape[-1] != _BYTES_PER_TOKEN or k_cache.element_size() != 1:
        raise ValueError(
            f"expected a [pages, page_size, 1, {_BYTES_PER_TOKEN}] one-byte KV cache view, got "
            f"shape {tuple(k_cache.shape)} dtype {k_cache.dtype}"
        )
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    page_bytes = k_cache.stride(0)
    if page_bytes < page_size * _BYTES_PER_TOKEN or page_bytes % _SCALE_STRIDE:
        raise ValueError(
            f"KV cache page stride {page_bytes} bytes cannot hold {page_size} tokens of "
            f"{_BYTES_PER_TOKEN} bytes with a size that keeps the 8-byte scale words aligned"
        )
    if k_cache.data_ptr() % _SCALE_STRIDE:
        raise ValueError("KV cache pages must start on an 8-byte boundary")
    raw = k_cache.as_strided((num_pages * page_bytes,), (1,)).view(torch.uint8)
    return (
        raw.view(torch.float8_e4m3fn),
        raw.view(torch.int64),
        raw.view(torch.bfloat16),
        page_size,
        page_bytes,
    )


def _index_rows(indices: torch.Tensor, batch: int) -> torch.Tensor:
    rows = indices.reshape(batch, -1)
    if rows.dtype != torch.int32:
        rows = rows.to(torch.int32)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows


@dataclass(frozen=True)
class _DeviceView:
    """The device as Triton sees it: what the launch configuration and split choice use."""

    arch: int
    num_sms: int
    limits: ArchLimits
    config: LaunchConfig


# Triton's interpreter runs without a device. Unless a driver was made active (the audit's
# virtual device does that), interpreted runs take an SM120 with few SMs, so small test shapes
# still get several splits from the automatic choice.
_INTERPRETER_VIEW_ARCH = 120
_INTERPRETER_VIEW_SMS = 8

_views: dict[tuple, _DeviceView] = {}


def _device_view() -> _DeviceView:
    from triton.runtime.driver import driver

    try:
        active = driver.active
    except RuntimeError:
        if not triton.knobs.runtime.interpret:
            raise
        active = None
    if active is None:
        arch, num_sms, max_shared = _INTERPRETER_VIEW_ARCH, _INTERPRETER_VIEW_SMS, None
        key = None
    else:
        device = active.get_current_device()
        # Keyed by the driver object itself (a process has one real driver; the audit's
        # virtual devices are kept alive by their entries).
        key = (active, device)
        view = _views.get(key)
        if view is not None:
            return view
        props = active.utils.get_device_properties(device)
        arch = active.get_current_target().arch
        num_sms, max_shared = props["multiprocessor_count"], props["max_shared_mem"]
    limits = limits_for_arch(arch, max_shared)
    view = _DeviceView(arch, num_sms, limits, config_for(arch, limits.max_shared_per_block))
    if key is not None:
        _views[key] = view
    return view


# Resident stage-1 CTAs per SM of each compiled variant, per device: read once from the
# compiled kernel (its registers, shared memory and warps), then reused.
_resident: dict[tuple, int] = {}


def _stage1_ctas_per_sm(view: _DeviceView, args: list, constexprs: dict) -> int:
    if triton.knobs.runtime.interpret:
        return view.config.ctas_per_sm
    from triton.runtime.driver import driver

    key = (driver.active, driver.active.get_current_device(), tuple(constexprs.items()))
    if key not in _resident:
        cfg = view.config
        kernel = _sparse_decode_split_kernel.warmup(
            *args, grid=(1,), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **constexprs
        )
        kernel._init_handles()
        _resident[key] = occupancy(
            kernel.n_regs, kernel.metadata.shared, cfg.num_warps, view.limits
        ).ctas_per_sm
    return _resident[key]


# Grow-only fp32 scratch for split partials, one per (device, stream). Every buffer ever handed
# out stays referenced: a CUDA graph captured with an older (smaller) buffer keeps its address.
_scratch: dict[tuple, list[torch.Tensor]] = {}


def _partials(device: torch.device, numel: int) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    buffers = _scratch.setdefault((str(device), stream), [])
    if not buffers or buffers[-1].numel() < numel:
        buffers.append(torch.empty(numel, dtype=torch.float32, device=device))
    return buffers[-1][:numel]


def flash_mla_sparse_decode_mma(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    head_dim_v: int,
    softmax_scale: float | None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode; same arguments as upstream's ``flash_mla_sparse_decode_triton``.

    Returns (out [B, 1, H, head_dim_v] bf16, lse [B, H, 1] fp32) with upstream's reference
    contract: lse is the log-sum-exp of the scaled scores without the sink (-inf for a request
    with no valid token, whose output is zero); the sink only rescales the output.
    """
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(
            f"expected q of shape [B, 1, H, D] (one decode token), got {tuple(q.shape)}"
        )
    batch, _, num_heads, d_qk = q.shape
    if d_qk < _D or not 0 < head_dim_v <= _D:
        raise ValueError(
            f"needs q head dim >= {_D} and 0 < head_dim_v <= {_D}, got {d_qk} and {head_dim_v}"
        )
    if softmax_scale is None:
        softmax_scale = d_qk ** (-0.5)
    device = q.device
    q3 = q[:, 0]
    if q3.stride(-1) != 1:
        q3 = q3.contiguous()

    view = _device_view()
    cfg = view.config
    swa_fp8, swa_i64, swa_bf16, swa_page_size, swa_page_bytes = _typed_views(k_cache)
    swa_rows = _index_rows(indices, batch)
    swa_topk = swa_rows.shape[1]
    swa_tiles = triton.cdiv(swa_topk, cfg.block_t)

    has_extra = extra_k_cache is not None and extra_indices is not None
    if has_extra:
        ext_fp8, ext_i64, ext_bf16, ext_page_size, ext_page_bytes = _typed_views(extra_k_cache)
        ext_rows = _index_rows(extra_indices, batch)
    else:
        ext_fp8, ext_i64, ext_bf16, ext_page_size, ext_page_bytes = swa_fp8, swa_i64, swa_bf16, 1, 0
        ext_rows = swa_rows
    ext_topk = ext_rows.shape[1] if has_extra else 0
    num_tiles = swa_tiles + triton.cdiv(ext_topk, cfg.block_t)

    out = torch.empty(batch, 1, num_heads, head_dim_v, dtype=torch.bfloat16, device=device)
    lse = torch.empty(batch, num_heads, 1, dtype=torch.float32, device=device)
    head_blocks = triton.cdiv(num_heads, cfg.block_h)
    if batch == 0 or num_heads == 0:
        return out, lse
    if num_tiles == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse

    placeholder = swa_rows
    sink = attn_sink if attn_sink is not None else placeholder
    swa_len = topk_length if topk_length is not None else placeholder
    ext_len = extra_topk_length if (has_extra and extra_topk_length is not None) else placeholder
    # Index 21 and 22 are the outputs (out and lse, or the partials), 27 num_splits and 29
    # tiles_per_split (neither is specialized on, so the kernel compiled for the occupancy query
    # below is the one launched).
    args = [
        q3,
        q3.stride(0),
        q3.stride(1),
        swa_fp8,
        swa_i64,
        swa_bf16,
        swa_rows,
        swa_rows.stride(0),
        swa_len,
        swa_topk,
        swa_page_size,
        swa_page_bytes,
        ext_fp8,
        ext_i64,
        ext_bf16,
        ext_rows,
        ext_rows.stride(0),
        ext_len,
        ext_topk,
        ext_page_size,
        ext_page_bytes,
        out,
        lse,
        sink,
        softmax_scale * 1.4426950408889634,
        num_heads,
        head_dim_v,
        1,
        swa_tiles,
        num_tiles,
    ]
    constexprs = dict(
        HAS_SWA_LEN=topk_length is not None,
        HAS_EXTRA=has_extra,
        HAS_EXT_LEN=has_extra and extra_topk_length is not None,
        HAS_SINK=attn_sink is not None,
        SINGLE_SPLIT=False,
        BLOCK_H=cfg.block_h,
        BLOCK_T=cfg.block_t,
        D=_D,
        NOPE_DIM=_NOPE_DIM,
        DOT_DTYPE=_DOT_DTYPE,
    )
    num_splits = resolve_split_count(
        batch=batch,
        head_blocks=head_blocks,
        num_tiles=num_tiles,
        tile_tokens=cfg.block_t,
        num_sms=view.num_sms,
        ctas_per_sm=_stage1_ctas_per_sm(view, args, constexprs),
    )
    single = num_splits == 1
    if not single:
        rows = batch * num_heads * num_splits
        scratch = _partials(device, rows * (_D + 1))
        args[21], args[22] = scratch[: rows * _D], scratch[rows * _D :]
    args[27], args[29] = num_splits, triton.cdiv(num_tiles, num_splits)
    constexprs["SINGLE_SPLIT"] = single
    _sparse_decode_split_kernel[(head_blocks, num_splits, batch)](
        *args, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **constexprs
    )
    if not single:
        _combine_splits_kernel[(triton.cdiv(num_heads, _COMBINE_BLOCK_H), batch)](
            args[21],
            args[22],
            out,
            lse,
            sink,
            num_heads,
            head_dim_v,
            num_splits,
            HAS_SINK=attn_sink is not None,
            BLOCK_H=_COMBINE_BLOCK_H,
            D=_D,
            num_warps=_COMBINE_WARPS,
        )
    return out, lse
