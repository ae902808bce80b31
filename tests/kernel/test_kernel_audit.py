"""bench/kernel/audit: the mma kernel compiled for every target GPU, checked without a GPU.

The audit runs in a process of its own: it compiles (Triton's JIT for virtual devices), while
this test process runs Triton in interpreter mode (see conftest.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang.kernels.ops.attention import sm120_mma_fit as fit

ROOT = Path(__file__).resolve().parents[2]
AUDIT = ROOT / "bench" / "kernel" / "audit.py"
STAGE1 = "_sparse_decode_split_kernel"
SM12X = ("rtx-pro-6000", "rtx-5090", "dgx-spark")
KEY_SHAPE = ["--heads", "16", "--batch", "64", "--extra", "c4-512", "--sink", "on"]


def _audit(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "audit.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(AUDIT), *args, "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    return done, (json.loads(out.read_text()) if out.exists() else None)


@pytest.fixture(scope="module")
def full_audit(tmp_path_factory):
    """The audit with no arguments: every target and every DSV4 decode shape."""
    done, doc = _audit(tmp_path_factory.mktemp("audit"))
    assert doc is not None, done.stdout[-3000:] + done.stderr[-3000:]
    return done, doc


def _stage1(result: dict) -> list[dict]:
    return [k for k in result["kernels"] if k["kernel"] == STAGE1]


def _result(doc: dict, key: str) -> dict:
    (result,) = [r for r in doc["results"] if r["target"]["key"] == key]
    return result


def test_every_dsv4_shape_loads_on_every_target(full_audit):
    done, doc = full_audit
    assert done.returncode == 0, done.stdout[-4000:]
    assert doc["findings"] == []
    assert {r["target"]["key"] for r in doc["results"]} == {*SM12X, "h200"}
    for result in doc["results"]:
        shapes = result["shapes"]
        # 5 head counts x 10 batch sizes x 4 extra lists x sink on/off x lengths on/off.
        assert len(shapes) == 800
        assert [s for s in shapes if "error" in s] == []
        assert all(1 <= s["ctas"] <= s["units"] for s in shapes)


def test_no_kernel_spills_on_any_target(full_audit):
    for result in full_audit[1]["results"]:
        for k in result["kernels"]:
            assert (k["local_bytes"], k["spill_stores"], k["spill_loads"]) == (0, 0, 0), k


def test_stage1_runs_on_tensor_cores_and_loads_scales_a_word_per_token(full_audit):
    for result in full_audit[1]["results"]:
        for k in _stage1(result):
            assert k["tensor_core_ops"] > 0, k
            assert k["global_loads_u8"] == 0, k
            assert k["global_loads_128"] > 0, k


def test_sm120_and_sm121_get_prefetched_32_row_tiles_one_cta_per_sm(full_audit):
    for key in SM12X:
        result = _result(full_audit[1], key)
        cfg = result["config"]
        assert (cfg["block_t"], cfg["prefetch"], cfg["ctas_per_sm"]) == (32, 1, 1)
        assert {k["ctas_per_sm"] for k in _stage1(result)} == {1}
        for k in _stage1(result):
            assert k["variant"]["PREFETCH"] == 1 and k["variant"]["BLOCK_T"] == 32
            assert k["shared_bytes"] <= k["shared_limit"]
            # The tile being waited for and the next one: 2 x 32 rows x 584 bytes per SM.
            assert k["tile_bytes_in_flight_per_sm"] == 2 * 32 * 584


def test_stage1_shared_memory_is_what_the_configuration_models(full_audit):
    for result in full_audit[1]["results"]:
        for k in _stage1(result):
            model = fit.stage1_shared_model(k["variant"]["BLOCK_H"], k["variant"]["BLOCK_T"])
            assert k["shared_bytes"] == model


def test_stage1_issues_each_mma_of_a_tile_once(full_audit):
    # The tile loop's tensor-core instructions, counted in the SASS, against the tile's
    # minimum: 16 heads x 32 rows x 512 scores and 16 x 512 x 32 for P.V, as m16n8k16.
    assert fit_minimum(16, 32) == 4 * 32 + 64 * 2
    for result in full_audit[1]["results"]:
        for k in _stage1(result):
            assert k["mma_per_tile"] == k["mma_minimum_per_tile"], k
            assert k["mma_ratio"] == 1.0


def fit_minimum(block_h: int, block_t: int) -> int:
    from bench.kernel.audit import mma_minimum_per_tile

    return mma_minimum_per_tile(block_h, block_t)


def test_auto_fills_the_last_wave_from_b16_to_b128_wherever_the_call_has_the_tiles(full_audit):
    # The compiled occupancy on every target: at least 90% of the last wave's slots busy for
    # every batch from 16 to 128 whose call has a tile for every slot.
    checked = 0
    for result in full_audit[1]["results"]:
        for rec in result["shapes"]:
            if 16 <= rec["batch"] <= 128 and rec["units"] >= rec["slots"]:
                assert rec["fill"] >= 0.9, (result["target"]["key"], rec)
                checked += 1
    assert checked > 500


def test_explicit_target_ctas_keeps_its_meaning(tmp_path):
    done, doc = _audit(
        tmp_path, "--targets", "rtx-pro-6000,dgx-spark", *KEY_SHAPE, "--target-ctas", "512"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for result in doc["results"]:
        (rec,) = [s for s in result["shapes"] if s["lengths"]]
        # 512 CTAs share the 64 requests x 20 32-row tiles.
        assert rec["ctas"] == 512 and rec["units"] == 64 * 20


def test_compare_audits_older_revisions_side_by_side(tmp_path):
    # The split-K kernel before the redesign issued 2.5 times a tile's MMA; the audited one,
    # exactly the minimum.
    done, doc = _audit(
        tmp_path, "--targets", "rtx-pro-6000", *KEY_SHAPE, "--lengths", "on", "--compare", "dc905b5"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "stage 1 side by side" in done.stdout
    (old,) = doc["compared"]
    assert old["revision"] == "dc905b5"
    (old_stage1,) = _stage1(old)
    assert old_stage1["mma_ratio"] == 2.5
    (new_stage1,) = _stage1(doc["results"][0])
    assert new_stage1["mma_ratio"] == 1.0


def test_audit_fails_a_kernel_that_does_not_fit_sm120(tmp_path):
    # A configuration whose tile cannot fit: 128-row tiles need 151,552 B of shared memory.
    source = Path(fit.__file__).read_text()
    for old, new in (("(32, 1, 1),", "(128, 1, 1),"), ("(16, 1, 1),", "")):
        assert old in source
        source = source.replace(old, new)
    kernel_dir = tmp_path / "kernel"
    kernel_dir.mkdir()
    (kernel_dir / "sm120_mma_fit.py").write_text(source)
    done, doc = _audit(
        tmp_path,
        "--targets",
        "rtx-pro-6000",
        *KEY_SHAPE,
        "--lengths",
        "on",
        "--kernel-dir",
        str(kernel_dir),
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "does not load: OutOfResources" in done.stdout
    (rec,) = doc["results"][0]["shapes"]
    assert rec["failed_kernel"]["shared_bytes"] > fit.limits_for_arch(120).max_shared_per_block


def test_audit_refuses_unknown_targets(tmp_path):
    done, _ = _audit(tmp_path, "--targets", "rtx-4090")
    assert done.returncode == 2
    assert "unknown" in done.stderr and "rtx-pro-6000" in done.stderr


def test_traffic_model_prices_the_padded_query_patch_0005_removed(full_audit):
    result = _result(full_audit[1], "rtx-pro-6000")
    by_heads = {
        s["heads"]: s
        for s in result["shapes"]
        if (s["batch"], s["extra"], s["sink"], s["lengths"]) == (64, "c4-512", True, True)
    }
    # 64 requests x 640 tokens x 584 bytes, gathered once per head block.
    native_kv = 64 * 640 * 584
    assert by_heads[16]["kv_bytes"] == native_kv
    assert by_heads[8]["kv_bytes"] == native_kv
    assert by_heads[32]["kv_bytes"] == 2 * native_kv
    for heads in (8, 16, 32):
        rec = by_heads[heads]
        assert rec["padded_heads"] == 64 and rec["padded_head_blocks"] == 4
        assert rec["padded_kv_bytes"] == 4 * native_kv
        assert rec["padded_mma_bytes"] > rec["mma_bytes"]
    assert "padded_heads" not in by_heads[64] and "padded_heads" not in by_heads[128]
