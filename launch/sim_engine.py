"""A simulated SGLang PD worker: the HTTP surface of a prefill or decode server, no GPU.

It takes the command line of `python -m sglang.launch_server` (the flags it needs; the rest are
accepted and listed in the log as ignored), so launch/prefill.sh and launch/decode.sh start it
with exactly the arguments a real server gets, and the env files' knobs reach its environment the
same way. It exists so the launch tooling and the real smg router can be exercised end to end on
a CPU machine; it measures nothing about GPU performance.

Timing model (all values in seconds, overridable through the environment):
  start-up      the server answers /health with 503 for PD_SIM_STARTUP_S (default 0.5), then 200.
  prefill       requests are served one at a time (FIFO); one takes
                PD_SIM_PREFILL_BASE_S + PD_SIM_PREFILL_PER_TOKEN_S x input_tokens
                (defaults 0.005 and 0.00002). Input tokens: ceil(characters / 4) of the prompt.
  KV transfer   decode fetches the finished room from prefill's bootstrap port; a room that
                prefill never finishes fails the request after PD_SIM_KV_WAIT_S (default 30).
  decode        one loop runs steps; a step takes PD_SIM_DECODE_STEP_BASE_S +
                PD_SIM_DECODE_STEP_PER_REQ_S x running (defaults 0.01 and 0.0005) and gives every
                running request one token, streamed as it is made. At most --max-running-requests
                (default 64) run; the rest queue.
Output text is deterministic ("tok0 tok1 ..."); max_tokens defaults to 16.

Load metrics (/metrics with SGLang's names, /v1/loads, /get_load) are the live state, read at
the moment of the request:
  running       prefill: the request being prefilled (0 or 1); decode: the requests in the step.
  queued        prefill: requests waiting for the prefill lock (sglang:num_queue_reqs); decode:
                requests waiting for a running slot (sglang:num_queue_reqs) and requests
                waiting for their KV from prefill (sglang:num_decode_transfer_queue_reqs).
  gen_throughput  decode: tokens of the last finished step / the time that step really took;
                0 while decode has nothing running or queued (prefill: always 0).
  counters      sglang:generation_tokens_total counts every token made, as it is made.

With --api-key every route wants `Authorization: Bearer KEY` (401 otherwise), as on a real
server, except the ones SGLang leaves open (/health*, /ready*, /metrics*) and the sim's /sim/*.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import itertools
import json
import logging
import math
import os
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from aiohttp import ClientSession, ClientTimeout, web

SIM_VERSION = "0.5.23"
LOG = logging.getLogger("sim_engine")


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"sim_engine: {name}={raw!r} is not a number") from None
    if value < 0:
        raise SystemExit(f"sim_engine: {name}={raw!r} must be >= 0")
    return value


@dataclass(frozen=True)
class Timing:
    startup_s: float
    prefill_base_s: float
    prefill_per_token_s: float
    decode_step_base_s: float
    decode_step_per_req_s: float
    kv_wait_s: float

    @classmethod
    def from_env(cls) -> Timing:
        return cls(
            startup_s=_env_float("PD_SIM_STARTUP_S", 0.5),
            prefill_base_s=_env_float("PD_SIM_PREFILL_BASE_S", 0.005),
            prefill_per_token_s=_env_float("PD_SIM_PREFILL_PER_TOKEN_S", 0.00002),
            decode_step_base_s=_env_float("PD_SIM_DECODE_STEP_BASE_S", 0.01),
            decode_step_per_req_s=_env_float("PD_SIM_DECODE_STEP_PER_REQ_S", 0.0005),
            kv_wait_s=_env_float("PD_SIM_KV_WAIT_S", 30.0),
        )

    def prefill_seconds(self, input_tokens: int) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * input_tokens

    def decode_step_seconds(self, running: int) -> float:
        return self.decode_step_base_s + self.decode_step_per_req_s * running


def count_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / 4))


def token_text(index: int) -> str:
    return f"tok{index} "


@dataclass
class DecodeJob:
    rid: str
    max_tokens: int
    produced: int = 0
    tokens: asyncio.Queue = field(default_factory=asyncio.Queue)


class Engine:
    """State shared by the handlers: readiness, queues, counters, recent requests."""

    def __init__(self, args: argparse.Namespace, timing: Timing):
        self.args = args
        self.timing = timing
        self.mode = args.disaggregation_mode
        self.started_at = time.time()
        self.ready_at: float | None = None
        self.prefill_lock = asyncio.Lock()
        self.prefill_waiting = 0
        self.prefill_running = 0
        self.finished_rooms: dict[int, int] = {}
        self.room_events: dict[int, asyncio.Event] = {}
        self.decode_queue: deque[DecodeJob] = deque()
        self.decode_running: list[DecodeJob] = []
        self.decode_wakeup = asyncio.Event()
        self.decode_transfer = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_total = 0
        self.recent: deque[dict] = deque(maxlen=256)
        self.last_step_tokens_per_s = 0.0

    @property
    def model_name(self) -> str:
        return self.args.served_model_name or self.args.model_path

    def is_ready(self) -> bool:
        return self.ready_at is not None

    async def become_ready(self) -> None:
        await asyncio.sleep(self.timing.startup_s)
        self.ready_at = time.time()
        LOG.info("The server is fired up and ready to roll! (simulated, mode=%s)", self.mode)

    def room_event(self, room: int) -> asyncio.Event:
        return self.room_events.setdefault(room, asyncio.Event())

    async def run_prefill(self, room: int | None, input_tokens: int) -> None:
        self.prefill_waiting += 1
        admitted = False
        try:
            async with self.prefill_lock:
                self.prefill_waiting -= 1
                admitted = True
                self.prefill_running += 1
                try:
                    await asyncio.sleep(self.timing.prefill_seconds(input_tokens))
                finally:
                    self.prefill_running -= 1
        finally:
            # A request cancelled while it waited leaves the queue count with it.
            if not admitted:
                self.prefill_waiting -= 1
        if room is not None:
            self.finished_rooms[room] = input_tokens
            self.room_event(room).set()
            while len(self.finished_rooms) > 4096:
                old = next(iter(self.finished_rooms))
                self.finished_rooms.pop(old)
                self.room_events.pop(old, None)

    async def decode_loop(self) -> None:
        while True:
            if not self.decode_queue and not self.decode_running:
                # Idle: nothing is being generated, and the throughput gauge says so.
                self.last_step_tokens_per_s = 0.0
            while not self.decode_queue and not self.decode_running:
                self.decode_wakeup.clear()
                await self.decode_wakeup.wait()
            while self.decode_queue and len(self.decode_running) < self.args.max_running_requests:
                self.decode_running.append(self.decode_queue.popleft())
            started = time.perf_counter()
            await asyncio.sleep(self.timing.decode_step_seconds(len(self.decode_running)))
            # Requests cancelled during the step get no token; the gauge counts what was made,
            # over the time the step really took (a loaded event loop oversleeps).
            elapsed = time.perf_counter() - started
            made = len(self.decode_running)
            self.last_step_tokens_per_s = made / elapsed if elapsed > 0 else 0.0
            still = []
            for job in self.decode_running:
                job.tokens.put_nowait(token_text(job.produced))
                job.produced += 1
                self.generation_tokens_total += 1
                if job.produced >= job.max_tokens:
                    job.tokens.put_nowait(None)
                else:
                    still.append(job)
            self.decode_running = still

    def cancel_decode(self, job: DecodeJob) -> None:
        if job in self.decode_running:
            self.decode_running.remove(job)
        elif job in self.decode_queue:
            self.decode_queue.remove(job)

    async def fetch_kv(self, host: str, port: int, room: int) -> int:
        """Wait for prefill to finish `room`, as a real decode waits for the KV transfer."""
        url = f"http://{host}:{port}/sim/kv?room={room}"
        timeout = ClientTimeout(total=self.timing.kv_wait_s + 5)
        async with ClientSession(timeout=timeout) as session:
            async with session.get(url) as resp:
                if resp.status != 200:
                    raise web.HTTPServiceUnavailable(
                        text=json.dumps({"error": f"KV transfer for room {room} failed"}),
                        content_type="application/json",
                    )
                return int((await resp.json())["input_tokens"])


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "code": status}, status=status)


def _prompt_text(body: dict, chat: bool) -> str:
    if chat:
        parts = []
        for message in body.get("messages") or []:
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
        return "\n".join(parts)
    text = body.get("text", body.get("prompt", ""))
    if isinstance(body.get("input_ids"), list):
        return " " * (4 * len(body["input_ids"]))
    return text if isinstance(text, str) else " ".join(map(str, text))


def _max_tokens(body: dict, chat: bool) -> int:
    if chat:
        value = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        value = (body.get("sampling_params") or {}).get("max_new_tokens")
    return 16 if value is None else max(1, int(value))


def _bootstrap(body: dict) -> tuple[str | None, int | None, int | None]:
    def first(value):
        return value[0] if isinstance(value, list) and value else value

    return (
        first(body.get("bootstrap_host")),
        first(body.get("bootstrap_port")),
        first(body.get("bootstrap_room")),
    )


# Routes a key never guards (SGLang's list, matched by prefix as it does, plus the sim's own).
OPEN_PREFIXES = ("/health", "/ready", "/metrics", "/sim/")


class Handlers:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.ids = itertools.count()

    def _authorized(self, request: web.Request) -> bool:
        """SGLang's rule for a normal endpoint with --api-key: `Bearer KEY`, the scheme in any
        case, the key compared in constant time."""
        key = self.engine.args.api_key
        if not key:
            return True
        scheme, _, token = (request.headers.get("Authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token, key)

    @web.middleware
    async def require_api_key(self, request: web.Request, handler):
        """Every route needs the key, as on a real server, except the ones SGLang leaves open
        for probes and scraping (/health*, /ready*, /metrics*) and the sim's own /sim/*."""
        path = request.path
        if request.method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
            return await handler(request)
        if not self._authorized(request):
            return _error(401, "Unauthorized")
        return await handler(request)

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.is_ready() else 503)

    async def server_info(self, _request: web.Request) -> web.Response:
        args = self.engine.args
        info = {
            "model_path": args.model_path,
            "served_model_name": self.engine.model_name,
            "tokenizer_path": args.model_path,
            "host": args.host,
            "port": args.port,
            "tp_size": args.tp_size,
            "dp_size": 1,
            "max_running_requests": args.max_running_requests,
            "disaggregation_mode": self.engine.mode,
            "disaggregation_bootstrap_port": args.disaggregation_bootstrap_port,
            "disaggregation_transfer_backend": args.disaggregation_transfer_backend,
            "api_key": None if not args.api_key else "<redacted>",
            "version": SIM_VERSION,
            "frontend": "python",
            "startup_time": self.engine.started_at,
            "internal_states": [{"last_gen_throughput": self.engine.last_step_tokens_per_s}],
            "sim": {"ready_at": self.engine.ready_at, "timing": self.engine.timing.__dict__},
        }
        return web.json_response(info)

    async def model_info(self, _request: web.Request) -> web.Response:
        args = self.engine.args
        return web.json_response(
            {
                "model_path": args.model_path,
                "served_model_name": self.engine.model_name,
                "tokenizer_path": args.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "disaggregation_mode": self.engine.mode,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "deepseek_v4",
                "architectures": ["DeepseekV4ForCausalLM"],
            }
        )

    async def version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": SIM_VERSION})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.engine.model_name,
                        "object": "model",
                        "created": int(self.engine.started_at),
                        "owned_by": "sglang",
                        "root": self.engine.args.model_path,
                        "max_model_len": self.engine.args.context_length,
                    }
                ],
            }
        )

    def _load_numbers(self) -> dict[str, int]:
        e = self.engine
        if e.mode == "prefill":
            return {"running": e.prefill_running, "queued": e.prefill_waiting}
        return {"running": len(e.decode_running), "queued": len(e.decode_queue)}

    async def loads(self, _request: web.Request) -> web.Response:
        n = self._load_numbers()
        e = self.engine
        disagg = {"mode": e.mode}
        if e.mode == "decode":
            disagg["decode_transfer_queue_reqs"] = e.decode_transfer
        load = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": n["running"],
            "num_waiting_reqs": n["queued"],
            "max_running_requests": e.args.max_running_requests,
            "gen_throughput": e.last_step_tokens_per_s,
            "disaggregation": disagg,
        }
        return web.json_response(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "version": SIM_VERSION,
                "accelerator": None,
                "num_accelerators": e.args.tp_size,
                "loads": [load],
            }
        )

    async def get_load(self, _request: web.Request) -> web.Response:
        n = self._load_numbers()
        return web.json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": n["running"] + n["queued"],
                    "num_waiting_reqs": n["queued"],
                }
            ]
        )

    async def metrics(self, _request: web.Request) -> web.Response:
        e = self.engine
        n = self._load_numbers()
        labels = f'model_name="{e.model_name}",engine_type="{e.mode}",tp_rank="0",pp_rank="0"'
        gauges = [
            ("sglang:num_running_reqs", "The number of running requests.", n["running"]),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", n["queued"]),
            (
                "sglang:gen_throughput",
                "The generation throughput (token/s).",
                e.last_step_tokens_per_s,
            ),
            ("sglang:token_usage", "The token usage.", 0.0),
        ]
        if e.mode == "prefill":
            gauges.append(("sglang:num_prefill_inflight_queue_reqs", "Prefill inflight queue.", 0))
        else:
            gauges.append(
                (
                    "sglang:num_decode_transfer_queue_reqs",
                    "Decode transfer queue.",
                    e.decode_transfer,
                )
            )
        counters = [
            ("sglang:prompt_tokens_total", "Prompt tokens processed.", e.prompt_tokens_total),
            ("sglang:generation_tokens_total", "Generation tokens.", e.generation_tokens_total),
            ("sglang:num_requests_total", "Requests received.", e.requests_total),
        ]
        lines = []
        for name, doc, value in gauges:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
        for name, doc, value in counters:
            lines += [
                f"# HELP {name} {doc}",
                f"# TYPE {name} counter",
                f"{name}{{{labels}}} {value}",
            ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def sim_requests(self, _request: web.Request) -> web.Response:
        return web.json_response(list(self.engine.recent))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if not self.engine.is_ready():
            return _error(503, "server is starting")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not JSON")
        e = self.engine
        host, port, room = _bootstrap(body)
        input_tokens = count_tokens(_prompt_text(body, chat))
        max_tokens = _max_tokens(body, chat)
        rid = body.get("rid") or uuid.uuid4().hex
        e.requests_total += 1
        e.recent.append(
            {
                "rid": rid,
                "mode": e.mode,
                "room": room,
                "input_tokens": input_tokens,
                "max_tokens": max_tokens,
                "path": request.path,
                "t": time.time(),
            }
        )
        if e.mode != "null" and (room is None or host is None):
            return _error(400, f"{e.mode} server needs bootstrap_host and bootstrap_room")
        if e.mode == "prefill":
            e.prompt_tokens_total += input_tokens
            await e.run_prefill(room, input_tokens)
            return self._complete(body, chat, rid, [token_text(0)], input_tokens, "length")
        if e.mode == "decode":
            e.decode_transfer += 1
            try:
                input_tokens = await e.fetch_kv(host, int(port or 8998), int(room))
            except (TimeoutError, OSError, ValueError, KeyError) as exc:
                return _error(503, f"KV transfer for room {room} failed: {type(exc).__name__}")
            finally:
                e.decode_transfer -= 1
        else:
            e.prompt_tokens_total += input_tokens
            await e.run_prefill(None, input_tokens)
        job = DecodeJob(rid=rid, max_tokens=max_tokens)
        e.decode_queue.append(job)
        e.decode_wakeup.set()
        if body.get("stream"):
            return await self._stream(request, body, chat, job, input_tokens)
        pieces = []
        try:
            while (piece := await job.tokens.get()) is not None:
                pieces.append(piece)
        finally:
            e.cancel_decode(job)
        return self._complete(body, chat, rid, pieces, input_tokens, "length")

    def _complete(self, body, chat, rid, pieces, input_tokens, reason) -> web.Response:
        text = "".join(pieces)
        usage = {
            "prompt_tokens": input_tokens,
            "completion_tokens": len(pieces),
            "total_tokens": input_tokens + len(pieces),
        }
        if not chat:
            return web.json_response(
                {
                    "text": text,
                    "meta_info": {
                        "id": rid,
                        "prompt_tokens": input_tokens,
                        "completion_tokens": len(pieces),
                        "finish_reason": {"type": reason},
                    },
                }
            )
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model") or self.engine.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": reason,
                    }
                ],
                "usage": usage,
            }
        )

    async def _stream(self, request, body, chat, job, input_tokens) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        model = body.get("model") or self.engine.model_name
        created = int(time.time())
        text = ""
        try:
            while (piece := await job.tokens.get()) is not None:
                if chat:
                    chunk = {
                        "id": job.rid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model,
                        "choices": [
                            {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                        ],
                    }
                else:
                    text += piece
                    chunk = {
                        "text": text,
                        "meta_info": {"id": job.rid, "completion_tokens": job.produced},
                    }
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if chat:
                final = {
                    "id": job.rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                }
                if (body.get("stream_options") or {}).get("include_usage"):
                    final["usage"] = {
                        "prompt_tokens": input_tokens,
                        "completion_tokens": job.produced,
                        "total_tokens": input_tokens + job.produced,
                    }
                await resp.write(f"data: {json.dumps(final)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.engine.cancel_decode(job)
            raise
        finally:
            self.engine.cancel_decode(job)
        return resp


class Bootstrap:
    """Prefill's bootstrap port: decode asks here for a finished room (the simulated KV)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    async def route(self, _request: web.Request) -> web.Response:
        return web.json_response({"mode": "sim", "prefill_port": self.engine.args.port})

    async def kv(self, request: web.Request) -> web.Response:
        try:
            room = int(request.query["room"])
        except (KeyError, ValueError):
            return _error(400, "room must be an integer")
        try:
            await asyncio.wait_for(
                self.engine.room_event(room).wait(), self.engine.timing.kv_wait_s
            )
        except TimeoutError:
            return _error(504, f"room {room} was never prefilled")
        return web.json_response({"room": room, "input_tokens": self.engine.finished_rooms[room]})


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="sim_engine.py",
        description="Simulated SGLang PD worker (no GPU). Takes sglang.launch_server's flags; "
        "the timing model is in this file's docstring.",
    )
    parser.add_argument("--model-path", "--model", required=True)
    parser.add_argument("--served-model-name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", "--tp", type=int, default=1)
    parser.add_argument("--api-key")
    parser.add_argument("--context-length", type=int, default=163840)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument(
        "--disaggregation-mode", choices=["null", "prefill", "decode"], default="null"
    )
    parser.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    parser.add_argument("--disaggregation-transfer-backend", default="mooncake")
    argv = _with_config(parser, argv)
    _refuse_what_sglang_refuses(parser, argv)
    args, ignored = parser.parse_known_args(argv)
    if args.max_running_requests < 1:
        parser.error("--max-running-requests must be >= 1")
    return args, ignored


def _with_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """sglang's `--config FILE`: a YAML mapping of options (launch/lib.sh passes the API key this
    way), merged as sglang.srt.server_args.prepare_server_args does: the file's options first, so
    the command line's own win."""
    if "--config" not in argv:
        return argv
    at = argv.index("--config")
    if at + 1 >= len(argv):
        parser.error("argument --config: expected one argument")
    try:
        options = yaml.safe_load(Path(argv[at + 1]).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        parser.error(f"--config {argv[at + 1]}: {err}")
    if not isinstance(options, dict):
        parser.error(f"--config {argv[at + 1]}: must hold a mapping of options")
    merged = []
    for key, value in options.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            merged.append(flag)
        elif value not in (False, None):
            merged += [flag, str(value)]
    return merged + argv[:at] + argv[at + 2 :]


def _refuse_what_sglang_refuses(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """The sim takes sglang.launch_server's command line and, like it, refuses a flag sglang's
    parser refuses (launch/pdlib/engine_args.py); the flags it does not model are ignored."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from launch.pdlib import engine_args

    table = engine_args.option_table()
    if table is None:
        print("sim_engine: sglang is not installed; its flags are not checked", file=sys.stderr)
        return
    refused = engine_args.refusals(argv, table)
    if refused:
        parser.error("; ".join(message for _, message in refused))


async def serve(args: argparse.Namespace, timing: Timing) -> None:
    engine = Engine(args, timing)
    h = Handlers(engine)
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[h.require_api_key])
    app.router.add_get("/health", h.health)
    app.router.add_get("/health_generate", h.health)
    app.router.add_get("/ready", h.health)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, h.server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, h.model_info)
    app.router.add_get("/version", h.version)
    app.router.add_get("/v1/models", h.models)
    app.router.add_get("/v1/loads", h.loads)
    app.router.add_get("/get_load", h.get_load)
    app.router.add_get("/metrics", h.metrics)
    app.router.add_get("/sim/requests", h.sim_requests)
    app.router.add_post("/v1/chat/completions", h.chat)
    app.router.add_post("/generate", h.generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    if args.disaggregation_mode == "prefill":
        boot = Bootstrap(engine)
        bapp = web.Application()
        bapp.router.add_get("/route", boot.route)
        bapp.router.add_get("/health", boot.route)
        bapp.router.add_get("/sim/kv", boot.kv)
        brunner = web.AppRunner(bapp, access_log=None)
        await brunner.setup()
        await web.TCPSite(brunner, args.host, args.disaggregation_bootstrap_port).start()
        LOG.info(
            "bootstrap server listening on %s:%d", args.host, args.disaggregation_bootstrap_port
        )
    LOG.info("listening on %s:%d mode=%s", args.host, args.port, args.disaggregation_mode)
    tasks = [asyncio.create_task(engine.become_ready())]
    if args.disaggregation_mode != "prefill":
        tasks.append(asyncio.create_task(engine.decode_loop()))
    await asyncio.gather(*tasks)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stdout,
    )
    args, ignored = parse_args(sys.argv[1:] if argv is None else argv)
    timing = Timing.from_env()
    if ignored:
        LOG.info("accepted and ignored (no meaning in the simulation): %s", " ".join(ignored))
    try:
        asyncio.run(serve(args, timing))
    except KeyboardInterrupt:
        return 0
    except OSError as exc:
        LOG.error("cannot listen: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
