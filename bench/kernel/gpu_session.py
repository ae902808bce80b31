#!/usr/bin/env python3
"""One prepared call that runs every GPU check and benchmark of the decode kernel on a lent GPU.

  bench/kernel/gpu_session --prepare   build the kit (build/gpu-kit), print the exact run command
  bench/kernel/gpu_session --out DIR   on the GPU: the whole session, results in DIR (default $OUT)
  bench/kernel/gpu_session --rehearse  the same sequence on CPU, in a venv of the device's versions

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
  5. audit         bench/kernel/audit on the real device (launches recorded) and on the virtual
                   H200; registers, shared memory and CTAs per SM compared shape by shape: a
                   mismatch means the virtual audit is wrong somewhere

The GPU machine has torch and triton but not sglang's dependencies, and no registry: the kernel
comes from the kit (bench/kernel/lib/gpu_kit.py), the kernel and upstream's SM120 dispatch
extracted from our patched wheel and imported without sglang's package chain, plus the baseline
kernel (our kernel at --baseline-commit, from git) that the bench times as mma-main. Output in
--out: gpu_session.json (everything), kernel.png, and the compact record (at most 200 KB) to
copy into bench/kernel/results/. The summary prints the issue's targets as pass or fail. Exit
status: 0; 1 when a correctness check fails; 3 when the real and virtual audits disagree (and
none failed); 2 on bad arguments.
"""

import argparse
import json
import os
import platform
import shutil
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
# Seconds each part may take at most; the bench takes what is left after keeping ncu's and the
# audit's.
PART_BUDGETS = {"correctness": 150, "bandwidth": 20, "ncu": 60, "audit": 120}
# The bench stops starting points this long before its part's end (start-up, one last point).
BENCH_MARGIN_S = 30
# Shapes the rehearsal audits (the GPU run audits the default grid).
QUICK_AUDIT = ["--heads", "16,64", "--batch", "1,64", "--extra", "none,c4-512", "--sink", "on"]
# The points Nsight Compute profiles.
NCU_POINTS = ["--first", "none", "--batch", "1,64", "--heads", "16", "--extra", "512"]
NCU_ROWS = ["--targets", "auto", "--backends", "mma,mma-main,gather"]
# The rehearsal's bench: the microbench's plan, inputs and one call per row in the interpreter.
DRY_RUN_BENCH = ["--dry-run", "--first", "none", "--batch", "2", "--heads", "16", "--swa", "16"]
DRY_RUN_BENCH += ["--extra", "16", "--targets", "auto,64", "--backends", "mma,mma-main,gather"]


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
    mode.add_argument("--child", choices=("correctness", "bandwidth"), help=argparse.SUPPRESS)
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
    print(
        "\nRun it on the lent GPU in one call (the working tree travels; the kit is ignored by "
        "git, so carry it):\n"
        f"  carry:     {json.dumps([rel])}\n"
        f'  command:   python3 bench/kernel/gpu_session.py --kit {rel} --out "$OUT"\n'
        f"  timeout_s: {RUN_TIMEOUT_S}\n"
        f"The session keeps within {DEFAULT_BUDGET_S} s; the timeout leaves room for start-up."
    )
    return 0


# --- children ----------------------------------------------------------------------------------


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
    import contextlib
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


# --- the session -------------------------------------------------------------------------------


class Session:
    def __init__(self, args, python: str, rehearsal: bool):
        self.args = args
        self.python = python
        self.rehearsal = rehearsal
        self.start = time.monotonic()
        self.parts: list[dict] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu-session-"))
        self.out: Path | None = None

    def remaining(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.start)

    def run(self, name: str, cmd: list[str], budget: float, interpret: bool = False) -> dict:
        """Run one part as a process of its own, within min(budget, what is left)."""
        allowed = min(budget, self.remaining())
        part = {"part": name, "command": " ".join(cmd[1:])}
        if allowed < 5:
            part.update(status="skipped", why=f"{self.remaining():.0f} s left of the budget")
            print(f"== {name}: skipped, {part['why']}", flush=True)
            self.parts.append(part)
            return part
        print(f"== {name} (up to {allowed:.0f} s)", flush=True)
        began = time.monotonic()
        full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if interpret:
            full_env["TRITON_INTERPRET"] = "1"
        try:
            done = subprocess.run(
                cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=allowed
            )
            part["rc"] = done.returncode
            part["status"] = "ok" if done.returncode == 0 else "failed"
            part["output_tail"] = (done.stdout + done.stderr)[-4000:]
        except subprocess.TimeoutExpired as err:
            part["status"] = "timed out"
            out = (err.stdout or b"") + (err.stderr or b"")
            part["output_tail"] = out.decode(errors="replace")[-4000:]
        part["seconds"] = round(time.monotonic() - began, 1)
        print(f"   {part['status']} in {part['seconds']} s", flush=True)
        if part["status"] != "ok":
            print(part["output_tail"][-1500:], flush=True)
        self.parts.append(part)
        return part

    def skip(self, name: str, why: str) -> None:
        print(f"== {name}: skipped, {why}", flush=True)
        self.parts.append({"part": name, "status": "skipped", "why": why})

    def child(self, name: str, budget: float, *extra: str, interpret: bool = False) -> dict:
        out = self.tmp / f"{name}.json"
        cmd = [
            self.python,
            str(Path(__file__).resolve()),
            "--child",
            name,
            "--kit",
            str(self.args.kit),
            "--child-out",
            str(out),
            *extra,
        ]
        part = self.run(name, cmd, budget, interpret)
        if out.exists():
            part["result"] = json.loads(out.read_text())
        return part


def _compare_audits(virtual: dict, real: dict) -> list[dict]:
    """Stage-1 and combine resources per shape: the virtual H200 against the real device."""

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
                "splits": shape["splits"],
            }
        return out

    left, right = resources(virtual), resources(real)
    mismatches = []
    for key in sorted(set(left) | set(right), key=str):
        a, b = left.get(key), right.get(key)
        if a != b:
            mismatches.append({"shape": list(key), "virtual_h200": a, "real": b})
    return mismatches


def _bench(s: Session, rehearsal: bool) -> dict | None:
    """The microbench part: the default grid on a GPU, keeping ncu's and the audit's time; a
    dry run of one tiny point in the interpreter in the rehearsal."""
    bench_json = s.tmp / "kernel.json"
    cmd = [s.python, str(ROOT / "bench" / "kernel" / "microbench.py"), "--kit", str(s.args.kit)]
    cmd += ["--json", str(bench_json)]
    if rehearsal:
        s.run("bench", [*cmd, *DRY_RUN_BENCH], 60, interpret=True)
    else:
        allowed = s.remaining() - PART_BUDGETS["ncu"] - PART_BUDGETS["audit"] - 5
        cmd += ["--padded-heads", "--plot", str(s.out / "kernel.png")]
        cmd += ["--time-budget-s", str(round(max(allowed - BENCH_MARGIN_S, 10), 1))]
        s.run("bench", cmd, max(allowed, 20))
    return json.loads(bench_json.read_text()) if bench_json.exists() else None


def _ncu(s: Session, rehearsal: bool) -> dict:
    """Nsight Compute at a few points, where ncu is found; the reason it was not run else."""
    from bench.kernel.lib.ncu import find_ncu, match_probes, ncu_command, parse_details_csv

    ncu = find_ncu()
    if rehearsal:
        why = "a GPU part; the rehearsal runs on CPU"
        s.skip("ncu", f"{why} (ncu {'found at ' + ncu if ncu else 'not found'} here)")
        return {"skipped": why, "ncu": ncu}
    if ncu is None:
        why = "Nsight Compute (ncu) is not on PATH nor under /usr/local/cuda*/bin"
        s.skip("ncu", why)
        return {"skipped": why}
    log, probe = s.tmp / "ncu.csv", s.tmp / "ncu-probe.json"
    program = [s.python, str(ROOT / "bench" / "kernel" / "microbench.py"), "--kit", str(s.args.kit)]
    program += ["--ncu-probe", str(probe), *NCU_POINTS, *NCU_ROWS]
    part = s.run("ncu", ncu_command(ncu, str(log), program), PART_BUDGETS["ncu"])
    text = log.read_text(errors="replace") if log.exists() else ""
    result = {"ncu": ncu, "log_tail": "\n".join(text.splitlines()[-15:])[-3000:]}
    if probe.exists():
        probes = json.loads(probe.read_text())["probes"]
        result["rows"] = match_probes(probes, parse_details_csv(text))
    part["rows"] = len(result.get("rows", []))
    return result


def _correctness_counts(result: dict | None) -> dict | None:
    if not result:
        return None
    return {k: len(result.get(k, [])) for k in ("compare", "graph", "gather", "baseline")}


def session(args, python: str, rehearsal: bool) -> int:
    from bench.kernel.lib.results import compact_name, compact_record, verdict_lines, write_compact

    out = args.out or ROOT / "bench" / "results" / time.strftime("gpu-session-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    s = Session(args, python, rehearsal)
    s.out = out
    from bench.kernel.lib.gpu_kit import activate

    manifest = activate(args.kit)
    import torch
    import triton

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }
    has_cuda = torch.cuda.is_available() and not rehearsal
    print(
        f"gpu_session: {'rehearsal on CPU' if rehearsal else 'GPU session'}, kit "
        f"{manifest['label']}, python {versions['python']}, torch {versions['torch']}, triton "
        f"{versions['triton']}, budget {args.budget_s:.0f} s",
        flush=True,
    )
    if not rehearsal and not has_cuda:
        print("gpu_session: no CUDA device is visible (use --rehearse on CPU)", file=sys.stderr)
        return 2

    correctness = s.child(
        "correctness",
        PART_BUDGETS["correctness"],
        *(["--cpu"] if rehearsal else []),
        interpret=rehearsal,
    )
    if rehearsal:
        s.skip("bandwidth", "a timing part; the rehearsal runs on CPU")
    else:
        s.child("bandwidth", PART_BUDGETS["bandwidth"])
    bench = _bench(s, rehearsal)
    ncu = _ncu(s, rehearsal)

    audits = {}
    audit_args = QUICK_AUDIT if rehearsal else []
    targets = ["h200"] if rehearsal else ["h200", "cuda"]
    per_audit = PART_BUDGETS["audit"] / len(targets)
    for target in targets:
        path = s.tmp / f"audit-{target}.json"
        cmd = [python, str(ROOT / "bench" / "kernel" / "audit.py"), "--kit", str(args.kit)]
        cmd += ["--targets", target, "--json", str(path), *audit_args]
        part = s.run(f"audit {target}", cmd, per_audit)
        if path.exists():
            audits[target] = json.loads(path.read_text())
            part["findings"] = audits[target]["findings"]
    if rehearsal:
        s.skip("audit cuda", "needs a CUDA device (the virtual H200 audit ran)")
    mismatches = None
    if "h200" in audits and "cuda" in audits:
        mismatches = _compare_audits(audits["h200"], audits["cuda"])
        print(f"   audit comparison: {len(mismatches)} shape(s) differ", flush=True)

    failed_checks = [
        p["part"] for p in s.parts if p["part"] == "correctness" and p["status"] != "ok"
    ]
    kit_facts = {"label": manifest["label"], "wheel": manifest["wheel"]}
    if "baseline" in manifest:
        kit_facts["baseline_commit"] = manifest["baseline"]["commit"]
    doc = {
        "kind": "rehearsal (CPU, interpreter)" if rehearsal else "GPU session",
        "device": "CPU" if rehearsal else torch.cuda.get_device_name(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": round(time.monotonic() - s.start, 1),
        "versions": versions,
        "kit": manifest,
        "parts": s.parts,
        "correctness": correctness.get("result"),
        "audits": audits,
        "audit_mismatches": mismatches,
        "bench": bench,
        "ncu": ncu,
    }
    (out / "gpu_session.json").write_text(json.dumps(doc, indent=1))
    session_facts = {
        "kind": doc["kind"],
        "device": doc["device"],
        "time": doc["time"],
        "wall_s": doc["wall_s"],
        "versions": versions,
        "kit": kit_facts,
        "parts": [
            {k: p[k] for k in ("part", "status", "seconds", "why") if k in p} for p in s.parts
        ],
        "correctness": _correctness_counts(doc["correctness"]),
        "audit_mismatches": None if mismatches is None else len(mismatches),
        "ncu": ncu.get("rows", ncu.get("skipped")),
    }
    record = compact_record(bench or {}, session_facts)
    compact = out / compact_name(record)
    size = write_compact(record, compact)
    shutil.rmtree(s.tmp, ignore_errors=True)
    print(f"\ngpu_session: {doc['wall_s']} s; results in {out / 'gpu_session.json'}")
    for part in s.parts:
        print(f"  {part['part']:<12} {part['status']:<9} {part.get('seconds', '')}")
    print("targets (mma at auto, graph replay with L2 cold):")
    print("\n".join(verdict_lines(record["targets"])))
    print(
        f"compact record: {compact} ({size:,} bytes); copy it into bench/kernel/results/",
        flush=True,
    )
    if failed_checks:
        print("gpu_session: FAILED: a correctness check failed", file=sys.stderr)
        return 1
    if mismatches:
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
    args = parse_args(argv)
    if args.child:
        result = {"correctness": child_correctness, "bandwidth": child_bandwidth}[args.child](args)
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
