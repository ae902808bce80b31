#!/usr/bin/env python3
"""DSV4 sparse-decode kernel microbenchmark: GPU, eager and host time per call of the mma kernel,
against a gather of the same KV rows, main's kernel and upstream's backends, on the same inputs.

What it runs, per point (batch, heads, SWA tokens, extra tokens; one decode token per request,
an SWA list in 256-token pages plus an extra list in 64-token pages, distinct KV per request):
  mma         our kernel, at every --targets value of SGLANG_SM120_MMA_TARGET_CTAS
  mma-main    the baseline kernel the GPU kit carries (main at a commit, default dc905b5), at
              the same targets: before and after in one run
  mma-padded  (--padded-heads) mma with q padded to upstream's width (64 heads)
  gather      bench/kernel/lib/gather.py: reads exactly the KV bytes mma reads, through the
              same index lists, and does no math: the limit for this access pattern
  triton, torch, flashinfer
              upstream's SM120 backends through upstream's flash_mla_with_kvcache_sm120
mma and mma-main are called through flash_mla_sparse_decode_mma itself, gather through
gather_kv_rows; all take the same arguments.

How it times (bench/kernel/lib/timing.py), per row, --repeats samples of --graph-calls calls,
each call on its own input set, so that no call finds another's KV in L2:
  graph  GPU us per call: the calls captured in one CUDA graph; per sample the L2 is flushed
         (a read of twice its size) outside the events, and events bracket one replay
  eager  us per call between events around eager calls started on an idle device after a flush
  host   wall-clock us per call of enqueueing eager calls while the device sleeps (a head start
         long enough that the enqueues never wait; a sample that did is counted host_blocked)
Each reports median, quartiles, min and max. The points are shuffled (--seed, recorded), those
of --first first; the rows of a point are shuffled anew for every repeat. The device's copy
bandwidth is measured in the same run.

Per row it also records the Triton launches of one call (kernel, grid, warps) and the split
count the kernel logs, and derives: KV GB/s and the fraction of copy bandwidth (from graph
time), the time over the gather's, speedups over upstream triton and torch, auto over the best
fixed target, new over main (mma over mma-main at the same target), native over padded. The
issue's targets are printed as pass or fail at the end. --json writes everything (rewritten
after every point, so a run cut short keeps what it finished); --compact writes the compact
record for bench/kernel/results/; --plot a PNG.

Needs a CUDA device and the patched sglang (or --kit); exits with a message otherwise.
--dry-run runs the same plan on CPU in Triton's interpreter with one call per row and no timing.
"""

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET_ENV = "SGLANG_SM120_MMA_TARGET_CTAS"
BACKENDS = ("mma", "mma-main", "gather", "triton", "torch", "flashinfer")
DISPATCH_BACKENDS = ("triton", "torch", "flashinfer")
# The target shapes, timed before the rest of the grid: BATCHxHEADSxEXTRA.
DEFAULT_FIRST = "1x16x512,64x16x512,96x16x512,128x16x512"
# A call slower than this gets fewer calls per sample: as many as fit in SLOW_SAMPLE_US.
SLOW_CALL_US = 250.0
SLOW_SAMPLE_US = 2000.0


STAGE1_KERNEL = "_sparse_decode_split_kernel"


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
    if not values:
        raise argparse.ArgumentTypeError("no targets given")
    return values


def _points(text: str) -> list[tuple[int, int, int]]:
    if text.strip().lower() == "none":
        return []
    points = []
    for item in (v.strip() for v in text.split(",") if v.strip()):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise argparse.ArgumentTypeError(
                f"points are BATCHxHEADSxEXTRA (e.g. 64x16x512), got {item!r}"
            )
        batch, heads, extra = map(int, parts)
        if batch < 1 or heads < 1:
            raise argparse.ArgumentTypeError(f"batch and heads must be >= 1 in {item!r}")
        points.append((batch, heads, extra))
    return points


def _backends(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = sorted(set(values) - set(BACKENDS))
    if unknown or not values:
        raise argparse.ArgumentTypeError(
            f"backends are a subset of {','.join(BACKENDS)}; unknown: {unknown or text!r}"
        )
    return values


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="bench/kernel/microbench",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
        "--first",
        type=_points,
        default=DEFAULT_FIRST,
        help="points timed before the grid, BATCHxHEADSxEXTRA,... (with --swa); 'none': no "
        "such points (default: %(default)s, the issue's target shapes)",
    )
    p.add_argument(
        "--targets",
        type=_targets,
        default="auto,128,256,512,1024",
        help="SGLANG_SM120_MMA_TARGET_CTAS values swept for mma and mma-main, auto or positive "
        "integers (default: %(default)s)",
    )
    p.add_argument(
        "--backends",
        type=_backends,
        help=f"comma-separated subset of {','.join(BACKENDS)} (default: all of them; mma-main "
        "only with a baseline)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=10,
        help="samples per row, each of --graph-calls calls (default: %(default)s)",
    )
    p.add_argument(
        "--graph-calls",
        type=int,
        default=8,
        help="calls per sample, each on its own input set; a backend slower than "
        f"{SLOW_CALL_US:.0f} us per call gets as many as fit in {SLOW_SAMPLE_US:.0f} us, at "
        "least 1 (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        help="seed of the shuffled order of points and rows (default: a random one, recorded "
        "in the JSON)",
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
        type=Path,
        help="import the kernel from this GPU kit (bench/kernel/gpu_session --prepare) instead "
        "of the installed sglang (default: none)",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        help="folder with the baseline kernel's files for mma-main (default: the kit's "
        "baseline/ with --kit, else none)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="on CPU, in Triton's interpreter: the plan, the inputs and one call per row, no "
        "timing (checks the bench without a GPU; default: off)",
    )
    p.add_argument(
        "--ncu-probe",
        type=Path,
        help="for Nsight Compute: no timing; one call per row between cudaProfilerStart and "
        "Stop, L2 flushed before it; writes the rows and their launches, in order, to this JSON "
        "(default: none)",
    )
    p.add_argument(
        "--json", type=Path, help="write all results to this JSON file (default: stdout only)"
    )
    p.add_argument(
        "--compact",
        type=Path,
        help="also write the compact record (bench/kernel/results/) to this file (default: none)",
    )
    p.add_argument(
        "--plot", type=Path, help="write a PNG of graph us per call vs batch (default: none)"
    )
    args = p.parse_args(argv)
    if args.repeats <= 0 or args.graph_calls <= 0:
        p.error("--repeats and --graph-calls must be > 0")
    if args.swa < 0 or args.time_budget_s < 0:
        p.error("--swa and --time-budget-s must be >= 0")
    if args.baseline is None and args.kit is not None and (args.kit / "baseline").is_dir():
        args.baseline = args.kit / "baseline"
    if args.backends is None:
        args.backends = [b for b in BACKENDS if b != "mma-main" or args.baseline is not None]
    elif "mma-main" in args.backends and args.baseline is None:
        p.error("--backends mma-main needs a baseline: --baseline DIR or a --kit that has one")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**31)
    return args


def plan_points(args) -> list[dict]:
    """Every point to time, in order: --first's points, then the grid's others, each group
    shuffled by the seed."""
    rng = random.Random(args.seed)
    first = list(dict.fromkeys(args.first))
    grid = [
        (b, h, e)
        for h in args.heads
        for e in args.extra
        for b in args.batch
        if (b, h, e) not in first
    ]
    rng.shuffle(first)
    rng.shuffle(grid)
    return [
        {"batch": b, "heads": h, "swa": args.swa, "extra": e, "phase": phase}
        for phase, group in (("first", first), ("rest", grid))
        for b, h, e in group
    ]


def _cache(torch, tokens: int, page_size: int, device):
    """Random DSV4 FP8 pages ([pages, page_size, 1, 584] view, page stride rounded to 576)."""
    pages = max(1, -(-tokens // page_size))
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
    """Upstream's keyword arguments for one call; every request owns distinct KV tokens, so
    the bytes gathered are real DRAM traffic."""
    kwargs = {
        "q": torch.randn(batch, 1, heads, 512, device=device).to(torch.bfloat16),
        "k_cache": _cache(torch, batch * swa, 256, device),
        "indices": torch.arange(batch * swa, device=device, dtype=torch.int32).view(batch, 1, swa),
        "topk_length": torch.full((batch,), swa, dtype=torch.int32, device=device),
        "attn_sink": torch.randn(heads, device=device),
        "head_dim_v": 512,
        "softmax_scale": 512**-0.5,
        "extra_k_cache": None,
        "extra_indices_in_kvcache": None,
        "extra_topk_length": None,
    }
    if extra:
        kwargs["extra_k_cache"] = _cache(torch, batch * extra, 64, device)
        perm = torch.randperm(batch * extra, device=device).to(torch.int32)
        kwargs["extra_indices_in_kvcache"] = perm.view(batch, 1, extra)
        kwargs["extra_topk_length"] = torch.full((batch,), extra, dtype=torch.int32, device=device)
    return kwargs


def decode_args(kwargs: dict) -> tuple:
    """The positional arguments every backend's function takes (upstream's order)."""
    return (
        kwargs["q"],
        kwargs["k_cache"],
        kwargs["indices"],
        kwargs["topk_length"],
        kwargs["attn_sink"],
        kwargs["head_dim_v"],
        kwargs["softmax_scale"],
        kwargs["extra_k_cache"],
        kwargs["extra_indices_in_kvcache"],
        kwargs["extra_topk_length"],
    )


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


# --- the run -----------------------------------------------------------------------------------


@dataclass
class Row:
    """One backend at one target and point: its calls, graph and samples."""

    backend: str
    target: str | None
    calls: list
    select: object
    record: dict
    graph: object = None
    head_start_us: float = 1000.0
    samples: dict = field(default_factory=lambda: {"graph": [], "eager": [], "host": []})
    blocked: int = 0


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:500]}"


class Bench:
    def __init__(self, args, torch, device, entries: dict, timer, recorder, split_log):
        self.args = args
        self.torch = torch
        self.device = device
        self.entries = entries
        self.timer = timer
        self.recorder = recorder
        self.split_log = split_log
        self.rng = random.Random(args.seed + 1)
        self.uncapturable: dict[str, str] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def rows_for(self, point: dict, sets: list[dict]) -> list[Row]:
        torch, args = self.torch, self.args
        rows = []

        def add(label: str, backend: str, target: str | None, kwargs_sets: list[dict]):
            entry = self.entries[backend]
            record = {**point, "backend": label, "target_ctas": target}
            if isinstance(entry, str):
                record["error"] = entry
                rows.append(Row(label, target, [], None, record))
                return
            if backend in DISPATCH_BACKENDS:
                calls = [functools.partial(entry, **kw) for kw in kwargs_sets]
            else:
                calls = [functools.partial(entry, *decode_args(kw)) for kw in kwargs_sets]
            rows.append(Row(label, target, calls, self._selector(backend, target), record))

        for backend in args.backends:
            if backend in ("mma", "mma-main"):
                for target in args.targets:
                    add(backend, backend, target, sets)
            else:
                add(backend, backend, None, sets)
        if "mma" in args.backends and args.padded_heads:
            if upstream_padded_heads(point["heads"]) != point["heads"]:
                padded = [padded_inputs(torch, kw) for kw in sets]
                for target in args.targets:
                    add("mma-padded", "mma", target, padded)
                    rows[-1].record["padded_heads"] = upstream_padded_heads(point["heads"])
        return rows

    def _selector(self, backend: str, target: str | None):
        dispatch = self.entries.get("_dispatch")

        def select():
            if target is not None:
                os.environ[TARGET_ENV] = target
            if backend in DISPATCH_BACKENDS:
                # Upstream reads SGLANG_SM120_FLASHMLA_BACKEND once, at import.
                dispatch._sm120_default_backend = backend

        return select

    def prepare(self, row: Row) -> None:
        """The row's first call (compiles, autotunes), a recorded call (its launches and the
        split count logged), the warm-up, an estimate that sizes its samples, and the graph
        capture."""
        if "error" in row.record:
            return
        try:
            row.select()
            with self._split_choice_logged():
                row.calls[0]()
                self._sync()
                with self.recorder:
                    row.calls[0]()
                    self._sync()
            row.record["launches"] = list(self.recorder.launches)
            row.record["splits"], logged_ctas = self.split_log.take_choice()
            if logged_ctas is not None and row.record["splits"] is None:
                row.record["ctas"] = logged_ctas
            stage1 = [la for la in row.record["launches"] if la["kernel"] == STAGE1_KERNEL]
            if stage1 and row.backend.startswith("mma"):
                grid = list(stage1[0]["grid"])
                row.record["ctas"] = math.prod(grid)
                if row.record["splits"] is None and grid[1:] != [1, 1]:
                    # A split-K kernel (grid head blocks x splits x batch) whose launch plan
                    # was cached before this row logs no choice: its grid says the same. The
                    # stream-K kernel (grid C x 1 x 1) has no split count, only its CTAs.
                    row.record["splits"] = grid[1]
            if self.timer is None:
                return
            for call in row.calls:
                call()
            self._sync()
            estimate = self.timer.eager_sample(row.calls[:1])
            if estimate > SLOW_CALL_US:
                row.calls = row.calls[: max(1, int(SLOW_SAMPLE_US // estimate))]
            row.record["calls_per_sample"] = len(row.calls)
            row.head_start_us = min(50_000.0, max(1_000.0, 2 * len(row.calls) * estimate))
        except Exception as err:  # a backend the device cannot run
            row.record["error"] = _error(err)
            self._recover()
            return
        if row.backend in self.uncapturable:
            row.record["graph_error"] = self.uncapturable[row.backend]
            return
        try:
            row.graph = self.timer.capture(row.calls)
        except Exception as err:  # e.g. a backend that syncs the host cannot be captured
            row.record["graph_error"] = _error(err)
            # Not tried again for this backend: a failed capture is not worth repeating.
            self.uncapturable[row.backend] = f"not captured (first failure: {_error(err)})"
            self._recover()

    @contextlib.contextmanager
    def _split_choice_logged(self):
        """The kernels log each split choice once per shape and knob value: let them log it
        again inside the block (a shape may have been logged at an earlier row), and keep every
        shape known after it, so that no timed call pays for logging."""
        self.split_log.take_splits()
        modules = [m for m in self.entries["_split_modules"] if hasattr(m, "_logged")]
        known = [set(m._logged) for m in modules]
        for module in modules:
            module._logged.clear()
        try:
            yield
        finally:
            for module, keys in zip(modules, known, strict=True):
                module._logged |= keys

    def _recover(self) -> None:
        try:
            self._sync()
        except Exception:
            pass

    def sample(self, row: Row) -> None:
        if "error" in row.record:
            return
        try:
            row.select()
            if row.graph is not None:
                row.samples["graph"].append(self.timer.graph_sample(row.graph, len(row.calls)))
            row.samples["eager"].append(self.timer.eager_sample(row.calls))
            host_us, blocked = self.timer.host_sample(row.calls, row.head_start_us)
            row.samples["host"].append(host_us)
            row.blocked += blocked
        except Exception as err:
            row.record["error"] = _error(err)
            self._recover()

    def inputs(self, point: dict, count: int) -> tuple[dict, list[dict]]:
        """``count`` input sets for a point, and the point with the bytes one call reads."""
        from bench.kernel.lib.gather import bytes_read

        sets = [
            make_inputs(
                self.torch,
                point["batch"],
                point["heads"],
                point["swa"],
                point["extra"],
                self.device,
            )
            for _ in range(count)
        ]
        first = sets[0]
        read = bytes_read(
            first["indices"],
            first["topk_length"],
            first["extra_indices_in_kvcache"],
            first["extra_topk_length"],
        )
        return {**point, "kv_bytes": read["kv_bytes"], "index_bytes": read["index_bytes"]}, sets

    def run_point(self, point: dict) -> list[dict]:
        from bench.kernel.lib.timing import summarize

        args = self.args
        point, sets = self.inputs(point, 1 if self.timer is None else args.graph_calls)
        rows = self.rows_for(point, sets)
        for row in rows:
            self.prepare(row)
        if self.timer is not None:
            for _ in range(args.repeats):
                self.rng.shuffle(rows)
                for row in rows:
                    self.sample(row)
        records = []
        for row in rows:
            for kind, samples in row.samples.items():
                if samples:
                    row.record[f"{kind}_us"] = summarize(samples)
            if row.samples["host"]:
                row.record["host_blocked"] = row.blocked
            records.append(row.record)
        order = {(b, t): i for i, (b, t) in enumerate(_row_order(args))}
        records.sort(key=lambda r: order.get((r["backend"], r["target_ctas"]), len(order)))
        del rows, sets
        return records

    def probe_point(self, point: dict) -> list[dict]:
        """--ncu-probe: one profiled call per row, in order; returns what each launched."""
        torch = self.torch
        point, sets = self.inputs(point, 1)
        probes = []
        for row in self.rows_for(point, sets):
            if "error" in row.record:
                continue
            row.select()
            for _ in range(2):
                row.calls[0]()
            self.timer.flush()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            with self.recorder:
                row.calls[0]()
                torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            probes.append({**row.record, "launches": list(self.recorder.launches)})
        return probes


def _row_order(args) -> list[tuple[str, str | None]]:
    order = []
    for backend in args.backends:
        targets = args.targets if backend in ("mma", "mma-main") else [None]
        order += [(backend, t) for t in targets]
    return order + [("mma-padded", t) for t in args.targets]


def _row_line(r: dict) -> str:
    where = f"B={r['batch']:<3} H={r['heads']:<3} extra={r['extra']:<5}"
    name = r["backend"] + (f"@{r['target_ctas']}" if r["target_ctas"] else "")
    if "error" in r:
        return f"{where} {name:<16} error: {r['error'][:120]}"
    parts = []
    for kind in ("graph", "eager", "host"):
        s = r.get(f"{kind}_us")
        if s:
            parts.append(f"{kind} {s['median']:.1f} [{s['min']:.1f}, {s['max']:.1f}]")
    if "graph_error" in r:
        parts.append(f"graph error: {r['graph_error'][:80]}")
    for key in ("over_gather", "new_vs_main", "frac_copy"):
        if r.get(key) is not None:
            parts.append(f"{key} {r[key]}")
    if r.get("splits") is not None:
        parts.append(f"splits {r['splits']}")
    if r.get("ctas") is not None:
        parts.append(f"ctas {r['ctas']}")
    if r.get("launches"):
        parts.append("grid " + " ".join("x".join(map(str, la["grid"])) for la in r["launches"]))
    return f"{where} {name:<16} " + ("; ".join(parts) or "ran (dry run)")


def _load_entries(args, torch) -> dict:
    """Each backend's function, or the reason it cannot run here."""
    try:
        from sglang.kernels.ops.attention import flash_mla_sm120 as dispatch
        from sglang.kernels.ops.attention import flash_mla_sm120_mma as mma
    except ImportError as err:
        sys.exit(f"kernel_microbench: the patched sglang with the mma backend is needed ({err})")
    from bench.kernel.lib.gather import gather_like_decode

    entries = {
        "_dispatch": dispatch,
        "_split_modules": [],
        "mma": mma.flash_mla_sparse_decode_mma,
        "gather": gather_like_decode,
    }
    for name in DISPATCH_BACKENDS:
        entries[name] = dispatch.flash_mla_with_kvcache_sm120
    if "mma-main" in args.backends:
        from bench.kernel.lib.gpu_kit import load_baseline

        try:
            entries["mma-main"] = load_baseline(args.baseline).flash_mla_sparse_decode_mma
        except Exception as err:
            entries["mma-main"] = f"baseline from {args.baseline} did not load: {_error(err)}"
    for name in (
        "sglang.kernels.ops.attention.sm120_mma_splits",
        "sm120pd_baseline.sm120_mma_splits",
    ):
        if name in sys.modules:
            entries["_split_modules"].append(sys.modules[name])
    return entries


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernel_microbench: unset TRITON_INTERPRET; this times compiled kernels")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("kernel_microbench: needs a CUDA device (none is visible); nothing was run")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    manifest = None
    if args.kit:
        from bench.kernel.lib.gpu_kit import activate

        manifest = activate(args.kit)
    entries = _load_entries(args, torch)
    import triton

    from bench.kernel.lib.results import compact_record, derive, target_verdicts, verdict_lines
    from bench.kernel.lib.timing import LaunchRecorder, SplitLog, Timer

    recorder, split_log = LaunchRecorder(), SplitLog()
    if args.dry_run:
        device, timer = torch.device("cpu"), None
        facts = {"device": "CPU (dry run, Triton interpreter)", "copy_gbps": None}
    else:
        from triton.runtime.driver import driver

        device = torch.device("cuda")
        recorder.install(driver.active)
        timer = Timer(torch, device)
        props = torch.cuda.get_device_properties(device)
        facts = {
            "device": props.name,
            "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count,
            "copy_gbps": round(copy_bandwidth_gbps(torch, device), 1),
        }
    header = {
        "tool": "bench/kernel/microbench",
        **facts,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
        },
        "kit": {"label": manifest["label"], "wheel": manifest["wheel"]} if manifest else None,
        "baseline": _baseline_facts(args, manifest),
        "method": {
            **(timer.describe() if timer else {}),
            "graph": "GPU us per call: one CUDA-graph replay of the calls, L2 flushed before it",
            "eager": "us per call between events around eager calls after a flush and a sync",
            "host": "wall-clock us per call of enqueueing eager calls while the device sleeps",
            "repeats": args.repeats,
            "graph_calls": args.graph_calls,
            "seed": args.seed,
            "order": "--first points, then the grid's, each shuffled; rows reshuffled per repeat",
            "entries": "mma, mma-main: flash_mla_sparse_decode_mma; gather: "
            "bench/kernel/lib/gather.py; triton, torch, flashinfer: flash_mla_with_kvcache_sm120",
            "launches": "Triton launches of one call, recorded through a wrapped launcher",
        },
        "command": " ".join(
            ["bench/kernel/microbench", *(argv if argv is not None else sys.argv[1:])]
        ),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print(
        json.dumps({k: header[k] for k in ("device", "copy_gbps", "kit", "baseline")}), flush=True
    )
    bench = Bench(args, torch, device, entries, timer, recorder, split_log)

    points = plan_points(args)
    if args.ncu_probe:
        probes = []
        for point in points:
            probes += bench.probe_point(point)
        _write_json(args.ncu_probe, {**header, "probes": probes})
        print(f"kernel_microbench: {len(probes)} profiled call(s), listed in {args.ncu_probe}")
        return 0

    rows, skipped = [], []
    started = time.monotonic()
    for point in points:
        if args.time_budget_s and time.monotonic() - started > args.time_budget_s:
            skipped.append(point)
            continue
        results = bench.run_point(point)
        derive(results, header["copy_gbps"])
        for r in results:
            print(_row_line(r), flush=True)
        rows += results
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.json:
            _write_json(args.json, {**header, "results": rows, "skipped": skipped})
    if skipped:
        print(
            f"kernel_microbench: time budget of {args.time_budget_s:.0f} s spent; "
            f"{len(skipped)} point(s) skipped (listed in the JSON)",
            flush=True,
        )
    verdicts = target_verdicts(rows)
    doc = {**header, "results": rows, "skipped": skipped, "targets": verdicts}
    if args.json:
        _write_json(args.json, doc)
    if args.compact:
        from bench.kernel.lib.results import write_compact

        size = write_compact(compact_record(doc), args.compact)
        print(f"kernel_microbench: compact record, {size:,} bytes, in {args.compact}")
    print("targets (mma at auto):\n" + "\n".join(verdict_lines(verdicts)), flush=True)
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _baseline_facts(args, manifest) -> dict | None:
    if "mma-main" not in args.backends:
        return None
    where = args.baseline.resolve()
    facts = {"dir": str(where.relative_to(ROOT) if where.is_relative_to(ROOT) else where)}
    if manifest and "baseline" in manifest:
        facts["commit"] = manifest["baseline"]["commit"]
    return facts


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["heads"], r["extra"]) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, (heads, extra) in zip(axes[0], shapes, strict=True):
        series = {}
        for r in rows:
            if (r["heads"], r["extra"]) == (heads, extra) and r.get("graph_us"):
                label = r["backend"] + (f" {r['target_ctas']}" if r["target_ctas"] else "")
                series.setdefault(label, []).append((r["batch"], r["graph_us"]["median"]))
        for label, points in sorted(series.items()):
            ax.plot(*zip(*sorted(points), strict=True), marker="o", label=label)
        ax.set(title=f"H={heads}, extra={extra}", xlabel="batch", ylabel="graph us per call")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from tools.entry import call

    # A dependency main() imports and this Python lacks ends in one line naming it, exit 2.
    call("bench/kernel/microbench", main)
