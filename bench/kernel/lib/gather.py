"""The same-run limit for the decode kernel's access pattern: a gather with no attention math.

``gather_kv_rows`` reads exactly the KV bytes the ``mma`` kernel reads for one decode call,
through the same index lists: for every request, the SWA list up to its topk length and then
the extra list up to its own, skipping ``-1`` entries; for every such token, its 576 data bytes
(448 FP8 nope bytes and 64 BF16 rope values, at ``t * 576`` in its page) and its 8-byte scale
word (in the page's footer, at ``page_size * 576 + t * 8``). See the page layout at the top of
``flash_mla_sm120_mma.py``. It does nothing with them but reduce every 32-bit word of a tile
to one (the largest, unsigned) per (request, tile), so the loads cannot be dropped, and writes
those words out: a few hundred bytes against the megabytes it reads.

Grid: one program per (tile of ``BLOCK_T`` tokens, request); the SWA list's tiles come first,
then the extra list's. Each program issues all of its tile's loads at once (no loop), so the
time is the gather's: index load, then the rows. The microbench times it exactly as it times
the kernels, at every point, and reports each backend's time over this one.

``reference_tile_words`` computes the same words with plain torch indexing on CPU tensors; the
checks (``tests/kernel/gpu_check.py gather``) compare the two in Triton's interpreter and on a
GPU.
"""

import numpy as np
import torch
import triton
import triton.language as tl

TOKEN_DATA_BYTES = 576
SCALE_BYTES = 8
BYTES_PER_TOKEN = TOKEN_DATA_BYTES + SCALE_BYTES  # 584
INDEX_BYTES = 4
# Tokens per program, and warps. 16 rows of 576 bytes are 9 KiB in flight per program; at B=1
# with 640 tokens that is 40 programs, one gather round each.
BLOCK_T = 16
NUM_WARPS = 4
_DATA_WORDS = TOKEN_DATA_BYTES // 4  # 144 int32 words: 128 + 16
_SCALE_WORDS = SCALE_BYTES // 4  # 2


@triton.jit
def _tile_words(
    words_ptr, idx_row_ptr, pos0, valid_len, page_size, page_words, BLOCK_T: tl.constexpr
):
    """The largest 32-bit word (unsigned) of the valid tokens [pos0, pos0 + BLOCK_T) of one
    index list; 0 when none is valid."""
    pos = pos0 + tl.arange(0, BLOCK_T)
    in_list = pos < valid_len
    idx = tl.load(idx_row_ptr + pos, mask=in_list, other=-1)
    valid = in_list & (idx >= 0)
    safe = tl.where(valid, idx, 0)
    page = (safe // page_size).to(tl.int64)
    slot = (safe % page_size).to(tl.int64)
    row = page * page_words + slot * 144
    head = tl.load(
        words_ptr + row[:, None] + tl.arange(0, 128)[None, :], mask=valid[:, None], other=0
    )
    tail = tl.load(
        words_ptr + (row + 128)[:, None] + tl.arange(0, 16)[None, :], mask=valid[:, None], other=0
    )
    scale_row = page * page_words + page_size * 144 + slot * 2
    scale = tl.load(
        words_ptr + scale_row[:, None] + tl.arange(0, 2)[None, :], mask=valid[:, None], other=0
    )
    # The largest word as unsigned: every loaded word can change it, masked lanes (0) cannot.
    # (A sum or XOR would do as well on a GPU; the interpreter reduces those slowly or
    # refuses int32 overflow.)
    word = tl.max(tl.max(head.to(tl.uint32, bitcast=True), axis=1), axis=0)
    word = tl.maximum(word, tl.max(tl.max(tail.to(tl.uint32, bitcast=True), axis=1), axis=0))
    word = tl.maximum(word, tl.max(tl.max(scale.to(tl.uint32, bitcast=True), axis=1), axis=0))
    return word.to(tl.int32, bitcast=True)


@triton.jit
def _gather_kernel(
    Out,
    swa_words,
    swa_idx,
    stride_swa_ib,
    swa_len_ptr,
    swa_topk,
    swa_page_size,
    swa_page_words,
    ext_words,
    ext_idx,
    stride_ext_ib,
    ext_len_ptr,
    ext_topk,
    ext_page_size,
    ext_page_words,
    swa_tiles,
    num_tiles,
    HAS_SWA_LEN: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    HAS_EXT_LEN: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    word = tl.zeros([], dtype=tl.int32)
    if tile < swa_tiles:
        swa_len = swa_topk
        if HAS_SWA_LEN:
            swa_len = tl.minimum(tl.load(swa_len_ptr + b).to(tl.int32), swa_topk)
        word = _tile_words(
            swa_words,
            swa_idx + b * stride_swa_ib,
            tile * BLOCK_T,
            swa_len,
            swa_page_size,
            swa_page_words,
            BLOCK_T,
        )
    if HAS_EXTRA:
        if tile >= swa_tiles:
            ext_len = ext_topk
            if HAS_EXT_LEN:
                ext_len = tl.minimum(tl.load(ext_len_ptr + b).to(tl.int32), ext_topk)
            word = _tile_words(
                ext_words,
                ext_idx + b * stride_ext_ib,
                (tile - swa_tiles) * BLOCK_T,
                ext_len,
                ext_page_size,
                ext_page_words,
                BLOCK_T,
            )
    tl.store(Out + b * num_tiles + tile, word)


def _words(k_cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The page buffer as flat int32 words, with (page_size, words per page)."""
    if k_cache.dim() != 4 or k_cache.shape[-1] != BYTES_PER_TOKEN or k_cache.element_size() != 1:
        raise ValueError(
            f"expected a [pages, page_size, 1, {BYTES_PER_TOKEN}] one-byte KV cache view, got "
            f"shape {tuple(k_cache.shape)} dtype {k_cache.dtype}"
        )
    pages, page_size = k_cache.shape[0], k_cache.shape[1]
    page_bytes = k_cache.stride(0)
    if page_bytes % 16 or k_cache.data_ptr() % 16:
        raise ValueError(f"KV pages must start on 16-byte boundaries (page stride {page_bytes})")
    raw = k_cache.as_strided((pages * page_bytes,), (1,)).view(torch.uint8)
    return raw.view(torch.int32), page_size, page_bytes // 4


def _rows(indices: torch.Tensor, batch: int) -> torch.Tensor:
    rows = indices.reshape(batch, -1)
    if rows.dtype != torch.int32:
        rows = rows.to(torch.int32)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def tile_counts(swa_topk: int, extra_topk: int) -> tuple[int, int]:
    """(SWA tiles, all tiles) per request."""
    swa_tiles = triton.cdiv(swa_topk, BLOCK_T)
    return swa_tiles, swa_tiles + triton.cdiv(extra_topk, BLOCK_T)


def gather_kv_rows(
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> torch.Tensor:
    """Read every KV row one decode call reads; returns int32 words [batch, tiles].

    ``indices`` is [B, 1, topk] (or [B, topk]) as the kernels take it. Word (b, t) is the largest
    32-bit word, unsigned, of the valid tokens of tile t of request b (0 for a tile without one).
    """
    batch = indices.shape[0]
    swa_words, swa_page_size, swa_page_words = _words(k_cache)
    swa_rows = _rows(indices, batch)
    has_extra = extra_k_cache is not None and extra_indices is not None
    if has_extra:
        ext_words, ext_page_size, ext_page_words = _words(extra_k_cache)
        ext_rows = _rows(extra_indices, batch)
    else:
        ext_words, ext_page_size, ext_page_words, ext_rows = swa_words, 1, 0, swa_rows
    ext_topk = ext_rows.shape[1] if has_extra else 0
    swa_tiles, num_tiles = tile_counts(swa_rows.shape[1], ext_topk)
    out = torch.empty(batch, num_tiles, dtype=torch.int32, device=swa_rows.device)
    if batch == 0 or num_tiles == 0:
        return out
    placeholder = swa_rows
    _gather_kernel[(num_tiles, batch)](
        out,
        swa_words,
        swa_rows,
        swa_rows.stride(0),
        topk_length if topk_length is not None else placeholder,
        swa_rows.shape[1],
        swa_page_size,
        swa_page_words,
        ext_words,
        ext_rows,
        ext_rows.stride(0),
        extra_topk_length if (has_extra and extra_topk_length is not None) else placeholder,
        ext_topk,
        ext_page_size,
        ext_page_words,
        swa_tiles,
        num_tiles,
        HAS_SWA_LEN=topk_length is not None,
        HAS_EXTRA=has_extra,
        HAS_EXT_LEN=has_extra and extra_topk_length is not None,
        BLOCK_T=BLOCK_T,
        num_warps=NUM_WARPS,
    )
    return out


def gather_like_decode(
    q,
    k_cache,
    indices,
    topk_length,
    attn_sink,
    head_dim_v,
    softmax_scale,
    extra_k_cache=None,
    extra_indices=None,
    extra_topk_length=None,
):
    """``gather_kv_rows`` with the decode kernels' arguments, so one harness times all of them."""
    return gather_kv_rows(
        k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length
    )


def _read_tokens(indices, lengths, batch: int, first_tile: int) -> list[tuple[int, int, int]]:
    """(request, tile, index) of each token a decode call reads from one index list."""
    rows = indices.reshape(batch, -1).tolist()
    out = []
    for b, row in enumerate(rows):
        n = len(row) if lengths is None else min(int(lengths[b]), len(row))
        out += [(b, first_tile + p // BLOCK_T, i) for p, i in enumerate(row[:n]) if i >= 0]
    return out


def _token_words(k_cache: torch.Tensor, index: torch.Tensor) -> np.ndarray:
    """Each indexed token's 146 int32 words (576 data bytes, then its 8 scale bytes), by torch
    indexing of the page buffer on CPU."""
    pages, page_size, page_bytes = k_cache.shape[0], k_cache.shape[1], k_cache.stride(0)
    raw = k_cache.as_strided((pages, page_bytes), (page_bytes, 1)).view(torch.uint8).cpu()
    page, slot = (index // page_size)[:, None], (index % page_size)[:, None]
    data = raw[page, slot * TOKEN_DATA_BYTES + torch.arange(TOKEN_DATA_BYTES)[None, :]]
    scale_at = page_size * TOKEN_DATA_BYTES + slot * SCALE_BYTES
    scale = raw[page, scale_at + torch.arange(SCALE_BYTES)[None, :]]
    return torch.cat([data, scale], dim=1).contiguous().view(torch.int32).numpy()


def reference_tile_words(
    k_cache,
    indices,
    topk_length,
    extra_k_cache=None,
    extra_indices=None,
    extra_topk_length=None,
) -> torch.Tensor:
    """``gather_kv_rows``'s words from torch indexing of the same rows (CPU, for checks)."""
    batch = indices.shape[0]
    has_extra = extra_k_cache is not None and extra_indices is not None
    ext_topk = extra_indices.reshape(batch, -1).shape[1] if has_extra else 0
    swa_tiles, num_tiles = tile_counts(indices.reshape(batch, -1).shape[1], ext_topk)
    out = np.zeros((batch, num_tiles), dtype=np.uint32)
    lists = [(k_cache, _read_tokens(indices, topk_length, batch, 0))]
    if has_extra:
        tokens = _read_tokens(extra_indices, extra_topk_length, batch, swa_tiles)
        lists.append((extra_k_cache, tokens))
    for cache, tokens in lists:
        if not tokens:
            continue
        b, tile, index = (torch.tensor(column) for column in zip(*tokens, strict=True))
        per_token = _token_words(cache, index).view(np.uint32).max(axis=1)
        np.maximum.at(out, (b.numpy(), tile.numpy()), per_token)
    return torch.from_numpy(out.view(np.int32))


def bytes_read(
    indices, topk_length, extra_indices=None, extra_topk_length=None, batch: int | None = None
) -> dict:
    """What one call reads: valid KV tokens, their bytes, and the index bytes of the lists."""
    batch = indices.shape[0] if batch is None else batch
    lists = [(indices, topk_length)]
    if extra_indices is not None:
        lists.append((extra_indices, extra_topk_length))
    tokens = 0
    index_bytes = 0
    for idx, lengths in lists:
        rows = idx.reshape(batch, -1)
        topk = rows.shape[1]
        positions = torch.arange(topk, device=rows.device)[None, :]
        limit = topk if lengths is None else lengths.reshape(batch, 1).clamp(max=topk)
        in_list = (positions < limit).expand(batch, topk)
        tokens += int((in_list & (rows >= 0)).sum())
        index_bytes += int(in_list.sum()) * INDEX_BYTES
    return {"tokens": tokens, "kv_bytes": tokens * BYTES_PER_TOKEN, "index_bytes": index_bytes}
