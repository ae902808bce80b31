#!/usr/bin/env python3
"""Audit the mma decode kernel on virtual GPUs: does every DSV4 decode shape load on every target?

For each target (a virtual device: architecture, SM count and CUDA's per-architecture limits)
and each DSV4 decode shape, runs our real launcher ``flash_mla_sparse_decode_mma`` on CPU tensors
while Triton's JIT compiles for that target (bench/kernel/lib/virtual_gpu.py). Nothing executes;
Triton specializes, compiles and checks resources as it would on the GPU, and the launches are
recorded.

Per compiled kernel it reports shared memory against the per-block limit, registers, local
memory and spill instructions, resident CTAs per SM (from registers, shared memory and threads)
and what limits them, tensor-core instructions, global loads (128-bit and byte-wide) read from
the cubin's SASS with the cuobjdump that Triton ships. Per shape it reports the grid, the split
count, the waves it fills, and a traffic model: bytes one call must move (KV gathered once per
head block, partials written and read, q and out) next to upstream's Triton kernel, which reads
the KV once per head, with lower-bound times at each target's datasheet bandwidth, and the same
call with q padded to upstream's 64 heads (as SM120 decode fed it before patch 0005). The model and
the datasheet figures are labelled as such; nothing here is a measurement of a GPU.

Exit status: 0 when every shape loads on every target with no spills, MMA instructions in stage 1
and the resident CTAs its configuration is sized for; 1 otherwise; 2 on bad arguments.
"""

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.kernel.microbench import _int_list  # noqa: E402

_KERNEL_PACKAGE = "sglang.kernels.ops.attention"
# --targets name of the GPU this process runs on (its launches run for real, recorded).
REAL_DEVICE = "cuda"
# The modules of the kernel under audit, in import order (later ones import earlier ones).
_KERNEL_MODULES = ("sm120_mma_fit", "sm120_mma_splits", "flash_mla_sm120_mma")

BYTES_PER_TOKEN = 584  # 448 FP8 nope + 64 BF16 rope + 8 scale bytes
HEAD_DIM = 512
SWA_TOKENS = 128
SWA_PAGE = 256
# Extra (compressed) index lists of DSV4's layers: name -> (tokens, tokens per page).
EXTRAS = {
    "none": (0, 0),
    "c4-512": (512, 64),
    "c4-2048": (2048, 64),
    "c128-512": (512, 2),
}


@dataclass(frozen=True)
class Shape:
    heads: int
    batch: int
    extra: str
    sink: bool
    lengths: bool

    @property
    def tokens(self) -> int:
        return SWA_TOKENS + EXTRAS[self.extra][0]

    def __str__(self) -> str:
        return (
            f"H{self.heads} B{self.batch} {self.extra}"
            f"{' sink' if self.sink else ''}{' len' if self.lengths else ''}"
        )


def _choice_list(choices):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        unknown = [v for v in values if v not in choices]
        if not values or unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown or text!r}; choose from {', '.join(choices)}"
            )
        return values

    return parse


def _stage1_config(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected BLOCK_H,BLOCK_T,WARPS,PREFETCH, four non-negative integers"
        )
    block_h, block_t, warps, prefetch = (int(p) for p in parts)
    for name, value in (("BLOCK_H", block_h), ("BLOCK_T", block_t), ("WARPS", warps)):
        if value < 1 or value & (value - 1):
            raise argparse.ArgumentTypeError(f"{text!r}: {name} must be a power of two")
    if prefetch != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: PREFETCH is 1 (one tile ahead)")
    return block_h, block_t, warps, prefetch


def _on_off(text: str) -> list[bool]:
    return [v == "on" for v in _choice_list(("on", "off"))(text)]


def parse_args(argv, targets):
    p = argparse.ArgumentParser(
        prog="bench/kernel/audit",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--targets",
        type=_choice_list((*targets, REAL_DEVICE)),
        default=",".join(targets),
        help=f"comma-separated virtual targets, or {REAL_DEVICE!r}: the GPU this runs on, "
        "launching for real (default: %(default)s)",
    )
    p.add_argument(
        "--heads",
        type=_int_list,
        default="8,16,32,64,128",
        help="comma-separated query heads per rank (default: %(default)s)",
    )
    p.add_argument(
        "--batch",
        type=_int_list,
        default="1,2,4,8,16,32,64,80,96,128",
        help="comma-separated batch sizes (default: %(default)s)",
    )
    p.add_argument(
        "--extra",
        type=_choice_list(tuple(EXTRAS)),
        default=",".join(EXTRAS),
        help="extra index lists: none, c4-N (N tokens, 64-token pages), c128-N (2-token "
        f"pages); {SWA_TOKENS} SWA tokens in {SWA_PAGE}-token pages always (default: %(default)s)",
    )
    p.add_argument("--sink", type=_on_off, default="on,off", help="(default: %(default)s)")
    p.add_argument(
        "--lengths",
        type=_on_off,
        default="on,off",
        help="topk lengths given (default: %(default)s)",
    )
    p.add_argument(
        "--target-ctas",
        default="auto",
        help="SGLANG_SM120_MMA_TARGET_CTAS for the launches (default: %(default)s)",
    )
    p.add_argument("--json", help="write every record to this JSON file (default: none)")
    p.add_argument(
        "--shapes",
        action="store_true",
        help="print one line per shape and target (default: only failures and key shapes)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=min(len(targets), os.cpu_count() or 1),
        help="processes auditing in parallel (default: %(default)s: the CPU count, at most one "
        "per target); targets of one architecture share a process, one after the other, so "
        "that the second finds the kernels the first compiled in Triton's cache",
    )
    p.add_argument(
        "--kernel-dir",
        type=Path,
        help="audit the kernel modules in this directory instead of the installed ones "
        f"({', '.join(m + '.py' for m in _KERNEL_MODULES)}, any subset), e.g. an older "
        "revision's: git show REV:overlay/sglang/kernels/ops/attention/FILE > DIR/FILE",
    )
    p.add_argument(
        "--stage1-config",
        type=_stage1_config,
        help="compile stage 1 with this configuration instead of the one the kernel picks for "
        "each target: BLOCK_H,BLOCK_T,WARPS,PREFETCH (for example 32,32,8,1), sized for one CTA "
        "per SM; for trying a tile before changing sm120_mma_fit.CONFIGS (default: none)",
    )
    p.add_argument(
        "--compare",
        type=lambda text: [v.strip() for v in text.split(",") if v.strip()],
        help="also audit the kernel of these git revisions of this repository (comma-separated, "
        "e.g. dc905b5,da6d56d) in the same run, and print their stage-1 facts next to the "
        "audited kernel's, shape by shape (default: none)",
    )
    p.add_argument(
        "--kit",
        type=Path,
        help="import the kernel from this GPU kit (bench/kernel/gpu_session --prepare) instead "
        "of the installed sglang (default: none)",
    )
    args = p.parse_args(argv)
    if args.kit is not None:
        from bench.kernel.lib.gpu_kit import activate

        try:
            activate(args.kit)
        except (FileNotFoundError, RuntimeError) as err:
            p.error(f"--kit: {err}")
    try:
        from sglang.kernels.ops.attention.sm120_mma_splits import parse_target_ctas
    except ImportError as err:
        p.error(f"the patched sglang (or --kit DIR) is needed for the kernel: {err}")
    try:
        parse_target_ctas(args.target_ctas)
    except ValueError as err:
        p.error(f"--target-ctas: {err}")
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    if REAL_DEVICE in args.targets:
        import torch

        if not torch.cuda.is_available():
            p.error(f"--targets {REAL_DEVICE}: no CUDA device is visible")
    for rev in args.compare or ():
        done = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            p.error(f"--compare {rev}: not a commit of this repository")
    if args.kernel_dir is not None and not args.kernel_dir.is_dir():
        p.error(f"--kernel-dir {args.kernel_dir}: not a directory")
    return args


def _load_kernel(kernel_dir: Path | None):
    """The launcher module; from kernel_dir's files where given, else the installed sglang."""
    if kernel_dir is not None:
        for name in _KERNEL_MODULES:
            path = kernel_dir / f"{name}.py"
            if path.is_file():
                full = f"{_KERNEL_PACKAGE}.{name}"
                spec = importlib.util.spec_from_file_location(full, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[full] = module
                spec.loader.exec_module(module)
    return importlib.import_module(f"{_KERNEL_PACKAGE}.flash_mla_sm120_mma")


def _alloc(torch, device: str):
    """torch.zeros on a real device (its kernels read the buffers); torch.empty on the CPU,
    where a virtual device only compiles and records, and nothing reads their contents."""
    return torch.empty if device == "cpu" else torch.zeros


def _cache(torch, page_size: int, device: str, pages: int = 2):
    """A small [pages, page_size, 1, 584] page buffer: the launch depends on its strides only."""
    page_bytes = -(-page_size * BYTES_PER_TOKEN // 576) * 576
    raw = _alloc(torch, device)(pages, page_bytes, dtype=torch.uint8, device=device)
    return raw.view(torch.float8_e4m3fn).as_strided(
        (pages, page_size, 1, BYTES_PER_TOKEN), (page_bytes, BYTES_PER_TOKEN, BYTES_PER_TOKEN, 1)
    )


def _launch_args(torch, shape: Shape, device: str = "cpu") -> tuple:
    """Positional arguments of flash_mla_sparse_decode_mma for a shape. Contents do not matter
    to a virtual device; on a real one every index points at token 0, so every read is in
    bounds."""
    b, h = shape.batch, shape.heads
    extra_tokens, extra_page = EXTRAS[shape.extra]
    fill = _alloc(torch, device)
    i32 = {"dtype": torch.int32, "device": device}
    lengths = torch.full((b,), SWA_TOKENS, **i32) if shape.lengths else None
    extra = (None, None, None)
    if extra_tokens:
        extra = (
            _cache(torch, extra_page, device),
            fill(b, 1, extra_tokens, **i32),
            torch.full((b,), extra_tokens, **i32) if shape.lengths else None,
        )
    return (
        fill(b, 1, h, HEAD_DIM, dtype=torch.bfloat16, device=device),
        _cache(torch, SWA_PAGE, device),
        fill(b, 1, SWA_TOKENS, **i32),
        lengths,
        fill(h, dtype=torch.float32, device=device) if shape.sink else None,
        HEAD_DIM,
        HEAD_DIM**-0.5,
        *extra,
    )


def stream_k_pieces(rows: int, tiles: int, ctas: int) -> int:
    """Pieces a stream-K launch writes and merges: one per (CTA, row) pair of a row that is cut
    between CTAs (CTA c walks units [c W / C, (c + 1) W / C) of W = rows x tiles)."""
    units = rows * tiles

    def cta_of(unit: int) -> int:
        return ((unit + 1) * ctas - 1) // units

    pieces = (cta_of(r * tiles + tiles - 1) - cta_of(r * tiles) + 1 for r in range(rows))
    return sum(p for p in pieces if p > 1)


def traffic_model(shape: Shape, head_blocks: int, pieces: int, block_h: int = 16) -> dict:
    """Bytes one call must move (a model): the mma kernel and upstream's per-head Triton kernel.

    ``pieces`` are the partial outputs written and read back: split partials of a split-K
    grid, or the pieces of rows cut between CTAs of a stream-K one; each is BLOCK_H heads of
    512 bf16 values and an fp32 log2-sum-exp, written once and read once."""
    b, h, t = shape.batch, shape.heads, shape.tokens
    indices = b * t * 4
    q_out = b * h * HEAD_DIM * 2 * 2 + b * h * 4
    kv_mma = b * head_blocks * t * BYTES_PER_TOKEN
    partials = 2 * pieces * block_h * (HEAD_DIM * 2 + 4)
    kv_upstream = b * h * t * BYTES_PER_TOKEN
    return {
        "kv_bytes": kv_mma,
        "partial_bytes": partials,
        "mma_bytes": kv_mma + partials + q_out + indices,
        "upstream_triton_bytes": kv_upstream + q_out + indices,
    }


def _pieces_of(launch, head_blocks: int, batch: int, tiles: int) -> int:
    """Partial outputs of a stage-1 launch. The split-K kernel (its SINGLE_SPLIT flag; grid
    head blocks x splits x batch) writes one per CTA when it has more than one split; the
    stream-K kernel (grid C), one per CTA of each row cut between CTAs."""
    grid = launch.grid
    if "SINGLE_SPLIT" in dict(launch.variant):
        return 0 if grid[1] == 1 else grid[0] * grid[1] * grid[2]
    return stream_k_pieces(batch * head_blocks, tiles, grid[0])


def _rows_and_tiles(shape: Shape, variant: dict) -> tuple[int, int]:
    """(head blocks, KV tiles per request) of a shape under a compiled variant's tile sizes."""
    block_h, block_t = variant.get("BLOCK_H", 16), variant.get("BLOCK_T", 32)
    extra = EXTRAS[shape.extra][0]
    return -(-shape.heads // block_h), -(-SWA_TOKENS // block_t) + -(-extra // block_t)


def upstream_padded_heads(heads: int) -> int:
    """The query width upstream gives SM120 decode backends without a native-head kernel (the
    mma backend before patch 0005): 64, or the head count above 64."""
    return 64 if heads <= 64 else heads


def _padded_model(mma, torch, dev, shape: Shape, device: str) -> dict:
    """The same call with q padded to upstream's width, launched on the virtual device: the
    grid the launcher picks for it and its traffic model (what patch 0005 saves)."""
    width = upstream_padded_heads(shape.heads)
    if width == shape.heads:
        return {}
    padded = Shape(width, shape.batch, shape.extra, shape.sink, shape.lengths)
    dev.launches.clear()
    try:
        mma.flash_mla_sparse_decode_mma(*_launch_args(torch, padded, device))
    except Exception as err:
        return {"padded_heads": width, "padded_error": f"{type(err).__name__}: {err}"}
    launch = next(lc for lc in dev.launches if lc.kernel == "_sparse_decode_split_kernel")
    head_blocks, tiles = _rows_and_tiles(padded, dict(launch.variant))
    model = traffic_model(padded, head_blocks, _pieces_of(launch, head_blocks, padded.batch, tiles))
    return {
        "padded_heads": width,
        "padded_head_blocks": head_blocks,
        "padded_ctas": launch.ctas,
        "padded_kv_bytes": model["kv_bytes"],
        "padded_mma_bytes": model["mma_bytes"],
    }


def audit_targets(keys: tuple[str, ...], *args) -> list[dict]:
    """Audit targets one after the other in this process: targets of one architecture compile
    the same kernels, so each after the first finds them in Triton's cache."""
    return [audit_target(key, *args) for key in keys]


def arch_groups(keys: list[str]) -> list[tuple[str, ...]]:
    """The targets grouped by architecture, in the order each architecture first appears
    (a key with no virtual target, such as cuda, alone)."""
    from bench.kernel.lib.virtual_gpu import TARGETS

    groups: dict[object, list[str]] = {}
    for key in keys:
        groups.setdefault(TARGETS[key].arch if key in TARGETS else key, []).append(key)
    return [tuple(g) for g in groups.values()]


def audit_target(
    key: str,
    shapes: list[dict],
    target_ctas: str,
    kernel_dir: str | None,
    kit: str | None,
    stage1_config: tuple[int, int, int, int] | None = None,
) -> dict:
    """Audit one target over the shapes (runs in a worker process of its own)."""
    os.environ["SGLANG_SM120_MMA_TARGET_CTAS"] = target_ctas
    os.environ.pop("TRITON_INTERPRET", None)
    if kit:
        from bench.kernel.lib.gpu_kit import activate

        activate(Path(kit))
    import torch
    from triton.runtime.errors import OutOfResources

    from bench.kernel.lib.virtual_gpu import (
        TARGETS,
        VirtualTarget,
        kernel_resources,
        recording_device,
        virtual_device,
    )

    mma = _load_kernel(Path(kernel_dir) if kernel_dir else None)
    fit = sys.modules.get(f"{_KERNEL_PACKAGE}.sm120_mma_fit")
    if stage1_config is not None:
        block_h, block_t, warps, prefetch = stage1_config
        chosen = fit.LaunchConfig(block_h, block_t, warps, 1, prefetch, 1)
        mma.config_for = lambda _arch, _shared: chosen
    if key == REAL_DEVICE:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        # No datasheet bandwidth for a device found at run time: the model prints bytes only.
        target = VirtualTarget(
            key, props.name, props.major * 10 + props.minor, props.multi_processor_count, 0.0
        )
        device, context = "cuda", recording_device()
    else:
        target = TARGETS[key]
        device, context = "cpu", virtual_device(target)
    kernels: dict[tuple, dict] = {}
    records = []
    config = None
    with context as dev:
        if fit is not None and hasattr(mma, "_device_view"):
            config = asdict(mma._device_view().config)
        for fields in shapes:
            shape = Shape(**fields)
            record = {"target": key, **fields, "tokens": shape.tokens}
            dev.launches.clear()
            try:
                mma.flash_mla_sparse_decode_mma(*_launch_args(torch, shape, device))
                if device == "cuda":
                    torch.cuda.synchronize()
            except OutOfResources as err:
                record["error"] = f"OutOfResources: {err}"
                failed = _last_compiled(mma, dev.device_id)
                if failed is not None:
                    res = kernel_resources(failed, target.arch)
                    occ = _occupancy(res, target.arch)
                    record["failed_kernel"] = {
                        **asdict(res),
                        "shared_limit": _limits(target.arch).max_shared_per_block,
                        "ctas_per_sm": occ.ctas_per_sm,
                        "limited_by": occ.limited_by,
                    }
                records.append(record)
                continue
            except Exception as err:  # any other refusal to launch is a finding too
                record["error"] = f"{type(err).__name__}: {err}"
                records.append(record)
                continue
            launches = []
            for launch in dev.launches:
                # Specializations with equal flags (say H = 8 and H = 16) are separate kernels.
                variant = (launch.kernel, launch.variant, launch.num_stages, launch.resources)
                if variant not in kernels:
                    kernels[variant] = _kernel_record(launch, target)
                launches.append({"kernel": launch.kernel, "grid": list(launch.grid)})
                if launch.kernel == "_sparse_decode_split_kernel":
                    record["stage1_kernel"] = list(kernels).index(variant)
                    head_blocks, tiles = _rows_and_tiles(shape, dict(launch.variant))
                    record["head_blocks"], record["tiles"] = head_blocks, tiles
                    record["units"] = shape.batch * head_blocks * tiles
                    record["ctas"] = launch.ctas
                    record["pieces"] = _pieces_of(launch, head_blocks, shape.batch, tiles)
                    slots = target.sms * kernels[variant]["ctas_per_sm"]
                    record["slots"] = slots
                    record["waves"] = math.ceil(launch.ctas / slots) if slots else None
                    # Busy share of the last wave's slots (every wave before it is full).
                    record["fill"] = (
                        round(launch.ctas / (record["waves"] * slots), 4) if slots else None
                    )
            record["launches"] = launches
            if "ctas" in record:
                record.update(traffic_model(shape, record["head_blocks"], record["pieces"]))
                record.update(_padded_model(mma, torch, dev, shape, device))
            records.append(record)
    return {
        "target": {**asdict(target), "sm": target.sm},
        "config": config,
        "kernels": list(kernels.values()),
        "shapes": records,
    }


def _last_compiled(mma, device_id):
    """The kernel compiled last for this device (the one that failed to load)."""
    cache = mma._sparse_decode_split_kernel.device_caches.get(device_id)
    if not cache or not cache[0]:
        return None
    return list(cache[0].values())[-1]


def _limits(arch: int):
    from sglang.kernels.ops.attention.sm120_mma_fit import limits_for_arch

    return limits_for_arch(arch)


def _occupancy(res, arch: int):
    from sglang.kernels.ops.attention.sm120_mma_fit import occupancy

    return occupancy(res.registers, res.shared_bytes, res.num_warps, _limits(arch))


def _kernel_record(launch, target) -> dict:
    res = launch.resources
    limits = _limits(target.arch)
    occ = _occupancy(res, target.arch)
    variant = dict(launch.variant)
    return {
        "kernel": launch.kernel,
        "variant": variant,
        "num_warps": res.num_warps,
        "num_stages": launch.num_stages,
        "shared_bytes": res.shared_bytes,
        "shared_limit": limits.max_shared_per_block,
        "registers": res.registers,
        "local_bytes": res.local_bytes,
        "spill_stores": res.spill_stores,
        "spill_loads": res.spill_loads,
        "ctas_per_sm": occ.ctas_per_sm,
        "limited_by": occ.limited_by,
        "tensor_core_ops": res.tensor_core_ops,
        "block_scaled_mma": res.block_scaled_mma,
        "global_loads": res.global_loads,
        "global_loads_128": res.global_loads_128,
        "global_loads_u8": res.global_loads_u8,
        **_tile_loop(res, variant),
        # Bytes of KV tiles that the resident stage-1 CTAs of one SM have requested at once:
        # the tile being waited for plus the PREFETCH tiles issued ahead of it.
        "tile_bytes_in_flight_per_sm": (
            occ.ctas_per_sm
            * variant["BLOCK_T"]
            * (1 + variant.get("PREFETCH", 0))
            * BYTES_PER_TOKEN
            if "BLOCK_T" in variant
            else None
        ),
    }


def mma_minimum_per_tile(block_h: int, block_t: int) -> int:
    """m16n8k16 MMAs one KV tile needs for a head block: the scores [BLOCK_H, BLOCK_T] over
    K = 512 and P.V [BLOCK_H, 512] over K = BLOCK_T, each computed once."""
    m = -(-block_h // 16)
    return m * (block_t // 8) * (HEAD_DIM // 16) + m * (HEAD_DIM // 8) * -(-block_t // 16)


def _tile_loop(res, variant: dict) -> dict:
    """Stage 1's tile loop as compiled: MMA per tile against the tile's minimum, and the
    shared-memory bytes the CTA reads and writes per tile (per-warp SASS counts x warps)."""
    if "BLOCK_T" not in variant or not res.loop_mma:
        return {}
    minimum = mma_minimum_per_tile(variant.get("BLOCK_H", 16), variant["BLOCK_T"])
    return {
        "mma_per_tile": res.loop_mma * res.num_warps,
        "mma_minimum_per_tile": minimum,
        "mma_ratio": round(res.loop_mma * res.num_warps / minimum, 3),
        "shared_read_per_tile": res.loop_shared_read_bytes * res.num_warps,
        "shared_written_per_tile": res.loop_shared_write_bytes * res.num_warps,
    }


def findings(result: dict) -> list[str]:
    """What makes the audit fail for one target."""
    out = []
    name = result["target"]["key"]
    for rec in result["shapes"]:
        if "error" in rec:
            out.append(f"{name} {_shape_of(rec)}: does not load: {rec['error']}")
    sized_for = (result["config"] or {}).get("ctas_per_sm")
    for k in result["kernels"]:
        label = f"{name} {k['kernel']} {_variant_label(k['variant'])}"
        if k["local_bytes"] or k["spill_stores"] or k["spill_loads"]:
            out.append(
                f"{label}: spills ({k['local_bytes']} B local, {k['spill_stores']} stores, "
                f"{k['spill_loads']} loads)"
            )
        if k["kernel"] == "_sparse_decode_split_kernel":
            if k["tensor_core_ops"] == 0:
                out.append(f"{label}: no tensor-core (MMA) instruction in stage 1")
            if sized_for and k["ctas_per_sm"] < sized_for:
                out.append(
                    f"{label}: {k['ctas_per_sm']} resident CTAs per SM ({k['limited_by']}), "
                    f"its configuration is sized for {sized_for}"
                )
    return out


def _stage1_kernels(result: dict) -> list[dict]:
    return [k for k in result["kernels"] if k["kernel"] == "_sparse_decode_split_kernel"]


def _variant_label(variant: dict) -> str:
    """Tile sizes and the flags that are on, e.g. ``h16 t16 extra,sink,swa_len``."""
    sizes = [
        f"{k.removeprefix('BLOCK_').lower()}{v}"
        for k, v in variant.items()
        if k.startswith("BLOCK_")
    ]
    flags = [k.removeprefix("HAS_").lower() for k, v in variant.items() if v is True]
    return " ".join(sizes + [",".join(flags) or "-"])


def _print_target(result: dict, show_shapes: bool) -> None:
    t = result["target"]
    cfg = result["config"]
    cfg_text = (
        f"BLOCK_T {cfg['block_t']}, {cfg['num_warps']} warps, {cfg['num_stages']} stage(s), "
        f"prefetch {cfg.get('prefetch', 0)} tile(s) ahead, sized for {cfg['ctas_per_sm']} CTA/SM"
        if cfg
        else "configuration not reported by this kernel"
    )
    print(f"\n== {t['name']} ({t['sm']}, {t['sms']} SMs): {cfg_text}")
    stage1 = _stage1_kernels(result)
    if stage1:
        scaled = sum(k.get("block_scaled_mma", 0) for k in stage1)
        print(
            f"   block-scaled MMA in stage 1: {scaled} instruction(s)"
            + (
                ""
                if scaled
                else " (FP8 KV dequantized to bf16; why: python -m bench.kernel.fp8_study)"
            )
        )
    in_flight = {k["tile_bytes_in_flight_per_sm"] for k in stage1}
    if in_flight:
        print(
            "   KV tile bytes requested at once per SM (model: resident CTAs x tile tokens x "
            f"(1 + prefetch) x {BYTES_PER_TOKEN} B): "
            + ", ".join(f"{b:,}" for b in sorted(in_flight))
        )
    print(
        f"   {'kernel':<44} {'shared / limit':>17} {'regs':>4} {'spill':>5} "
        f"{'CTA/SM (limit)':<18} {'MMA':>4} {'MMA/tile (min)':>14} {'smem rd/tile':>12} "
        f"{'LDG':>4} {'128b':>5} {'u8':>3}"
    )
    for k in result["kernels"]:
        name = "stage1" if k["kernel"] == "_sparse_decode_split_kernel" else "combine"
        share = k["global_loads_128"] / k["global_loads"] if k["global_loads"] else 0.0
        spill = k["local_bytes"] + 4 * (k["spill_stores"] + k["spill_loads"])
        occ = f"{k['ctas_per_sm']} ({k['limited_by']})"
        per_tile = (
            f"{k['mma_per_tile']} ({k['mma_minimum_per_tile']}) {k['mma_ratio']:.2f}x"
            if "mma_per_tile" in k
            else "-"
        )
        smem = f"{k['shared_read_per_tile']:,} B" if "shared_read_per_tile" in k else "-"
        print(
            f"   {name + ' ' + _variant_label(k['variant']):<44} "
            f"{k['shared_bytes']:>7,} / {k['shared_limit']:<7,} {k['registers']:>4} "
            f"{'yes' if spill else 'no':>5} {occ:<18} "
            f"{k['tensor_core_ops']:>4} {per_tile:>14} {smem:>12} "
            f"{k['global_loads']:>4} {share:>5.0%} {k['global_loads_u8']:>3}"
        )
    shapes = result["shapes"]
    loaded = sum("error" not in r for r in shapes)
    print(f"   shapes: {len(shapes)} audited, {loaded} load, {len(shapes) - loaded} do not")
    for r in shapes:
        if "error" in r:
            failed = r.get("failed_kernel")
            extra = (
                f" [{failed['shared_bytes']:,} B shared, {failed['registers']} regs, "
                f"{failed['ctas_per_sm']} CTA/SM ({failed['limited_by']}), "
                f"{failed['global_loads_u8']} byte-wide loads]"
                if failed
                else ""
            )
            print(f"   FAIL {_shape_of(r)}: {r['error']}{extra}")
        elif show_shapes or _is_key_shape(r):
            _print_shape(r, t)


def _is_key_shape(r: dict) -> bool:
    return r["batch"] == 64 and r["extra"] == "c4-512" and r["sink"] and r["lengths"]


def _print_shape(r: dict, t: dict) -> None:
    bw = t["datasheet_gbps"] * 1e9

    def size(n: int) -> str:
        return f"{n / 1e6:.2f} MB" + (f" ({n / bw * 1e6:.1f} us)" if bw else "")

    padded = ""
    if "padded_mma_bytes" in r:
        padded = (
            f"; padded to {r['padded_heads']} heads: {size(r['padded_mma_bytes'])}, KV "
            f"{r['padded_kv_bytes'] / 1e6:.2f} MB vs {r['kv_bytes'] / 1e6:.2f} MB native"
        )
    at = f" at the {t['datasheet_gbps']:.0f} GB/s datasheet bandwidth" if bw else ""
    print(
        f"   {_shape_of(r)}: {r['units']} tiles on {r['ctas']} CTAs, {r['waves']} wave(s) of "
        f"{r['slots']} slots, last wave {r['fill']:.0%} busy, {r['pieces']} partial(s); model: "
        f"{size(r['mma_bytes'])} vs upstream triton {size(r['upstream_triton_bytes'])}{at}"
        f"{padded}"
    )


def _shape_of(record: dict) -> Shape:
    return Shape(**{k: record[k] for k in Shape.__dataclass_fields__})


_KERNEL_PATH = "overlay/sglang/kernels/ops/attention"


def _revision_dir(rev: str, into: Path) -> str:
    """The kernel modules of a git revision, written into a directory for --kernel-dir."""
    into.mkdir(parents=True)
    for name in _KERNEL_MODULES:
        done = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{_KERNEL_PATH}/{name}.py"],
            capture_output=True,
        )
        if done.returncode == 0:
            (into / f"{name}.py").write_bytes(done.stdout)
    return str(into)


def _comparison_rows(label: str, result: dict) -> list[str]:
    rows = []
    t = result["target"]
    for r in result["shapes"]:
        if "error" in r:
            rows.append(f"   {label:<10} {t['key']:<13} {_shape_of(r)}: does not load")
            continue
        k = result["kernels"][r["stage1_kernel"]]
        ratio = f"{k['mma_ratio']:.2f}x" if "mma_ratio" in k else "-"
        smem = f"{k['shared_read_per_tile'] / 1024:.0f} KiB" if "shared_read_per_tile" in k else "-"
        rows.append(
            f"   {label:<10} {t['key']:<13} {str(_shape_of(r)):<26} "
            f"t{k['variant'].get('BLOCK_T', '?'):<3} {k['registers']:>4} "
            f"{k['ctas_per_sm']} ({k['limited_by']}){'':<3} {ratio:>6} {smem:>9} "
            f"{r['ctas']:>5} {r['slots']:>5} {r['fill']:>5.0%} {r['pieces']:>6} "
            f"{r['mma_bytes'] / 1e6:>8.2f}"
        )
    return rows


def _print_comparison(labelled: list[tuple[str, dict]]) -> None:
    print(
        "\n== stage 1 side by side (compiled facts; MB is the traffic model)\n"
        f"   {'kernel':<10} {'target':<13} {'shape':<26} {'tile':<4} {'regs':>4} "
        f"{'CTA/SM (limit)':<18} {'MMA/min':>6} {'smem/tile':>9} {'CTAs':>5} {'slots':>5} "
        f"{'fill':>5} {'pieces':>6} {'model MB':>8}"
    )
    for label, result in labelled:
        for row in _comparison_rows(label, result):
            print(row)


def main(argv=None) -> int:
    from bench.kernel.lib.virtual_gpu import TARGETS

    args = parse_args(argv, TARGETS)
    shapes = [
        asdict(Shape(h, b, e, s, length))
        for h in args.heads
        for b in args.batch
        for e in args.extra
        for s in args.sink
        for length in args.lengths
    ]
    start = time.monotonic()
    kernel_dir = str(args.kernel_dir.resolve()) if args.kernel_dir else None
    kit = str(args.kit.resolve()) if args.kit else None
    # One job per architecture: two processes compiling the same kernels at once (RTX PRO 6000
    # and RTX 5090 are both sm_120) would each compile them cold.
    groups = arch_groups(args.targets)
    jobs = [
        (keys, shapes, args.target_ctas, kernel_dir, kit, args.stage1_config) for keys in groups
    ]
    scratch = tempfile.TemporaryDirectory(prefix="kernel-audit-")
    labels = [["audited"] * len(keys) for keys in groups]
    for rev in args.compare or ():
        rev_dir = _revision_dir(rev, Path(scratch.name) / rev)
        jobs += [(keys, shapes, args.target_ctas, rev_dir, None, None) for keys in groups]
        labels += [[rev] * len(keys) for keys in groups]
    args.jobs = min(args.jobs, len(jobs))
    print(
        f"kernel_audit: {len(shapes)} shapes x {len(args.targets)} targets, "
        f"{args.jobs} process(es); compiling for each target (a few minutes the first time)",
        flush=True,
    )
    if args.jobs == 1 and not args.compare:
        results = [audit_targets(*job) for job in jobs]
    else:
        import multiprocessing

        # A process per job when revisions are compared: each imports its own kernel modules.
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            max_workers=min(args.jobs, len(jobs)),
            mp_context=ctx,
            max_tasks_per_child=1 if args.compare else None,
        ) as pool:
            futures = [pool.submit(audit_targets, *job) for job in jobs]
            results = [f.result() for f in futures]
    scratch.cleanup()
    results = [r for group in results for r in group]
    labels = [label for group in labels for label in group]
    # Back in the order the targets were given.
    order = {key: i for i, key in enumerate(args.targets)}
    revisions = ["audited", *(args.compare or ())]
    ranked = sorted(
        zip(labels, results, strict=True),
        key=lambda lr: (revisions.index(lr[0]), order[lr[1]["target"]["key"]]),
    )
    labels, results = [lr[0] for lr in ranked], [lr[1] for lr in ranked]
    compared = [(label, r) for label, r in zip(labels, results, strict=True) if label != "audited"]
    results = [r for label, r in zip(labels, results, strict=True) if label == "audited"]
    problems = []
    for result in results:
        _print_target(result, args.shapes)
        problems += findings(result)
    if compared:
        _print_comparison([("audited", r) for r in results] + compared)
    wall = time.monotonic() - start
    print(f"\nkernel_audit: {len(shapes) * len(results)} launches audited in {wall:.0f} s")
    if problems:
        print(f"kernel_audit: FAILED, {len(problems)} finding(s):")
        for p in problems:
            print(f"  {p}")
    else:
        print(
            "kernel_audit: every shape loads on every target, no spills, MMA in stage 1, "
            "resident CTAs as configured"
        )
    if args.json:
        doc = {
            "command": " ".join(
                ["bench/kernel/audit", *(argv if argv is not None else sys.argv[1:])]
            ),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "wall_s": round(wall, 1),
            "note": "resources are compiled facts; bytes and times are a model at datasheet "
            "bandwidths, not measurements",
            "findings": problems,
            "results": results,
            "compared": [{"revision": label, **r} for label, r in compared],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    from tools.entry import call

    # A dependency main() imports and this Python lacks ends in one line naming it, exit 2.
    call("bench/kernel/audit", main)
