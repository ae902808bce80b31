"""Triage on the sim stack (real smg router) with decode slowed down: "engine saturated".

The opposite case of the stalled-proxy test: here the engines are the bottleneck. Decode gets
few running slots and a slow step, requests arrive faster than it can serve them, and triage,
run while they queue, must blame the engines with the numbers that show it, not the connection
layer. Afterwards the idle sim must read as idle.
"""

import asyncio
import json
import sys
import time
import urllib.request

import aiohttp
from bench_harness import ROOT, sim_stack_up

from bench.lib import promtext
from bench.lib.client import ChatOutput, ChatRequest, first_model_id, stream_chat
from bench.lib.stack import stack_from_env_dir
from bench.lib.triage import CONNECTION, SATURATED

MAX_RUNNING = 8
STEP_BASE_S = 0.1
STEP_PER_REQ_S = 0.0005
STEP_S = STEP_BASE_S + STEP_PER_REQ_S * MAX_RUNNING
SLOW_DECODE = {
    "PD_SIM_DECODE_STEP_BASE_S": str(STEP_BASE_S),
    "PD_SIM_DECODE_STEP_PER_REQ_S": str(STEP_PER_REQ_S),
    "DECODE_ARGS": f'"--max-running-requests {MAX_RUNNING}"',
}
# Open-loop arrivals at 20/s for 2.5 s; decode serves about MAX_RUNNING / (10 x STEP_S) = 7.7/s,
# so its queue grows the whole time triage looks.
REQUESTS = 50
ARRIVALS_PER_S = 20.0
MAX_TOKENS = 10
REQUEST_TIMEOUT_S = 20.0
TRIAGE_AFTER_S = 0.5
FAST_S = 1.0


async def _request(session, url, model, i) -> ChatOutput:
    request = ChatRequest([{"role": "user", "content": f"load {i}"}], MAX_TOKENS, model=model)
    try:
        return await asyncio.wait_for(stream_chat(session, url, request), REQUEST_TIMEOUT_S)
    except TimeoutError:
        return ChatOutput(error=f"timeout after {REQUEST_TIMEOUT_S:g} s")


async def _load_and_triage(router: str, env_dir) -> tuple[list[ChatOutput], dict, str]:
    model = await first_model_id(router, 10)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        start = time.monotonic()

        async def arrivals():
            for i in range(REQUESTS):
                await asyncio.sleep(max(0.0, start + i / ARRIVALS_PER_S - time.monotonic()))
                tasks.append(asyncio.ensure_future(_request(session, router, model, i)))

        feeder = asyncio.ensure_future(arrivals())
        await asyncio.sleep(TRIAGE_AFTER_S)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "bench/triage",
            "--url",
            router,
            "--env-dir",
            str(env_dir),
            "--fast-s",
            str(FAST_S),
            "--probe-timeout-s",
            "10",
            "--json",
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        await feeder
        outputs = await asyncio.gather(*tasks)
    assert proc.returncode == 0, out.decode() + err.decode()
    return outputs, json.loads(out), err.decode()


def _decode_load(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return promtext.load_of(promtext.parse(resp.read().decode()))


def test_slow_decode_under_load_is_engine_saturated_not_connection(tmp_path):
    with sim_stack_up(tmp_path, decode_env=SLOW_DECODE) as stack:
        urls = stack_from_env_dir(stack.env)
        outputs, verdict, stderr = asyncio.run(
            asyncio.wait_for(_load_and_triage(urls.router_url, stack.env), 60)
        )
        idle = _decode_load(urls.decode_url)

    print("\n".join([f"triage verdict: {verdict['verdict']}", *verdict["evidence"]]))
    assert verdict["verdict"] == SATURATED, json.dumps(verdict, indent=2)
    assert verdict["verdict"] != CONNECTION
    facts = verdict["measurements"]
    engines = {e["role"]: e for e in facts["engines"]}
    decode = engines["decode"]
    before, after = decode["before"], decode["after"]
    # Every slot busy, the queue growing across the window, tokens coming out.
    assert after["running"] == MAX_RUNNING, decode
    assert 0 < before["running"] <= MAX_RUNNING, decode
    assert after["queued"] > before["queued"] >= 0, decode
    assert after["generation_tokens_total"] > before["generation_tokens_total"], decode
    # The gauge is the measured step rate: never above the timing model's, not far below.
    assert 0.3 * MAX_RUNNING / STEP_S < after["gen_throughput"] <= MAX_RUNNING / STEP_S, decode
    assert engines["prefill"]["ok"] and engines["prefill"]["after"]["running"] is not None
    # One fresh-connection probe (the client URL is the router): answered, but slowly.
    (probe,) = facts["probes"]
    assert probe["ok"] and probe["tokens"] == 4, probe
    assert probe["latency_s"] > FAST_S, probe
    # The printed evidence carries the same numbers.
    assert any(f"answered in {probe['latency_s']:.3f} s" in e for e in verdict["evidence"])
    queued = f"queued {before['queued']:g} -> {after['queued']:g}"
    assert any(e.startswith("decode ") and queued in e for e in verdict["evidence"])

    # The load was served in full, only slowly, and the drained sim reads as idle.
    assert len(outputs) == REQUESTS
    assert all(o.success and o.output_tokens == MAX_TOKENS for o in outputs), [
        o.error for o in outputs if not o.success
    ]
    assert {k: idle[k] for k in ("running", "queued", "gen_throughput")} == {
        "running": 0.0,
        "queued": 0.0,
        "gen_throughput": 0.0,
    }
    assert idle["generation_tokens_total"] >= REQUESTS * MAX_TOKENS
    assert stderr == ""


def test_a_decode_step_that_never_ends_is_engine_stalled_naming_decode(tmp_path):
    """The other engine-side verdict: decode holds requests and makes no progress at all (its
    first step takes 1000 s). Triage must say stalled, name decode, and not blame prefill."""
    with sim_stack_up(tmp_path, decode_env={"PD_SIM_DECODE_STEP_BASE_S": "1000"}) as stack:
        urls = stack_from_env_dir(stack.env)

        async def run() -> tuple[int, str]:
            model = await first_model_id(urls.router_url, 10)
            async with aiohttp.ClientSession() as session:
                stuck = [
                    asyncio.ensure_future(
                        stream_chat(
                            session,
                            urls.router_url,
                            ChatRequest(
                                [{"role": "user", "content": f"stall {i}"}], 4, model=model
                            ),
                        )
                    )
                    for i in range(2)
                ]
                await asyncio.sleep(1.0)
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "bench/triage",
                    *("--url", urls.router_url, "--env-dir", str(stack.env)),
                    *("--probe-timeout-s", "3"),
                    cwd=ROOT,
                    stdout=asyncio.subprocess.PIPE,
                )
                out, _ = await asyncio.wait_for(proc.communicate(), 30)
                for task in stuck:
                    task.cancel()
                return proc.returncode, out.decode()

        code, out = asyncio.run(asyncio.wait_for(run(), 60))
    print(out)
    assert code == 0, out
    assert "triage verdict: engine stalled" in out
    assert "because: requests are on decode but it made no progress in the window" in out
    assert "the router says:" not in out  # every engine answered
