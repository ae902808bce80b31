"""bench/chaos's fault catalogue and its seeded schedule.

Every kind of fault is written down here with what it does and the outcome it must have, so
that a report can quote the expectation it checked. The schedule is a pure function of the
seed and the options that shape it (fault count, duration, kinds, holds, the stack's
instances): the same seed gives the same faults at the same planned times, and `--only-fault
K` replays fault K of that schedule alone.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

# An engine paused (a scheduler or a whole process group) is held for a drawn time in this
# range unless --hold-s says otherwise.
HOLD_S = (3.0, 20.0)


@dataclass(frozen=True)
class Kind:
    name: str
    does: str
    expected: str
    # What the fault is aimed at: "engine" (one prefill or decode instance), "router",
    # "stack" (every instance), "pair" (two faults overlapping), "role" (every instance of a
    # role with two or more) or "clients" (the client connections, through bench/chaos's proxy).
    aims: str
    # The alerts of `launch/pd monitoring`'s rules that must fire for the faulted instance
    # while the fault is held (and resolve after it), with --prometheus. An overlap's are its
    # stop's.
    alerts: tuple[str, ...] = ()
    # No request may fail during it: the stack is meant to keep serving through it.
    fails_none: bool = False


# What the restarting kinds say of alerts.
QUIET = (
    "no alert is expected (launch/pd's restarts end within the down alerts' windows, and mark "
    "what they restart as in maintenance where PD_TEXTFILE_DIR is set)"
)

CATALOGUE = {
    k.name: k
    for k in (
        Kind(
            "scheduler-stop",
            "SIGSTOP the engine's scheduler process(es) (its children named sglang::scheduler) "
            "for the hold, then SIGCONT; its HTTP server keeps answering",
            "requests on it wait: each ends with its reference answer or an error (a PD "
            "timeout) within its bound; once resumed it serves again and holds nothing (a room "
            "decode quarantined is released on prefill's ACK); triage, when the hold passes "
            "--wedged-after-s, reads `scheduler wedged` naming it; with --prometheus, "
            "PDSchedulerStalled fires for it and resolves once it runs",
            "engine",
            alerts=("PDSchedulerStalled",),
        ),
        Kind(
            "engine-stop",
            "SIGSTOP the engine's whole process group (HTTP server, scheduler, detokenizer) for "
            "the hold, then SIGCONT",
            "the router stops routing to it once its health checks fail; requests on it end "
            "with their reference answer or an error within their bound; once resumed it "
            "serves again and holds nothing; triage reads `engine unresponsive` naming it; "
            "with --prometheus, PDInstanceDown fires for it and resolves once it answers its "
            "scrape",
            "engine",
            alerts=("PDInstanceDown",),
        ),
        Kind(
            "engine-kill",
            "SIGKILL the engine's process group, then `launch/pd restart INSTANCE`",
            "requests on it end with an error, never a wrong answer; the restart exits 0 with "
            "the engine healthy; no process of the killed engine is left and its load snapshot "
            "file is gone; the other engine holds nothing once settled; triage, between the "
            "kill and the restart, reads `engine unresponsive` naming it; with --prometheus, "
            "PDInstanceDown fires for it before the restart and resolves after it",
            "engine",
            alerts=("PDInstanceDown",),
        ),
        Kind(
            "router-restart",
            "`launch/pd restart router`",
            "requests in flight through the router end with an error or their reference "
            "answer; the new router serves; the engines hold nothing once settled; "
            + QUIET
            + ". Triage is not run: it has no verdict for a router that is down (it reads the "
            "engines, which answer)",
            "router",
        ),
        Kind(
            "co-restart",
            "`launch/pd co-restart` (prefill, decode, router in turn, then verify and probe)",
            "it exits 0; requests during it end with an error or their reference answer; the "
            "stack serves afterwards; no process of the old engines is left; "
            + QUIET
            + ". Triage is not run: every component restarts in turn, so no one component is to "
            "blame",
            "stack",
        ),
        Kind(
            "overlap",
            "a scheduler-stop or engine-stop of one engine and, while it is held, an "
            "engine-kill of an engine of the other role or a router-restart",
            "both faults' outcomes at once; triage (run for the stopped engine) names one of "
            "the two faulted components; with --prometheus, the stop's alert fires and resolves",
            "pair",
        ),
        Kind(
            "rolling-restart",
            "`launch/pd rolling-restart ROLE` on a role with two or more instances (xPyD): each "
            "instance in turn out of the router's rotation, drained, restarted, back in",
            "it exits 0 and no request fails: each instance leaves the rotation and drains "
            "before its restart while the others serve; no process of an old instance is left "
            "and its load snapshot file is gone; the engines hold nothing once settled; "
            + QUIET
            + ". Triage is not run: no request is meant to fail, and one that does is a broken "
            "invariant of its own",
            "role",
            fails_none=True,
        ),
        Kind(
            "proxy-stall",
            "bench/chaos's connection proxy (between its clients and the router) reads each "
            "request that arrives during the hold and forwards none of them, the connections "
            "left open; at the end of the hold it forwards them",
            "each held request ends with its reference answer (or an error) within its bound, "
            "never a wrong one; the engines hold nothing once settled. Triage, once the proxy "
            "forwards no request, reads `connection layer between client and router`: the "
            "engines are idle and a fresh request straight to the router is answered while one "
            "through the proxy is not. No alert: the router and the engines see no request",
            "clients",
        ),
        Kind(
            "proxy-reset",
            "bench/chaos's connection proxy resets (TCP RST) every client connection with a "
            "request in flight, and every one that sends a request during the hold",
            "the reset requests end with an error at once, never a wrong answer; the router "
            "sees its clients go away and the engines hold nothing once settled; requests after "
            "the hold are served. Triage reads `connection layer between client and router`, "
            "as for a stall. No alert, as for a stall",
            "clients",
        ),
    )
}
# Kinds this version can run; the others are in the catalogue and refused with their reason.
BUILT = tuple(CATALOGUE)
STOPS = ("scheduler-stop", "engine-stop")
PROXIES = ("proxy-stall", "proxy-reset")


@dataclass(frozen=True)
class Part:
    """One action of a fault: a kind aimed at a target, `after_s` after the fault begins,
    held `hold_s` (stop kinds; 0 for the others)."""

    kind: str
    target: str
    after_s: float = 0.0
    hold_s: float = 0.0

    def describe(self) -> str:
        text = f"{self.kind} {self.target}"
        if self.hold_s:
            text += f" for {self.hold_s:.1f} s"
        if self.after_s:
            text += f" at +{self.after_s:.1f} s"
        return text


@dataclass(frozen=True)
class Fault:
    index: int  # 1-based, as --only-fault names it
    kind: str
    at_s: float  # planned offset from the start of the load
    parts: tuple[Part, ...]

    def describe(self) -> str:
        what = " + ".join(p.describe() for p in self.parts)
        if self.kind == "overlap":
            what = f"overlap: {what}"
        return f"#{self.index} at {self.at_s:.1f} s: {what}"

    def targets(self) -> list[str]:
        return [p.target for p in self.parts]

    def to_json(self) -> dict:
        return asdict(self)


def several(instances: dict[str, list[str]]) -> list[str]:
    """The roles with two or more instances: the ones a rolling restart can take in turn."""
    return [role for role in ("prefill", "decode") if len(instances.get(role, [])) >= 2]


def refusal(kind: str, instances: dict[str, list[str]], sim: bool = False) -> str | None:
    """Why this kind cannot run on a stack with these instances (kind -> names), its engines
    simulated or not; None if it can."""
    if kind not in CATALOGUE:
        return f"unknown fault kind {kind!r}; the catalogue has {', '.join(CATALOGUE)}"
    if kind not in BUILT:
        return f"{kind}: {CATALOGUE[kind].expected}"
    if kind == "overlap" and not (instances.get("prefill") and instances.get("decode")):
        return "overlap: needs a prefill and a decode instance"
    if kind == "rolling-restart" and not several(instances):
        return (
            "rolling-restart: needs a role with two or more instances (xPyD: prefill.N.env or "
            "decode.N.env files); this stack has one of each"
        )
    if kind == "scheduler-stop" and sim:
        return "scheduler-stop: a simulated engine (--sim) has no sglang scheduler process"
    if not (instances.get("prefill") or instances.get("decode")):
        return f"{kind}: the stack has no engine instance"
    return None


def _hold(rng: random.Random, holds: tuple[float, float]) -> float:
    return round(rng.uniform(*holds), 1)


def draw(
    seed: int,
    faults: int,
    duration_s: float,
    kinds: list[str],
    instances: dict[str, list[str]],
    holds: tuple[float, float] = HOLD_S,
    sim: bool = False,
) -> list[Fault]:
    """The seeded schedule: `faults` faults of the given kinds, planned at sorted times drawn
    in [0, duration_s). `instances` maps prefill and decode to their instance names; on
    simulated engines (sim) an overlap's stop is an engine-stop (they have no scheduler)."""
    rng = random.Random(f"bench/chaos:{seed}")
    engines = [name for kind in ("prefill", "decode") for name in instances.get(kind, [])]
    # Tenths of a second, rounded down: a time stays inside [0, duration_s).
    times = sorted(math.floor(rng.uniform(0, duration_s) * 10) / 10 for _ in range(faults))
    schedule = []
    for index, at_s in enumerate(times, 1):
        kind = rng.choice(kinds)
        if kind in STOPS:
            parts = (Part(kind, rng.choice(engines), hold_s=_hold(rng, holds)),)
        elif kind == "engine-kill":
            parts = (Part(kind, rng.choice(engines)),)
        elif kind == "router-restart":
            parts = (Part(kind, "router"),)
        elif kind == "co-restart":
            parts = (Part(kind, "stack"),)
        elif kind == "rolling-restart":
            parts = (Part(kind, rng.choice(several(instances))),)
        elif kind in PROXIES:
            parts = (Part(kind, "clients", hold_s=_hold(rng, holds)),)
        else:  # overlap
            role = rng.choice(("prefill", "decode"))
            stop = rng.choice(("engine-stop",) if sim else STOPS)
            first = Part(stop, rng.choice(instances[role]), hold_s=_hold(rng, holds))
            other = "decode" if role == "prefill" else "prefill"
            second_kind = rng.choice(("engine-kill", "router-restart"))
            target = rng.choice(instances[other]) if second_kind == "engine-kill" else "router"
            after = round(first.hold_s * rng.uniform(0.2, 0.6), 1)
            parts = (first, Part(second_kind, target, after_s=after))
        schedule.append(Fault(index, kind, at_s, parts))
    return schedule


def expected_alerts(fault: Fault) -> list[tuple[str, str]]:
    """(alert name, pd_instance) of each alert that must fire while the fault is held: its
    first part's (an overlap's stop)."""
    first = fault.parts[0]
    return [(name, first.target) for name in CATALOGUE[first.kind].alerts]


def render(schedule: list[Fault]) -> str:
    return "\n".join(f.describe() for f in schedule)
