"""Streaming chat-completions client: one request in, one recorded output out.

The shape follows sglang's bench_serving: a request dataclass, an output dataclass, and one async
function per API flavour. Metrics are computed from the outputs elsewhere (bench.lib.metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

CHAT_PATH = "/v1/chat/completions"
# The variable env/common.env sets and launch's scripts pass to smg and both engines as
# --api-key: a stack launched with a key is benchmarked with it without extra flags.
API_KEY_ENV = "API_KEY"
REDACTED = "<redacted>"

# A fixed vocabulary keeps seeded prompts reproducible without a tokenizer; the simulated engine
# and the real one both see plain words, one word being about one token.
_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
    "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


@dataclass
class ChatRequest:
    messages: list[dict[str, str]]
    max_tokens: int
    model: str = "default"
    ignore_eos: bool = True
    seed: int | None = None

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": self.ignore_eos,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        return body


@dataclass
class ChatOutput:
    success: bool = False
    error: str = ""
    status: int = 0
    start_time: float = 0.0
    latency_s: float = 0.0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    connection: str = ""  # "new" or "reused" when the session traces connections

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record.pop("text")
        return record


def add_api_key_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="send 'Authorization: Bearer KEY' with every request (default: API_KEY from the "
        f"env dir's common.env when there is one and it is set, else ${API_KEY_ENV}; '' sends "
        "none). The key is never printed",
    )


def resolve_api_key(cli: str | None, env_dir: Path | None = None) -> str:
    """The key to send: --api-key, else the env dir's API_KEY, else $API_KEY; "" for none.

    The env dir's value comes first because it is the one the stack was launched with (launch's
    scripts let the files override the calling environment).
    """
    if cli is not None:
        return cli
    if env_dir is not None:
        from launch.pdlib.envfiles import EnvDir

        try:
            key = EnvDir(Path(env_dir)).common().get(API_KEY_ENV, "")
        except (OSError, ValueError):
            key = ""
        if key:
            return key
    return os.environ.get(API_KEY_ENV, "")


def auth_headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def redact(text: str, api_key: str) -> str:
    return text.replace(api_key, REDACTED) if api_key else text


def _session_key(session: aiohttp.ClientSession) -> str:
    value = session.headers.get("Authorization", "")
    return value[len("Bearer ") :] if value.startswith("Bearer ") else ""


def seeded_prompt(seed: int, index: int, words: int) -> str:
    rng = random.Random(seed * 1_000_003 + index)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def connection_tracing() -> aiohttp.TraceConfig:
    """A trace config that marks each request's ChatOutput as riding a new or reused connection."""
    trace = aiohttp.TraceConfig()

    async def on_create(_session, ctx, _params):
        ctx.trace_request_ctx["connection"] = "new"

    async def on_reuse(_session, ctx, _params):
        ctx.trace_request_ctx["connection"] = "reused"

    trace.on_connection_create_end.append(on_create)
    trace.on_connection_reuseconn.append(on_reuse)
    return trace


def _sse_events(line: bytes) -> str | None:
    text = line.decode("utf-8", "replace").strip()
    if not text.startswith("data:"):
        return None
    return text[5:].strip()


async def stream_chat(
    session: aiohttp.ClientSession,
    base_url: str,
    request: ChatRequest,
    trace_ctx: dict[str, str] | None = None,
) -> ChatOutput:
    """Send one streaming chat completion; never raises for HTTP or transport errors.

    The API key, if any, is in the session's headers (auth_headers()).

    With a session built with connection_tracing(), `trace_ctx["connection"]` says "new" or
    "reused" as soon as a connection is picked, so a caller can tell even while it is stuck.
    """
    out = ChatOutput()
    trace_ctx = {} if trace_ctx is None else trace_ctx
    start = time.perf_counter()
    out.start_time = time.time()
    last = start
    chunks = 0
    try:
        async with session.post(
            base_url.rstrip("/") + CHAT_PATH, json=request.payload(), trace_request_ctx=trace_ctx
        ) as resp:
            out.status = resp.status
            out.connection = trace_ctx.get("connection", "")
            if resp.status != 200:
                # A server that echoes the request must not get the key printed.
                body = redact(await resp.text(), _session_key(session))
                out.error = f"HTTP {resp.status}: {body[:200]}"
                out.latency_s = time.perf_counter() - start
                return out
            pieces: list[str] = []
            async for line in resp.content:
                data = _sse_events(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    # Keep reading to the end of the body: a response read to its end is what
                    # lets the connection go back to the pool and be reused.
                    continue
                event = json.loads(data)
                usage = event.get("usage") or {}
                if usage:
                    out.output_tokens = int(usage.get("completion_tokens", out.output_tokens))
                    out.prompt_tokens = int(usage.get("prompt_tokens", out.prompt_tokens))
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content") or ""
                    if not content:
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        out.ttft_s = now - start
                    else:
                        out.itl_s.append(now - last)
                    last = now
                    chunks += 1
                    pieces.append(content)
            out.text = "".join(pieces)
            if out.output_tokens == 0:
                out.output_tokens = chunks
            out.latency_s = time.perf_counter() - start
            out.success = chunks > 0
            if not out.success:
                out.error = "stream ended without content"
    except asyncio.CancelledError:
        raise
    except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as exc:
        out.error = redact(f"{type(exc).__name__}: {exc}", _session_key(session))
        out.latency_s = time.perf_counter() - start
        out.connection = out.connection or trace_ctx.get("connection", "")
    return out


async def first_model_id(base_url: str, timeout_s: float, api_key: str = "") -> str:
    """The first model the server lists, fetched over its own short-lived connection."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers(api_key)) as session:
        async with session.get(base_url.rstrip("/") + "/v1/models") as resp:
            resp.raise_for_status()
            data = (await resp.json()).get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])
