"""bench/kernel/lib/results.py, ncu.py and timing.py: the ratios, the issue's targets as pass or
fail, the compact record of a GPU run, the Nsight Compute CSV, and the timing statistics; all
on synthetic records, without a device."""

import csv
import io
import json
import logging
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.kernel.lib import results  # noqa: E402
from bench.kernel.lib.ncu import match_probes, parse_details_csv  # noqa: E402
from bench.kernel.lib.timing import LaunchRecorder, SplitLog, summarize  # noqa: E402

TARGETS = ("auto", "128", "256", "512", "1024")


def _times(us: float) -> dict:
    return summarize([us * 0.98, us, us * 1.05])


def _row(batch, heads, extra, backend, target, graph, host=20.0):
    return {
        "batch": batch,
        "heads": heads,
        "swa": 128,
        "extra": extra,
        "phase": "first" if heads == 16 else "rest",
        "kv_bytes": batch * (128 + extra) * 584,
        "backend": backend,
        "target_ctas": target,
        "graph_us": _times(graph),
        "eager_us": _times(graph + host),
        "host_us": _times(host),
        "splits": 2,
        "launches": [
            {"kernel": "stage1", "grid": [1, 2, batch], "warps": 4},
            {"kernel": "combine", "grid": [1, batch, 1], "warps": 4},
        ],
    }


def _point(batch, heads, extra, mma_us, main_us, gather_us, fixed_best=None, host=20.0):
    rows = [_row(batch, heads, extra, "gather", None, gather_us)]
    for target in TARGETS:
        fixed = fixed_best if (fixed_best and target == "512") else mma_us * 1.2
        rows.append(
            _row(batch, heads, extra, "mma", target, mma_us if target == "auto" else fixed, host)
        )
        rows.append(_row(batch, heads, extra, "mma-main", target, main_us))
    rows.append(_row(batch, heads, extra, "triton", None, mma_us * 10))
    rows.append(_row(batch, heads, extra, "torch", None, mma_us * 20))
    rows.append({**_row(batch, heads, extra, "flashinfer", None, 1.0), "error": "no flashinfer"})
    for r in rows:
        if "error" in r:
            for kind in ("graph", "eager", "host"):
                r.pop(f"{kind}_us")
    results.derive(rows, copy_gbps=4000.0)
    return rows


def test_derive_ratios_against_the_rows_of_the_same_point():
    rows = _point(64, 16, 512, mma_us=12.0, main_us=60.0, gather_us=8.0, fixed_best=10.0)
    auto = next(r for r in rows if r["backend"] == "mma" and r["target_ctas"] == "auto")
    assert auto["over_gather"] == pytest.approx(12.0 / 8.0, abs=1e-3)
    assert auto["new_vs_main"] == pytest.approx(0.2)
    assert auto["new_vs_main_host"] == pytest.approx(1.0)
    assert auto["auto_vs_best_fixed"] == pytest.approx(1.2)
    assert auto["speedup_vs_triton"] == pytest.approx(10.0)
    assert auto["speedup_vs_torch"] == pytest.approx(20.0)
    gbps = 64 * 640 * 584 / 12e-6 / 1e9
    assert auto["kv_gbps"] == pytest.approx(gbps, abs=0.1)
    assert auto["frac_copy"] == pytest.approx(gbps / 4000.0, abs=1e-4)
    gather = next(r for r in rows if r["backend"] == "gather")
    assert "over_gather" not in gather and "new_vs_main" not in gather


def test_targets_pass_fail_and_not_measured():
    # B=1 at 14 us (pass), large batches 1.2x the gather but below half of copy bandwidth,
    # auto 1.2x the best fixed target (fail), main's kernel slower everywhere (pass).
    rows = _point(1, 16, 512, 14.0, 30.0, 6.0)
    rows += _point(64, 16, 512, 12.0, 60.0, 10.0, fixed_best=10.0)
    rows += _point(128, 16, 512, 30.0, 90.0, 25.0, host=45.0)
    verdicts = {v["target"].split(":")[0]: v for v in results.target_verdicts(rows)}
    assert verdicts["B=1, 16 heads, SWA 128 + 512 extra"]["status"] == "pass"
    assert verdicts["B>=64, 16 heads"]["status"] == "fail"  # the last one: copy bandwidth
    gather = next(v for v in results.target_verdicts(rows) if "gather" in v["target"])
    assert gather["status"] == "pass" and gather["points"] == 2
    auto = next(v for v in results.target_verdicts(rows) if v["target"].startswith("auto"))
    assert auto["status"] == "fail" and any("B=64" in f for f in auto["failing"])
    host = next(v for v in results.target_verdicts(rows) if "host" in v["target"])
    assert host["status"] == "fail" and host["failing"] == ["B=128 H=16 swa=128 extra=512: 45.0 us"]
    main = next(v for v in results.target_verdicts(rows) if "main's kernel" in v["target"])
    assert main["status"] == "pass" and main["range"][1] < 1
    empty = results.target_verdicts([])
    assert {v["status"] for v in empty} == {"not measured"}
    lines = results.verdict_lines(results.target_verdicts(rows))
    assert any(line.startswith("  PASS  B=1") for line in lines)
    assert any(line.startswith("  FAIL  eager host") for line in lines)


def _full_grid() -> list[dict]:
    rows = []
    for heads in (16, 32, 64):
        for extra in (512, 2048):
            for batch in (1, 16, 32, 64, 80, 96, 128):
                point = _point(batch, heads, extra, 20.0, 40.0, 10.0)
                if heads < 64:
                    padded = [
                        {**_row(batch, heads, extra, "mma-padded", t, 30.0), "padded_heads": 64}
                        for t in TARGETS
                    ]
                    results.derive(point + padded, 4000.0)
                    point += padded
                rows += point
    return rows


def test_compact_record_of_the_full_default_grid_fits_and_keeps_every_point(tmp_path):
    bench = {
        "device": "NVIDIA H200",
        "capability": "9.0",
        "sms": 132,
        "copy_gbps": 4253.9,
        "time": "2027-01-05T10:11:12+0000",
        "results": _full_grid(),
        "skipped": [],
    }
    session = {"kind": "GPU session", "kit": {"label": "sm120pd.abc", "baseline_commit": "dc9"}}
    record = results.compact_record(bench, session)
    path = tmp_path / results.compact_name(record)
    size = results.write_compact(record, path)
    assert path.name == "20270105-1011-h200-sm120pd.abc.json"
    assert size <= results.COMPACT_LIMIT_BYTES and record["trimmed"] == []
    back = json.loads(path.read_text())
    assert len(back["points"]) == 42
    first = back["points"][0]
    assert first["phase"] == "first" and first["heads"] == 16
    columns = back["columns"]
    row = dict(zip(columns, first["rows"][1], strict=True))
    assert row["backend"] == "mma" and row["target"] == "auto"
    assert row["graph"] == 20.0 and row["graph_min"] == pytest.approx(19.6)
    assert row["grid"] == f"1x2x{first['batch']} 1x{first['batch']}x1"
    assert row["new_vs_main"] == 0.5 and row["over_gather"] == 2.0
    assert back["errors"] == {"flashinfer": "no flashinfer"}
    assert [v["status"] for v in back["targets"]][:1] == ["fail"]


def test_compact_record_trims_in_order_when_over_the_limit(monkeypatch):
    bench = {"device": "X", "results": _full_grid(), "skipped": []}
    full = len(json.dumps(results.compact_record(bench), separators=(",", ":")))
    monkeypatch.setattr(results, "COMPACT_LIMIT_BYTES", int(full * 0.7))
    record = results.compact_record(bench)
    assert record["trimmed"][0] == "mma-padded rows"
    assert len(json.dumps(record, separators=(",", ":"))) <= results.COMPACT_LIMIT_BYTES
    assert all(r[0] != "mma-padded" for p in record["points"] for r in p["rows"])
    monkeypatch.setattr(results, "COMPACT_LIMIT_BYTES", 5000)
    with pytest.raises(ValueError, match="over"):
        results.write_compact({"points": ["x" * 6000]}, "/dev/null")


_NCU_HEADER = (
    "ID,Process ID,Process Name,Host Name,Kernel Name,Context,Stream,Block Size,Grid Size,"
    "Device,CC,Section Name,Metric Name,Metric Unit,Metric Value"
).split(",")
_STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
_NCU_METRICS = [
    (0, "_split_kernel", "dram__bytes_read.sum", "byte", "25,165,824"),
    (0, "_split_kernel", "gpu__time_duration.sum", "nsecond", "21,504"),
    (0, "_split_kernel", _STALL.format("long_scoreboard"), "ratio", "12.5"),
    (0, "_split_kernel", _STALL.format("barrier"), "ratio", "3.25"),
    (0, "_split_kernel", _STALL.format("selected"), "ratio", "99"),
    (0, "_split_kernel", _STALL.format("wait"), "ratio", "1.0"),
    (0, "_split_kernel", _STALL.format("math_pipe_throttle"), "ratio", "0.5"),
    (1, "_combine_kernel", "gpu__time_duration.sum", "nsecond", "3,072"),
    (1, "_combine_kernel", "dram__bytes_read.sum", "byte", "1,048,576"),
]


def _ncu_log() -> str:
    """ncu's --csv --log-file output: its own lines around the details page, a row per metric."""
    buf = io.StringIO()
    writer = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writerow(_NCU_HEADER)
    for kernel_id, kernel, name, unit, value in _NCU_METRICS:
        launch = ["1", "7", "(128, 1, 1)", "(1, 4, 64)", "0", "9.0"]
        section = "Command line profiler metrics"
        metric = [section, name, unit, value]
        writer.writerow([kernel_id, 4242, "python3.12", "127.0.0.1", kernel, *launch, *metric])
    return (
        "==PROF== Connected to process 4242 (/usr/bin/python3.12)\n"
        + buf.getvalue()
        + "==PROF== Disconnected from process 4242\n"
    )


def test_ncu_details_csv_gives_each_kernel_its_duration_bytes_and_top_stalls():
    kernels = parse_details_csv(_ncu_log())
    assert [k["kernel"] for k in kernels] == ["_split_kernel", "_combine_kernel"]
    probe = {
        "batch": 64,
        "heads": 16,
        "swa": 128,
        "extra": 512,
        "backend": "mma",
        "target_ctas": "auto",
        "kv_bytes": 64 * 640 * 584,
        "index_bytes": 64 * 640 * 4,
        "launches": [{"kernel": "_split_kernel"}, {"kernel": "_combine_kernel"}],
    }
    (row,) = match_probes([probe], kernels)
    split, combine = row["kernels"]
    assert split["duration_us"] == pytest.approx(21.504) and combine["duration_us"] == 3.072
    assert split["dram_read_bytes"] == 25_165_824
    assert split["top_stalls"] == [["long_scoreboard", 12.5], ["barrier", 3.25], ["wait", 1.0]]
    assert row["dram_read_over_unique"] == pytest.approx(
        (25_165_824 + 1_048_576) / (64 * 640 * 588), abs=1e-3
    )
    assert "mismatch" not in row
    (short,) = match_probes([{**probe, "launches": probe["launches"] * 2}], kernels)
    assert "mismatch" in short


def test_summarize_gives_median_quartiles_and_extremes():
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median"], s["min"], s["max"], s["q1"], s["q3"], s["n"]) == (3, 1, 5, 2, 4, 5)
    assert summarize([7.0])["q3"] == 7.0


class _Meta:
    name = "_kernel"
    num_warps = 8


class _FakeDriver:
    """A Triton driver's one attribute the recorder uses: launcher_cls(src, metadata)."""

    def __init__(self):
        self.calls = []
        driver = self

        class Launcher:
            def __init__(self, src, metadata):
                self.src = src

            def __call__(self, *args):
                driver.calls.append(args)
                return "launched"

        self.launcher_cls = Launcher


def test_launch_recorder_records_while_recording_and_always_forwards():
    driver, recorder = _FakeDriver(), LaunchRecorder()
    recorder.install(driver)
    launch = driver.launcher_cls("src", _Meta())
    assert launch(2, 3, 4, "stream", "fn", "arg") == "launched"
    with recorder:
        launch(1, 8, 64, "stream", "fn", "arg")
    launch(5, 5, 5, "stream", "fn")
    assert recorder.launches == [{"kernel": "_kernel", "grid": [1, 8, 64], "warps": 8}]
    assert len(driver.calls) == 3 and driver.calls[1] == (1, 8, 64, "stream", "fn", "arg")


def test_split_log_reads_the_split_count_each_kernel_logs():
    log = SplitLog()
    logger = logging.getLogger("sm120pd_baseline.sm120_mma_splits")
    logger.info("%s: batch %d ... -> %d splits, %d CTAs", "KNOB=auto (unset)", 64, 4, 256)
    assert log.take_splits() == 4
    assert log.take_splits() is None
    log.close()
    logger.info("-> 3 splits")
    assert log.take_splits() is None


RESULTS = sorted((ROOT / "bench" / "kernel" / "results").glob("*.json"))


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_each_committed_result_is_a_compact_record_of_a_gpu_run(path):
    assert path.stat().st_size <= results.COMPACT_LIMIT_BYTES
    record = json.loads(path.read_text())
    assert record["schema"] == results.COMPACT_SCHEMA and record["kind"] == "GPU session"
    assert record["device"] and record["versions"]["torch"] and record["versions"]["triton"]
    assert record["kit"]["label"] and record["points"] and record["targets"]
    assert path.name == results.compact_name(record)
