import asyncio
import time

import aiohttp
import pytest
from bench_harness import run_tool

from bench.lib.client import ChatRequest, connection_tracing, stream_chat


def _request() -> ChatRequest:
    return ChatRequest([{"role": "user", "content": "hello"}], max_tokens=4, model="fake-model")


async def _rounds(url: str, n: int, timeout_s: float) -> list[str]:
    """Send n requests over one keep-alive connection; 'ok <conn>', 'error' or 'stuck' each."""
    results = []
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(
        connector=connector, trace_configs=[connection_tracing()]
    ) as s:
        for _ in range(n):
            try:
                out = await asyncio.wait_for(stream_chat(s, url, _request()), timeout_s)
            except TimeoutError:
                results.append("stuck")
                break
            results.append(f"ok {out.connection}" if out.success else "error")
    return results


def test_stall_after_stops_a_reused_connection_while_new_ones_work(fake_engine, fault_proxy):
    proxy = fault_proxy(fake_engine(), "--stall-after", "2")
    assert asyncio.run(_rounds(proxy, 3, timeout_s=1.0)) == ["ok new", "ok reused", "stuck"]
    assert asyncio.run(_rounds(proxy, 1, timeout_s=1.0)) == ["ok new"]


def test_reset_after_breaks_the_connection_and_the_client_reconnects(fake_engine, fault_proxy):
    proxy = fault_proxy(fake_engine(), "--reset-after", "1")
    assert asyncio.run(_rounds(proxy, 3, timeout_s=2.0)) == ["ok new", "error", "ok new"]


def test_delay_ms_delays_every_request(fake_engine, fault_proxy):
    proxy = fault_proxy(fake_engine(), "--delay-ms", "300")
    start = time.perf_counter()
    assert asyncio.run(_rounds(proxy, 2, timeout_s=5.0)) == ["ok new", "ok reused"]
    assert time.perf_counter() - start >= 0.6


async def _models_then_chat(url: str, timeout_s: float) -> list[str]:
    """Two GET /v1/models, then a chat, over one keep-alive connection."""
    results = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        for _ in range(2):
            async with s.get(url + "/v1/models") as resp:
                results.append(f"models {resp.status}")
        try:
            out = await asyncio.wait_for(stream_chat(s, url, _request()), timeout_s)
            results.append("chat ok" if out.success else "chat error")
        except TimeoutError:
            results.append("chat stuck")
    return results


def test_only_path_limits_the_stall_to_the_paths_named(fake_engine, fault_proxy):
    """--only-path: requests on other paths pass and are not counted (a router's health
    checks and load polls, between it and an engine), the named ones stall."""
    engine = fake_engine()
    stalled = fault_proxy(engine, "--stall-after", "0", "--only-path", "/v1/chat")
    got = asyncio.run(_models_then_chat(stalled, timeout_s=1.0))
    assert got == ["models 200", "models 200", "chat stuck"]
    elsewhere = fault_proxy(engine, "--stall-after", "0", "--only-path", "/generate")
    assert asyncio.run(_models_then_chat(elsewhere, timeout_s=2.0))[-1] == "chat ok"
    counted = fault_proxy(engine, "--stall-after", "1", "--only-path", "/v1/chat")
    assert asyncio.run(_models_then_chat(counted, timeout_s=2.0))[-1] == "chat ok"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--listen", "nowhere", "--upstream", "http://127.0.0.1:1"], "HOST:PORT"),
        (["--listen", "127.0.0.1:1", "--upstream", "ftp://x"], "http://HOST:PORT"),
        (
            ["--listen", "127.0.0.1:1", "--upstream", "http://127.0.0.1:1", "--stall-after", "-1"],
            "whole number",
        ),
        (
            [
                "--listen",
                "127.0.0.1:1",
                "--upstream",
                "http://127.0.0.1:1",
                "--stall-after",
                "1",
                "--reset-after",
                "1",
            ],
            "alternatives",
        ),
        (
            ["--listen", "127.0.0.1:1", "--upstream", "http://127.0.0.1:1", "--only-path", "x"],
            "starting with '/'",
        ),
    ],
)
def test_proxy_rejects_bad_arguments(args, message):
    result = run_tool("bench/proxy", *args)
    assert result.returncode == 2
    assert message in result.stderr
