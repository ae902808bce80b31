"""Multi-round keep-alive reproducer.

Each session is one client holding one keep-alive connection through a multi-turn chat whose
context grows every round. Every request has a deadline; the first one missed triggers triage at
that moment, while the other sessions' requests are still where they are.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from bench.lib.client import (
    ChatOutput,
    ChatRequest,
    add_api_key_arg,
    auth_headers,
    connection_tracing,
    first_model_id,
    redact,
    resolve_api_key,
    seeded_prompt,
    stream_chat,
)
from bench.lib.stack import Stack, add_stack_args, stack_from_args
from bench.lib.triage import triage


@dataclass
class Miss:
    session: int
    round: int
    deadline_s: float
    connection: str


@dataclass
class Plan:
    url: str
    model: str
    sessions: int
    rounds: int
    deadline_s: float
    max_tokens: int
    first_words: int
    turn_words: int
    seed: int
    api_key: str = field(default="", repr=False)


def _line(session: int, rnd: int, out: ChatOutput) -> str:
    head = f"session {session} round {rnd}:"
    conn = f"connection {out.connection or 'unknown'}"
    if not out.success:
        return f"{head} error after {out.latency_s:.3f} s ({out.error}), {conn}"
    return (
        f"{head} ok {out.latency_s:.3f} s (ttft {out.ttft_s:.3f} s), prompt {out.prompt_tokens} "
        f"tokens, {out.output_tokens} output tokens, {conn}"
    )


async def _session(plan: Plan, session: int, ok: list[int], missed: asyncio.Queue) -> None:
    # limit=1: every round of this session rides the same connection while the server keeps it.
    connector = aiohttp.TCPConnector(limit=1)
    messages = [{"role": "user", "content": seeded_prompt(plan.seed, session, plan.first_words)}]
    async with aiohttp.ClientSession(
        connector=connector,
        trace_configs=[connection_tracing()],
        headers=auth_headers(plan.api_key),
    ) as client:
        for rnd in range(1, plan.rounds + 1):
            request = ChatRequest(list(messages), plan.max_tokens, model=plan.model)
            trace: dict[str, str] = {}
            task = asyncio.ensure_future(stream_chat(client, plan.url, request, trace))
            done, _ = await asyncio.wait({task}, timeout=plan.deadline_s)
            if not done:
                conn = trace.get("connection", "not yet chosen")
                print(
                    f"session {session} round {rnd}: no answer within the "
                    f"{plan.deadline_s:g} s deadline, connection {conn}",
                    flush=True,
                )
                await missed.put((Miss(session, rnd, plan.deadline_s, conn), task))
                return
            out = task.result()
            print(_line(session, rnd, out), flush=True)
            if out.success:
                ok[0] += 1
                messages.append({"role": "assistant", "content": out.text})
                words = seeded_prompt(plan.seed, 1000 * session + rnd, plan.turn_words)
                messages.append({"role": "user", "content": words})


async def run(plan: Plan, stack: Stack, triage_fast_s: float, triage_window_s: float) -> int:
    ok = [0]
    missed: asyncio.Queue = asyncio.Queue()
    sessions = [
        asyncio.ensure_future(_session(plan, s, ok, missed)) for s in range(1, plan.sessions + 1)
    ]
    all_done = asyncio.ensure_future(asyncio.gather(*sessions, return_exceptions=True))
    first_miss = asyncio.ensure_future(missed.get())
    await asyncio.wait({all_done, first_miss}, return_when=asyncio.FIRST_COMPLETED)
    total = plan.sessions * plan.rounds
    status = 0
    if first_miss.done():
        miss, stuck = first_miss.result()
        started = time.perf_counter()
        print(
            f"deadline missed: session {miss.session} round {miss.round} "
            f"({miss.deadline_s:g} s); running triage now",
            flush=True,
        )
        verdict = await triage(
            plan.url,
            stack,
            triage_fast_s,
            triage_window_s,
            probe_timeout_s=plan.deadline_s,
            model=plan.model,
            api_key=plan.api_key,
        )
        print(verdict.render())
        print(f"triage took {time.perf_counter() - started:.1f} s", flush=True)
        stuck.cancel()
        status = 1
    else:
        first_miss.cancel()
    for s in sessions:
        s.cancel()
    results = await asyncio.gather(*sessions, return_exceptions=True)
    for r in results:
        if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError):
            print(f"session failed: {redact(f'{type(r).__name__}: {r}', plan.api_key)}", flush=True)
    if ok[0] != total:
        status = 1
    print(f"{ok[0]}/{total} rounds ok", flush=True)
    return status


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"wants a whole number >= 1, got {text!r}")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"wants a number > 0, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/multiround",
        description="Multi-round chat over one keep-alive connection per session, context "
        "growing each round. A missed deadline runs triage at once and exits 1. The last line "
        "counts rounds, e.g. '24/24 rounds ok'.",
    )
    parser.add_argument("--url", required=True, help="URL the client talks to (router or proxy)")
    parser.add_argument("--sessions", type=_positive_int, default=4, help="default: 4")
    parser.add_argument("--rounds", type=_positive_int, default=6, help="default: 6")
    parser.add_argument(
        "--deadline-s",
        type=_positive_float,
        default=60.0,
        help="per-request deadline in seconds (default: 60)",
    )
    parser.add_argument(
        "--max-tokens", type=_positive_int, default=64, help="output tokens per round (default: 64)"
    )
    parser.add_argument(
        "--first-words",
        type=_positive_int,
        default=200,
        help="words in the first user turn (default: 200)",
    )
    parser.add_argument(
        "--turn-words",
        type=_positive_int,
        default=50,
        help="words in each later user turn (default: 50)",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    parser.add_argument("--model", help="model name (default: the first in /v1/models)")
    parser.add_argument(
        "--triage-fast-s",
        type=_positive_float,
        default=2.0,
        help="triage: a fresh request within this is fast (default: 2.0)",
    )
    parser.add_argument(
        "--triage-window-s",
        type=_positive_float,
        default=1.0,
        help="triage: seconds between metrics samples (default: 1.0)",
    )
    add_stack_args(parser)
    add_api_key_arg(parser)
    args = parser.parse_args(argv)
    stack = stack_from_args(parser, args)
    api_key = resolve_api_key(args.api_key, args.env_dir)
    model = args.model
    if model is None:
        try:
            model = asyncio.run(first_model_id(args.url, args.deadline_s, api_key))
        except (TimeoutError, aiohttp.ClientError, OSError, RuntimeError) as exc:
            error = redact(str(exc), api_key)
            print(f"bench/multiround: cannot list models at {args.url}: {error}", file=sys.stderr)
            return 2
    plan = Plan(
        args.url.rstrip("/"),
        model,
        args.sessions,
        args.rounds,
        args.deadline_s,
        args.max_tokens,
        args.first_words,
        args.turn_words,
        args.seed,
        api_key,
    )
    return asyncio.run(run(plan, stack, args.triage_fast_s, args.triage_window_s))


if __name__ == "__main__":
    sys.exit(main())
