"""The mma backend compiled for a real GPU (skipped without CUDA).

The checks run in a subprocess without TRITON_INTERPRET, which this test process has set for
the interpreter tests (see conftest.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]
CHECK = Path(__file__).with_name("gpu_check.py")
MICROBENCH = ROOT / "bench" / "kernel" / "microbench.py"


def _compiled(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=900
    )


def _gpu_check(mode: str, *args: str) -> subprocess.CompletedProcess:
    return _compiled(str(CHECK), mode, *args)


@pytest.fixture(scope="module")
def baseline_dir(tmp_path_factory):
    sys.path.insert(0, str(ROOT))
    from bench.kernel.lib.gpu_kit import DEFAULT_BASELINE_COMMIT, baseline_files

    _, files = baseline_files(ROOT, DEFAULT_BASELINE_COMMIT)
    path = tmp_path_factory.mktemp("baseline")
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def test_compiled_mma_matches_upstream_reference():
    done = _gpu_check("compare")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("ok compare") == 32


def test_cuda_graph_replay_matches_eager():
    done = _gpu_check("graph")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("ok graph") == 2


def test_compiled_gather_reads_the_rows_torch_indexing_reads():
    done = _gpu_check("gather")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("ok gather") == 8


def test_compiled_baseline_kernel_matches_upstream_reference(baseline_dir):
    done = _gpu_check("baseline", "--baseline", str(baseline_dir))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("ok baseline") == 16


def test_microbench_times_graph_eager_and_host_per_row(baseline_dir, tmp_path):
    out, compact = tmp_path / "bench.json", tmp_path / "compact.json"
    done = _compiled(
        str(MICROBENCH),
        *("--first", "none", "--batch", "1", "--heads", "16", "--extra", "512"),
        *("--targets", "auto,256", "--backends", "mma,mma-main,gather"),
        *("--repeats", "3", "--graph-calls", "2", "--baseline", str(baseline_dir)),
        *("--json", str(out), "--compact", str(compact)),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["method"]["l2_bytes"] > 0 and doc["copy_gbps"] > 0
    rows = {(r["backend"], r["target_ctas"]): r for r in doc["results"]}
    assert len(rows) == 5 and not [r for r in rows.values() if "error" in r]
    for row in rows.values():
        for kind in ("graph", "eager", "host"):
            summary = row[f"{kind}_us"]
            assert summary["n"] == 3 and 0 < summary["min"] <= summary["median"] <= summary["max"]
        assert row["launches"] and all(launch["grid"] for launch in row["launches"])
    auto = rows[("mma", "auto")]
    assert auto["ctas"] >= 1 and auto["over_gather"] > 0 and auto["new_vs_main"] > 0
    assert rows[("gather", None)]["launches"][0]["kernel"] == "_gather_kernel"
    assert "targets (mma at auto):" in done.stdout
    assert compact.stat().st_size <= 200_000
