"""Closed-loop load at a fixed concurrency: exactly C requests in flight until N are done."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from bench.lib.client import ChatOutput, ChatRequest, auth_headers, seeded_prompt, stream_chat


@dataclass(frozen=True)
class LoadSpec:
    concurrency: int
    requests: int
    input_words: int
    output_tokens: int
    seed: int
    request_timeout_s: float
    # sglang.bench_serving opens a connection per request; this matches it when asked.
    fresh_connections: bool = False


async def run_load(
    url: str,
    model: str,
    spec: LoadSpec,
    on_done: Callable[[ChatOutput], None] = lambda _out: None,
    api_key: str = "",
    until: Callable[[], bool] = lambda: False,
) -> tuple[list[ChatOutput], float]:
    """Return the outputs in request order and the wall time from first send to last answer.
    No request is sent once `until()` is true (the ones in flight finish)."""
    outputs: list[ChatOutput | None] = [None] * spec.requests
    next_index = iter(range(spec.requests))
    prompts = [seeded_prompt(spec.seed, i, spec.input_words) for i in range(spec.requests)]
    connector = aiohttp.TCPConnector(limit=spec.concurrency, force_close=spec.fresh_connections)

    async def worker(session: aiohttp.ClientSession) -> None:
        for i in next_index:
            if until():
                return
            request = ChatRequest(
                [{"role": "user", "content": prompts[i]}], spec.output_tokens, model=model
            )
            try:
                out = await asyncio.wait_for(
                    stream_chat(session, url, request), spec.request_timeout_s
                )
            except TimeoutError:
                out = ChatOutput(error=f"timeout after {spec.request_timeout_s:g} s")
                out.latency_s = spec.request_timeout_s
            outputs[i] = out
            on_done(out)

    async with aiohttp.ClientSession(connector=connector, headers=auth_headers(api_key)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(spec.concurrency)))
        duration = time.perf_counter() - start
    return [o for o in outputs if o is not None], duration
