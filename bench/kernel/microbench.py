#!/usr/bin/env python3
"""DSV4 sparse-decode kernel microbenchmark: the mma backend vs upstream triton and torch.

Times each backend on the same inputs at DSV4 decode shapes (one decode token per request, a
SWA list in 256-token pages plus an extra list), measures the device's copy bandwidth in the
same run, and reports per point: microseconds per call, GB/s of KV gathered (valid tokens x 584
bytes, each counted once), that as a fraction of copy bandwidth, and the speedup over upstream
triton. For the mma backend it sweeps SGLANG_SM120_MMA_TARGET_CTAS and says how far ``auto`` is
from the best fixed value at each shape. With --padded-heads it also times mma on the same
inputs with q padded to upstream's width (64 heads), as decode fed it before patch 0005, and
reports native_vs_padded per target. Results go to stdout and, with --json, to a JSON file;
--plot writes a PNG.

Needs a CUDA device and the patched sglang (the mma backend) importable; exits with a message
otherwise.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _int_list(text: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
    return values


def _extra_list(text: str) -> list[int]:
    return _int_list(text, minimum=0)


def _targets(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    for v in values:
        if v != "auto" and not (v.isdigit() and int(v) > 0):
            raise argparse.ArgumentTypeError(f"targets are 'auto' or positive integers, got {v!r}")
    return values


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="bench/kernel/microbench", description=__doc__.split("\n\n")[0], epilog=__doc__
    )
    # String defaults go through `type` like typed ones, and --help shows them as typed.
    p.add_argument(
        "--batch",
        type=_int_list,
        default="1,16,32,64,80,96,128",
        help="comma-separated batch sizes, requests per call (default: %(default)s)",
    )
    p.add_argument(
        "--heads",
        type=_int_list,
        default="16,32,64",
        help="comma-separated query heads per rank (default: %(default)s)",
    )
    p.add_argument(
        "--swa", type=int, default=128, help="SWA tokens per request (default: %(default)s)"
    )
    p.add_argument(
        "--extra",
        type=_extra_list,
        default="512,2048",
        help="comma-separated extra tokens per request, 0: none (default: %(default)s)",
    )
    p.add_argument(
        "--targets",
        type=_targets,
        default="auto,128,256,512,1024",
        help="SGLANG_SM120_MMA_TARGET_CTAS values swept for mma, auto or positive integers "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--backends",
        default="mma,triton,torch,flashinfer",
        help="comma-separated subset of mma,triton,torch,flashinfer (default: %(default)s)",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=50,
        help="timed calls per point, after 3 warm-up calls (default: %(default)s)",
    )
    p.add_argument(
        "--padded-heads",
        action="store_true",
        help="also time mma on the same inputs with q padded to upstream's width (64 heads, "
        "or the head count above 64) as SM120 decode fed it before patch 0005; rows "
        "'mma-padded' with native_vs_padded = padded us / native us (default: off)",
    )
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=0.0,
        help="stop starting new points after this many seconds and list the skipped ones in "
        "the JSON; 0: no limit (default: %(default)s)",
    )
    p.add_argument(
        "--kit",
        help="import the kernel from this GPU kit (bench/kernel/gpu_session --prepare) instead "
        "of the installed sglang (default: none)",
    )
    p.add_argument(
        "--json", help="write all results to this JSON file (default: none, stdout only)"
    )
    p.add_argument(
        "--plot", help="write a PNG plot of us per call vs batch to this file (default: none)"
    )
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - {"mma", "triton", "torch", "flashinfer"}
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}")
    if args.iters <= 0 or args.swa < 0 or args.time_budget_s < 0:
        p.error("--iters must be > 0, --swa >= 0 and --time-budget-s >= 0")
    return args


def _cache(torch, tokens: int, page_size: int, device):
    """Random DSV4 FP8 pages ([pages, page_size, 1, 584] view, page stride rounded to 576)."""
    pages = -(-tokens // page_size)
    page_bytes = -(-page_size * 584 // 576) * 576
    raw = torch.empty(pages, page_bytes, dtype=torch.uint8, device=device)
    data = raw[:, : page_size * 576].view(pages, page_size, 576)
    nope = torch.randn(pages, page_size, 448, device=device).to(torch.float8_e4m3fn)
    data[..., :448] = nope.view(torch.uint8)
    rope = torch.randn(pages, page_size, 64, device=device).to(torch.bfloat16)
    data[..., 448:] = rope.view(torch.uint8).view(pages, page_size, 128)
    scales = raw[:, page_size * 576 : page_size * 584].view(pages, page_size, 8)
    scales[..., :7] = torch.randint(122, 130, (pages, page_size, 7), device=device).to(torch.uint8)
    return raw.view(torch.float8_e4m3fn).as_strided(
        (pages, page_size, 1, 584), (page_bytes, 584, 584, 1)
    )


def make_inputs(torch, batch, heads, swa, extra, device):
    """Every request owns distinct KV tokens, so gathered bytes are real DRAM traffic."""
    kwargs = {
        "q": torch.randn(batch, 1, heads, 512, device=device).to(torch.bfloat16),
        "k_cache": _cache(torch, batch * swa, 256, device),
        "indices": torch.arange(batch * swa, device=device, dtype=torch.int32).view(batch, 1, swa),
        "topk_length": torch.full((batch,), swa, dtype=torch.int32, device=device),
        "attn_sink": torch.randn(heads, device=device),
        "head_dim_v": 512,
        "softmax_scale": 512**-0.5,
    }
    if extra:
        kwargs["extra_k_cache"] = _cache(torch, batch * extra, 64, device)
        perm = torch.randperm(batch * extra, device=device).to(torch.int32)
        kwargs["extra_indices_in_kvcache"] = perm.view(batch, 1, extra)
        kwargs["extra_topk_length"] = torch.full((batch,), extra, dtype=torch.int32, device=device)
    return kwargs


def upstream_padded_heads(heads: int) -> int:
    """The query width upstream gives SM120 decode backends without a native-head kernel."""
    return 64 if heads <= 64 else heads


def padded_inputs(torch, kwargs: dict) -> dict:
    """The same call with q padded as upstream pads it: real heads first, the rest left as
    whatever the allocation held (upstream uses new_empty), and the sink zero-padded."""
    q = kwargs["q"]
    batch, _, heads, dim = q.shape
    width = upstream_padded_heads(heads)
    q_padded = torch.empty(batch, 1, width, dim, dtype=q.dtype, device=q.device)
    q_padded[:, :, :heads] = q
    sink = kwargs["attn_sink"]
    if sink is not None:
        sink = torch.cat([sink, sink.new_zeros(width - heads)])
    return {**kwargs, "q": q_padded, "attn_sink": sink}


def time_us(torch, fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def copy_bandwidth_gbps(torch, device) -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = time_us(torch, lambda: dst.copy_(src), 10)
    return 2 * (1 << 30) / (us * 1e-6) / 1e9


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernel_microbench: unset TRITON_INTERPRET; this times compiled kernels")
    import torch

    if not torch.cuda.is_available():
        sys.exit("kernel_microbench: needs a CUDA device (none is visible); nothing was run")
    os.environ["SGLANG_SM120_FLASHMLA_BACKEND"] = "mma"
    if args.kit:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from bench.kernel.lib.gpu_kit import activate

        activate(args.kit)
    try:
        from sglang.kernels.ops.attention import flash_mla_sm120 as dispatch
        from sglang.kernels.ops.attention import flash_mla_sm120_mma  # noqa: F401
    except ImportError as err:
        sys.exit(f"kernel_microbench: the patched sglang with the mma backend is needed ({err})")

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    copy_gbps = copy_bandwidth_gbps(torch, device)
    header = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "copy_gbps": round(copy_gbps, 1),
        "command": " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print(json.dumps(header), flush=True)

    def run_backend(name, kwargs):
        # Upstream reads SGLANG_SM120_FLASHMLA_BACKEND once, at import.
        dispatch._sm120_default_backend = name
        return lambda: dispatch.flash_mla_with_kvcache_sm120(**kwargs)

    rows, skipped = [], []
    started = time.monotonic()
    for heads in args.heads:
        for extra in args.extra:
            for batch in args.batch:
                if args.time_budget_s and time.monotonic() - started > args.time_budget_s:
                    skipped.append({"batch": batch, "heads": heads, "extra": extra})
                    continue
                kwargs = make_inputs(torch, batch, heads, args.swa, extra, device)
                gathered = batch * (args.swa + extra) * 584
                point = {"batch": batch, "heads": heads, "swa": args.swa, "extra": extra}
                runs = [
                    (backend, target, backend, kwargs)
                    for backend in args.backends
                    for target in (args.targets if backend == "mma" else [None])
                ]
                if "mma" in args.backends and args.padded_heads:
                    padded = padded_inputs(torch, kwargs)
                    if padded["q"].shape[2] != heads:
                        runs += [("mma", t, "mma-padded", padded) for t in args.targets]
                results = []
                for backend, target, label, inputs in runs:
                    if target is not None:
                        os.environ["SGLANG_SM120_MMA_TARGET_CTAS"] = target
                    row = {**point, "backend": label, "target_ctas": target}
                    if label == "mma-padded":
                        row["padded_heads"] = inputs["q"].shape[2]
                    try:
                        us = time_us(torch, run_backend(backend, inputs), args.iters)
                    except Exception as err:  # a backend the device cannot run
                        results.append({**row, "error": repr(err)})
                        continue
                    gbps = gathered / (us * 1e-6) / 1e9
                    results.append(
                        {
                            **row,
                            "us": round(us, 2),
                            "kv_gbps": round(gbps, 1),
                            "frac_copy": round(gbps / copy_gbps, 3),
                        }
                    )
                by_label = {(r["backend"], r["target_ctas"]): r.get("us") for r in results}
                triton_us = by_label.get(("triton", None))
                fixed = [
                    r["us"]
                    for r in results
                    if r["backend"] == "mma" and r["target_ctas"] != "auto" and "us" in r
                ]
                for r in results:
                    if "us" in r and triton_us:
                        r["speedup_vs_triton"] = round(triton_us / r["us"], 2)
                    if r["backend"] == "mma" and r["target_ctas"] == "auto" and fixed:
                        r["auto_vs_best_fixed"] = round(r["us"] / min(fixed), 3)
                    native_us = by_label.get(("mma", r["target_ctas"]))
                    if r["backend"] == "mma-padded" and "us" in r and native_us:
                        r["native_vs_padded"] = round(r["us"] / native_us, 2)
                    print(json.dumps(r), flush=True)
                rows.extend(results)
                del kwargs
                torch.cuda.empty_cache()

    if skipped:
        print(
            f"kernel_microbench: time budget of {args.time_budget_s:.0f} s spent; "
            f"{len(skipped)} point(s) skipped (listed in the JSON)",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**header, "results": rows, "skipped": skipped}, f, indent=1)
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["heads"], r["extra"]) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, (heads, extra) in zip(axes[0], shapes, strict=True):
        series = {}
        for r in rows:
            if (r["heads"], r["extra"]) == (heads, extra) and "us" in r:
                label = r["backend"] + (f" {r['target_ctas']}" if r["target_ctas"] else "")
                series.setdefault(label, []).append((r["batch"], r["us"]))
        for label, points in sorted(series.items()):
            ax.plot(*zip(*sorted(points), strict=True), marker="o", label=label)
        ax.set(title=f"H={heads}, extra={extra}", xlabel="batch", ylabel="us per call")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tools.entry import call

    # A dependency main() imports and this Python lacks ends in one line naming it, exit 2.
    call("bench/kernel/microbench", main)
