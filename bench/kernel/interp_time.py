#!/usr/bin/env python3
"""Time the mma decode kernel in Triton's interpreter, as the CPU engines and tests run it.

The shape is a DSV4 prefill's on a CPU engine: every prompt token is a row, with a full SWA list
(128 tokens) and a c4 list of 512 slots of which only the first --c4-entries hold a token (a
short context). Each call gets the same seeded inputs; the time of each call after a first,
untimed one is printed, then their mean. Not a GPU figure: it times interpreted Python.

  .venv/bin/python bench/kernel/interp_time.py --rows 8 --c4-entries 40
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.entry import require  # noqa: E402

NAME = "bench/kernel/interp_time.py"
# Under .venv's Python when this one lacks torch, else one line naming it (tools/entry.py).
require(NAME, "torch", "triton", "sglang", script=__file__)
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from bench.kernel.microbench import _cache as kv_pages  # noqa: E402

SWA_TOPK, C4_TOPK, PAGE, PAGES = 128, 512, 64, 8


def call_args(rows: int, heads: int, c4_entries: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the pages' values (microbench's page maker draws from torch's own)
    tokens = PAGES * PAGE
    c4 = torch.full((rows, 1, C4_TOPK), -1, dtype=torch.int32)
    c4[..., :c4_entries] = torch.randint(0, tokens, (rows, 1, c4_entries), generator=gen)
    return {
        "q": torch.randn(rows, 1, heads, 512, generator=gen).to(torch.bfloat16),
        "k_cache": kv_pages(torch, tokens, PAGE, "cpu"),
        "indices": torch.randint(0, tokens, (rows, 1, SWA_TOPK), generator=gen, dtype=torch.int32),
        "topk_length": torch.full((rows,), SWA_TOPK, dtype=torch.int32),
        "attn_sink": torch.zeros(heads),
        "head_dim_v": 512,
        "softmax_scale": None,
        "extra_k_cache": kv_pages(torch, tokens, PAGE, "cpu"),
        "extra_indices": c4,
        "extra_topk_length": torch.full((rows,), c4_entries, dtype=torch.int32),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=NAME,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rows", type=int, default=8, help="rows (prompt tokens)")
    parser.add_argument("--heads", type=int, default=4, help="query heads per rank")
    parser.add_argument(
        "--c4-entries", type=int, default=40, help=f"tokens in the {C4_TOPK}-slot c4 list"
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed calls")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.heads < 1 or args.repeat < 1:
        parser.error("--rows, --heads and --repeat must be at least 1")
    if not 0 <= args.c4_entries <= C4_TOPK:
        parser.error(f"--c4-entries must be in 0..{C4_TOPK}")

    from sglang.kernels.ops.attention import flash_mla_sm120_mma as mma

    kwargs = call_args(args.rows, args.heads, args.c4_entries)
    mma.flash_mla_sparse_decode_mma(**kwargs)  # the plan, outside the timing
    times = []
    for i in range(args.repeat):
        start = time.perf_counter()
        mma.flash_mla_sparse_decode_mma(**kwargs)
        times.append(time.perf_counter() - start)
        print(f"call {i + 1}: {times[-1]:.3f} s", flush=True)
    print(
        f"rows {args.rows}, heads {args.heads}, c4 entries {args.c4_entries}/{C4_TOPK}: "
        f"mean {statistics.mean(times):.3f} s per interpreted call"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
