"""End to end on the simulated PD stack with the real smg router (launch/pd --sim).

Reproduces the reference incident on loopback: through bench/proxy --stall-after 2 the
multiround client misses its deadline and triage blames the connection layer, while the same
client straight to the router passes 24/24.
"""

import json
import shutil

import pytest
from conftest import ROOT, free_port, run_tool

PD = ROOT / "launch" / "pd"
ENV = ROOT / "env"
pytestmark = pytest.mark.skipif(
    not (PD.exists() and (ENV / "ab" / "B.env").exists()),
    reason="needs launch/pd and env/ from the launch work, not in this tree yet",
)
SMALL = ["--deadline-s", "5", "--max-tokens", "8", "--first-words", "40", "--turn-words", "10"]


def _pd(verb, env_dir, timeout_s=180):
    return run_tool(str(PD), verb, "--sim", "--env-dir", str(env_dir), timeout_s=timeout_s)


@pytest.fixture(scope="module")
def sim_env(tmp_path_factory):
    """A copy of env/ on free ports, with the sim stack up; torn down after the module."""
    env_dir = tmp_path_factory.mktemp("sim") / "env"
    shutil.copytree(ENV, env_dir)
    for path in env_dir.glob("*.env"):
        lines = []
        for line in path.read_text().splitlines():
            key = line.partition("=")[0].strip()
            if key.endswith("_PORT") and not line.startswith("#"):
                line = f"{key}={free_port()}"
            lines.append(line)
        path.write_text("\n".join(lines) + "\n")
    up = _pd("up", env_dir)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield env_dir
    finally:
        _pd("down", env_dir)


def _router(env_dir):
    from bench.lib.stack import stack_from_env_dir

    return stack_from_env_dir(env_dir).router_url


def test_multiround_direct_to_router_passes_every_round(sim_env):
    result = run_tool("bench/multiround", "--url", _router(sim_env), *SMALL, timeout_s=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "24/24 rounds ok"


def test_stalled_proxy_is_blamed_on_the_connection_layer(sim_env, fault_proxy):
    proxy = fault_proxy(_router(sim_env), "--stall-after", "2")
    result = run_tool(
        "bench/multiround", "--url", proxy, "--env-dir", str(sim_env), *SMALL, timeout_s=120
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no answer within the 5 s deadline, connection reused" in result.stdout
    assert "triage verdict: connection layer between client and router" in result.stdout
    assert "running 0 -> 0" in result.stdout


def test_ab_co_restart_verifies_the_knob_per_trial(sim_env, tmp_path):
    out = tmp_path / "ab"
    result = run_tool(
        "bench/ab",
        "--a",
        str(ENV / "ab" / "A.env"),
        "--b",
        str(ENV / "ab" / "B.env"),
        "--env-dir",
        str(sim_env),
        "--sim",
        "--concurrency",
        "64,80,96",
        "--trials",
        "2",
        "--requests-per-c",
        "1",
        "--input-words",
        "8",
        "--output-tokens",
        "4",
        "--warmup",
        "1",
        "--no-progress",
        "--out",
        str(out),
        timeout_s=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert {r["concurrency"] for r in summary["runs"]} == {64, 80, 96}
    assert all(r["knob"]["required"] and r["knob"]["verified"] for r in summary["runs"])
    assert (out / "throughput.png").exists() and (out / "tpot.png").exists()
