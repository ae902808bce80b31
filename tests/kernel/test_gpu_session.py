"""bench/kernel/gpu_session: the kit, its import path without sglang's dependencies, and the
session's sequence rehearsed on CPU (the GPU parts themselves run only on a lent GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSION = ROOT / "bench" / "kernel" / "gpu_session.py"
sys.path.insert(0, str(ROOT))

from bench.kernel.gpu_session import _compare_audits  # noqa: E402
from bench.kernel.lib.gpu_kit import BASELINE_FILES, BASELINE_SOURCE_DIR  # noqa: E402
from bench.kernel.lib.results import COMPACT_LIMIT_BYTES  # noqa: E402


def _run(*args, env=None, timeout=600) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    path = tmp_path_factory.mktemp("kit") / "gpu-kit"
    done = _run(str(SESSION), "--prepare", "--kit", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    return path, done.stdout


def test_prepare_builds_a_small_kit_of_the_current_series_and_prints_the_call(kit):
    path, stdout = kit
    label = subprocess.run(
        [str(ROOT / "build.sh"), "label"], capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    manifest = json.loads((path / "kit_manifest.json").read_text())
    assert manifest["label"] == label
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert 0 < size < 50 * 2**20
    assert f"{size:,} bytes" in stdout
    for name in manifest["files"]:
        assert (path / name).is_file()
    assert "carry:" in stdout and "gpu_session.py --kit" in stdout and "timeout_s:" in stdout


def test_prepare_puts_the_baseline_kernel_from_git_in_the_kit(kit):
    path, stdout = kit
    baseline = json.loads((path / "kit_manifest.json").read_text())["baseline"]
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "dc905b5"], capture_output=True, text=True
    ).stdout.strip()
    assert baseline["commit"] == commit and f"commit {commit[:12]}" in stdout
    assert sorted(baseline["files"]) == sorted(BASELINE_FILES)
    for name in BASELINE_FILES:
        shown = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{commit}:{BASELINE_SOURCE_DIR}/{name}"],
            capture_output=True,
        ).stdout
        assert (path / "baseline" / name).read_bytes() == shown


def test_prepare_refuses_an_unknown_baseline_commit(tmp_path):
    done = _run(
        str(SESSION), "--prepare", "--kit", str(tmp_path / "kit"), "--baseline-commit", "nope"
    )
    assert done.returncode != 0 and "--baseline-commit" in done.stderr
    assert not (tmp_path / "kit").exists()


_KIT_IMPORT = """
import os, sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from pathlib import Path
from bench.kernel.lib.gpu_kit import activate
activate(Path({kit!r}))
os.environ["SGLANG_SM120_FLASHMLA_BACKEND"] = "mma"
from sglang.kernels.ops.attention import flash_mla_sm120 as d
from cases import Case, assert_matches_reference, make_inputs, reference_args
kw = make_inputs(Case(batch=2, heads=16, swa_topk=40, extra_topk=30))
out, lse = d.flash_mla_with_kvcache_sm120(**kw)
assert_matches_reference(out, lse, *d._sm120_sparse_decode_fwd(*reference_args(kw)))
assert d.__file__.startswith({kit!r}), d.__file__
assert "sglang.kernels.ops.attention.flash_mla_sm120_mma" in sys.modules
heavy = ("pydantic", "zmq", "fastapi", "orjson", "msgspec", "uvloop")
heavy = [m for m in heavy if m in sys.modules]
assert not heavy, heavy
print("kit ok")
"""


def test_kit_runs_the_kernel_without_sglangs_package_chain(kit):
    path, _ = kit
    code = _KIT_IMPORT.format(root=str(ROOT), tests=str(ROOT / "tests" / "kernel"), kit=str(path))
    done = _run("-c", code, env={"TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kit ok" in done.stdout


def test_kit_refuses_to_mix_with_an_imported_sglang(kit):
    path, _ = kit
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); import sglang.srt.environ\n"
        f"from bench.kernel.lib.gpu_kit import activate; from pathlib import Path\n"
        f"activate(Path({str(path)!r}))"
    )
    done = _run("-c", code)
    assert done.returncode != 0 and "activate the kit first" in done.stderr


def test_rehearsal_runs_the_sequence_and_writes_the_json_and_the_compact_record(kit, tmp_path):
    path, _ = kit
    done = _run(
        str(SESSION),
        "--rehearse",
        "--python",
        sys.executable,
        "--kit",
        str(path),
        "--out",
        str(tmp_path),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and names[1] == "gpu_session.json", names
    doc = json.loads((tmp_path / "gpu_session.json").read_text())
    status = {p["part"]: p["status"] for p in doc["parts"]}
    assert status == {
        "correctness": "ok",
        "bandwidth": "skipped",
        "bench": "ok",
        "ncu": "skipped",
        "audit h200": "ok",
        "audit cuda": "skipped",
    }
    # gpu_check's CPU mode: its five small cases at one split and at the most splits; the
    # gather on the same five; the kit's baseline kernel on one case.
    counts = {k: len(doc["correctness"][k]) for k in ("compare", "graph", "gather", "baseline")}
    assert counts == {"compare": 10, "graph": 0, "gather": 5, "baseline": 1}
    assert doc["audits"]["h200"]["findings"] == []
    assert all("why" in p for p in doc["parts"] if p["status"] == "skipped")
    # The bench's dry run: every row ran once through the kit, the baseline beside the kernel.
    rows = {(r["backend"], r["target_ctas"]): r for r in doc["bench"]["results"]}
    assert set(rows) == {
        ("mma", "auto"),
        ("mma", "64"),
        ("mma-main", "auto"),
        ("mma-main", "64"),
    } | {("gather", None)}
    assert not [r for r in rows.values() if "error" in r]
    assert all(isinstance(rows[(b, t)]["splits"], int) for b, t in rows if b != "gather")
    assert doc["bench"]["baseline"]["commit"] == doc["kit"]["baseline"]["commit"]
    # The compact record: small, the session's facts, the targets not measured on CPU.
    compact = tmp_path / names[0]
    record = json.loads(compact.read_text())
    assert compact.stat().st_size <= COMPACT_LIMIT_BYTES and record["kind"].startswith("rehearsal")
    assert record["kit"]["label"] == doc["kit"]["label"] and record["correctness"] == counts
    assert {v["status"] for v in record["targets"]} == {"not measured"}
    assert len(record["points"]) == 1 and len(record["points"][0]["rows"]) == 5
    # Elapsed time per part, a reason for each skipped one, the targets and the compact record.
    assert done.stdout.count(" s\n") >= 2 and "ok in " in done.stdout
    assert "== ncu: skipped, a GPU part" in done.stdout
    assert "not measured" in done.stdout and f"compact record: {compact}" in done.stdout


def _audit_doc(registers: int, splits: int) -> dict:
    kernel = {"registers": registers, "shared_bytes": 49152, "ctas_per_sm": 2}
    shape = {
        "heads": 16,
        "batch": 64,
        "extra": "c4-512",
        "sink": True,
        "lengths": True,
        "stage1_kernel": 0,
        "splits": splits,
    }
    return {"results": [{"kernels": [kernel], "shapes": [shape]}]}


def test_audit_comparison_names_the_shapes_where_real_and_virtual_differ():
    assert _compare_audits(_audit_doc(104, 4), _audit_doc(104, 4)) == []
    (diff,) = _compare_audits(_audit_doc(104, 4), _audit_doc(112, 4))
    assert diff["shape"] == [16, 64, "c4-512", True, True]
    assert diff["virtual_h200"]["registers"] == 104 and diff["real"]["registers"] == 112


def test_session_refuses_a_missing_kit(tmp_path):
    done = _run(str(SESSION), "--kit", str(tmp_path / "none"))
    assert done.returncode != 0 and "--prepare" in done.stderr
