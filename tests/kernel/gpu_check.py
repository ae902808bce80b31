"""Compiled checks of the mma backend on a CUDA device, run by test_gpu.py in a process of its
own: the kernel tests' process runs Triton in interpreter mode, and that is fixed at import.

  python tests/kernel/gpu_check.py compare   compiled mma vs upstream's torch reference
  python tests/kernel/gpu_check.py graph     CUDA graph capture + replay vs eager
  python tests/kernel/gpu_check.py gather    the microbench's gather kernel vs torch indexing
                                             of the same KV rows (bench/kernel/lib/gather.py)
  python tests/kernel/gpu_check.py baseline --baseline DIR
                                             the baseline kernel the microbench times as
                                             mma-main (a GPU kit's baseline/) vs the reference

Exits non-zero on the first mismatch. ``--device cpu`` (with TRITON_INTERPRET=1) runs compare,
gather and baseline in the interpreter on fewer cases, to check this script itself on a machine
without a GPU.
"""

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["SGLANG_SM120_FLASHMLA_BACKEND"] = "mma"

import torch  # noqa: E402
from cases import Case, assert_matches_reference, make_inputs, reference_args  # noqa: E402
from sglang.kernels.ops.attention import flash_mla_sm120 as dispatch  # noqa: E402
from sglang.kernels.ops.attention.sm120_mma_splits import ENV_NAME  # noqa: E402

SMALL_CASES = [
    Case(batch=1, heads=16, swa_topk=150),
    Case(batch=3, heads=16, swa_topk=140, swa_page_size=256, sink=False),
    Case(batch=2, heads=64, swa_topk=45, extra_topk=77, extra_page_size=64, empty_row=True),
    Case(batch=2, heads=128, swa_topk=33, extra_topk=90, extra_page_size=128),
    Case(batch=2, heads=20, swa_topk=64, extra_topk=95, extra_page_size=32),
]
# DSV4-like decode shapes: 128 SWA tokens in 256-token pages plus hundreds to thousands of extra.
DECODE_CASES = [
    Case(batch=64, heads=16, swa_topk=128, swa_page_size=256, extra_topk=512),
    Case(batch=32, heads=64, swa_topk=128, swa_page_size=256, extra_topk=2048, empty_row=True),
    Case(batch=7, heads=32, swa_topk=128, swa_page_size=256, extra_topk=1000, with_lengths=False),
]
TARGETS = ("1", "auto", "512", "100000")
# The interpreter's case for the baseline: holes, lengths, an empty request, both lists.
BASELINE_CPU_CASES = [Case(batch=2, heads=16, swa_topk=45, extra_topk=77, empty_row=True)]


def _run(kwargs):
    return dispatch.flash_mla_with_kvcache_sm120(**kwargs)


def compare(device: str) -> None:
    cases = SMALL_CASES + (DECODE_CASES if device == "cuda" else [])
    for target in TARGETS if device == "cuda" else ("1", "100000"):
        os.environ[ENV_NAME] = target
        for case in cases:
            kwargs = make_inputs(case, device)
            out, lse = _run(kwargs)
            assert_matches_reference(
                out, lse, *dispatch._sm120_sparse_decode_fwd(*reference_args(kwargs))
            )
            print(f"ok compare {ENV_NAME}={target} {case}", flush=True)


def gather(device: str) -> None:
    """The gather reads the rows the kernel reads: -1 holes, topk lengths, both lists."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.kernel.lib.gather import gather_kv_rows, reference_tile_words

    cases = SMALL_CASES + (DECODE_CASES if device == "cuda" else [])
    for case in cases:
        kwargs = make_inputs(case, device)
        lists = (
            kwargs["k_cache"],
            kwargs["indices"],
            kwargs["topk_length"],
            kwargs["extra_k_cache"],
            kwargs["extra_indices_in_kvcache"],
            kwargs["extra_topk_length"],
        )
        got = gather_kv_rows(*lists).cpu()
        want = reference_tile_words(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in lists))
        assert torch.equal(got, want), f"gather words differ at {int((got != want).sum())} tiles"
        assert want.any(), "no tile read any bits: the check would pass by construction"
        print(f"ok gather {case}", flush=True)


def baseline(device: str, directory: Path) -> None:
    """The baseline kernel (mma-main) against the reference, so before/after compare two
    correct kernels."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.kernel.lib.gpu_kit import load_baseline

    old = load_baseline(directory)
    cases = (SMALL_CASES + DECODE_CASES) if device == "cuda" else BASELINE_CPU_CASES
    for target in ("auto", "512") if device == "cuda" else ("100000",):
        os.environ[ENV_NAME] = target
        for case in cases:
            kwargs = make_inputs(case, device)
            out, lse = old.flash_mla_sparse_decode_mma(*reference_args(kwargs))
            assert_matches_reference(
                out, lse, *dispatch._sm120_sparse_decode_fwd(*reference_args(kwargs))
            )
            print(f"ok baseline {ENV_NAME}={target} {case}", flush=True)


def _refill(static: dict, fresh: dict) -> None:
    """Copy new inputs into the captured tensors (the KV caches through their raw pages)."""
    for key, value in static.items():
        if isinstance(value, torch.Tensor):
            if key in ("k_cache", "extra_k_cache"):
                numel = value.shape[0] * value.stride(0)
                value.as_strided((numel,), (1,)).copy_(fresh[key].as_strided((numel,), (1,)))
            else:
                value.copy_(fresh[key])


def graph() -> None:
    case = Case(batch=16, heads=64, swa_topk=128, swa_page_size=256, extra_topk=512, empty_row=True)
    for target in ("1", "auto", "512"):
        os.environ[ENV_NAME] = target
        static = make_inputs(case, "cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                _run(static)
        torch.cuda.current_stream().wait_stream(side)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            graph_out, graph_lse = _run(static)
        # Several replays with new inputs: each must merge every cut row again, so a row
        # ticket left unreset by the replay before would show here as a stale output.
        for seed in (7, 8, 9):
            _refill(static, make_inputs(replace(case, seed=seed), "cuda"))
            captured.replay()
            torch.cuda.synchronize()
            eager_out, eager_lse = _run(static)
            assert torch.equal(graph_out, eager_out), "graph replay output differs from eager"
            assert torch.equal(graph_lse, eager_lse), "graph replay lse differs from eager"
            assert_matches_reference(
                graph_out, graph_lse, *dispatch._sm120_sparse_decode_fwd(*reference_args(static))
            )
        print(f"ok graph {ENV_NAME}={target} {case} (3 replays)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=("compare", "graph", "gather", "baseline"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--baseline", type=Path, help="baseline: the folder of the baseline kernel's files"
    )
    args = parser.parse_args()
    if args.check == "baseline" and args.baseline is None:
        parser.error("baseline needs --baseline DIR (a GPU kit's baseline/)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA device (use --device cpu with TRITON_INTERPRET=1)")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu needs TRITON_INTERPRET=1")
    if args.check == "graph" and args.device != "cuda":
        parser.error("the graph check needs a CUDA device")
    if args.check == "compare":
        compare(args.device)
    elif args.check == "gather":
        gather(args.device)
    elif args.check == "baseline":
        baseline(args.device, args.baseline)
    else:
        graph()
    return 0


if __name__ == "__main__":
    sys.exit(main())
