"""Why the mma kernel keeps dequantizing FP8 KV instead of using block-scaled MMA on sm_120.

Two facts, each printed by ``.venv/bin/python -m bench.kernel.fp8_study`` on a CPU:

1. What Triton emits for ``tl.dot_scaled`` per target (a 16 x 32 x 512 probe compiled for the
   virtual targets, SASS read with the cuobjdump Triton ships): e4m3 x e4m3 with UE8M0 scales
   becomes block-scaled MMA (QMMA.SF) on sm_120 and sm_121; bf16 x e4m3 is upcast to a bf16
   HMMA everywhere; sm_90 has no block-scaled MMA.
2. What a block-scaled QK would cost in accuracy: native QMMA.SF needs q in e4m3 too (one UE8M0
   scale per 32 values, as MX formats store it). Upstream's torch reference run with q's 448
   nope values so quantized, against the same reference with bf16 q, on the interpreter tests'
   inputs: the output error as a multiple of the kernel's test tolerance
   (tests/kernel/cases.py: 1e-2 x max|out| + 1e-2 x |out|), and the lse error.

P.V cannot use the stored scales at all: an MX scale covers 32 consecutive values along the
reduction (here: 32 tokens), while the cache stores one scale per token and 64-column group.
"""

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _probe_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def probe(a_ptr, as_ptr, b_ptr, bs_ptr, o_ptr, LHS: tl.constexpr, K: tl.constexpr):
        m = tl.arange(0, 16)
        n = tl.arange(0, 32)
        k = tl.arange(0, K)
        ks = tl.arange(0, K // 32)
        if LHS == "e4m3":
            a = tl.load(a_ptr + m[:, None] * K + k[None, :])
            a_scale = tl.load(as_ptr + m[:, None] * (K // 32) + ks[None, :])
        else:
            bf16 = a_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
            a = tl.load(bf16 + m[:, None] * K + k[None, :])
            a_scale = None
        b = tl.load(b_ptr + k[:, None] + n[None, :] * K)
        b_scale = tl.load(bs_ptr + n[:, None] * (K // 32) + ks[None, :])
        c = tl.dot_scaled(a, a_scale, LHS, b, b_scale, "e4m3")
        tl.store(o_ptr + m[:, None] * 32 + n[None, :], c)

    return probe


def mma_kinds(arch: int, lhs: str) -> list[str]:
    """The MMA mnemonics of the dot_scaled probe compiled for ``arch`` (e4m3 or bf16 lhs)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from bench.kernel.lib.virtual_gpu import _read_cubin

    signature = {
        "a_ptr": "*fp8e4nv",
        "as_ptr": "*u8",
        "b_ptr": "*fp8e4nv",
        "bs_ptr": "*u8",
        "o_ptr": "*fp32",
        "LHS": "constexpr",
        "K": "constexpr",
    }
    src = triton.compiler.ASTSource(
        fn=_probe_kernel(), signature=signature, constexprs={"LHS": lhs, "K": 512}
    )
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
    _, sass = _read_cubin(compiled.asm["cubin"])
    return sorted(set(re.findall(r"\b[A-Z]*MMA(?:\.\w+)*", sass)))


def mx_e4m3(x, block: int = 32):
    """x rounded to e4m3 with one power-of-two scale per ``block`` values (the MX rule: the
    smallest power of two that brings the block's largest magnitude within e4m3's 448)."""
    import torch

    shape = x.shape
    blocks = x.float().reshape(*shape[:-1], shape[-1] // block, block)
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=2**-126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    return ((blocks / scale).to(torch.float8_e4m3fn).float() * scale).reshape(shape)


def q_quantization_error(seeds: int) -> list[dict]:
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "kernel"))
    from cases import Case, make_inputs, reference_args
    from sglang.kernels.ops.attention.flash_mla_sm120 import _sm120_sparse_decode_fwd

    rows = []
    for seed in range(seeds):
        case = Case(batch=4, heads=16, swa_topk=128, extra_topk=256, seed=seed)
        args = list(reference_args(make_inputs(case)))
        ref_out, ref_lse = _sm120_sparse_decode_fwd(*args)
        q = args[0].float()
        q[..., :448] = mx_e4m3(q[..., :448])
        args[0] = q.to(torch.bfloat16)
        out, lse = _sm120_sparse_decode_fwd(*args)
        ref = ref_out.float()
        tol = 1e-2 * ref.abs().amax().clamp(min=1.0) + 1e-2 * ref.abs()
        rows.append(
            {
                "case": f"{case} seed {seed}",
                "out_error_over_tolerance": round(
                    ((out.float() - ref).abs() / tol).amax().item(), 2
                ),
                "lse_abs_error": round((lse - ref_lse).abs().max().item(), 4),
            }
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kernel.fp8_study", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seeds", type=int, default=4, help="input seeds for part 2 (default 4)")
    args = parser.parse_args(argv)
    print("1. tl.dot_scaled(lhs, e4m3 rhs) compiled per target: MMA instructions")
    for arch in (120, 121, 90):
        for lhs in ("e4m3", "bf16"):
            print(f"   sm_{arch} lhs {lhs:<4}: {', '.join(mma_kinds(arch, lhs))}")
    print("2. q's nope values as e4m3 with a UE8M0 scale per 32, upstream's torch reference:")
    for row in q_quantization_error(args.seeds):
        print(
            f"   {row['case']}: output error {row['out_error_over_tolerance']}x the test "
            f"tolerance, lse off by {row['lse_abs_error']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
