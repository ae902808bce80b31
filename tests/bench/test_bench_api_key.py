"""API keys: the bench tools send `Authorization: Bearer KEY`, and never print the key.

The end-to-end half runs against a sim stack launched with API_KEY set, so the real smg router
(started with --api-key) is what rejects a request without the header.
"""

import json
import urllib.error
import urllib.request

import pytest
from bench_harness import TINY_AB_LOAD, copy_env_dir, env_with_api_key, run_tool, sim_stack_up

from bench.lib.client import REDACTED, auth_headers, redact, resolve_api_key
from bench.lib.stack import stack_from_env_dir

KEY = "bench-test-key-7f3a"
ROUND = ["--sessions", "1", "--rounds", "2", "--max-tokens", "4", "--first-words", "8"]
ROUND += ["--turn-words", "4", "--deadline-s", "10"]


def test_key_comes_from_the_flag_then_the_env_dir_then_the_environment(tmp_path, monkeypatch):
    keyed = copy_env_dir(tmp_path / "keyed", API_KEY="from-env-dir")
    unkeyed = copy_env_dir(tmp_path / "unkeyed", API_KEY="")
    monkeypatch.setenv("API_KEY", "from-environment")
    assert resolve_api_key("from-flag", keyed) == "from-flag"
    assert resolve_api_key("", keyed) == ""  # an explicit empty key sends none
    assert resolve_api_key(None, keyed) == "from-env-dir"
    assert resolve_api_key(None, unkeyed) == "from-environment"
    assert resolve_api_key(None, None) == "from-environment"
    assert resolve_api_key(None, tmp_path / "missing") == "from-environment"
    monkeypatch.delenv("API_KEY")
    assert resolve_api_key(None, unkeyed) == ""
    assert auth_headers("") == {}
    assert auth_headers("k") == {"Authorization": "Bearer k"}
    assert redact("echo k1 k1", "k1") == f"echo {REDACTED} {REDACTED}"


@pytest.fixture(scope="module")
def keyed_stack(tmp_path_factory):
    with sim_stack_up(tmp_path_factory.mktemp("keyed"), api_key=KEY) as stack:
        yield stack


def _no_key_printed(result):
    assert KEY not in result.stdout + result.stderr


def test_router_rejects_the_client_without_the_header(keyed_stack):
    router = stack_from_env_dir(keyed_stack.env).router_url
    result = run_tool(
        "bench/multiround", "--url", router, *ROUND, "--api-key", "", env=env_with_api_key(None)
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "error after" in result.stdout and "HTTP 401" in result.stdout
    assert result.stdout.splitlines()[-1] == "0/2 rounds ok"


@pytest.mark.parametrize("source", ["environment", "env-dir", "flag"])
def test_multiround_sends_the_key_from_each_source(keyed_stack, source):
    router = stack_from_env_dir(keyed_stack.env).router_url
    extra = {"env-dir": ["--env-dir", str(keyed_stack.env)], "flag": ["--api-key", KEY]}
    env = env_with_api_key(KEY if source == "environment" else None)
    result = run_tool("bench/multiround", "--url", router, *ROUND, *extra.get(source, []), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "2/2 rounds ok"
    _no_key_printed(result)


def test_triage_probes_with_the_key_of_the_env_dir(keyed_stack):
    router = stack_from_env_dir(keyed_stack.env).router_url
    common = ["bench/triage", "--url", router, "--env-dir", str(keyed_stack.env), "--json"]
    ok = run_tool(*common, env=env_with_api_key(None))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    verdict = json.loads(ok.stdout)
    assert all(p["ok"] for p in verdict["measurements"]["probes"]), verdict
    _no_key_printed(ok)
    # The same probe without the key is refused, so the engines-idle verdict has no fast answer.
    refused = run_tool(*common, "--api-key", "", env=env_with_api_key(None))
    assert refused.returncode == 3, refused.stdout + refused.stderr
    probes = json.loads(refused.stdout)["measurements"]["probes"]
    assert probes and all(not p["ok"] and "HTTP 401" in p["error"] for p in probes), probes


def test_ab_sends_the_key_and_records_only_that_it_did(keyed_stack, tmp_path):
    router = stack_from_env_dir(keyed_stack.env).router_url
    out = tmp_path / "ab"
    result = run_tool(
        "bench/ab",
        "--url-a",
        router,
        "--url-b",
        router,
        "--concurrency",
        "2",
        "--trials",
        "1",
        *TINY_AB_LOAD,
        # No env dir to read a key from (not even env/): the key comes from $API_KEY alone.
        "--env-dir",
        str(tmp_path / "none"),
        "--out",
        str(out),
        env=env_with_api_key(KEY),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [r["api_key_sent"] for r in summary["runs"]] == [True, True]
    assert all(r["errors"] == 0 for r in summary["runs"])
    _no_key_printed(result)
    for path in out.iterdir():
        if path.suffix in (".json", ".jsonl", ".md"):
            assert KEY not in path.read_text(), path


def test_bench_serving_check_gives_both_clients_the_key(keyed_stack):
    router = stack_from_env_dir(keyed_stack.env).router_url
    small = ["--concurrency", "4", "--requests", "8", "--input-len", "8", "--output-tokens", "4"]
    result = run_tool(
        "bench/bench_serving_check.py",
        "--url",
        router,
        *small,
        env=env_with_api_key(KEY),
        timeout_s=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "API key sent" in result.stdout
    # bench_serving completed every request (errors 0), which the router allows only with the key.
    summary = [
        ln for ln in result.stdout.splitlines() if ln.startswith("  sglang.benchmark.serving")
    ]
    assert summary and summary[0].endswith("errors 0"), result.stdout
    _no_key_printed(result)
    refused = run_tool(
        "bench/bench_serving_check.py", "--url", router, *small, env=env_with_api_key(None)
    )
    assert refused.returncode != 0
    assert "warm-up failed" in refused.stderr + refused.stdout and "401" in refused.stderr


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sim_engines_guard_the_routes_a_real_server_guards(keyed_stack, role):
    stack = stack_from_env_dir(keyed_stack.env)
    base = stack.prefill_url if role == "prefill" else stack.decode_url

    def status(path: str, key: str | None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        request = urllib.request.Request(base + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                return reply.status
        except urllib.error.HTTPError as exc:
            return exc.code

    for path in ("/server_info", "/get_model_info", "/v1/models", "/v1/loads", "/get_load"):
        assert status(path, None) == 401, path
        assert status(path, "wrong-key") == 401, path
        assert status(path, KEY) == 200, path
    # Left open for probes and scraping, as SGLang leaves them.
    for path in ("/health", "/health_generate", "/metrics"):
        assert status(path, None) == 200, path
