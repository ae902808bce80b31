"""bench/kernel/gpu_session: the kit, its import path without sglang's dependencies, and the
session's sequence rehearsed on CPU (the GPU parts themselves run only on a lent GPU)."""

import argparse
import importlib.metadata
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSION = ROOT / "bench" / "kernel" / "gpu_session.py"
sys.path.insert(0, str(ROOT))

from bench.kernel.gpu_session import (  # noqa: E402
    BENCH_SHAPES,
    DEVICE_KIND,
    Session,
    _compare_audits,
    audit_args,
    audit_comparison,
    audit_shape_args,
    device_check,
    run_instructions,
    versions_ran,
)
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
    assert f"kind:      {DEVICE_KIND}" in stdout


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
    # Written after every part, complete only at the last write.
    assert doc["complete"] is True and doc["parts_done"] == list(status)
    # The audit covers the shapes the GPU run's bench times (not the audit's default grid).
    audit_part = next(p for p in doc["parts"] if p["part"] == "audit h200")
    assert audit_part["command"].endswith(" ".join(audit_shape_args(BENCH_SHAPES)))
    # Each part that ran reports what it ran with; the top level is what they reported.
    ran = [p for p in doc["parts"] if p["status"] != "skipped"]
    assert all(p["versions"]["executable"] == sys.executable for p in ran)
    assert doc["versions"] == versions_ran(doc["parts"])
    assert doc["versions"]["triton"] == importlib.metadata.version("triton")
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
    # The baseline (split-K) logs its split count; the stream-K kernel has none to log.
    assert all(isinstance(rows[("mma-main", t)]["splits"], int) for t in ("auto", "64"))
    assert doc["bench"]["baseline"]["commit"] == doc["kit"]["baseline"]["commit"]
    # The compact record: small, the session's facts, the targets not measured on CPU.
    compact = tmp_path / names[0]
    record = json.loads(compact.read_text())
    assert compact.stat().st_size <= COMPACT_LIMIT_BYTES and record["kind"].startswith("rehearsal")
    assert record["kit"]["label"] == doc["kit"]["label"] and record["correctness"] == counts
    assert record["complete"] is True and record["versions"] == doc["versions"]
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


def _stream_k_audit_doc(ctas: int) -> dict:
    doc = _audit_doc(104, 0)
    (shape,) = doc["results"][0]["shapes"]
    del shape["splits"]
    shape["ctas"] = ctas
    return doc


def test_audit_comparison_takes_the_stream_k_kernels_ctas_where_there_is_no_split_count():
    assert _compare_audits(_stream_k_audit_doc(264), _stream_k_audit_doc(264)) == []
    (diff,) = _compare_audits(_stream_k_audit_doc(264), _stream_k_audit_doc(228))
    assert diff["virtual_h200"]["ctas"] == 264 and "splits" not in diff["real"]


def test_session_refuses_a_missing_kit(tmp_path):
    done = _run(str(SESSION), "--kit", str(tmp_path / "none"))
    assert done.returncode != 0 and "--prepare" in done.stderr


def _session(out: Path, budget_s: float = 120) -> Session:
    args = argparse.Namespace(budget_s=budget_s, kit=Path("no-kit"))
    return Session(args, sys.executable, True, out, {"kit": {"label": "test"}})


_KILLED_DRIVER = """
import argparse, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from bench.kernel.gpu_session import Session
out = Path({out!r})
s = Session(argparse.Namespace(budget_s=120, kit=Path("no-kit")), sys.executable, True, out,
            {{"kit": {{"label": "test"}}}})
s.run("correctness", [sys.executable, "-c", "print('ok compare')"], 30)
bench = out.parent / "kernel.json"
s.run("bench", [sys.executable, "-c", {bench_code!r}, str(bench)], 60,
      poll=s.follow("bench", bench))
"""
# A bench that has finished one point (its JSON rewritten atomically, as microbench does) and
# runs on until the session that started it is gone.
_SLOW_BENCH = """
import json, os, sys, time
path = sys.argv[1]
with open(path + ".tmp", "w") as f:
    json.dump({"results": [], "skipped": [], "points_done": 1}, f)
os.replace(path + ".tmp", path)
parent = os.getppid()
while os.getppid() == parent:
    time.sleep(0.05)
"""


def test_a_session_killed_mid_way_leaves_the_parts_it_finished_and_the_bench_so_far(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code = _KILLED_DRIVER.format(root=str(ROOT), out=str(out), bench_code=_SLOW_BENCH)
    driver = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        doc = {}
        while not (doc.get("running") == "bench" and doc.get("bench")):
            assert time.monotonic() < deadline and driver.poll() is None, doc
            time.sleep(0.1)
            if (out / "gpu_session.json").exists():
                doc = json.loads((out / "gpu_session.json").read_text())
    finally:
        driver.kill()
        driver.wait()
    doc = json.loads((out / "gpu_session.json").read_text())
    assert doc["complete"] is False and doc["parts_done"] == ["correctness"]
    assert doc["parts"][0]["status"] == "ok" and "ok compare" in doc["parts"][0]["output_tail"]
    assert doc["running"] == "bench" and doc["bench"]["points_done"] == 1
    (compact,) = [p for p in out.iterdir() if p.name != "gpu_session.json"]
    record = json.loads(compact.read_text())
    assert record["complete"] is False and record["parts_done"] == ["correctness"]


def test_a_part_over_its_time_is_ended_and_what_its_json_held_is_kept(tmp_path):
    s = _session(tmp_path, budget_s=6)
    bench = tmp_path / "kernel.json"
    try:
        part = s.run(
            "bench",
            [sys.executable, "-c", _SLOW_BENCH, str(bench)],
            60,
            poll=s.follow("bench", bench),
        )
    finally:
        shutil.rmtree(s.tmp)
    assert part["status"] == "timed out" and 5 <= part["seconds"] < 30
    doc = json.loads((tmp_path / "gpu_session.json").read_text())
    assert doc["parts_done"] == ["bench"] and doc["bench"]["points_done"] == 1
    assert doc["complete"] is False


def _bench_shapes(bench_args: list[str]) -> set[tuple]:
    from bench.kernel.microbench import parse_args, plan_points

    return {
        (p["heads"], p["batch"], f"c4-{p['extra']}" if p["extra"] else "none", True, True)
        for p in plan_points(parse_args(bench_args))
    }


def _audited_shapes(args: list[str]) -> set[tuple]:
    flags = dict(zip(args[::2], args[1::2], strict=True))
    heads, batch = (map(int, flags[f].split(",")) for f in ("--heads", "--batch"))
    extra = flags["--extra"].split(",")
    sink, lengths = ([v == "on" for v in flags[f].split(",")] for f in ("--sink", "--lengths"))
    return set(itertools.product(heads, batch, extra, sink, lengths))


def test_the_audits_cover_the_shapes_the_bench_times_and_no_others():
    bench = _bench_shapes(BENCH_SHAPES)
    assert (16, 1, "c4-512", True, True) in bench and (64, 128, "c4-2048", True, True) in bench
    for target in ("h200", "cuda"):
        args = audit_args(Path("kit"), target, Path("audit.json"))
        assert args[:6] == ["--kit", "kit", "--targets", target, "--json", "audit.json"]
        assert _audited_shapes(args[6:]) == bench
    small = ["--first", "none", "--batch", "1,64", "--heads", "16,64", "--extra", "0,512"]
    assert _audited_shapes(audit_shape_args(small)) == _bench_shapes(small)
    with pytest.raises(ValueError, match="SWA 16"):
        audit_shape_args(["--swa", "16"])


def test_run_instructions_name_the_h200_kind_the_virtual_target_matches():
    text = run_instructions("build/gpu-kit")
    assert "  kind:      nvidia-h200\n" in text and "132 SMs" in text
    assert '  carry:     ["build/gpu-kit"]\n' in text


def _target():
    from bench.kernel.lib.virtual_gpu import TARGETS

    return TARGETS["h200"]


def test_device_check_accepts_an_h200_and_names_what_differs_on_another_device():
    assert device_check("NVIDIA H200", 132, "9.0", _target())["mismatches"] == []
    (name,) = device_check("NVIDIA H100 80GB HBM3", 132, "9.0", _target())["mismatches"]
    assert "H100" in name
    pcie = device_check("NVIDIA H100 PCIe", 114, "9.0", _target())["mismatches"]
    assert len(pcie) == 2 and "114 SMs, not 132" in pcie[1]
    assert len(device_check("NVIDIA RTX PRO 6000", 188, "12.0", _target())["mismatches"]) == 3


def test_audit_comparison_is_skipped_with_the_reason_on_a_device_that_is_not_the_target():
    audits = {"h200": _audit_doc(104, 4), "cuda": _audit_doc(104, 8)}
    h200 = device_check("NVIDIA H200", 132, "9.0", _target())
    mismatches, why = audit_comparison(audits, h200)
    assert len(mismatches) == 1 and why is None
    h100 = device_check("NVIDIA H100 PCIe", 114, "9.0", _target())
    mismatches, why = audit_comparison(audits, h100)
    assert mismatches is None and "114 SMs, not 132" in why and "by design" in why
    assert audit_comparison({"h200": audits["h200"]}, h200)[0] is None


def test_a_parts_versions_are_the_ones_its_own_process_reports(tmp_path, monkeypatch):
    # The part's Python finds a numpy of its own (first on its path); the session's is another.
    fake = tmp_path / "site"
    (fake / "numpy").mkdir(parents=True)
    (fake / "numpy" / "__init__.py").write_text("__version__ = '0.0.1'\n")
    (fake / "numpy-0.0.1.dist-info").mkdir()
    (fake / "numpy-0.0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: numpy\nVersion: 0.0.1\n"
    )
    assert importlib.metadata.version("numpy") != "0.0.1"
    monkeypatch.setenv("PYTHONPATH", str(fake))
    out = tmp_path / "out"
    out.mkdir()
    s = _session(out)
    try:
        # A bench that stops at its arguments: its versions are still reported.
        part = s.tool("bench", "microbench", ["--repeats", "0"], 30)
    finally:
        shutil.rmtree(s.tmp)
    assert part["status"] == "failed" and part["rc"] == 2
    assert part["versions"]["numpy"] == "0.0.1"
    assert part["versions"]["executable"] == sys.executable
    doc = json.loads((out / "gpu_session.json").read_text())
    assert doc["versions"]["numpy"] == "0.0.1" and doc["parts"][0]["versions"] == part["versions"]


def test_versions_that_differ_between_parts_are_given_per_part():
    parts = [
        {"part": "bench", "versions": {"python": "3.12.3", "triton": "3.6.0"}},
        {"part": "audit h200", "versions": {"python": "3.12.3", "triton": "3.8.0"}},
        {"part": "ncu", "status": "skipped"},
    ]
    assert versions_ran(parts) == {
        "python": "3.12.3",
        "triton": {"bench": "3.6.0", "audit h200": "3.8.0"},
    }
