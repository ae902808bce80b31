"""Triage: is a stuck client request the connection layer's fault or the engines'?

Measures, then decides. Measurements: engine load and scheduler time from every prefill and
decode instance's /metrics and the age of its scheduler's load snapshot from /v1/loads, each
read twice a window apart, and whether each answers /health; one request over a fresh
connection to the client's URL; the same directly to the router when that is a different URL;
and, when an engine did not answer, how the router lists it (GET /workers). The decision
(`decide`) is a pure function of those facts so it can be tested on recorded numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from bench.lib import promtext
from bench.lib.client import (
    ChatRequest,
    add_api_key_arg,
    auth_headers,
    first_model_id,
    redact,
    resolve_api_key,
    stream_chat,
)
from bench.lib.stack import Stack, add_stack_args, stack_from_args
from launch.pdlib.rotation import RouterList, list_workers
from launch.pdlib.unresponsive import (
    NOTHING_ANSWERED,
    UNRESPONSIVE,
    Silent,
    no_answer,
    reason,
    router_view,
)
from launch.pdlib.wedged import (
    LOADS_PATH,
    LOADS_TIMEOUT_S,
    WEDGED,
    WEDGED_AFTER_S,
    Life,
    Snapshot,
    Wedged,
    scheduler_seconds,
    snapshot_from,
)
from launch.pdlib.wedged import reason as wedged_reason

CONNECTION = "connection layer between client and router"
SATURATED = "engine saturated"
STALLED = "engine stalled"
INCONCLUSIVE = "inconclusive"


@dataclass
class Probe:
    name: str
    url: str
    ok: bool
    latency_s: float
    tokens: int = 0
    error: str = ""
    # The HTTP status the server answered with; 0 when none came (timeout, refused).
    status: int = 0

    def describe(self) -> str:
        if self.ok:
            return (
                f"{self.name} {self.url}: answered in {self.latency_s:.3f} s "
                f"({self.tokens} tokens) over a fresh connection"
            )
        return f"{self.name} {self.url}: failed after {self.latency_s:.3f} s: {self.error}"


@dataclass
class EngineLoad:
    role: str  # the instance: prefill, decode, or decode/2 of several
    url: str
    ok: bool
    error: str = ""
    window_s: float = 0.0
    before: dict[str, float | None] = field(default_factory=dict)
    after: dict[str, float | None] = field(default_factory=dict)
    # Endpoints that gave no answer at all, each as unresponsive.no_answer() words.
    no_answer: list[str] = field(default_factory=list)
    # What /health answered ("HTTP 200 in 0.004 s"); "" when it was not asked.
    health: str = ""
    # Its scheduler's own signs of running: load snapshot ages and scheduler time.
    scheduler: Life = field(default_factory=Life)

    def _max(self, key: str) -> float | None:
        vals = [v for v in (self.before.get(key), self.after.get(key)) if v is not None]
        return max(vals) if vals else None

    @property
    def busy(self) -> bool:
        return bool(self._max("running")) or bool(self._max("queued"))

    @property
    def queue_growing(self) -> bool:
        b, a = self.before.get("queued"), self.after.get("queued")
        return b is not None and a is not None and a > b

    @property
    def producing(self) -> bool | None:
        """Whether the engine made progress during the window: tokens came out (generation,
        prompt or realtime counters, or a nonzero throughput gauge), or requests left it (running
        plus queued went down). None when no metric tells.

        A prefill engine in PD makes no generation tokens, so the generation counters alone
        would call a busy prefill stalled while it hands requests on to decode."""
        signals = []
        thr = self._max("gen_throughput")
        if thr is not None:
            signals.append(thr > 0)
        for key in ("generation_tokens_total", "prompt_tokens_total", "realtime_tokens_total"):
            b, a = self.before.get(key), self.after.get(key)
            if b is not None and a is not None:
                signals.append(a > b)
        work = [(p.get("running"), p.get("queued")) for p in (self.before, self.after)]
        if all(r is not None and q is not None for r, q in work):
            (rb, qb), (ra, qa) = work
            signals.append(ra + qa < rb + qb)
        return any(signals) if signals else None

    def wedged(self, after_s: float) -> Wedged | None:
        """Its HTTP server answers and its scheduler shows it stopped (launch/pdlib/wedged.py)."""
        signals, support = self.scheduler.stopped(after_s)
        if not signals or self.no_answer:
            return None
        answered = f"/health: {self.health}" if self.health else "/metrics answered"
        return Wedged(self.role, self.url, answered, tuple(signals), tuple(support))

    def describe(self) -> str:
        if self.no_answer:
            return f"{self.role} {self.url}: " + "; ".join(self.no_answer)
        health = f"; /health: {self.health}" if self.health else ""
        if not self.ok:
            return f"{self.role} {self.url}/metrics: unreadable: {self.error}{health}"

        def fmt(key: str) -> str:
            b, a = self.before.get(key), self.after.get(key)
            show = lambda v: "n/a" if v is None else f"{v:g}"  # noqa: E731
            return f"{show(b)} -> {show(a)}"

        scheduler = self.scheduler.describe()
        return (
            f"{self.role} {self.url}: running {fmt('running')}, queued {fmt('queued')}, "
            f"gen_throughput {fmt('gen_throughput')} tok/s, generation_tokens_total "
            f"{fmt('generation_tokens_total')} over {self.window_s:.1f} s{health}"
            + (f"; {scheduler}" if scheduler else "")
        )


@dataclass
class Verdict:
    verdict: str
    reason: str
    evidence: list[str]
    # The same facts as numbers (probes and engine samples), for --json readers.
    measurements: dict = field(default_factory=dict)
    # The router's own statements about the engines it could not use, where it made some.
    router: list[str] = field(default_factory=list)

    def render(self) -> str:
        lines = [f"triage verdict: {self.verdict}", f"because: {self.reason}"]
        if self.router:
            lines += ["the router says:", *(f"  - {r}" for r in self.router)]
        lines += ["evidence:", *(f"  - {e}" for e in self.evidence)]
        return "\n".join(lines)


def _router_says(
    probes: list[Probe], silent: list[EngineLoad], listing: RouterList | None
) -> tuple[bool, list[str]]:
    """Whether the router answered at all, and its own statements: the error it gave the probe
    and how it lists each silent engine. The last probe is the router's (the client URL is)."""
    said = []
    router = probes[-1] if probes else None
    answered = bool(router and router.status)
    if router and router.status and not router.ok:
        said.append(f"to the probe: {router.error}")
    if listing is not None:
        answered = answered or listing.answered
        if listing.error:
            said.append(f"nothing about its workers: {listing.error}")
        else:
            by_url = {str(w.get("url", "")).rstrip("/"): w for w in listing.workers}
            for e in silent:
                said.append(f"{e.role}: {router_view(by_url.get(e.url.rstrip('/')))}")
    return answered, said


def decide(
    probes: list[Probe],
    engines: list[EngineLoad],
    fast_s: float,
    router_list: RouterList | None = None,
    wedged_after_s: float = WEDGED_AFTER_S,
) -> Verdict:
    """router_list: the router's GET /workers; None when it was not asked (every engine
    answered). wedged_after_s: how old a scheduler's load snapshot (or how long its time
    counters still) before its scheduler reads as wedged."""
    evidence = [p.describe() for p in probes] + [e.describe() for e in engines]
    measurements = {
        "fast_s": fast_s,
        "wedged_after_s": wedged_after_s,
        "probes": [asdict(p) for p in probes],
        "engines": [asdict(e) for e in engines],
        "router_workers": None if router_list is None else asdict(router_list),
    }

    def out(verdict: str, reason: str, router: list[str] | None = None) -> Verdict:
        return Verdict(verdict, reason, evidence, measurements, router or [])

    if not engines:
        return out(
            INCONCLUSIVE, "no engine URL to read: give --env-dir or --prefill-url/--decode-url"
        )
    silent = [e for e in engines if e.no_answer]
    if silent:
        answering = [e.role for e in engines if not e.no_answer]
        router_answered, router = _router_says(probes, silent, router_list)
        because = reason([Silent(e.role, e.url, tuple(e.no_answer)) for e in silent], answering)
        if answering or router_answered:
            return out(UNRESPONSIVE, because, router)
        return out(INCONCLUSIVE, f"{NOTHING_ANSWERED}: {because}", router)
    wedged = [w for e in engines if (w := e.wedged(wedged_after_s))]
    if wedged:
        running = [e.role for e in engines if e.scheduler.runs(wedged_after_s)]
        return out(WEDGED, wedged_reason(wedged, running))
    unreadable = [e for e in engines if not e.ok]
    if unreadable:
        names = ", ".join(e.role for e in unreadable)
        return out(
            INCONCLUSIVE,
            f"engine load could not be read from {names}: it answered, but not with load",
        )
    fast = [p for p in probes if p.ok and p.latency_s < fast_s]
    busy = [e for e in engines if e.busy]
    if not busy:
        if fast:
            return out(
                CONNECTION,
                f"engines idle and a fresh connection is answered in under {fast_s:g} s: the "
                "request is stuck before it reaches the engines",
            )
        return out(INCONCLUSIVE, "engines idle but no fresh request was answered quickly either")
    stalled = [e for e in busy if e.producing is False]
    if stalled:
        roles = ", ".join(e.role for e in stalled)
        return out(
            STALLED,
            f"requests are on {roles} but it made no progress in the window: "
            "no tokens counted and no request left it",
        )
    if any(e.producing for e in busy) and (
        len(fast) < len(probes) or any(e.queue_growing or e._max("queued") for e in busy)
    ):
        return out(
            SATURATED,
            "engines are producing tokens with requests waiting or fresh "
            f"requests slower than {fast_s:g} s",
        )
    return out(
        INCONCLUSIVE,
        "engines are busy and fresh requests are fast; neither side is clearly at fault",
    )


async def _probe(name: str, url: str, model: str, timeout_s: float, api_key: str) -> Probe:
    request = ChatRequest(
        messages=[{"role": "user", "content": "triage probe"}], max_tokens=4, model=model
    )
    connector = aiohttp.TCPConnector(force_close=True)
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, headers=auth_headers(api_key)) as session:
        try:
            result = await asyncio.wait_for(stream_chat(session, url, request), timeout_s)
        except TimeoutError:
            return Probe(
                name,
                url,
                False,
                time.perf_counter() - start,
                error=f"no complete answer within {timeout_s:g} s",
            )
    return Probe(
        name,
        url,
        result.success,
        result.latency_s,
        result.output_tokens,
        result.error,
        result.status,
    )


# No answer at all, as opposed to an answer that is an error or not Prometheus's format.
_SILENCE = (TimeoutError, aiohttp.ClientConnectionError, OSError)


async def _read_metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url.rstrip("/") + "/metrics") as resp:
        resp.raise_for_status()
        return await resp.text()


async def _snapshot(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Snapshot:
    """GET /v1/loads within its own short timeout: a handler that waits on a stopped
    scheduler's lock is a finding, not a reason to wait."""
    timeout_s = min(LOADS_TIMEOUT_S, timeout_s)
    try:
        async with session.get(
            url.rstrip("/") + LOADS_PATH, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            return snapshot_from(resp.status, await resp.read(), "", timeout_s)
    except _SILENCE as exc:
        return snapshot_from(None, b"", f"{type(exc).__name__}: {exc}", timeout_s)
    except aiohttp.ClientError as exc:
        return Snapshot(error=f"/v1/loads: {type(exc).__name__}")


async def _health(session: aiohttp.ClientSession, e: EngineLoad, timeout_s: float) -> None:
    start = time.perf_counter()
    try:
        async with session.get(e.url.rstrip("/") + "/health") as resp:
            await resp.read()
            e.health = f"HTTP {resp.status} in {time.perf_counter() - start:.3f} s"
    except _SILENCE as exc:
        e.no_answer.append(no_answer("/health", f"{type(exc).__name__}: {exc}", timeout_s))


async def _load(
    session: aiohttp.ClientSession, e: EngineLoad, timeout_s: float, api_key: str
) -> None:
    e.scheduler.window_s = e.window_s
    for phase in ("before", "after"):
        if phase == "after":
            await asyncio.sleep(e.window_s)
        try:
            text = await _read_metrics(session, e.url)
            setattr(e, phase, promtext.load_of(promtext.parse(text)))
            seconds = scheduler_seconds(text)
        except _SILENCE as exc:
            e.ok = False
            e.no_answer.insert(0, no_answer("/metrics", f"{type(exc).__name__}: {exc}", timeout_s))
            return
        except (aiohttp.ClientError, ValueError) as exc:
            # An HTTP error status, or /metrics text that is not Prometheus's format.
            e.ok, e.error = False, redact(f"{type(exc).__name__}: {exc}", api_key)
            return
        # After /metrics: without patch 0021 this read can freeze the engine's HTTP server.
        snapshot = await _snapshot(session, e.url, timeout_s)
        if phase == "before":
            e.scheduler.seconds_before, e.scheduler.first = seconds, snapshot
        else:
            e.scheduler.seconds_after, e.scheduler.last = seconds, snapshot


async def _engine_loads(
    stack: Stack, window_s: float, timeout_s: float, api_key: str
) -> list[EngineLoad]:
    """Every engine's load and /health at once, so that a silent one costs one timeout."""
    engines = [EngineLoad(role, url, True, window_s=window_s) for role, url in stack.engines()]
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # SGLang serves /metrics without the key; sent anyway for servers that want it.
    async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers(api_key)) as session:
        await asyncio.gather(
            *(_load(session, e, timeout_s, api_key) for e in engines),
            *(_health(session, e, timeout_s) for e in engines),
        )
    return engines


async def triage(
    client_url: str,
    stack: Stack,
    fast_s: float = 2.0,
    window_s: float = 1.0,
    probe_timeout_s: float = 10.0,
    model: str | None = None,
    api_key: str = "",
    wedged_after_s: float = WEDGED_AFTER_S,
) -> Verdict:
    # Load first: the probes themselves would make idle engines look busy.
    engines = await _engine_loads(stack, window_s, probe_timeout_s, api_key)
    targets = [("client URL", client_url)]
    if stack.router_url and stack.router_url.rstrip("/") != client_url.rstrip("/"):
        targets.append(("router (direct)", stack.router_url))
    if model is None:
        try:
            model = await first_model_id(targets[-1][1], probe_timeout_s, api_key)
        except (TimeoutError, aiohttp.ClientError, OSError, RuntimeError):
            model = "default"
    probes = [await _probe(name, url, model, probe_timeout_s, api_key) for name, url in targets]
    workers = None
    if any(e.no_answer for e in engines) and stack.router_url:
        workers = await asyncio.to_thread(list_workers, stack.router_url, api_key, probe_timeout_s)
    return decide(probes, engines, fast_s, workers, wedged_after_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/triage",
        description="Tell a stuck client connection from a busy, stalled, wedged or unresponsive "
        "engine: time a request over a fresh connection to the client's URL and to the router, "
        "read every prefill and decode instance's load and scheduler time from /metrics, its "
        "scheduler's load snapshot from /v1/loads and its /health, and print a verdict with "
        "the numbers (an engine that gives no answer, or whose scheduler does not run behind "
        "an answering HTTP server, is named, with what showed it). Exit 0 when a verdict other "
        "than 'inconclusive' is reached, 3 otherwise.",
    )
    parser.add_argument("--url", required=True, help="the URL the client uses (may be a proxy)")
    add_stack_args(parser)
    parser.add_argument(
        "--fast-s",
        type=float,
        default=2.0,
        help="a fresh request answered within this is fast (default: 2.0)",
    )
    parser.add_argument(
        "--window-s",
        type=float,
        default=1.0,
        help="seconds between the two metrics samples (default: 1.0)",
    )
    parser.add_argument(
        "--probe-timeout-s",
        type=float,
        default=10.0,
        help="give up on a probe request after this (default: 10.0)",
    )
    parser.add_argument(
        "--wedged-after-s",
        type=float,
        default=WEDGED_AFTER_S,
        help="a scheduler whose load snapshot is this old (or whose time counters stand still "
        f"this long) reads as wedged (default: {WEDGED_AFTER_S:g}); raise it where one forward "
        "pass takes longer",
    )
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")
    add_api_key_arg(parser)
    args = parser.parse_args(argv)
    for name in ("fast_s", "window_s", "probe_timeout_s", "wedged_after_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    stack = stack_from_args(parser, args)
    api_key = resolve_api_key(args.api_key, args.env_dir)
    result = asyncio.run(
        triage(
            args.url,
            stack,
            args.fast_s,
            args.window_s,
            args.probe_timeout_s,
            api_key=api_key,
            wedged_after_s=args.wedged_after_s,
        )
    )
    print(json.dumps(asdict(result), indent=2) if args.json else result.render())
    return 3 if result.verdict == INCONCLUSIVE else 0


if __name__ == "__main__":
    sys.exit(main())
