import json

from bench_harness import TINY_AB_LOAD, run_tool

TINY = ["--trials", "2", *TINY_AB_LOAD]


def test_url_mode_reports_both_arms_at_each_concurrency(fake_engine, tmp_path):
    fast, slow = fake_engine(token_ms=1), fake_engine(token_ms=5)
    out = tmp_path / "ab"
    result = run_tool(
        "bench/ab",
        "--url-a",
        fast,
        "--url-b",
        slow,
        "--concurrency",
        "64,80,96",
        *TINY,
        "--out",
        str(out),
        timeout_s=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    runs = {(r["arm"], r["trial"], r["concurrency"]) for r in summary["runs"]}
    assert runs == {(a, t, c) for a in "AB" for t in (1, 2) for c in (64, 80, 96)}
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * (64 + 80 + 96)
    assert all(json.loads(line)["success"] for line in lines)
    for c in (64, 80, 96):
        assert any(line.startswith(f"| {c} |") for line in result.stdout.splitlines())
    assert "no knob was applied or verified" in result.stdout
    assert (out / "throughput.png").stat().st_size > 0 and (out / "tpot.png").stat().st_size > 0


def test_ab_rejects_mixed_or_incomplete_arms(tmp_path):
    result = run_tool("bench/ab", "--url-a", "http://127.0.0.1:1")
    assert result.returncode == 2 and "--url-a and --url-b go together" in result.stderr
    result = run_tool("bench/ab", "--a", str(tmp_path / "missing.env"), "--b", "x.env")
    assert result.returncode == 2 and "no such file" in result.stderr
    result = run_tool("bench/ab", "--url-a", "u", "--url-b", "v", "--concurrency", "64,x")
    assert result.returncode == 2 and "comma-separated" in result.stderr
