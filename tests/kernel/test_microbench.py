"""bench/kernel/microbench without a GPU: its options, the order of its points, the baseline
kernel loaded beside the current one (interpreter), and the launch recorder on a Triton that
compiles for real (a virtual H200). The timing itself runs only on a GPU (test_gpu.py), and the
whole plan runs as a dry run in the GPU session's rehearsal (test_gpu_session.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cases import Case, assert_matches_reference, make_inputs, reference_args

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.kernel import microbench  # noqa: E402
from bench.kernel.lib.gpu_kit import (  # noqa: E402
    BASELINE_FILES,
    DEFAULT_BASELINE_COMMIT,
    baseline_files,
    load_baseline,
)


def test_defaults_put_the_issue_targets_first_and_leave_mma_main_out_without_a_baseline():
    args = microbench.parse_args([])
    assert args.first == [(1, 16, 512), (64, 16, 512), (96, 16, 512), (128, 16, 512)]
    assert "mma-main" not in args.backends and args.backends[0] == "mma"
    assert (args.repeats, args.graph_calls, args.targets[0]) == (10, 8, "auto")
    assert isinstance(args.seed, int)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--first", "64x16"], "BATCHxHEADSxEXTRA"),
        (["--backends", "mma,cutlass"], "unknown"),
        (["--backends", "mma,mma-main"], "needs a baseline"),
        (["--targets", "auto,0"], "positive integers"),
        (["--repeats", "0"], "must be > 0"),
    ],
)
def test_bad_options_exit_2_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        microbench.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_points_first_then_the_grid_each_once_in_a_seeded_shuffle():
    argv = ["--batch", "1,16,64,128", "--heads", "16,64", "--extra", "0,512", "--seed", "7"]
    args = microbench.parse_args([*argv, "--first", "64x16x512,1x16x512"])
    points = microbench.plan_points(args)
    keys = [(p["batch"], p["heads"], p["extra"]) for p in points]
    assert sorted(keys[:2]) == [(1, 16, 512), (64, 16, 512)]
    assert {p["phase"] for p in points[:2]} == {"first"} and points[2]["phase"] == "rest"
    assert sorted(keys) == sorted(
        {(b, h, e) for b in (1, 16, 64, 128) for h in (16, 64) for e in (0, 512)}
    )
    assert all(p["swa"] == 128 for p in points)
    assert microbench.plan_points(args) == points
    other = microbench.plan_points(microbench.parse_args([*argv, "--seed", "8"]))
    assert [(p["batch"], p["heads"], p["extra"]) for p in other] != keys
    none = microbench.plan_points(microbench.parse_args([*argv, "--first", "none"]))
    assert {p["phase"] for p in none} == {"rest"} and len(none) == len(points)


@pytest.fixture(scope="module")
def baseline_dir(tmp_path_factory):
    commit, files = baseline_files(ROOT, DEFAULT_BASELINE_COMMIT)
    assert commit.startswith(DEFAULT_BASELINE_COMMIT) and sorted(files) == sorted(BASELINE_FILES)
    path = tmp_path_factory.mktemp("baseline")
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def test_baseline_loads_beside_the_current_kernel_and_computes_the_reference(baseline_dir):
    from sglang.kernels.ops.attention import flash_mla_sm120 as dispatch
    from sglang.kernels.ops.attention import flash_mla_sm120_mma as current

    old = load_baseline(baseline_dir)
    assert old is not current and old.__file__ == str(baseline_dir / "flash_mla_sm120_mma.py")
    assert old.resolve_split_count.__module__ == "sm120pd_baseline.sm120_mma_splits"
    assert sys.modules["sm120pd_baseline.sm120_mma_fit"].__file__.startswith(str(baseline_dir))
    assert load_baseline(baseline_dir) is old
    kwargs = make_inputs(Case(batch=2, heads=16, swa_topk=40, extra_topk=30))
    out, lse = old.flash_mla_sparse_decode_mma(*reference_args(kwargs))
    assert_matches_reference(out, lse, *dispatch._sm120_sparse_decode_fwd(*reference_args(kwargs)))


def test_an_unknown_baseline_commit_is_refused():
    with pytest.raises(ValueError, match="not a commit"):
        baseline_files(ROOT, "0000000deadbeef")


_RECORD_ON_A_VIRTUAL_H200 = """
import json, sys
sys.path[:0] = [{root!r}, {tests!r}]
from cases import Case, make_inputs
from bench.kernel.lib.gather import gather_kv_rows
from bench.kernel.lib.timing import LaunchRecorder
from bench.kernel.lib.virtual_gpu import TARGETS, virtual_device
kw = make_inputs(Case(batch=3, heads=16, swa_topk=128, swa_page_size=256, extra_topk=512))
lists = [kw[k] for k in ("k_cache", "indices", "topk_length", "extra_k_cache",
                         "extra_indices_in_kvcache", "extra_topk_length")]
recorder = LaunchRecorder()
with virtual_device(TARGETS["h200"]) as device:
    recorder.install(device)
    gather_kv_rows(*lists)
    with recorder:
        gather_kv_rows(*lists)
print(json.dumps(recorder.launches))
"""


def test_launch_recorder_sees_a_compiled_triton_launch():
    code = _RECORD_ON_A_VIRTUAL_H200.format(root=str(ROOT), tests=str(ROOT / "tests" / "kernel"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (launch,) = json.loads(done.stdout.splitlines()[-1])
    assert launch == {"kernel": "_gather_kernel", "grid": [8 + 32, 3, 1], "warps": 4}


class _FakeTimer:
    """Stands in for the CUDA timer so the bench's plan runs on CPU: the rows' calls run (in
    the interpreter) when the bench makes them and in the host samples; the numbers are made
    up."""

    def __init__(self):
        self.graph_samples = 0

    def eager_sample(self, calls):
        return 1000.0 if calls[0].func.__name__ == "flash_mla_with_kvcache_sm120" else 50.0

    def capture(self, calls):
        if calls[0].func.__name__ == "flash_mla_with_kvcache_sm120":
            raise RuntimeError("operation not permitted when stream is capturing")
        return "graph"

    def graph_sample(self, graph, calls_in_graph):
        self.graph_samples += 1
        return 10.0 + self.graph_samples

    def host_sample(self, calls, head_start_us):
        for call in calls:
            call()
        return 20.0, head_start_us > 2000


def test_the_bench_loop_samples_every_row_and_records_what_fails():
    import torch

    from bench.kernel.lib.timing import LaunchRecorder, SplitLog

    args = microbench.parse_args(
        [*("--first", "none", "--batch", "2", "--heads", "16", "--swa", "16", "--extra", "16")]
        + [*("--targets", "auto", "--backends", "mma,gather,torch,flashinfer")]
        + [*("--repeats", "3", "--graph-calls", "3", "--seed", "1")]
    )
    entries = microbench._load_entries(args, torch)
    timer, split_log = _FakeTimer(), SplitLog()
    bench = microbench.Bench(
        args, torch, torch.device("cpu"), entries, timer, LaunchRecorder(), split_log
    )
    (point,) = microbench.plan_points(args)
    try:
        records = bench.run_point(point)
        # The split choice was logged for the probe call only: no timed call paid for logging.
        assert split_log.messages == []
    finally:
        split_log.close()
    rows = {r["backend"]: r for r in records}
    assert list(rows) == ["mma", "gather", "torch", "flashinfer"]
    assert rows["mma"]["ctas"] >= 1 and rows["mma"]["kv_bytes"] == 2 * 32 * 584
    for name in ("mma", "gather"):
        row = rows[name]
        assert row["calls_per_sample"] == 3 and row["host_blocked"] == 0
        assert row["graph_us"]["n"] == row["eager_us"]["n"] == row["host_us"]["n"] == 3
    # The slow backend gets 2000 us worth of calls per sample, no graph, and is tried once.
    torch_row = rows["torch"]
    assert torch_row["calls_per_sample"] == 2 and "graph_us" not in torch_row
    assert "stream is capturing" in torch_row["graph_error"] and torch_row["host_blocked"] == 3
    assert torch_row["eager_us"]["median"] == 1000.0
    assert "error" in rows["flashinfer"] and "flashinfer" in rows["flashinfer"]["error"]
    assert timer.graph_samples == 6
    inputs = microbench.make_inputs(torch, 2, 16, 16, 16, torch.device("cpu"))
    (again,) = [r for r in bench.rows_for(point, [inputs]) if r.backend == "torch"]
    bench.prepare(again)
    assert again.record["graph_error"].startswith("not captured (first failure")
