"""bench/ab records the router's own decisions: on the sim stack with the real smg router, at a
concurrency above decode's running window, each run's JSON and report.md carry smg's counts,
whose names are checked against the installed smg (its live /metrics and its binary). A router
made to shed for real (overload thresholds at one waiting request) shows each shed in the run it
happened in, equal to the errors that run's clients saw and, summed, to smg's own total. Arms
whose routers would run with different settings are refused before anything starts.

smg's PD admission window (`smg_pd_admission_waits_total`, `smg_pd_admission_sheds_total`) gates
gRPC PD dispatches only (smg's docs, "PD Decode Admission Window"; smg_pd_admission_window reads
2 here and no dispatch ever waits): on these HTTP stacks those two stay at 0."""

from __future__ import annotations

import contextlib
import json
import shutil
import urllib.request
from pathlib import Path

from bench_harness import ROOT, TINY_AB_LOAD, SimStack, run_tool, set_env_values
from prometheus_client.parser import text_string_to_metric_families

from bench.lib import router_counters
from launch.pdlib.envfiles import EnvDir, parse_file

WINDOW = 2
CONCURRENCY = 16
ROUTER_ARGS = (
    "--policy round_robin --health-check-interval-secs 1 --worker-startup-check-interval 1 "
    "--shutdown-grace-period-secs 1 --load-monitor-interval 1"
)
NARROW_DECODE = {
    "DECODE_ARGS": f'"--max-running-requests {WINDOW}"',
    "PD_SIM_DECODE_STEP_BASE_S": "0.02",
}
AB = ["--concurrency", str(CONCURRENCY), *TINY_AB_LOAD, "--output-tokens", "20"]


@contextlib.contextmanager
def _stack(tmp, router_args: str):
    stack = SimStack(tmp, NARROW_DECODE)
    set_env_values(stack.env / "router.env", ROUTER_ARGS=f'"{router_args}"')
    try:
        up = stack.pd("up")
        assert up.returncode == 0, up.stdout + up.stderr
        common = EnvDir(stack.env).common()
        yield (
            f"http://127.0.0.1:{common['ROUTER_PORT']}",
            f"http://127.0.0.1:{common['ROUTER_PROMETHEUS_PORT']}/metrics",
        )
    finally:
        try:
            stack.pd("down", timeout_s=60)
        finally:
            stack.kill_leftovers()


def _live(metrics_url: str, name: str) -> float:
    """A counter's total as smg itself exports it (the reference for what bench/ab recorded)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        samples = [s.value for s in family.samples if s.name == name]
        if samples:
            return sum(samples)
    raise AssertionError(f"{name} is not on smg's /metrics:\n{text[:2000]}")


def _ab(router: str, metrics: str, out, *extra: str):
    return run_tool(
        "bench/ab",
        "--url-a",
        router,
        "--url-b",
        router,
        "--router-metrics-a",
        metrics,
        "--router-metrics-b",
        metrics,
        *AB,
        *extra,
        "--out",
        str(out),
        timeout_s=120,
    )


def _smg_binary_strings() -> str:
    import smg

    so = next(Path(smg.__file__).parent.glob("smg_rs*.so"))
    return so.read_bytes().decode("latin-1")


def test_router_counts_above_decodes_window_are_in_the_trial_json_and_report(tmp_path):
    with _stack(tmp_path, ROUTER_ARGS) as (router, metrics):
        before = _live(metrics, "smg_http_requests_total")
        result = _ab(router, metrics, tmp_path / "ab", "--trials", "2")
        after = _live(metrics, "smg_http_requests_total")
        with urllib.request.urlopen(metrics, timeout=10) as resp:
            live = resp.read().decode()
    assert result.returncode == 0, result.stdout + result.stderr
    assert after > before
    # Every counter bench/ab sums is one the installed smg knows: on its live /metrics, or (for
    # the families smg registers at their first event) named in its binary.
    binary = _smg_binary_strings()
    for names in router_counters.COUNTERS.values():
        for name in names:
            assert name in live or name in binary, name
    runs = json.loads((tmp_path / "ab" / "summary.json").read_text())["runs"]
    assert len(runs) == 4
    for run in runs:
        router = run["router"]
        assert router["read"] and not router["reset"], router
        assert set(router["counts"]) >= set(router_counters.COUNTERS)
        assert run["errors"] == 0 and router["counts"][router_counters.HTTP_ERRORS] == 0
        assert router["flags"] == []
    report = (tmp_path / "ab" / "report.md").read_text()
    assert "## Router decisions per run" in report
    lines = report.splitlines()
    header = next(ln for ln in lines if ln.startswith("| C | arm | trial |"))
    assert "adm. waits" in header and "retries" in header and "CB transitions" in header
    assert sum(ln.startswith(f"| {CONCURRENCY} | ") for ln in lines) == 4 + 2  # + the C tables
    assert "### Runs in which the router shed" not in report


def _live_sheds(metrics_url: str) -> float:
    """smg's own count of overload sheds at selection, from its /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "smg_worker_overload_shed_total" and s.labels["stage"] == "selection":
                return s.value
    raise AssertionError(f"no selection-stage overload shed count on smg's /metrics:\n{text}")


def test_an_arm_whose_router_sheds_shows_each_shed_in_its_runs(tmp_path):
    """smg made to shed for real: decode's queue at or above one waiting request counts as
    overloaded (`--worker-overload-waiting-requests 1 --worker-overload-shed`), and 4 x C
    requests at C=16 against a running window of 2 fill that queue by smg's first load poll.
    Each run's shed count must equal the errors its own clients saw, and their sum smg's own
    /metrics total over the A/B; the report names the runs."""
    shedding = ROUTER_ARGS + " --worker-overload-waiting-requests 1 --worker-overload-shed"
    with _stack(tmp_path, shedding) as (router, metrics):
        before = _live_sheds(metrics)
        result = _ab(router, metrics, tmp_path / "ab", "--trials", "1", "--requests-per-c", "4",
                     "--warmup", "0")  # fmt: skip
        after = _live_sheds(metrics)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = json.loads((tmp_path / "ab" / "summary.json").read_text())["runs"]
    assert len(runs) == 2
    for run in runs:
        counts = run["router"]["counts"]
        assert run["errors"] > 0, run
        assert counts["overload_sheds"] == run["errors"], (counts, run["errors"])
        assert counts[router_counters.HTTP_ERRORS] == run["errors"], counts
        assert counts["retries"] == 0  # a shed is never retried by smg
    assert sum(r["router"]["counts"]["overload_sheds"] for r in runs) == after - before > 0
    report = (tmp_path / "ab" / "report.md").read_text()
    assert "### Runs in which the router shed" in report, report


def test_arms_whose_routers_would_differ_are_refused_naming_the_flag(tmp_path):
    env = tmp_path / "env"
    shutil.copytree(ROOT / "env", env, ignore=shutil.ignore_patterns("ab", "cpu*"))
    b = tmp_path / "B.env"
    base = {ln.key: ln.value for ln in parse_file(env / "router.env")}["ROUTER_ARGS"]
    b.write_text(
        (ROOT / "env" / "ab" / "B.env").read_text()
        + f'ROUTER_ARGS="{base} --worker-overload-shed"\n'
    )
    out = tmp_path / "ab"
    result = run_tool(
        "bench/ab",
        "--a",
        str(ROOT / "env" / "ab" / "A.env"),
        "--b",
        str(b),
        "--env-dir",
        str(env),
        "--sim",
        *AB,
        "--out",
        str(out),
        timeout_s=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "different routing settings" in result.stderr
    assert "--worker-overload-shed: A False, B True" in result.stderr
    # Refused before anything started: no trial ran and no router was started.
    assert not (out / "summary.json").exists()
