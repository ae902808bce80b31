"""bench/chaos: a PD stack under closed-loop load and a seeded schedule of faults, with its
invariants checked after every fault and at a final settle.

The load mixes short greedy requests and long prompts (each compared with the answer it got on
the healthy stack before any fault) and multiround chat sessions, through the router (through
this tool's own connection proxy, bench/lib/chaos_proxy.py, when proxy faults are drawn). Faults
come from bench/lib/chaos_plan.py's catalogue, one at a time: the load runs a while, the fault
is injected and ended, the load runs until a request succeeds again, then pauses (no new
request; those in flight end) and every engine must hold nothing within the settle bound.
So each fault has its own window of requests, and a broken invariant is the fault's. A fault
the stack does not recover or settle from ends the run there: a later fault would only fault
what is already down.

Everything is bounded: requests by count (--max-requests) and each by the bound its timeouts
imply (cut off and counted as a hang past it), each restart command by --command-timeout-s,
recovery by --recover-s, settling by --settle-s, the wait for an expected alert (--prometheus)
by --alert-wait-s. A process this tool stopped is continued before it exits, however it exits;
Ctrl-C and SIGTERM end the run with report.md written from the history so far, marked as
interrupted (exit 130). Loopback stacks only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import ipaddress
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import psutil

from bench.lib import chaos_alerts, chaos_check, chaos_plan
from bench.lib.chaos_proxy import ChaosProxy
from bench.lib.client import (
    ChatRequest,
    add_api_key_arg,
    auth_headers,
    first_model_id,
    redact,
    resolve_api_key,
    seeded_prompt,
    stream_chat,
)
from bench.lib.stack import stack_from_env_dir
from bench.lib.triage import CONNECTION, triage
from launch.pdlib import loadfiles, loads
from launch.pdlib.stack import http, load_stack
from launch.pdlib.supervise import supervisor_for
from launch.pdlib.unresponsive import UNRESPONSIVE
from launch.pdlib.wedged import WEDGED, WEDGED_AFTER_S

ROOT = Path(__file__).resolve().parents[2]
PD = ROOT / "launch" / "pd"
RESULTS = ROOT / "bench" / "results"
SCHEDULER_NAME = "sglang::schedul"  # sglang titles its scheduler processes sglang::scheduler*
# Upstream's default for decode's wait for a room's KV (prefill's inflight timeout has none).
WAITING_TIMEOUT_DEFAULT_S = 300.0
# How long after an engine-stop triage starts, and its probes' timeout: short, so that the
# hold it extends stays short.
TRIAGE_PROBE_S = 3.0
TRIAGE_FAST_S = 2.0
TRIAGE_WINDOW_S = 1.0
# A session's first message (words) and each round's max_tokens; each later message is 10 words.
SESSION_WORDS = 30
SESSION_TOKENS = 16
# Seconds a killed engine's processes may take to be reaped before its restart.
KILL_EXIT_S = 15.0
# Tries at each reference request on the healthy stack.
REFERENCE_TRIES = 3
# With --prometheus: the longest a fault is held past its drawn hold for its expected alerts to
# fire, and the longest they may take to resolve once it ended.
ALERT_WAIT_S = 300.0
# Exit status of a run ended by Ctrl-C or SIGTERM (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130
# How long a proxy fault's triage waits for the proxy to forward no request (engines idle).
PROXY_IDLE_S = 30.0


def _now(t0: float) -> float:
    return round(time.monotonic() - t0, 3)


class History:
    """history.jsonl, written as it happens, and the same records in memory for the checks."""

    def __init__(self, path: Path):
        self.t0 = time.monotonic()
        self.records: list[dict] = []
        self.path = path
        self._file = path.open("w")

    def now(self) -> float:
        return _now(self.t0)

    def add(self, record: dict) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class Options:
    env_dir: Path
    seed: int
    faults: int
    duration_s: float
    kinds: list[str]
    holds: tuple[float, float]
    only_fault: int | None
    out: Path
    short_clients: int
    long_clients: int
    session_clients: int
    short_prompts: int
    long_prompts: int
    short_words: int
    long_words: int
    short_tokens: int
    long_tokens: int
    session_rounds: int
    max_requests: int
    gap_s: float
    error_pause_s: float
    serve_s: float
    settle_s: float
    recover_s: float
    command_timeout_s: float
    wedged_after_s: float
    tie_logprob: float = chaos_check.TIE_LOGPROB
    triage_fast_s: float = TRIAGE_FAST_S
    triage_window_s: float = TRIAGE_WINDOW_S
    session_words: int = SESSION_WORDS
    session_tokens: int = SESSION_TOKENS
    triage_probe_s: float = TRIAGE_PROBE_S
    sim: bool = False
    model_in_generate: bool = False
    prometheus: str | None = None
    alert_wait_s: float = ALERT_WAIT_S
    api_key: str = field(default="", repr=False)


@dataclass
class Shared:
    """What the clients and the fault runner share: the current window, whether the load runs,
    and the fault now active (for the requests' live bounds)."""

    history: History
    base_bound_s: float
    window: str = "1"
    active_since: float | None = None
    sent: int = 0
    inflight: int = 0
    load: asyncio.Event = field(default_factory=asyncio.Event)
    done: bool = False

    def bound(self, start: float, now: float) -> float:
        spent = chaos_check.fault_time(self.history.records, start, now)
        if self.active_since is not None:
            spent += max(0.0, now - max(start, self.active_since))
        return self.base_bound_s + spent


# ---- the load -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    name: str  # short/3, long/1
    kind: str  # short or long
    body: dict


def greedy_prompts(opts: Options, model: str = "") -> list[Prompt]:
    """The greedy prompts; model named in each body when given (smg wants it on /generate
    when it routes by model, as it does for workers from its discovery file: xPyD)."""
    prompts = []
    for kind, count, words, tokens, offset in (
        ("short", opts.short_prompts, opts.short_words, opts.short_tokens, 0),
        ("long", opts.long_prompts, opts.long_words, opts.long_tokens, 10_000),
    ):
        for i in range(1, count + 1):
            text = seeded_prompt(opts.seed, offset + i, words)
            body = {
                "text": text,
                "sampling_params": {"max_new_tokens": tokens, "temperature": 0},
                "return_logprob": True,
            }
            if model:
                body["model"] = model
            prompts.append(Prompt(f"{kind}/{i}", kind, body))
    return prompts


async def generate(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One /generate through the router: ok with its token ids and logprobs, or the error."""
    try:
        async with session.post(url + "/generate", json=body) as resp:
            text = await resp.text()
            if resp.status != 200:
                error = f"HTTP {resp.status}: {text[:200]}"
                return {"ok": False, "status": resp.status, "error": error}
            data = json.loads(text)
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        return {"ok": False, "status": 0, "error": f"{type(exc).__name__}: {exc}"[:300]}
    if isinstance(data, list):
        data = data[0]
    meta = data.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    if not isinstance(finish, dict) or finish.get("type") not in ("length", "stop"):
        return {"ok": False, "status": 200, "error": f"finished by {json.dumps(finish)[:200]}"}
    logprobs = [x[0] for x in meta.get("output_token_logprobs") or []]
    answer = {"ok": True, "status": 200, "output_ids": data.get("output_ids"), "logprobs": logprobs}
    if meta.get("output_top_logprobs"):
        # [[token, logprob], ...] per position, where the body asked for top_logprobs_num.
        answer["top"] = [[[t[1], t[0]] for t in top or []] for top in meta["output_top_logprobs"]]
    if answer["output_ids"] is None:
        # A simulated engine answers text without token ids: the text is the answer compared.
        answer["text"] = data.get("text")
    return answer


class Load:
    """Closed-loop clients through the router: short and long greedy requests, multiround
    sessions. Each request is recorded once it ends."""

    def __init__(self, opts: Options, shared: Shared, url: str, model: str, refs: dict):
        self.opts, self.shared, self.url, self.model, self.refs = opts, shared, url, model, refs
        self.prompts = greedy_prompts(opts, model if opts.model_in_generate else "")
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        clients = (
            [("short", i) for i in range(1, self.opts.short_clients + 1)]
            + [("long", i) for i in range(1, self.opts.long_clients + 1)]
            + [("session", i) for i in range(1, self.opts.session_clients + 1)]
        )
        for kind, i in clients:
            runner = self._sessions if kind == "session" else self._greedy
            self.tasks.append(asyncio.create_task(runner(f"{kind}/{i}", kind, i)))

    async def stop(self) -> None:
        self.shared.done = True
        self.shared.load.set()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _turn(self) -> bool:
        """Wait until the load runs; False once the run is over or the count is spent."""
        # A client woken by the event's set() may run after a clear(): look again.
        while not self.shared.load.is_set():
            await self.shared.load.wait()
        if self.shared.done or self.shared.sent >= self.opts.max_requests:
            return False
        self.shared.sent += 1
        return True

    async def _bounded(self, coro) -> tuple[dict | None, float, float]:
        """Run one request under its live bound; (result or None when cut off, start, end)."""
        shared = self.shared
        start = shared.history.now()
        shared.inflight += 1
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if done:
                    return task.result(), start, shared.history.now()
                now = shared.history.now()
                if now - start > shared.bound(start, now):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                    return None, start, shared.history.now()
        finally:
            shared.inflight -= 1

    async def _after(self, record: dict) -> None:
        """A client pauses after an error, as a real one backs off: a router that answers 503
        at once would otherwise turn an outage into thousands of requests a second."""
        if not record["ok"]:
            await asyncio.sleep(self.opts.error_pause_s)

    def _record(self, rid: str, kind: str, prompt: str, window: str, result, start, end) -> dict:
        record = {
            "type": "request",
            "id": rid,
            "kind": kind,
            "prompt": prompt,
            "window": window,
            "start": start,
            "end": end,
        }
        if result is None:
            record |= {"ok": False, "hung": True, "error": "no answer within its bound; cut off"}
        else:
            record |= {"ok": result["ok"], "error": result.get("error", "")}
            if "output_ids" in result:
                record["output_ids"] = result["output_ids"]
                if "text" in result:
                    record["text"] = result["text"]
                want = self.refs.get(prompt, {}).get("logprobs") or []
                got = result.get("logprobs") or []
                same = result["output_ids"] == self.refs.get(prompt, {}).get("output_ids")
                if result["ok"] and same and want and len(got) == len(want):
                    record["logprob_diff"] = max(abs(a - b) for a, b in zip(got, want, strict=True))
        if record["error"]:
            record["error"] = redact(record["error"], self.opts.api_key)
        self.shared.history.add(record)
        return record

    async def _greedy(self, client: str, kind: str, index: int) -> None:
        mine = [p for p in self.prompts if p.kind == kind]
        connector = aiohttp.TCPConnector(limit=1)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        headers = auth_headers(self.opts.api_key)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, headers=headers
        ) as s:
            n = index - 1
            while await self._turn():
                prompt = mine[n % len(mine)]
                n += 1
                window = self.shared.window
                result, start, end = await self._bounded(generate(s, self.url, prompt.body))
                record = self._record(
                    f"{client}#{n}", kind, prompt.name, window, result, start, end
                )
                await self._after(record)

    async def _sessions(self, client: str, kind: str, index: int) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        headers = auth_headers(self.opts.api_key)
        n = 0
        session_no = 0
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1), timeout=timeout, headers=headers
        ) as s:
            while True:
                session_no += 1
                first = seeded_prompt(
                    self.opts.seed, 20_000 + 100 * index + session_no, self.opts.session_words
                )
                messages = [{"role": "user", "content": first}]
                for rnd in range(1, self.opts.session_rounds + 1):
                    if not await self._turn():
                        return
                    n += 1
                    window = self.shared.window
                    request = ChatRequest(
                        list(messages), self.opts.session_tokens, model=self.model
                    )
                    out, start, end = await self._bounded(stream_chat(s, self.url, request))
                    result = None if out is None else {"ok": out.success, "error": out.error}
                    name = f"session/{index}.{session_no} round {rnd}"
                    record = self._record(f"{client}#{n}", kind, name, window, result, start, end)
                    if not record["ok"]:
                        await self._after(record)
                        break
                    messages += [
                        {"role": "assistant", "content": out.text},
                        {"role": "user", "content": seeded_prompt(self.opts.seed, n, 10)},
                    ]


# ---- the stack ------------------------------------------------------------------------------


class Target:
    """The stack's instances as launch/pd knows them: processes, URLs, restart commands."""

    def __init__(self, env_dir: Path, sim: bool = False):
        self.env_dir = env_dir
        self.stack = load_stack(env_dir, sim=sim)
        self.supervisor = supervisor_for(self.stack, env_dir)
        self.clients = stack_from_env_dir(env_dir)
        self.urls = dict(self.clients.engines())
        self.router_url = self.clients.router_url

    def instances(self) -> dict[str, list[str]]:
        return {kind: [r.name for r in self.stack.of_kind(kind)] for kind in ("prefill", "decode")}

    def group(self, name: str) -> list[psutil.Process]:
        return self.supervisor.processes(self.stack.role(name).key)

    def schedulers(self, name: str) -> list[psutil.Process]:
        found = []
        for p in self.group(name):
            with contextlib.suppress(psutil.Error):
                if p.name().startswith(SCHEDULER_NAME):
                    found.append(p)
        return found

    def pd_timeouts_s(self) -> float:
        """Decode's wait for a room's KV plus prefill's wait for its transfer (when set): the
        longest the PD path itself may keep a request before failing it."""
        env = self.stack.env

        def longest(kind: str, key: str, default: float) -> float:
            values = []
            for index in env.instances(kind) or [None]:
                raw = env.role_env(kind, index).get(key, "")
                try:
                    values.append(float(raw) if raw else default)
                except ValueError:
                    values.append(default)
            return max(values)

        return longest(
            "decode", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", WAITING_TIMEOUT_DEFAULT_S
        ) + longest("prefill", "SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT", 0.0)

    def not_up(self, api_key: str) -> list[str]:
        """Each instance whose health endpoint does not answer 200, with what it answered."""
        problems = []
        for role in self.stack.roles.values():
            url = self.urls.get(role.name, self.router_url) + role.health_path
            reply = http(url, timeout=5, api_key=api_key)
            if reply.status != 200:
                problems.append(f"{role.name} {url}: {reply.status or reply.error}")
        return problems


def describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid} ({p.name()}, {p.status()})"
    except psutil.Error:
        return f"pid {p.pid}"


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running as the same processes (a pid may be reused), zombies not counted."""
    left = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
    return left


def stopped(procs: list[psutil.Process]) -> list[psutil.Process]:
    found = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.status() == psutil.STATUS_STOPPED:
                found.append(p)
    return found


class Paused:
    """Every process this tool stopped and has not continued yet; continued on any exit."""

    def __init__(self):
        self.procs: list[psutil.Process] = []

    def stop(self, procs: list[psutil.Process]) -> None:
        for p in procs:
            self.procs.append(p)
            p.suspend()

    def cont(self, procs: list[psutil.Process]) -> None:
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.resume()
            if p in self.procs:
                self.procs.remove(p)

    def cont_all(self) -> None:
        self.cont(list(self.procs))


# ---- the faults -----------------------------------------------------------------------------


class Injector:
    def __init__(
        self,
        opts: Options,
        target: Target,
        shared: Shared,
        paused: Paused,
        model: str,
        proxy: ChaosProxy | None = None,
    ):
        self.opts, self.target, self.shared, self.paused = opts, target, shared, paused
        self.model, self.proxy = model, proxy
        # launch/pd commands an interruption killed before they ended.
        self.cut: list[str] = []

    def now(self) -> float:
        return self.shared.history.now()

    async def command(self, *verb: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            str(PD),
            *verb,
            *(["--sim"] if self.opts.sim else []),
            "--env-dir",
            str(self.opts.env_dir),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            # Its own process group, in this session: an engine launch/pd restarts stays in the
            # session the stack runs in (launch/pdlib/supervise.py says why it matters).
            process_group=0,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.opts.command_timeout_s)
        except TimeoutError:
            proc.kill()
            out, _ = await proc.communicate()
            out += f"\n(killed after {self.opts.command_timeout_s:g} s)".encode()
        except asyncio.CancelledError:
            # Interrupted: killed now rather than left to the event loop's close, and said.
            proc.kill()
            await proc.wait()
            self.cut.append(f"launch/pd {' '.join(verb)}")
            raise
        text = redact(out.decode(errors="replace"), self.opts.api_key)
        return (proc.returncode if proc.returncode is not None else -1), text

    async def run_triage(self, fault: chaos_plan.Fault) -> dict:
        proxied = fault.parts[0].kind in chaos_plan.PROXIES
        if proxied:
            # Through the proxy, as the clients go: triage must tell their hung connections
            # from a stalled engine, and the engines are fine.
            client_url, expected = self.proxy.url, ["clients"]
        else:
            client_url = self.target.router_url
            expected = [t for t in fault.targets() if t in self.target.urls]
        try:
            verdict = await triage(
                client_url,
                self.target.clients,
                fast_s=self.opts.triage_fast_s,
                window_s=self.opts.triage_window_s,
                probe_timeout_s=self.opts.triage_probe_s,
                model=self.model,
                api_key=self.opts.api_key,
                wedged_after_s=self.opts.wedged_after_s,
            )
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            why = redact(f"triage failed: {type(exc).__name__}: {exc}", self.opts.api_key)
            return {"ran": False, "why_not": why}
        if proxied:
            named = expected if verdict.verdict == CONNECTION else []
        else:
            named = [
                t
                for t in expected
                if verdict.verdict in (UNRESPONSIVE, WEDGED)
                and f"{t} ({self.target.urls[t]})" in verdict.reason
            ]
        return {
            "ran": True,
            "at": self.now(),
            "verdict": verdict.verdict,
            "reason": redact(verdict.reason, self.opts.api_key),
            "expected": expected,
            "named": named,
        }

    def triage_plan(self, fault: chaos_plan.Fault) -> tuple[chaos_plan.Part | None, str]:
        """Which part triage runs during, or why it runs during none."""
        first = fault.parts[0]
        if first.kind == "scheduler-stop":
            if first.hold_s < self.opts.wedged_after_s + 1:
                return None, (
                    f"the {first.hold_s:g} s hold is shorter than triage needs to tell a stopped "
                    f"scheduler from a busy one (--wedged-after-s {self.opts.wedged_after_s:g} s "
                    "+ 1 s)"
                )
            return first, ""
        if first.kind in ("engine-stop", "engine-kill", *chaos_plan.PROXIES):
            return first, ""
        return None, chaos_plan.CATALOGUE[first.kind].expected.split("Triage is not run: ")[-1]

    async def part(self, part: chaos_plan.Part, record: dict, triage_for, fault) -> None:
        if part.after_s:
            await asyncio.sleep(part.after_s)
        record["start"] = self.now()
        try:
            if part.kind in chaos_plan.STOPS:
                await self._stop(part, record, triage_for, fault)
            elif part.kind == "engine-kill":
                await self._kill(part, record, triage_for, fault)
            elif part.kind in chaos_plan.PROXIES:
                await self._proxy(part, record, triage_for, fault)
            else:
                await self._restart(part, record)
        except (psutil.Error, OSError) as exc:
            record["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            record["end"] = self.now()

    async def _restart(self, part: chaos_plan.Part, record: dict) -> None:
        """A launch/pd verb that restarts instances: the router, the whole stack in turn, or
        every instance of a role one at a time."""
        if part.kind == "router-restart":
            names, verb = ["router"], ["restart", "router"]
        elif part.kind == "rolling-restart":
            names = [r.name for r in self.target.stack.of_kind(part.target)]
            verb = ["rolling-restart", part.target]
        else:
            names, verb = list(self.target.stack.roles), ["co-restart"]
        group = [p for name in names for p in self.target.group(name)]
        files = loadfiles.open_by(group)
        rc, out = await self.command(*verb)
        record["rc"], record["output"] = rc, out[-2000:]
        if rc != 0:
            record["error"] = f"launch/pd {' '.join(verb)} exited {rc}: {out[-600:]}"
        record["left"] = [describe(p) for p in alive(group)]
        record["files_left"] = sorted(f for f in files if os.path.exists(f))

    async def _hold(self, part, record, triage_for, fault, triage_after_s, ready=None) -> None:
        """Hold the fault: triage during it where planned (after triage_after_s, and once
        ready() returns), then the rest of the drawn hold, then, with --prometheus, until the
        fault's expected alerts fire. The alerts are watched from the start of the hold, so
        each one's time is when it was first seen firing, not the end of the hold."""
        watching = asyncio.create_task(self._alerts_fire(part, record, fault))
        try:
            if triage_for is part:
                await asyncio.sleep(triage_after_s)
                if ready is not None:
                    await ready()
                record["triage"] = await self.run_triage(fault)
            rest = part.hold_s - (self.now() - record["start"])
            if rest > 0:
                await asyncio.sleep(rest)
            await watching
        finally:
            watching.cancel()

    async def _alerts_fire(self, part, record, fault) -> None:
        wanted = chaos_plan.expected_alerts(fault)
        if not self.opts.prometheus or part is not fault.parts[0] or not wanted:
            return
        seen, error = await chaos_alerts.wait(
            self.opts.prometheus,
            self.target.stack.unit_prefix,
            wanted,
            True,
            self.opts.alert_wait_s,
            self.now,
        )
        record["alerts"] = [
            {"alert": name, "instance": instance, "fired": seen[(name, instance)]}
            for name, instance in wanted
        ]
        if error:
            record["alerts_error"] = error

    async def _stop(self, part, record, triage_for, fault) -> None:
        group = self.target.group(part.target)
        if not group:
            record["error"] = f"{part.target} is not running (launch/pd has no live process)"
            return
        if part.kind == "scheduler-stop":
            procs = self.target.schedulers(part.target)
            if not procs:
                record["error"] = (
                    f"no sglang scheduler process under {part.target} pid {group[0].pid}: "
                    "scheduler-stop needs a real sglang engine"
                )
                return
            after = self.opts.wedged_after_s + 0.5
        else:
            procs = group
            after = 0.5
        try:
            self.paused.stop(procs)
            await self._hold(part, record, triage_for, fault, after)
        finally:
            self.paused.cont(procs)
        await asyncio.sleep(0.2)
        record["still_stopped"] = [describe(p) for p in stopped(self.target.group(part.target))]

    async def _proxy(self, part, record, triage_for, fault) -> None:
        proxy = self.proxy
        stalled, resets = proxy.stalled, proxy.resets
        if part.kind == "proxy-stall":
            proxy.stall()
        else:
            proxy.begin_reset()

        async def engines_idle() -> None:
            # The requests forwarded before the fault began end first: triage must find the
            # engines idle, or it cannot tell the connection layer from a busy engine.
            await proxy.idle(PROXY_IDLE_S)
            record["forwarding_at_triage"] = proxy.forwarding

        try:
            await self._hold(part, record, triage_for, fault, 0.5, engines_idle)
        finally:
            proxy.end()
        record["stalled"] = proxy.stalled - stalled
        record["reset"] = proxy.resets - resets

    async def _kill(self, part, record, triage_for, fault) -> None:
        group = self.target.group(part.target)
        if not group:
            record["error"] = f"{part.target} is not running (launch/pd has no live process)"
            return
        files = loadfiles.open_by(group)
        pgid = os.getpgid(group[0].pid)
        if pgid == os.getpgrp():
            record["error"] = f"{part.target} runs in this tool's own process group; not killed"
            return
        os.killpg(pgid, signal.SIGKILL)
        watching = asyncio.create_task(self._alerts_fire(part, record, fault))
        try:
            await asyncio.to_thread(psutil.wait_procs, group, KILL_EXIT_S)
            if triage_for is part:
                record["triage"] = await self.run_triage(fault)
            await watching  # the restart waits for the alerts (or --alert-wait-s)
        finally:
            watching.cancel()
        rc, out = await self.command("restart", part.target)
        record["rc"], record["output"] = rc, out[-2000:]
        if rc != 0:
            record["error"] = f"launch/pd restart {part.target} exited {rc}: {out[-600:]}"
        record["left"] = [describe(p) for p in alive(group)]
        record["files_left"] = sorted(f for f in files if os.path.exists(f))

    async def inject(self, fault: chaos_plan.Fault) -> dict:
        triage_for, why_not = self.triage_plan(fault)
        parts = [{"kind": p.kind, "target": p.target, "hold_s": p.hold_s} for p in fault.parts]
        start = self.now()
        self.shared.active_since = start
        try:
            await asyncio.gather(
                *(
                    self.part(p, rec, triage_for, fault)
                    for p, rec in zip(fault.parts, parts, strict=True)
                )
            )
        finally:
            self.shared.active_since = None
        found = [rec.pop("triage") for rec in parts if "triage" in rec]
        triaged = found[0] if found else {"ran": False, "why_not": why_not}
        if triage_for is not None and not found:
            triaged = {"ran": False, "why_not": "the fault's action failed before triage"}
        return {
            "type": "fault",
            "index": fault.index,
            "kind": fault.kind,
            "describe": fault.describe(),
            "planned_s": fault.at_s,
            "start": start,
            "end": self.now(),
            "parts": parts,
            "triage": triaged,
        }


# ---- the run --------------------------------------------------------------------------------


async def held_now(target: Target, api_key: str) -> dict[str, object]:
    """What each engine holds now by its /v1/loads (quarantined rooms' KV included, in
    num_used_tokens), without the engines that hold nothing; a string where it could not be
    read."""
    state: dict[str, object] = {}
    for name, url in target.urls.items():
        snapshot = await asyncio.to_thread(loads.read, url, api_key, 5.0)
        counts = snapshot if isinstance(snapshot, str) else loads.held(snapshot)
        if counts:
            state[name] = counts
    return state


async def settle(target: Target, opts: Options, shared: Shared, window: str) -> dict:
    """Pause the load, let every request in flight end, then wait for nothing held."""
    shared.load.clear()
    while shared.inflight:
        await asyncio.sleep(0.1)
    paused = shared.history.now()
    state: dict[str, object] = {}
    while True:
        state = await held_now(target, opts.api_key)
        took = shared.history.now() - paused
        if not state or took > opts.settle_s:
            break
        await asyncio.sleep(0.5)
    record = {
        "type": "settle",
        "window": window,
        "paused": paused,
        "settled": not state,
        "settle_s": round(took, 2),
        "bound_s": opts.settle_s,
        "held": {k: loads.describe(v) if isinstance(v, dict) else v for k, v in state.items()},
    }
    shared.history.add(record)
    return record


async def recovery(opts: Options, shared: Shared, fault: int, since: float) -> dict:
    """The first success among requests sent after the fault ended."""
    history = shared.history
    recovered = None
    while history.now() - since <= opts.recover_s:
        if shared.sent >= opts.max_requests:
            record = {"type": "recovery", "fault": fault, "recovered_s": None}
            history.add(record | {"skipped": f"--max-requests {opts.max_requests} spent"})
            return history.records[-1]
        firsts = [
            r["end"]
            for r in history.records
            if r["type"] == "request" and r["ok"] and r["start"] >= since
        ]
        if firsts:
            recovered = round(min(firsts) - since, 2)
            break
        await asyncio.sleep(0.2)
    record = {
        "type": "recovery",
        "fault": fault,
        "recovered_s": recovered,
        "bound_s": opts.recover_s,
    }
    history.add(record)
    return record


def say(history: History, text: str) -> None:
    print(f"[{history.now():7.1f} s] {text}", flush=True)


async def references(url: str, opts: Options, model: str) -> tuple[dict, str | None]:
    """Each greedy prompt's answer on the healthy stack, one at a time, each within
    REFERENCE_TRIES tries: on cores shared with other work a long prompt alone has outlasted a
    10 s PD timeout once. A prompt that fails every try ends the run (the stack does not serve
    its own load)."""
    refs = {}
    connector = aiohttp.TCPConnector(limit=1)
    timeout = aiohttp.ClientTimeout(total=opts.serve_s)
    headers = auth_headers(opts.api_key)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as s:
        for prompt in greedy_prompts(opts, model if opts.model_in_generate else ""):
            errors = []
            # The top two logprobs at each position tell a tie the engine may break either
            # way from a wrong answer (chaos_check.tie_break).
            body = prompt.body | {"top_logprobs_num": 2}
            for _ in range(REFERENCE_TRIES):
                got = await generate(s, url, body)
                if got["ok"]:
                    refs[prompt.name] = got
                    break
                errors.append(redact(got["error"], opts.api_key))
            else:
                return refs, f"{prompt.name}, {REFERENCE_TRIES} tries: " + " | ".join(errors)
    return refs, None


async def alerts_resolve(opts: Options, target: Target, shared: Shared, record: dict) -> None:
    """With --prometheus, after a fault whose alerts were waited for: wait until the ones that
    fired resolve, and record each one's fired and resolved times."""
    first = record["parts"][0]
    if "alerts" not in first:
        return
    fired = [(a["alert"], a["instance"]) for a in first["alerts"] if a["fired"] is not None]
    seen, error = await chaos_alerts.wait(
        opts.prometheus,
        target.stack.unit_prefix,
        fired,
        False,
        opts.alert_wait_s,
        shared.history.now,
    )
    shared.history.add(
        {
            "type": "alerts",
            "fault": record["index"],
            "wait_s": opts.alert_wait_s,
            "fault_start": record["start"],
            "fault_end": record["end"],
            "alerts": [
                a | {"resolved": seen.get((a["alert"], a["instance"]))} for a in first["alerts"]
            ],
            "error": first.get("alerts_error") or error,
        }
    )


def on_signals(task: asyncio.Task, caught: list[str]) -> None:
    """Ctrl-C and SIGTERM cancel the run (once), so that it continues what it stopped and
    writes its report from the history so far."""

    def handle(sig: signal.Signals) -> None:
        if not caught:
            caught.append(sig.name)
            task.cancel()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handle, sig)


async def run(opts: Options, target: Target, schedule: list[chaos_plan.Fault], replay: str) -> int:
    opts.out.mkdir(parents=True, exist_ok=True)
    history = History(opts.out / "history.jsonl")
    pd_timeouts = target.pd_timeouts_s()
    shared = Shared(history, opts.serve_s + pd_timeouts)
    paused = Paused()
    load = None
    proxy = None
    caught: list[str] = []
    injecting: chaos_plan.Fault | None = None
    injector = None
    on_signals(asyncio.current_task(), caught)
    try:
        if any(kind in chaos_plan.PROXIES for kind in opts.kinds):
            proxy = ChaosProxy(target.router_url)
            await proxy.start()
            say(history, f"clients go through the connection proxy at {proxy.url}")
        model = await first_model_id(target.router_url, 10.0, opts.api_key)
        say(history, f"taking the reference answers of {len(greedy_prompts(opts))} prompts")
        refs, failed = await references(target.router_url, opts, model)
        if failed:
            print(
                f"bench/chaos: the healthy stack did not serve a reference request: {failed}",
                file=sys.stderr,
            )
            return 2
        history.add(
            {
                "type": "run",
                "seed": opts.seed,
                "env_dir": str(opts.env_dir),
                "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "schedule": [f.to_json() for f in schedule],
                "faults": opts.faults,
                "only_fault": opts.only_fault,
                "kinds": opts.kinds,
                "holds_s": list(opts.holds),
                "duration_s": opts.duration_s,
                "serve_s": opts.serve_s,
                "pd_timeouts_s": pd_timeouts,
                "bound_base_s": shared.base_bound_s,
                "settle_s": opts.settle_s,
                "recover_s": opts.recover_s,
                "replay": replay,
                "sim": opts.sim,
                "proxy": proxy.url if proxy else None,
                "prometheus": opts.prometheus,
                "alert_wait_s": opts.alert_wait_s,
                "tie_logprob": opts.tie_logprob,
            }
        )
        for name, got in refs.items():
            history.add(
                {
                    "type": "reference",
                    "prompt": name,
                    "output_ids": got["output_ids"],
                    **({"text": got["text"]} if "text" in got else {}),
                    "logprobs": got["logprobs"],
                    **({"top": got["top"]} if "top" in got else {}),
                }
            )
        load = Load(opts, shared, proxy.url if proxy else target.router_url, model, refs)
        injector = Injector(opts, target, shared, paused, model, proxy)
        load_start = history.now()
        shared.load.set()
        load.start()
        say(history, f"load running; {len(schedule)} fault(s) to inject")
        for fault in schedule:
            if shared.sent >= opts.max_requests:
                why = f"its --max-requests {opts.max_requests} were sent"
                later = [f.index for f in schedule if f.index >= fault.index]
                history.add(
                    {"type": "stop", "after": fault.index - 1, "why": why, "not_run": later}
                )
                say(history, f"{why}: fault #{fault.index} and later not run")
                break
            shared.window = str(fault.index)
            shared.load.set()
            wait = max(opts.gap_s, load_start + fault.at_s - history.now())
            await asyncio.sleep(wait)
            say(history, f"injecting {fault.describe()}")
            injecting = fault
            record = await injector.inject(fault)
            injecting = None
            history.add(record)
            problems = [p["error"] for p in record["parts"] if p.get("error")]
            say(
                history,
                f"fault #{fault.index} ended after {record['end'] - record['start']:.1f} s"
                + (f"; FAILED: {problems[0][:300]}" if problems else "")
                + f"; triage: {chaos_check.triage_text(record)[:200]}",
            )
            rec = await recovery(opts, shared, fault.index, record["end"])
            if opts.prometheus:
                await alerts_resolve(opts, target, shared, record)
            settled = await settle(target, opts, shared, str(fault.index))
            rows = [r for r in chaos_check.window_rows(history.records) if r["fault"] is record]
            row = rows[0]
            say(
                history,
                f"fault #{fault.index}: {row['served']} served, {row['failed']} failed, "
                f"{row['wrong']} wrong; recovery {chaos_check._seconds(rec['recovered_s'])}; "
                + (
                    f"held nothing {settled['settle_s']:.1f} s after the load paused"
                    if settled["settled"]
                    else f"NOT SETTLED within {opts.settle_s:g} s: {settled['held']}"
                ),
            )
            if rec["recovered_s"] is None and not rec.get("skipped") or not settled["settled"]:
                # A stack that did not come back has nothing more to qualify: a later fault
                # would only fault what is already down.
                later = [f.index for f in schedule if f.index > fault.index]
                why = "recover" if rec["recovered_s"] is None else "settle"
                why = f"the stack did not {why}"
                history.add({"type": "stop", "after": fault.index, "why": why, "not_run": later})
                say(history, f"{why} after fault #{fault.index}: the run stops here")
                break
        else:
            shared.window = "final"
            rest = load_start + opts.duration_s - history.now()
            if rest > 0 and shared.sent < opts.max_requests and opts.only_fault is None:
                shared.load.set()
                say(history, f"load for the {rest:.0f} s left of --duration")
                await asyncio.sleep(rest)
            final = await settle(target, opts, shared, "final")
            state = "held nothing" if final["settled"] else str(final["held"])
            say(history, f"final settle: {state}")
    except asyncio.CancelledError:
        if not caught:
            raise
        history.add(
            {
                "type": "interrupted",
                "signal": caught[0],
                "at": history.now(),
                "window": shared.window,
                "injecting": injecting.describe() if injecting else None,
                "commands_killed": injector.cut if injector else [],
            }
        )
        say(history, f"{caught[0]}: interrupted; continuing what it stopped, then the report")
    finally:
        paused.cont_all()
        if proxy is not None:
            proxy.end()
        if load is not None:
            await load.stop()
        if proxy is not None:
            await proxy.close()
        history.close()
    violations = chaos_check.check(history.records)
    report = chaos_check.render(history.records, violations)
    (opts.out / "report.md").write_text(report)
    print(report)
    if violations:
        for v in violations:
            print(f"bench/chaos: seed {opts.seed}: broken: {v.line()}", file=sys.stderr)
            if v.window != "final":
                print(
                    f"  replay: {chaos_check.replay_command({'replay': replay}, v.window)}",
                    file=sys.stderr,
                )
    if caught:
        print(
            f"bench/chaos: interrupted by {caught[0]}; every process it stopped was continued; "
            f"history and report (so far) in {opts.out}",
            file=sys.stderr,
        )
        return INTERRUPTED
    if violations:
        return 1
    print(f"bench/chaos: every invariant held; history and report in {opts.out}")
    return 0


# ---- the command line -----------------------------------------------------------------------


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = -1
        if value <= 0:
            raise argparse.ArgumentTypeError(f"wants a number > 0, got {text!r}")
        return value

    return parse


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"wants a whole number >= 0, got {text!r}")
    return int(text)


def _holds(text: str) -> tuple[float, float]:
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants MIN,MAX seconds, got {text!r}") from None
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"wants 0 < MIN <= MAX, got {text!r}")
    return low, high


class _DefaultsInHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Every default in --help: the formatter's, or for an option whose default is worked out
    at run time (None), the words its own help gives."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/chaos",
        description="Qualify a running PD stack under random faults and load: a seeded "
        "schedule of faults, each followed by checks that no greedy request got a wrong "
        "answer, none hung past its bound, every engine holds nothing once load pauses, and "
        "triage named the faulted component where requests failed. Writes history.jsonl and "
        "report.md to --out; exit 0 when every invariant held, 1 when one broke (with the "
        "command that replays that fault alone), 2 on bad input or a stack that is not up, 130 "
        "when interrupted (Ctrl-C, SIGTERM; report.md is written from the history so far).",
        formatter_class=_DefaultsInHelp,
    )
    p.add_argument(
        "--env-dir",
        type=Path,
        default=argparse.SUPPRESS,
        help="the stack's env dir (default: this checkout's env/)",
    )
    p.add_argument("--seed", type=int, default=0, help="schedule and prompt seed")
    p.add_argument("--faults", type=_positive(int), default=6, help="faults to draw")
    p.add_argument(
        "--duration",
        type=_positive(float),
        default=300.0,
        help="seconds of load over which the faults are planned (a fault waits for the one "
        "before it to settle)",
    )
    p.add_argument(
        "--kinds",
        default=None,
        help="comma-separated fault kinds to draw from; a kind the stack cannot run is refused "
        "with the reason (default: every kind of the catalogue the stack can run; catalogue: "
        f"{', '.join(chaos_plan.CATALOGUE)})",
    )
    p.add_argument(
        "--sim",
        action="store_true",
        default=False,
        help="the stack runs simulated engines (launch/pd up --sim): its restarts pass --sim, "
        "and scheduler-stop is refused",
    )
    p.add_argument(
        "--hold-s",
        type=_holds,
        default=",".join(f"{s:g}" for s in chaos_plan.HOLD_S),
        metavar="MIN,MAX",
        help="range of a stop or proxy fault's hold, in seconds",
    )
    p.add_argument(
        "--only-fault",
        type=_positive(int),
        metavar="K",
        default=argparse.SUPPRESS,
        help="run only fault K of the schedule, after --gap-s of load (default: all)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print the schedule and exit (default: off)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=argparse.SUPPRESS,
        help="results directory (default: bench/results/chaos-<UTC time>)",
    )
    p.add_argument("--short-clients", type=_count, default=2, help="short greedy clients")
    p.add_argument("--long-clients", type=_count, default=1, help="long-prompt clients")
    p.add_argument("--session-clients", type=_count, default=1, help="multiround clients")
    p.add_argument("--short-prompts", type=_positive(int), default=6, help="short prompts")
    p.add_argument("--long-prompts", type=_positive(int), default=2, help="long prompts")
    p.add_argument("--short-words", type=_positive(int), default=12, help="words per short prompt")
    p.add_argument("--long-words", type=_positive(int), default=150, help="words per long prompt")
    p.add_argument("--short-tokens", type=_positive(int), default=12, help="short max_new_tokens")
    p.add_argument("--long-tokens", type=_positive(int), default=8, help="long max_new_tokens")
    p.add_argument("--session-rounds", type=_positive(int), default=4, help="rounds per session")
    p.add_argument(
        "--session-words",
        type=_positive(int),
        default=SESSION_WORDS,
        help="words in a session's first message (each later one has 10)",
    )
    p.add_argument(
        "--session-tokens",
        type=_positive(int),
        default=SESSION_TOKENS,
        help="a session round's max_tokens",
    )
    p.add_argument(
        "--max-requests", type=_positive(int), default=20000, help="requests sent at most"
    )
    p.add_argument(
        "--gap-s", type=_positive(float), default=2.0, help="seconds of load before each fault"
    )
    p.add_argument(
        "--error-pause-s",
        type=_positive(float),
        default=0.5,
        help="seconds a client waits after a failed request before its next",
    )
    p.add_argument(
        "--serve-s",
        type=_positive(float),
        default=60.0,
        help="seconds a request may take on a healthy stack; a request's bound is this plus "
        "the stack's PD timeouts plus the time faults were active while it was out",
    )
    p.add_argument(
        "--settle-s",
        type=_positive(float),
        default=60.0,
        help="seconds after the load pauses within which every engine must hold nothing",
    )
    p.add_argument(
        "--recover-s",
        type=_positive(float),
        default=120.0,
        help="seconds after a fault within which a request must succeed again",
    )
    p.add_argument(
        "--command-timeout-s",
        type=_positive(float),
        default=900.0,
        help="seconds a launch/pd restart or co-restart may take",
    )
    p.add_argument(
        "--wedged-after-s",
        type=_positive(float),
        default=WEDGED_AFTER_S,
        help="triage's threshold for a stopped scheduler; a scheduler-stop shorter than this "
        "plus 1 s is not triaged",
    )
    p.add_argument(
        "--triage-fast-s",
        type=_positive(float),
        default=TRIAGE_FAST_S,
        help="triage's bound for a healthy answer: a fresh connection answered within it "
        "clears the engines. A stack whose requests take longer (a 12-token request on the "
        "DSV4 stacks on a CPU: about 25 s) needs more, or triage blames an engine that is only "
        "slow",
    )
    p.add_argument(
        "--triage-window-s",
        type=_positive(float),
        default=TRIAGE_WINDOW_S,
        help="seconds triage watches the engines' counters for progress (as bench/triage's "
        "--window-s); a stack whose one forward pass takes longer needs more, or triage reads "
        "an engine mid-pass as stalled",
    )
    p.add_argument(
        "--triage-probe-s",
        type=_positive(float),
        default=None,
        help="seconds each triage probe (a one-token request, an engine's /v1/loads and "
        "/health) may take; more than --triage-fast-s (default: the larger of "
        f"{TRIAGE_PROBE_S:g} and --triage-fast-s + 1)",
    )
    p.add_argument(
        "--tie-logprob",
        type=_positive(float),
        default=chaos_check.TIE_LOGPROB,
        help="two tokens whose logprobs in a reference differ by at most this are tied: an "
        "answer that takes the other one there is listed as a tie, not wrong. The default fits "
        "env/cpu's tiny Llama (bf16 logits, answers equal to their reference within 5e-7); a "
        "stack whose logprobs move more with the batch (the DSV4 stacks: up to 0.06) needs "
        "more",
    )
    p.add_argument(
        "--prometheus",
        metavar="URL",
        default=None,
        help="a Prometheus that evaluates `launch/pd monitoring`'s rules for this stack: each "
        "fault is held until the alerts the catalogue expects for it fire, and they must "
        "resolve after it (default: none; alerts not checked, and the report says so)",
    )
    p.add_argument(
        "--alert-wait-s",
        type=_positive(float),
        default=ALERT_WAIT_S,
        help="with --prometheus: seconds a fault is held past its drawn hold for its alerts to "
        "fire, and seconds they may take to resolve once it ended",
    )
    add_api_key_arg(p)
    return p


# Options replay_base does not repeat from the parser: those it writes itself (the schedule's),
# and those a replay must not carry (which fault, printing only, where results go, the key).
_NOT_REPLAYED = {
    "help",
    "env_dir",
    "sim",
    "seed",
    "faults",
    "duration",
    "kinds",
    "hold_s",
    "prometheus",
    "only_fault",
    "dry_run",
    "out",
    "api_key",
}


def replay_base(args: argparse.Namespace, kinds: list[str], parser: argparse.ArgumentParser) -> str:
    """The command that draws the same schedule (without --only-fault) under the same load and
    the same judgement: every other option given a value other than its default."""
    low, high = args.hold_s
    rest = [
        f"{a.option_strings[0]} {getattr(args, a.dest):g}"
        if isinstance(getattr(args, a.dest), float)
        else f"{a.option_strings[0]} {getattr(args, a.dest)}"
        for a in parser._actions
        if a.dest not in _NOT_REPLAYED and getattr(args, a.dest) != a.default
    ]
    return (
        f"bench/chaos --env-dir {args.env_dir}{' --sim' if args.sim else ''} --seed {args.seed} "
        f"--faults {args.faults} --duration {args.duration:g} --kinds {','.join(kinds)} "
        f"--hold-s {low:g},{high:g}"
        + (f" --prometheus {args.prometheus}" if args.prometheus else "")
        + "".join(f" {r}" for r in rest)
    )


def prometheus_problem(url: str, kinds: list[str]) -> str:
    """Why this Prometheus cannot check the kinds' alerts ('' when it can): it does not
    answer, or it has not loaded a rule the catalogue expects."""
    try:
        rules = asyncio.run(chaos_alerts.alert_rules(url))
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError) as exc:
        return f"its rules could not be read: {type(exc).__name__}: {exc}"[:300]
    # An overlap's alerts are its stop's.
    drawn = [*kinds, *(chaos_plan.STOPS if "overlap" in kinds else ())]
    wanted = {name for kind in drawn for name in chaos_plan.CATALOGUE[kind].alerts}
    missing = sorted(wanted - rules)
    if missing:
        return (
            f"no alerting rule {', '.join(missing)} loaded (render them with launch/pd "
            "monitoring for this stack and load its rules.yml)"
        )
    return ""


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    args.env_dir = getattr(args, "env_dir", ROOT / "env")
    args.only_fault = getattr(args, "only_fault", None)
    args.dry_run = getattr(args, "dry_run", False)
    args.out = getattr(args, "out", None)
    given = [k.strip() for k in (args.kinds or "").split(",") if k.strip()]
    if args.kinds is not None and not given:
        p.error("--kinds: name at least one kind")
    for kind in given:
        if kind not in chaos_plan.CATALOGUE:
            p.error(
                f"--kinds: unknown fault kind {kind!r}; the catalogue has "
                f"{', '.join(chaos_plan.CATALOGUE)}"
            )
    if args.triage_probe_s is not None and args.triage_probe_s <= args.triage_fast_s:
        p.error(
            f"--triage-probe-s {args.triage_probe_s:g}: a probe must be allowed more than "
            f"--triage-fast-s ({args.triage_fast_s:g} s), or no answer counts as fast"
        )
    if not args.env_dir.is_dir():
        p.error(f"--env-dir {args.env_dir}: not a directory")
    try:
        target = Target(args.env_dir, args.sim)
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    instances = target.instances()
    if args.kinds is None:
        given = [k for k in chaos_plan.BUILT if not chaos_plan.refusal(k, instances, args.sim)]
    # In the catalogue's order: the schedule depends on which kinds, not on how they were listed.
    kinds = [k for k in chaos_plan.CATALOGUE if k in given]
    for kind in kinds:
        why = chaos_plan.refusal(kind, instances, args.sim)
        if why:
            p.error(f"--kinds: {why}")
    if args.only_fault is not None and args.only_fault > args.faults:
        p.error(f"--only-fault {args.only_fault}: the schedule has {args.faults} faults")
    schedule = chaos_plan.draw(
        args.seed, args.faults, args.duration, kinds, instances, args.hold_s, args.sim
    )
    replay = replay_base(args, kinds, p)
    print(f"bench/chaos: seed {args.seed}, schedule ({replay}):")
    print(chaos_plan.render(schedule), flush=True)
    if args.only_fault is not None:
        # Alone, it runs after --gap-s of load, not at its planned time.
        schedule = [dataclasses.replace(schedule[args.only_fault - 1], at_s=0.0)]
        print(f"running fault #{args.only_fault} alone", flush=True)
    if args.dry_run:
        return 0
    not_loopback = [url for url in [target.router_url, *target.urls.values()] if not _loopback(url)]
    if not_loopback:
        p.error(f"--env-dir {args.env_dir}: not a loopback stack: {', '.join(not_loopback)}")
    api_key = resolve_api_key(args.api_key, args.env_dir)
    down = target.not_up(api_key)
    if down:
        print(
            f"bench/chaos: the stack of {args.env_dir} is not up: {'; '.join(down)}. Start it "
            f"with launch/pd up{' --sim' if args.sim else ''} --env-dir {args.env_dir}",
            file=sys.stderr,
        )
        return 2
    if args.prometheus:
        missing = prometheus_problem(args.prometheus, kinds)
        if missing:
            print(f"bench/chaos: --prometheus {args.prometheus}: {missing}", file=sys.stderr)
            return 2
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    opts = Options(
        env_dir=args.env_dir,
        seed=args.seed,
        faults=args.faults,
        duration_s=args.duration,
        kinds=kinds,
        holds=args.hold_s,
        only_fault=args.only_fault,
        out=args.out or RESULTS / f"chaos-{stamp}",
        short_clients=args.short_clients,
        long_clients=args.long_clients,
        session_clients=args.session_clients,
        short_prompts=args.short_prompts,
        long_prompts=args.long_prompts,
        short_words=args.short_words,
        long_words=args.long_words,
        short_tokens=args.short_tokens,
        long_tokens=args.long_tokens,
        session_rounds=args.session_rounds,
        session_words=args.session_words,
        session_tokens=args.session_tokens,
        max_requests=args.max_requests,
        gap_s=args.gap_s,
        error_pause_s=args.error_pause_s,
        serve_s=args.serve_s,
        settle_s=args.settle_s,
        recover_s=args.recover_s,
        command_timeout_s=args.command_timeout_s,
        wedged_after_s=args.wedged_after_s,
        tie_logprob=args.tie_logprob,
        triage_fast_s=args.triage_fast_s,
        triage_window_s=args.triage_window_s,
        triage_probe_s=args.triage_probe_s or max(TRIAGE_PROBE_S, args.triage_fast_s + 1),
        sim=args.sim,
        model_in_generate=target.stack.several,
        prometheus=args.prometheus,
        alert_wait_s=args.alert_wait_s,
        api_key=api_key,
    )
    # Before the run's own handlers are in place (on_signals), SIGTERM ends it as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return asyncio.run(run(opts, target, schedule, replay))
    except KeyboardInterrupt:
        print("bench/chaos: interrupted; every process it stopped was continued", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
