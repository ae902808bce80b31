"""End to end on the simulated PD stack with the real smg router (launch/pd --sim).

Reproduces the reference incident on loopback: through bench/proxy --stall-after 2 the
multiround client misses its deadline and triage blames the connection layer, while the same
client straight to the router passes 24/24.
"""

import json
import subprocess
from importlib.metadata import PackageNotFoundError, distribution

import pytest
from bench_harness import PD, ROOT, TINY_AB_LOAD, run_tool

from bench.lib.stack import stack_from_env_dir

DEADLINE_S = 3
SMALL = ["--max-tokens", "8", "--first-words", "40", "--turn-words", "10"]
TINY_AB = ["--concurrency", "4,8", "--trials", "2", *TINY_AB_LOAD]


def _patched_manifest() -> str | None:
    try:
        return distribution("sglang").read_text("sm120pd_manifest.json")
    except PackageNotFoundError:
        return None


def test_multiround_direct_to_router_passes_every_round(sim_stack):
    router = stack_from_env_dir(sim_stack.env).router_url
    result = run_tool(
        "bench/multiround", "--url", router, "--deadline-s", "20", *SMALL, timeout_s=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "24/24 rounds ok"


def test_stalled_proxy_is_blamed_on_the_connection_layer(sim_stack, fault_proxy):
    proxy = fault_proxy(stack_from_env_dir(sim_stack.env).router_url, "--stall-after", "2")
    result = run_tool(
        "bench/multiround",
        "--url",
        proxy,
        "--env-dir",
        str(sim_stack.env),
        "--deadline-s",
        str(DEADLINE_S),
        *SMALL,
        timeout_s=60,
    )
    print(result.stdout)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"no answer within the {DEADLINE_S} s deadline, connection reused" in result.stdout
    assert "triage verdict: connection layer between client and router" in result.stdout
    assert "running 0 -> 0" in result.stdout


def test_ab_url_mode_against_the_sim_router(sim_stack, tmp_path):
    router = stack_from_env_dir(sim_stack.env).router_url
    out = tmp_path / "ab"
    result = run_tool(
        "bench/ab",
        "--url-a",
        router,
        "--url-b",
        router,
        *TINY_AB,
        "--out",
        str(out),
        timeout_s=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    runs = {(r["arm"], r["trial"], r["concurrency"]) for r in summary["runs"]}
    assert runs == {(a, t, c) for a in "AB" for t in (1, 2) for c in (4, 8)}
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * (4 + 8)
    assert all(json.loads(line)["success"] for line in lines)


@pytest.mark.skipif(
    not _patched_manifest(),
    reason="co-restart ends with launch/pd verify, whose patched-build check needs the "
    "patched sglang wheel (no sm120pd_manifest.json in the installed sglang)",
)
def test_ab_co_restart_verifies_the_knob_per_trial(sim_stack):
    """The issue's A/B: two sim arms at the default C64/C80/C96, arms alternating over two
    trials, each trial co-restarting the stack and verifying its knob live in decode."""
    # Inside the stack's tmp dir, so the leftover sweep also finds processes started from the
    # arms' env copies.
    out = sim_stack.tmp / "ab-co-restart"
    result = run_tool(
        "bench/ab",
        "--a",
        str(ROOT / "env" / "ab" / "A.env"),
        "--b",
        str(ROOT / "env" / "ab" / "B.env"),
        "--env-dir",
        str(sim_stack.env),
        "--sim",
        # No --concurrency: the defaults are the 64, 80 and 96.
        "--trials",
        "2",
        *TINY_AB_LOAD,
        "--out",
        str(out),
        timeout_s=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert {(r["arm"], r["trial"], r["concurrency"]) for r in runs} == {
        (a, t, c) for a in "AB" for t in (1, 2) for c in (64, 80, 96)
    }
    # A B A B: each trial's arm starts after the other arm's previous trial.
    order = []
    for r in runs:
        if not order or order[-1] != (r["arm"], r["trial"]):
            order.append((r["arm"], r["trial"]))
    assert order == [("A", 1), ("B", 1), ("A", 2), ("B", 2)]
    assert all(r["knob"]["required"] and r["knob"]["verified"] for r in runs)
    keys = {r["arm"]: r["knob"]["keys"] for r in runs}
    assert keys["A"]["SGLANG_SM120_MMA_TARGET_CTAS"] == "auto"
    assert keys["B"]["SGLANG_SM120_MMA_TARGET_CTAS"] == "512"
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * (64 + 80 + 96)
    assert all(json.loads(line)["success"] for line in lines)

    report = (out / "report.md").read_text()
    for c in (64, 80, 96):
        row = next(ln for ln in report.splitlines() if ln.startswith(f"| {c} |"))
        assert any(v in row for v in ("B faster", "no detectable difference", "B slower")), row
    assert "## Deltas refused" not in report
    for png in ("throughput.png", "tpot.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _wait_router_healthy(router: str, timeout_s: float = 30) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(router + "/workers", timeout=5) as resp:
            workers = json.loads(resp.read())["workers"]
        if all(w["is_healthy"] for w in workers):
            return
        assert time.monotonic() < deadline, f"the router still lists {workers}"
        time.sleep(0.5)


def _frozen(stack, *roles):
    """SIGSTOP each role's process group (as launch/pd runs it) until the block ends."""
    import contextlib
    import os
    import signal

    @contextlib.contextmanager
    def frozen():
        groups = [json.loads((stack.run_dir / f"{r}.pid").read_text())["pid"] for r in roles]
        for pid in groups:
            os.killpg(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in groups:
                os.killpg(pid, signal.SIGCONT)

    return frozen()


def test_a_frozen_prefill_is_named_by_multiround_triage_and_nothing_answering_is_inconclusive(
    sim_stack,
):
    urls = stack_from_env_dir(sim_stack.env)
    with _frozen(sim_stack, "prefill"):
        result = run_tool(
            "bench/multiround",
            "--url",
            urls.router_url,
            "--env-dir",
            str(sim_stack.env),
            "--deadline-s",
            str(DEADLINE_S),
            "--sessions",
            "1",
            "--rounds",
            "2",
            *SMALL,
            timeout_s=90,
        )
    out = result.stdout
    print(out)
    assert result.returncode == 1, out + result.stderr
    assert "triage verdict: engine unresponsive" in out, out
    assert (
        f"because: prefill ({urls.prefill_url}) did not answer: /metrics: no answer within "
        f"{DEADLINE_S} s; /health: no answer within {DEADLINE_S} s; decode answered"
    ) in out, out
    assert "the router says:\n  - prefill: listed " in out, out

    with _frozen(sim_stack, "prefill", "decode", "router"):
        result = run_tool(
            "bench/triage",
            "--url",
            urls.router_url,
            "--env-dir",
            str(sim_stack.env),
            "--probe-timeout-s",
            "2",
            timeout_s=60,
        )
        probe = subprocess.run(
            [str(PD), "probe", "--sim", "--env-dir", str(sim_stack.env), "--probe-timeout", "2"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert probe.returncode == 1, probe.stdout + probe.stderr
    assert (
        "verdict: inconclusive: nothing in the stack answered, the router included: prefill ("
    ) in probe.stdout, probe.stdout
    out = result.stdout
    print(out, probe.stdout, sep="\n")
    assert result.returncode == 3, out + result.stderr
    assert "triage verdict: inconclusive" in out
    assert "because: nothing in the stack answered, the router included: prefill (" in out
    assert "  - nothing about its workers: GET /workers: no answer within 2 s" in out, out

    # Thawed, the stack serves again once the router's health checks see every worker back.
    _wait_router_healthy(urls.router_url)
    result = run_tool(
        "bench/multiround", "--url", urls.router_url, "--deadline-s", "20", *SMALL, timeout_s=90
    )
    assert result.returncode == 0, result.stdout + result.stderr
