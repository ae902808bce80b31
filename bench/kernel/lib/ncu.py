"""Nsight Compute for the GPU session: the command, and what its CSV says per kernel.

The session runs ``bench/kernel/microbench --ncu-probe`` under ``ncu`` at a few points: one call
per row (mma and mma-main at auto, the gather) between cudaProfilerStart and Stop, so only those
kernels are profiled. ncu flushes the caches before each kernel it measures
(``--cache-control all``) and here leaves the clocks alone (``--clock-control none``, so its
durations compare with the graph-replay times). Per kernel it reads the duration, DRAM bytes
read and written, launch facts, achieved occupancy and the warp stall reasons (every
``smsp__average_warps_issue_stalled_*_per_issue_active`` metric, by regex, so the names this
ncu version knows are the ones asked for), from the CSV of its details page.
"""

import csv
import glob
import io
import re
import shutil
from collections import Counter

METRICS = (
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "launch__grid_size",
    "launch__block_size",
    "launch__registers_per_thread",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio",
)
_STALL = re.compile(r"issue_stalled_([a-z_]+?)_per_issue_active")
# Where CUDA installs put ncu when it is not on PATH.
_NCU_GLOBS = ("/usr/local/cuda*/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu")
# "selected" is a warp issuing, not a stall.
_NOT_STALLS = {"selected"}


def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in _NCU_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def ncu_command(ncu: str, log_file: str, program: list[str]) -> list[str]:
    return [
        ncu,
        "--profile-from-start",
        "off",
        "--target-processes",
        "all",
        "--cache-control",
        "all",
        "--clock-control",
        "none",
        "--print-units",
        "base",
        "--csv",
        "--log-file",
        log_file,
        "--metrics",
        ",".join(METRICS),
        *program,
    ]


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_details_csv(text: str) -> list[dict]:
    """Kernels in launch order from ncu's details-page CSV (one row per kernel and metric;
    ncu's own ``==PROF==`` lines around it are skipped): name and {metric: value}."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        kernel_id = row.get("ID")
        name = row.get("Metric Name")
        if kernel_id is None or name is None or not kernel_id.strip().isdigit():
            continue
        kernel = kernels.setdefault(
            kernel_id, {"id": int(kernel_id), "kernel": row.get("Kernel Name"), "metrics": {}}
        )
        value = _number(row.get("Metric Value", ""))
        if value is not None:
            kernel["metrics"][name] = value
    return sorted(kernels.values(), key=lambda k: k["id"])


def kernel_summary(kernel: dict) -> dict:
    m = kernel["metrics"]
    stalls = Counter(
        {
            found.group(1): value
            for name, value in m.items()
            if (found := _STALL.search(name)) and found.group(1) not in _NOT_STALLS
        }
    )
    duration_ns = m.get("gpu__time_duration.sum")
    return {
        "kernel": kernel["kernel"],
        "duration_us": None if duration_ns is None else round(duration_ns / 1e3, 3),
        "dram_read_bytes": m.get("dram__bytes_read.sum"),
        "dram_write_bytes": m.get("dram__bytes_write.sum"),
        "grid_size": m.get("launch__grid_size"),
        "block_size": m.get("launch__block_size"),
        "registers": m.get("launch__registers_per_thread"),
        "achieved_occupancy_pct": m.get("sm__warps_active.avg.pct_of_peak_sustained_active"),
        "top_stalls": [[reason, round(v, 2)] for reason, v in stalls.most_common(3)],
    }


def match_probes(probes: list[dict], kernels: list[dict]) -> list[dict]:
    """Each profiled row of the probe with its kernels (in launch order), DRAM bytes read
    against the unique bytes the call must read (KV rows and index lists)."""
    out, at = [], 0
    for probe in probes:
        count = len(probe.get("launches", []))
        mine = kernels[at : at + count]
        at += count
        names = [k["kernel"] for k in mine]
        wanted = [launch["kernel"] for launch in probe.get("launches", [])]
        summaries = [kernel_summary(k) for k in mine]
        unique = probe.get("kv_bytes", 0) + probe.get("index_bytes", 0)
        read = sum(s["dram_read_bytes"] or 0 for s in summaries)
        row = {
            "batch": probe["batch"],
            "heads": probe["heads"],
            "swa": probe["swa"],
            "extra": probe["extra"],
            "backend": probe["backend"],
            "target_ctas": probe.get("target_ctas"),
            "kernels": summaries,
            "unique_bytes": unique,
            "dram_read_over_unique": round(read / unique, 3) if unique and summaries else None,
        }
        if len(mine) != count or not all(
            w in (n or "") for w, n in zip(wanted, names, strict=False)
        ):
            row["mismatch"] = f"expected kernels {wanted}, ncu listed {names}"
        out.append(row)
    return out
