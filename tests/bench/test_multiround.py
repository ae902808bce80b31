import json
import threading
import urllib.request

from bench_harness import run_tool

SMALL = ["--deadline-s", "2", "--max-tokens", "8", "--first-words", "20", "--turn-words", "5"]


def test_direct_sessions_reuse_their_connection_and_pass_every_round(fake_engine):
    result = run_tool("bench/multiround", "--url", fake_engine(), *SMALL)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "24/24 rounds ok"
    assert sum("connection new" in line for line in lines) == 4
    assert sum("connection reused" in line for line in lines) == 20
    # Context grows each round: the prompt of round 2 is longer than round 1's.
    r1 = next(line for line in lines if line.startswith("session 1 round 1:"))
    r2 = next(line for line in lines if line.startswith("session 1 round 2:"))
    tokens = lambda line: int(line.split("prompt ")[1].split()[0])  # noqa: E731
    assert tokens(r2) > tokens(r1)


def test_stalled_keepalive_connection_misses_deadline_and_triage_blames_connection(
    fake_engine, fault_proxy
):
    engine = fake_engine()
    proxy = fault_proxy(engine, "--stall-after", "2")
    result = run_tool(
        "bench/multiround",
        "--url",
        proxy,
        "--router-url",
        engine,
        "--prefill-url",
        engine,
        "--decode-url",
        engine,
        *SMALL,
        timeout_s=30,
    )
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "no answer within the 2 s deadline, connection reused" in out
    assert "triage verdict: connection layer between client and router" in out
    assert "over a fresh connection" in out
    assert out.splitlines()[-1] == "8/24 rounds ok"


def test_multiround_rejects_bad_arguments():
    result = run_tool("bench/multiround", "--url", "http://127.0.0.1:1", "--sessions", "0")
    assert result.returncode == 2 and "whole number >= 1" in result.stderr
    result = run_tool(
        "bench/multiround", "--url", "http://127.0.0.1:1", "--env-dir", "/nonexistent"
    )
    assert result.returncode == 2 and "not a directory" in result.stderr


def _other_clients(url: str, n: int, tokens: int) -> list[threading.Thread]:
    """n streaming requests of `tokens` tokens each from other clients, in threads (bounded by
    their own timeout; they end with the engine at the fixture's teardown at the latest)."""

    def one():
        body = {"messages": [{"role": "user", "content": "other client"}], "max_tokens": tokens}
        request = urllib.request.Request(
            url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                resp.read()
        except OSError:
            pass  # the engine stopped first

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for thread in threads:
        thread.start()
    return threads


def test_slow_decode_is_called_engine_saturated_not_connection(fake_engine):
    engine = fake_engine(token_ms=600)
    # A saturated engine is busy with other clients' requests too. Without them the engine
    # drains as soon as multiround gives up on its own, and a triage that starts late (a loaded
    # machine) finds it idle: "inconclusive", seen once in a parallel CI run.
    others = _other_clients(engine, 2, 40)
    result = run_tool(
        "bench/multiround",
        "--url",
        engine,
        "--prefill-url",
        engine,
        "--decode-url",
        engine,
        *SMALL,
        timeout_s=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "triage verdict: engine saturated" in result.stdout, result.stdout
    assert "connection layer" not in result.stdout
    assert all(thread.is_alive() for thread in others)  # still streaming when triage ran
