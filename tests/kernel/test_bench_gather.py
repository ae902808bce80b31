"""bench/kernel/lib/gather.py in Triton's interpreter: the microbench's gather reads exactly the
KV bytes a decode call reads (each valid token's 576 data bytes and its scale word, through
both index lists, holes and topk lengths honoured), and nothing else."""

import sys
from pathlib import Path

import pytest
import torch
from cases import Case, make_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.kernel.lib.gather import (  # noqa: E402
    BLOCK_T,
    bytes_read,
    gather_kv_rows,
    reference_tile_words,
)

CASE = Case(batch=3, heads=16, swa_topk=40, extra_topk=77, extra_page_size=64, empty_row=True)


def _lists(kwargs: dict) -> tuple:
    return (
        kwargs["k_cache"],
        kwargs["indices"],
        kwargs["topk_length"],
        kwargs["extra_k_cache"],
        kwargs["extra_indices_in_kvcache"],
        kwargs["extra_topk_length"],
    )


def _page_bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache's page buffer as writable bytes [pages, page_bytes]."""
    pages, page_bytes = cache.shape[0], cache.stride(0)
    return cache.as_strided((pages, page_bytes), (page_bytes, 1)).view(torch.uint8)


@pytest.mark.parametrize(
    "case",
    [
        CASE,
        Case(batch=2, heads=16, swa_topk=150, swa_page_size=256, with_lengths=False),
        Case(batch=2, heads=16, swa_topk=64, extra_topk=95, extra_page_size=2),
    ],
    ids=str,
)
def test_gather_matches_torch_indexing_of_the_same_rows(case):
    kwargs = make_inputs(case)
    got = gather_kv_rows(*_lists(kwargs))
    assert torch.equal(got, reference_tile_words(*_lists(kwargs)))
    assert got.shape == (case.batch, -(-case.swa_topk // BLOCK_T) - (-case.extra_topk // BLOCK_T))
    assert (got != 0).sum() > got.numel() // 2


def _first_valid(kwargs, list_name: str, length_name: str) -> tuple[int, int]:
    """(position, index) of request 0's first token the kernels read from one list."""
    row = kwargs[list_name][0, 0].tolist()
    for pos, index in enumerate(row[: int(kwargs[length_name][0])]):
        if index >= 0:
            return pos, index
    raise AssertionError("request 0 reads no token")


def _read(kwargs, list_name: str, length_name: str) -> set[int]:
    """Every token some request reads from one list (inside its length, not a hole)."""
    rows, lengths = kwargs[list_name][:, 0].tolist(), kwargs[length_name].tolist()
    return {i for row, n in zip(rows, lengths, strict=True) for i in row[:n] if i >= 0}


def test_every_byte_it_reads_is_a_byte_the_kernel_reads():
    kwargs = make_inputs(CASE)
    before = gather_kv_rows(*_lists(kwargs))
    cache, page_size = _page_bytes(kwargs["extra_k_cache"]), CASE.extra_page_size

    # Tokens no request reads (unreferenced, or referenced only past a topk length) stay unread.
    read = _read(kwargs, "extra_indices_in_kvcache", "extra_topk_length")
    listed = set(kwargs["extra_indices_in_kvcache"].reshape(-1).tolist())
    assert listed - read - {-1}, "the case has no token referenced only past a length"
    for token in set(range(cache.shape[0] * page_size)) - read:
        page, slot = divmod(token, page_size)
        cache[page, slot * 576 : (slot + 1) * 576] = 0xFF
        cache[page, page_size * 576 + slot * 8 : page_size * 576 + (slot + 1) * 8] = 0xFF
    assert torch.equal(gather_kv_rows(*_lists(kwargs)), before)

    # A read token's scale word (in the page's footer) and its last data word both count.
    pos, index = _first_valid(kwargs, "extra_indices_in_kvcache", "extra_topk_length")
    page, slot = divmod(index, page_size)
    scale_at = page_size * 576 + slot * 8
    cache[page, scale_at + 4 : scale_at + 8] = 0xFF
    after = gather_kv_rows(*_lists(kwargs))
    swa_tiles = -(-CASE.swa_topk // BLOCK_T)
    assert after[0, swa_tiles + pos // BLOCK_T] == -1
    assert torch.equal(after, reference_tile_words(*_lists(kwargs)))
    pos, index = _first_valid(kwargs, "indices", "topk_length")
    page, slot = divmod(index, CASE.swa_page_size)
    _page_bytes(kwargs["k_cache"])[page, slot * 576 + 572 : slot * 576 + 576] = 0xFF
    assert gather_kv_rows(*_lists(kwargs))[0, pos // BLOCK_T] == -1


def test_bytes_read_counts_each_valid_token_and_each_index_in_the_lists():
    indices = torch.tensor([[[0, -1, 5, 7]], [[1, 2, 3, 4]]], dtype=torch.int32)
    lengths = torch.tensor([3, 1], dtype=torch.int32)
    extra = torch.tensor([[[9, 8]], [[-1, -1]]], dtype=torch.int32)
    read = bytes_read(indices, lengths, extra, None)
    # Request 0: tokens 0 and 5 (the -1 is a hole, 7 is past its length), extra 9 and 8;
    # request 1: token 1. Index bytes: positions inside the lengths (3 + 1) plus both extras.
    assert read == {"tokens": 5, "kv_bytes": 5 * 584, "index_bytes": (3 + 1 + 4) * 4}
