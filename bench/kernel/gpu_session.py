#!/usr/bin/env python3
"""One prepared call that runs every GPU check and benchmark of the decode kernel on a lent GPU.

  bench/kernel/gpu_session --prepare   build the kit (build/gpu-kit), print the exact run command
  bench/kernel/gpu_session --out DIR   on the GPU: the whole session, results in DIR (default $OUT)
  bench/kernel/gpu_session --rehearse  the same sequence on CPU, in a venv of the device's versions

The call is made with the device kind nvidia-h200: the audit compares the real device with the
virtual H200 (sm_90, 132 SMs; bench/kernel/lib/virtual_gpu.py). At start the session checks the
real device's name, SM count and architecture against it; on another device (an H100, say) the
mismatch is recorded and only the real-against-virtual audit comparison is skipped.

The session, each part in a process of its own with a time budget (a part that no longer fits
is skipped and says so; elapsed time is printed per part):
  1. correctness   tests/kernel/gpu_check.py compare (every case, every TARGET_CTAS value), graph
                   (CUDA graph capture and replay equal to eager), gather (the bench's gather
                   kernel reads the right rows) and baseline (the kit's baseline kernel is right)
  2. bandwidth     device-to-device copy bandwidth
  3. bench         bench/kernel/microbench over its default grid with --padded-heads: the issue's
                   target shapes first, then the rest while the budget lasts, keeping the time
                   the parts after it need (copy bandwidth measured again in that run)
  4. ncu           where Nsight Compute (ncu) is found: mma, mma-main and the gather at B=1 and
                   64 (16 heads, extra 512) profiled; duration, DRAM bytes read against the
                   unique bytes, top stall reasons (skipped, with the reason, without ncu)
  5. audit         bench/kernel/audit on the virtual H200 and on the real device (launches
                   recorded), over the shapes the bench times (its plan's heads, batches and
                   extra lists, sink and lengths on); registers, shared memory, CTAs per SM and
                   the launch plan (splits, or stage 1's CTAs) compared shape by shape: a
                   mismatch means the virtual audit is wrong

Every part's process reports the Python, torch, triton and numpy it ran with; the record gives
those, per part and merged. gpu_session.json and the compact record are rewritten in --out
(atomically) when a part starts and when it ends, and while the bench runs as its JSON grows,
with "complete": false until the last write: a call killed at its limit returns what finished.

The GPU machine has torch and triton but not sglang's dependencies, and no registry: the kernel
comes from the kit (bench/kernel/lib/gpu_kit.py), the kernel and upstream's SM120 dispatch
extracted from our patched wheel and imported without sglang's package chain, plus the baseline
kernel (our kernel at --baseline-commit, from git) that the bench times as mma-main. Output in
--out: gpu_session.json (everything), kernel.png, and the compact record (at most 200 KB) to
copy into bench/kernel/results/. The summary prints the issue's targets as pass or fail. Exit
status: 0; 1 when a correctness check fails; 3 when the real and virtual audits disagree (and
none failed); 2 on bad arguments; 143 when stopped by SIGTERM (what finished is kept).
"""

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.kernel.lib.gpu_kit import DEFAULT_BASELINE_COMMIT  # noqa: E402

DEFAULT_KIT = "build/gpu-kit"
REHEARSE_VENV = "build/rehearse-venv"
# The lent machine's versions (its image); the rehearsal installs the same.
DEVICE_VERSIONS = {"python": "3.12", "torch": "2.11.0", "triton": "3.6.0"}
# Triton 3.6's interpreter turns one-element arrays into Python ints (loop bounds), which NumPy
# 2.5 refuses; the rehearsal pins a NumPy it works with.
REHEARSE_NUMPY = "2.3.5"
KIT_LIMIT_BYTES = 50 * 1024 * 1024
DEFAULT_BUDGET_S = 480
RUN_TIMEOUT_S = 560
# The device kind the call names, and the virtual target (bench/kernel/lib/virtual_gpu.py) its
# real-device audit is compared with: the two must be the same product.
DEVICE_KIND = "nvidia-h200"
VIRTUAL_TARGET = "h200"
# Seconds each part may take at most; the bench takes what is left after keeping ncu's and the
# audit's.
PART_BUDGETS = {"correctness": 150, "bandwidth": 20, "ncu": 60, "audit": 120}
# The bench stops starting points this long before its part's end (start-up, one last point).
BENCH_MARGIN_S = 30
# The microbench options that choose the bench's points: none, its default grid (the issue's
# target shapes first). The audits cover the same shapes (audit_shape_args).
BENCH_SHAPES: list[str] = []
# The points Nsight Compute profiles.
NCU_POINTS = ["--first", "none", "--batch", "1,64", "--heads", "16", "--extra", "512"]
NCU_ROWS = ["--targets", "auto", "--backends", "mma,mma-main,gather"]
# The rehearsal's bench: the microbench's plan, inputs and one call per row in the interpreter.
DRY_RUN_BENCH = ["--dry-run", "--first", "none", "--batch", "2", "--heads", "16", "--swa", "16"]
DRY_RUN_BENCH += ["--extra", "16", "--targets", "auto,64", "--backends", "mma,mma-main,gather"]
# How often a running part is looked at (the bench's JSON folded into the session's).
POLL_S = 1.0
RESULT_FILE = "gpu_session.json"
# The hidden first argument of a part that runs one of the kit's tools in this script's process:
# --tool VERSIONS_FILE MODULE ARGS...
TOOL_FLAG = "--tool"
TOOLS = {"microbench": "bench.kernel.microbench", "audit": "bench.kernel.audit"}


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="bench/kernel/gpu_session",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--prepare", action="store_true", help="build the kit; print the run command")
    mode.add_argument(
        "--rehearse",
        action="store_true",
        help=f"run the sequence on CPU under TRITON_INTERPRET=1 with tiny cases, in a Python "
        f"{DEVICE_VERSIONS['python']} venv with torch {DEVICE_VERSIONS['torch']} and triton "
        f"{DEVICE_VERSIONS['triton']} ({REHEARSE_VENV}, created on first use, with numpy "
        f"{REHEARSE_NUMPY}); the bench runs as a dry run, the other timing parts are skipped",
    )
    mode.add_argument(
        "--child", choices=("correctness", "bandwidth", "device"), help=argparse.SUPPRESS
    )
    p.add_argument("--kit", type=Path, default=Path(DEFAULT_KIT), help="(default: %(default)s)")
    p.add_argument(
        "--baseline-commit",
        default=DEFAULT_BASELINE_COMMIT,
        help="--prepare: the commit whose kernel the kit carries as the baseline (mma-main), "
        "taken with git show (default: %(default)s, main when issue 29 started)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
        help="where gpu_session.json, kernel.png and the compact record go (default: $OUT, "
        "else bench/results/gpu-session-TIME)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="time for the whole session, seconds (default: %(default)s)",
    )
    p.add_argument(
        "--python",
        help="--rehearse: run with this interpreter instead of the rehearsal venv's (default: "
        f"{REHEARSE_VENV}/bin/python)",
    )
    p.add_argument(
        "--base-python",
        default=f"python{DEVICE_VERSIONS['python']}",
        help="--rehearse: the interpreter the rehearsal venv is created with (default: "
        "%(default)s)",
    )
    p.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-versions", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.budget_s <= 0:
        p.error("--budget-s must be > 0")
    return args


# --- prepare -----------------------------------------------------------------------------------


def _run_build(*args: str) -> str:
    done = subprocess.run([str(ROOT / "build.sh"), *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"gpu_session: ./build.sh {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def _series_wheel() -> tuple[Path, str]:
    """A wheel of the current series (any tag: the kit's files are pure Python), built if
    this checkout has none."""
    label = _run_build("label").strip().splitlines()[-1]
    wheels = sorted((ROOT / "dist").glob(f"sglang-*+{label}-*.whl"))
    if not wheels:
        print(f"gpu_session: no wheel for {label} in dist/; running ./build.sh", flush=True)
        _run_build()
        wheels = sorted((ROOT / "dist").glob(f"sglang-*+{label}-*.whl"))
    if not wheels:
        sys.exit(f"gpu_session: ./build.sh left no wheel for {label} in dist/")
    return wheels[0], label


def run_instructions(kit: str) -> str:
    """The one call to make on the lent GPU, for the kit at kit (relative to the root)."""
    from bench.kernel.lib.virtual_gpu import TARGETS

    target = TARGETS[VIRTUAL_TARGET]
    return (
        "Run it on the lent GPU in one call (the working tree travels; the kit is ignored by "
        "git, so carry it):\n"
        f"  kind:      {DEVICE_KIND}\n"
        f"  carry:     {json.dumps([kit])}\n"
        f'  command:   python3 bench/kernel/gpu_session.py --kit {kit} --out "$OUT"\n'
        f"  timeout_s: {RUN_TIMEOUT_S}\n"
        f"The session keeps within {DEFAULT_BUDGET_S} s; the timeout leaves room for start-up. "
        f"Name the kind {DEVICE_KIND}: the real device's audit is compared with the virtual "
        f"{target.name} ({target.sm}, {target.sms} SMs); on another device (an H100, say) the "
        "session records the mismatch and skips that comparison."
    )


def prepare(kit: Path, baseline_commit: str) -> int:
    from bench.kernel.lib.gpu_kit import baseline_files, build_kit, kit_bytes

    try:
        baseline = baseline_files(ROOT, baseline_commit)
    except ValueError as err:
        sys.exit(f"gpu_session: --baseline-commit: {err}")
    wheel, label = _series_wheel()
    kit = kit if kit.is_absolute() else ROOT / kit
    manifest = build_kit(wheel, kit, label, baseline)
    size = kit_bytes(kit)
    rel = os.path.relpath(kit, ROOT)
    print(f"kit: {rel}: {len(manifest['files'])} files from {wheel.name}, {size:,} bytes")
    print(
        f"baseline (mma-main): {len(baseline[1])} files of commit {baseline[0][:12]} "
        f"({baseline_commit})"
    )
    if size > KIT_LIMIT_BYTES:
        print(f"gpu_session: the kit is over {KIT_LIMIT_BYTES // 2**20} MiB", file=sys.stderr)
        return 1
    print("\n" + run_instructions(rel))
    return 0


# --- children ----------------------------------------------------------------------------------


def runtime_versions() -> dict:
    """This process's Python and the installed torch, triton and numpy it imports (each where
    importable; read from the distribution, so nothing is imported for it), and torch's CUDA
    once torch is loaded."""
    versions = {"python": platform.python_version(), "executable": sys.executable}
    for name in ("torch", "triton", "numpy"):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = getattr(sys.modules.get(name), "__version__", "unknown")
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch.version, "cuda", None):
        versions["cuda"] = torch.version.cuda
    return versions


def _write_json(path: Path, text: str) -> None:
    """Replace path with text atomically: a reader (or a kill) sees the old file or the new."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def reporting_versions(path: Path | None):
    """Write runtime_versions() to path before the part runs and again when it ends, so a part
    that is killed still says what it ran with."""
    if path is None:
        yield
        return
    _write_json(path, json.dumps(runtime_versions()))
    try:
        yield
    finally:
        _write_json(path, json.dumps(runtime_versions()))


def run_tool(versions_out: str, tool: str, argv: list[str]) -> None:
    """One of the kit's tools (microbench, audit) as a part, in this process, reporting its
    versions; exits with the tool's status."""
    from tools.entry import call

    with reporting_versions(Path(versions_out)):
        module = importlib.import_module(TOOLS[tool])
        call(f"bench/kernel/{tool}", lambda: module.main(argv))


def child_correctness(args) -> dict:
    """gpu_check's compare, graph, gather and baseline checks (interpreted, without graph and
    on fewer cases, with --cpu)."""
    from bench.kernel.lib.gpu_kit import BASELINE_DIR, activate

    activate(args.kit)
    sys.path.insert(0, str(ROOT / "tests" / "kernel"))
    import gpu_check

    device = "cpu" if args.cpu else "cuda"
    result = {"device": device, "compare": [], "graph": [], "gather": [], "baseline": []}
    result["skipped"] = []
    _capture(result["compare"], gpu_check.compare, device)
    if device == "cuda":
        _capture(result["graph"], gpu_check.graph)
    else:
        result["skipped"].append("graph: CUDA graph capture needs a CUDA device")
    _capture(result["gather"], gpu_check.gather, device)
    if (args.kit / BASELINE_DIR).is_dir():
        _capture(result["baseline"], gpu_check.baseline, device, args.kit / BASELINE_DIR)
    else:
        result["skipped"].append("baseline: the kit has no baseline/")
    return result


def _capture(lines: list, fn, *args) -> None:
    """Run a gpu_check function, keeping the 'ok ...' lines it prints."""
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            fn(*args)
        finally:
            lines.extend(line for line in buf.getvalue().splitlines() if line.startswith("ok "))
            sys.stdout.write(buf.getvalue())


def child_bandwidth(_args) -> dict:
    import torch

    from bench.kernel.microbench import copy_bandwidth_gbps

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    return {
        "device": props.name,
        "sms": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "copy_gbps": round(copy_bandwidth_gbps(torch, device), 1),
    }


def child_device(_args) -> dict:
    """The CUDA device's name, SM count and capability, probed in a process of its own (the
    session itself holds no CUDA context)."""
    import torch

    if not torch.cuda.is_available():
        return {"cuda": False}
    props = torch.cuda.get_device_properties(0)
    return {
        "cuda": True,
        "name": props.name,
        "sms": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
    }


# --- what the parts run on ---------------------------------------------------------------------


def audit_shape_args(bench_args: list[str]) -> list[str]:
    """The audit's shape options for the points the bench with bench_args times: the heads,
    batches and extra lists of its plan (the audit takes their product, which is the plan for
    a grid like the default one), with the sink and topk lengths on, as the bench's inputs
    have them. ValueError for a bench the audit cannot model (an SWA list other than its own,
    an extra list it has no name for)."""
    from bench.kernel.audit import EXTRAS, SWA_TOKENS
    from bench.kernel.microbench import parse_args as bench_parse_args
    from bench.kernel.microbench import plan_points

    # The bench's extra list is in 64-token pages (c4); none is 0 tokens.
    by_tokens = {tokens: name for name, (tokens, page) in EXTRAS.items() if page in (0, 64)}
    points = plan_points(bench_parse_args(bench_args))
    for p in points:
        if p["swa"] != SWA_TOKENS or p["extra"] not in by_tokens:
            raise ValueError(
                f"the audit models {SWA_TOKENS} SWA tokens and extra lists of "
                f"{sorted(by_tokens)} tokens in 64-token pages, not SWA {p['swa']} with extra "
                f"{p['extra']}"
            )

    def listed(key: str) -> str:
        return ",".join(str(v) for v in sorted({p[key] for p in points}))

    extras = ",".join(by_tokens[e] for e in sorted({p["extra"] for p in points}))
    shapes = ["--heads", listed("heads"), "--batch", listed("batch"), "--extra", extras]
    return [*shapes, "--sink", "on", "--lengths", "on"]


def audit_args(kit: Path, target: str, json_path: Path) -> list[str]:
    """bench/kernel/audit's options for one target: the shapes the GPU run's bench times."""
    args = ["--kit", str(kit), "--targets", target, "--json", str(json_path)]
    return [*args, *audit_shape_args(BENCH_SHAPES)]


def device_check(name: str, sms: int, capability: str, target) -> dict:
    """The real device against the virtual target its audit is compared with: the same product
    (the target's name), SM count and architecture, or the mismatches."""
    product = target.name.split(" (")[0]
    mismatches = []
    if product.lower() not in name.lower():
        mismatches.append(f"the device is {name!r}, not an {product}")
    if sms != target.sms:
        mismatches.append(f"{sms} SMs, not {target.sms}")
    if capability.replace(".", "") != str(target.arch):
        mismatches.append(f"sm_{capability.replace('.', '')}, not {target.sm}")
    return {
        "target": target.key,
        "virtual": {"name": target.name, "sms": target.sms, "arch": target.sm},
        "real": {"name": name, "sms": sms, "capability": capability},
        "mismatches": mismatches,
    }


# What the launcher planned per shape, where the audit records it: the split count (split-K
# kernels) and the CTAs stage 1 launches (the stream-K kernel has no split count).
PLAN_FIELDS = ("splits", "ctas")


def _compare_audits(virtual: dict, real: dict) -> list[dict]:
    """Stage-1 resources and the launch plan per shape: the virtual H200 against the real
    device."""

    def resources(doc: dict) -> dict:
        (result,) = doc["results"]
        kernels = result["kernels"]
        out = {}
        for shape in result["shapes"]:
            if "error" in shape:
                continue
            key = (shape["heads"], shape["batch"], shape["extra"], shape["sink"], shape["lengths"])
            k = kernels[shape["stage1_kernel"]]
            out[key] = {
                "registers": k["registers"],
                "shared_bytes": k["shared_bytes"],
                "ctas_per_sm": k["ctas_per_sm"],
                **{field: shape[field] for field in PLAN_FIELDS if field in shape},
            }
        return out

    left, right = resources(virtual), resources(real)
    mismatches = []
    for key in sorted(set(left) | set(right), key=str):
        a, b = left.get(key), right.get(key)
        if a != b:
            mismatches.append({"shape": list(key), "virtual_h200": a, "real": b})
    return mismatches


def audit_comparison(audits: dict, check: dict | None) -> tuple[list[dict] | None, str | None]:
    """The real device's audit against the virtual target's: the shapes that differ, or None
    and why it was not compared."""
    if VIRTUAL_TARGET not in audits or "cuda" not in audits:
        return None, f"needs both audits ({VIRTUAL_TARGET} and cuda)"
    if check and check.get("mismatches"):
        return None, (
            f"the real device is not the virtual {check['virtual']['name']} "
            f"({'; '.join(check['mismatches'])}): their audits differ by design"
        )
    return _compare_audits(audits[VIRTUAL_TARGET], audits["cuda"]), None


def versions_ran(parts: list[dict]) -> dict:
    """The versions the parts' processes reported: one value per name where they agree, else
    the value per part."""
    merged = {}
    names = dict.fromkeys(k for p in parts for k in p.get("versions", {}))
    for name in names:
        values = {p["part"]: p["versions"][name] for p in parts if name in p.get("versions", {})}
        distinct = set(values.values())
        merged[name] = distinct.pop() if len(distinct) == 1 else values
    return merged


# --- the session -------------------------------------------------------------------------------


class Terminated(Exception):
    """SIGTERM arrived: the session stops, keeping what finished."""


def _terminate(_signum, _frame):
    raise Terminated


class Session:
    """The parts run so far and the document they make, written to out after every change."""

    def __init__(self, args, python: str, rehearsal: bool, out: Path, facts: dict):
        self.args = args
        self.python = python
        self.rehearsal = rehearsal
        self.out = out
        self.start = time.monotonic()
        self.parts: list[dict] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu-session-"))
        self.compact: Path | None = None
        self.doc = {
            "kind": "rehearsal (CPU, interpreter)" if rehearsal else "GPU session",
            "device": "CPU",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "complete": False,
            "parts_done": [],
            "running": None,
            "wall_s": 0.0,
            "versions": {},
            "kit": None,
            "device_check": None,
            "parts": self.parts,
            "correctness": None,
            "bandwidth": None,
            "audits": {},
            "audit_mismatches": None,
            "audit_comparison_skipped": None,
            "bench": None,
            "ncu": None,
            **facts,
        }

    def remaining(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.start)

    def facts(self) -> dict:
        """The session's part of the compact record."""
        doc, manifest = self.doc, self.doc["kit"] or {}
        kit = {"label": manifest.get("label"), "wheel": manifest.get("wheel")}
        if "baseline" in manifest:
            kit["baseline_commit"] = manifest["baseline"]["commit"]
        mismatches = doc["audit_mismatches"]
        ncu = doc["ncu"] or {}
        return {
            "kind": doc["kind"],
            "device": doc["device"],
            "time": doc["time"],
            "complete": doc["complete"],
            "parts_done": doc["parts_done"],
            "wall_s": doc["wall_s"],
            "versions": doc["versions"],
            "kit": kit,
            "device_check": doc["device_check"],
            "parts": [
                {k: p[k] for k in ("part", "status", "seconds", "why") if k in p}
                for p in self.parts
            ],
            "correctness": _correctness_counts(doc["correctness"]),
            "audit_mismatches": None if mismatches is None else len(mismatches),
            "audit_comparison_skipped": doc["audit_comparison_skipped"],
            "ncu": ncu.get("rows", ncu.get("skipped")),
        }

    def save(self, complete: bool = False) -> tuple[Path, int]:
        """gpu_session.json and the compact record in out, each replaced atomically."""
        from bench.kernel.lib.results import compact_name, compact_record, write_compact

        doc = self.doc
        doc.update(
            complete=complete,
            parts_done=[p["part"] for p in self.parts],
            wall_s=round(time.monotonic() - self.start, 1),
            versions=versions_ran(self.parts),
        )
        _write_json(self.out / RESULT_FILE, json.dumps(doc, indent=1))
        record = compact_record(doc["bench"] or {}, self.facts())
        self.compact = self.compact or self.out / compact_name(record)
        tmp = self.compact.with_name(f".{self.compact.name}.tmp")
        size = write_compact(record, tmp)
        os.replace(tmp, self.compact)
        return self.compact, size

    def follow(self, key: str, path: Path):
        """A poll that folds the JSON a running part rewrites (atomically) at path into
        doc[key]; it says whether there was anything new."""
        seen = None

        def poll() -> bool:
            nonlocal seen
            try:
                stamp = path.stat().st_mtime_ns
                if stamp == seen:
                    return False
                self.doc[key] = json.loads(path.read_text())
            except (OSError, ValueError):
                return False
            seen = stamp
            return True

        return poll

    def run(
        self,
        name: str,
        cmd: list[str],
        budget: float,
        *,
        interpret: bool = False,
        shown: list[str] | None = None,
        versions: Path | None = None,
        poll=None,
        done=None,
    ) -> dict:
        """Run one part as a process of its own, within min(budget, what is left), and write
        the document when it starts, whenever poll (called every POLL_S seconds while it runs)
        has something new, and when it ends, after done(part) has folded in what it made.
        shown: the command as recorded (default: cmd without its interpreter); versions: the
        file where the process reports what it runs with."""
        allowed = min(budget, self.remaining())
        part = {"part": name, "command": " ".join(cmd[1:] if shown is None else shown)}
        if allowed < 5:
            self.skip(name, f"{self.remaining():.0f} s left of the budget", part)
            return part
        print(f"== {name} (up to {allowed:.0f} s)", flush=True)
        self.doc["running"] = name
        self.save()
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONUNBUFFERED"] = "1"
        if interpret:
            env["TRITON_INTERPRET"] = "1"
        log = self.tmp / (re.sub(r"\W+", "-", name) + ".log")
        began = time.monotonic()
        with open(log, "wb") as sink:
            try:
                # A session of its own, so a part that runs over is ended with its children
                # (ncu's).
                proc = subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as err:
                sink.write(f"gpu_session: could not start {cmd[0]}: {err}\n".encode())
                proc = None
        try:
            while proc is not None and (left := allowed - (time.monotonic() - began)) > 0:
                try:
                    proc.wait(timeout=min(POLL_S, left))
                    break
                except subprocess.TimeoutExpired:
                    if poll is not None and poll():
                        self.save()
        finally:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                part["status"] = "timed out"
        if proc is None:
            part["status"] = "failed"
        elif "status" not in part:
            part["rc"] = proc.returncode
            part["status"] = "ok" if proc.returncode == 0 else "failed"
        part["output_tail"] = log.read_bytes()[-16000:].decode(errors="replace")[-4000:]
        part["seconds"] = round(time.monotonic() - began, 1)
        if versions is not None and versions.exists():
            part["versions"] = json.loads(versions.read_text())
        if poll is not None:
            poll()
        if done is not None:
            done(part)
        print(f"   {part['status']} in {part['seconds']} s", flush=True)
        if part["status"] != "ok":
            print(part["output_tail"][-1500:], flush=True)
        self.parts.append(part)
        self.doc["running"] = None
        self.save()
        return part

    def skip(self, name: str, why: str, part: dict | None = None) -> None:
        print(f"== {name}: skipped, {why}", flush=True)
        self.parts.append({**(part or {"part": name}), "status": "skipped", "why": why})
        self.save()

    def child(self, name: str, budget: float, *extra: str, interpret: bool = False) -> dict:
        """One of this script's --child parts; its result goes to doc[name]."""
        out, versions = self.tmp / f"{name}.json", self.tmp / f"{name}-versions.json"
        cmd = [self.python, str(Path(__file__).resolve()), "--child", name]
        cmd += ["--kit", str(self.args.kit), "--child-out", str(out)]
        cmd += ["--child-versions", str(versions), *extra]

        def done(part: dict) -> None:
            if out.exists():
                part["result"] = self.doc[name] = json.loads(out.read_text())

        return self.run(name, cmd, budget, interpret=interpret, versions=versions, done=done)

    def tool_command(self, tool: str, args: list[str], versions: Path) -> list[str]:
        """The command of a part that runs a tool (TOOLS) through this script, which reports
        the versions it runs with to the file versions."""
        script = str(Path(__file__).resolve())
        return [self.python, script, TOOL_FLAG, str(versions), tool, *args]

    def tool(self, name: str, tool: str, args: list[str], budget: float, **run_kw) -> dict:
        """A part that runs bench/kernel/TOOL with args."""
        versions = self.tmp / (re.sub(r"\W+", "-", name) + "-versions.json")
        cmd = self.tool_command(tool, args, versions)
        shown = [f"bench/kernel/{tool}.py", *args]
        return self.run(name, cmd, budget, shown=shown, versions=versions, **run_kw)


def _bench(s: Session, rehearsal: bool) -> None:
    """The microbench part: the default grid on a GPU, keeping ncu's and the audit's time; a
    dry run of one tiny point in the interpreter in the rehearsal. Its JSON, rewritten after
    every point, is folded into the session's while it runs."""
    bench_json = s.tmp / "kernel.json"
    args = ["--kit", str(s.args.kit), "--json", str(bench_json)]
    follow = s.follow("bench", bench_json)
    if rehearsal:
        s.tool("bench", "microbench", [*args, *DRY_RUN_BENCH], 60, interpret=True, poll=follow)
    else:
        allowed = s.remaining() - PART_BUDGETS["ncu"] - PART_BUDGETS["audit"] - 5
        args += [*BENCH_SHAPES, "--padded-heads", "--plot", str(s.out / "kernel.png")]
        args += ["--time-budget-s", str(round(max(allowed - BENCH_MARGIN_S, 10), 1))]
        s.tool("bench", "microbench", args, max(allowed, 20), poll=follow)


def _ncu(s: Session, rehearsal: bool) -> dict:
    """Nsight Compute at a few points, where ncu is found; the reason it was not run else."""
    from bench.kernel.lib.ncu import find_ncu, match_probes, ncu_command, parse_details_csv

    ncu = find_ncu()
    if rehearsal:
        why = "a GPU part; the rehearsal runs on CPU"
        s.doc["ncu"] = {"skipped": why, "ncu": ncu}
        s.skip("ncu", f"{why} (ncu {'found at ' + ncu if ncu else 'not found'} here)")
        return s.doc["ncu"]
    if ncu is None:
        why = "Nsight Compute (ncu) is not on PATH nor under /usr/local/cuda*/bin"
        s.doc["ncu"] = {"skipped": why}
        s.skip("ncu", why)
        return s.doc["ncu"]
    log, probe = s.tmp / "ncu.csv", s.tmp / "ncu-probe.json"
    versions = s.tmp / "ncu-versions.json"
    args = ["--kit", str(s.args.kit), "--ncu-probe", str(probe), *NCU_POINTS, *NCU_ROWS]
    cmd = ncu_command(ncu, str(log), s.tool_command("microbench", args, versions))
    shown = ncu_command(ncu, str(log), ["bench/kernel/microbench.py", *args])[1:]

    def done(part: dict) -> None:
        text = log.read_text(errors="replace") if log.exists() else ""
        result = {"ncu": ncu, "log_tail": "\n".join(text.splitlines()[-15:])[-3000:]}
        if probe.exists():
            probes = json.loads(probe.read_text())["probes"]
            result["rows"] = match_probes(probes, parse_details_csv(text))
        part["rows"] = len(result.get("rows", []))
        s.doc["ncu"] = result

    s.run("ncu", cmd, PART_BUDGETS["ncu"], shown=shown, versions=versions, done=done)
    return s.doc["ncu"]


def _audits(s: Session, rehearsal: bool) -> None:
    """bench/kernel/audit on the virtual H200 and on the real device, over the bench's shapes,
    and the comparison of the two."""
    targets = [VIRTUAL_TARGET] if rehearsal else [VIRTUAL_TARGET, "cuda"]
    per_audit = PART_BUDGETS["audit"] / len(targets)
    for target in targets:
        path = s.tmp / f"audit-{target}.json"

        def done(part: dict, target=target, path=path) -> None:
            if path.exists():
                s.doc["audits"][target] = json.loads(path.read_text())
                part["findings"] = s.doc["audits"][target]["findings"]

        s.tool(
            f"audit {target}", "audit", audit_args(s.args.kit, target, path), per_audit, done=done
        )
    if rehearsal:
        s.skip("audit cuda", f"needs a CUDA device (the virtual {VIRTUAL_TARGET} audit ran)")
    mismatches, why = audit_comparison(s.doc["audits"], s.doc["device_check"])
    s.doc.update(audit_mismatches=mismatches, audit_comparison_skipped=why)
    if mismatches is not None:
        print(f"   audit comparison: {len(mismatches)} shape(s) differ", flush=True)
    elif not rehearsal:
        print(f"   audit comparison skipped: {why}", flush=True)


def _correctness_counts(result: dict | None) -> dict | None:
    if not result:
        return None
    return {k: len(result.get(k, [])) for k in ("compare", "graph", "gather", "baseline")}


def _real_device(python: str, rehearsal: bool) -> dict | None:
    """The device's facts and how it compares with the virtual target; None without CUDA."""
    if rehearsal:
        return {
            "device": "CPU",
            "device_check": {"skipped": "the rehearsal runs on CPU; no real device to compare"},
        }
    with tempfile.TemporaryDirectory(prefix="gpu-session-device-") as tmp:
        out = Path(tmp) / "device.json"
        cmd = [python, str(Path(__file__).resolve()), "--child", "device", "--child-out", str(out)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        if done.returncode != 0 or not out.exists():
            sys.exit(
                f"gpu_session: the device probe failed:\n{(done.stdout + done.stderr)[-3000:]}"
            )
        probe = json.loads(out.read_text())
    if not probe["cuda"]:
        return None
    from bench.kernel.lib.virtual_gpu import TARGETS

    check = device_check(probe["name"], probe["sms"], probe["capability"], TARGETS[VIRTUAL_TARGET])
    return {"device": probe["name"], "device_check": check}


def session(args, python: str, rehearsal: bool) -> int:
    out = args.out or ROOT / "bench" / "results" / time.strftime("gpu-session-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    from bench.kernel.lib.gpu_kit import activate

    manifest = activate(args.kit)
    print(
        f"gpu_session: {'rehearsal on CPU' if rehearsal else 'GPU session'}, kit "
        f"{manifest['label']}, parts run with {python}, budget {args.budget_s:.0f} s",
        flush=True,
    )
    device = _real_device(python, rehearsal)
    if device is None:
        print("gpu_session: no CUDA device is visible (use --rehearse on CPU)", file=sys.stderr)
        return 2
    check = device["device_check"]
    if check.get("mismatches"):
        print(
            f"gpu_session: {device['device']} is not the virtual {check['virtual']['name']} "
            f"({'; '.join(check['mismatches'])}); the real-against-virtual audit comparison "
            f"will be skipped (make the call with kind {DEVICE_KIND})",
            flush=True,
        )
    s = Session(args, python, rehearsal, out, {"kit": manifest, **device})
    s.save()
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        status = _sequence(s, rehearsal)
    except Terminated:
        s.doc["stopped"] = f"SIGTERM while {s.doc['running'] or 'between parts'}"
        s.save()
        print(f"gpu_session: stopped ({s.doc['stopped']}); what finished is in {out}", flush=True)
        return 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    shutil.rmtree(s.tmp, ignore_errors=True)
    return status


def _sequence(s: Session, rehearsal: bool) -> int:
    from bench.kernel.lib.results import target_verdicts, verdict_lines

    s.child(
        "correctness",
        PART_BUDGETS["correctness"],
        *(["--cpu"] if rehearsal else []),
        interpret=rehearsal,
    )
    if rehearsal:
        s.skip("bandwidth", "a timing part; the rehearsal runs on CPU")
    else:
        s.child("bandwidth", PART_BUDGETS["bandwidth"])
    _bench(s, rehearsal)
    _ncu(s, rehearsal)
    _audits(s, rehearsal)

    failed_checks = [
        p["part"] for p in s.parts if p["part"] == "correctness" and p["status"] != "ok"
    ]
    compact, size = s.save(complete=True)
    doc = s.doc
    print(f"\ngpu_session: {doc['wall_s']} s; results in {s.out / RESULT_FILE}")
    for part in s.parts:
        print(f"  {part['part']:<12} {part['status']:<9} {part.get('seconds', '')}")
    ran = doc["versions"]
    print(
        "ran with (as the parts reported): "
        + ", ".join(f"{k} {ran[k]}" for k in ("python", "torch", "triton", "numpy") if k in ran)
    )
    print("targets (mma at auto, graph replay with L2 cold):")
    print("\n".join(verdict_lines(target_verdicts((doc["bench"] or {}).get("results", [])))))
    print(
        f"compact record: {compact} ({size:,} bytes); copy it into bench/kernel/results/",
        flush=True,
    )
    if failed_checks:
        print("gpu_session: FAILED: a correctness check failed", file=sys.stderr)
        return 1
    if doc["audit_mismatches"]:
        print("gpu_session: the real and virtual audits disagree (see audit_mismatches)")
        return 3
    return 0


# --- rehearsal venv ----------------------------------------------------------------------------


def rehearsal_python(args) -> str:
    if args.python:
        return args.python
    venv = ROOT / REHEARSE_VENV
    py = venv / "bin" / "python"
    if not py.exists():
        base = shutil.which(args.base_python) or args.base_python
        probe = subprocess.run(
            [base, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
        )
        if probe.returncode != 0 or probe.stdout.strip() != DEVICE_VERSIONS["python"]:
            sys.exit(
                f"gpu_session: --rehearse creates {REHEARSE_VENV} with a Python "
                f"{DEVICE_VERSIONS['python']}, and {args.base_python!r} is not one that runs "
                f"({(probe.stderr or probe.stdout).strip()[:200]}); pass --base-python PATH, "
                "or --python PATH of a Python that has the device's torch and triton"
            )
        print(f"gpu_session: creating {REHEARSE_VENV} with {base}", flush=True)
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    wanted = [DEVICE_VERSIONS["torch"], DEVICE_VERSIONS["triton"], REHEARSE_NUMPY]
    pins = [f"{name}=={v}" for name, v in zip(("torch", "triton", "numpy"), wanted, strict=True)]
    have = subprocess.run(
        [
            str(py),
            "-c",
            "import torch, triton, numpy; "
            "print(torch.__version__, triton.__version__, numpy.__version__)",
        ],
        capture_output=True,
        text=True,
    ).stdout.split()
    if [v.split("+")[0] for v in have] != wanted:
        print(f"gpu_session: installing {' '.join(pins)} (several GB the first time)", flush=True)
        subprocess.run([str(py), "-m", "pip", "install", *pins], check=True)
    return str(py)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [TOOL_FLAG]:
        run_tool(argv[1], argv[2], argv[3:])
    args = parse_args(argv)
    if args.child:
        children = {
            "correctness": child_correctness,
            "bandwidth": child_bandwidth,
            "device": child_device,
        }
        with reporting_versions(args.child_versions):
            result = children[args.child](args)
        args.child_out.write_text(json.dumps(result))
        return 0
    if args.prepare:
        return prepare(args.kit, args.baseline_commit)
    args.kit = args.kit if args.kit.is_absolute() else ROOT / args.kit
    if not (args.kit / "kit_manifest.json").is_file():
        sys.exit(f"gpu_session: no kit at {args.kit}; run bench/kernel/gpu_session --prepare first")
    if args.rehearse:
        python = rehearsal_python(args)
        if Path(python).resolve() != Path(sys.executable).resolve():
            cmd = [python, str(Path(__file__).resolve()), "--rehearse", "--python", python]
            cmd += ["--kit", str(args.kit), "--budget-s", str(args.budget_s)]
            if args.out:
                cmd += ["--out", str(args.out)]
            return subprocess.run(cmd, cwd=ROOT).returncode
        return session(args, python, rehearsal=True)
    return session(args, sys.executable, rehearsal=False)


if __name__ == "__main__":
    from tools.entry import call

    # A dependency main() imports and this Python lacks ends in one line naming it, exit 2.
    call("bench/kernel/gpu_session", main)
