"""A scheduler that no longer runs behind an HTTP server that still answers, said the same way
by every tool that reads engines (bench/triage, bench/multiround's triage, `launch/pd probe`).

An sglang engine is an HTTP process and a scheduler process. With
SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 (our CPU env files) /health answers from the HTTP
process alone; prefill's bootstrap /health, which decode's heartbeat calls, never asks the
scheduler; sglang's watchdog is a thread of the scheduler and stops with it. A scheduler stopped
by SIGSTOP, a debugger, a deadlock or a hung device call leaves all of them answering. Two
things only a running scheduler moves (sglang 0.5.23):

- its load snapshot, which GET /v1/loads answers. `loads[].timestamp` is the scheduler's clock
  at its last publish: every pass of its loop while idle (at least once a second under
  --sleep-on-idle, whose poll waits at most 1 s), every 50 ms while requests wait without a
  batch, after each prefill batch and every 15 decode batches. The answer's own top-level
  `timestamp` is the HTTP process's clock when it answered, so the age is read on the engine's
  host, whatever this host's clock says.
- its time counters on /metrics (with --enable-metrics), added to about once a second:
  sglang:scheduler_stage_seconds_total by its loop's wall time per stage (idle is a stage),
  sglang:scheduler_idle_seconds_total by its idle time besides.

Neither moves during one forward pass either, so a pass longer than the threshold reads the
same as a stop: on a GPU a pass takes milliseconds to a few seconds; in Triton's interpreter
(env/cpu-dsv4) a prefill's pass can take a minute, and the threshold must be raised there.

/v1/loads itself may not answer: upstream's handler waits on the snapshot's file lock inside
the HTTP event loop, and a scheduler stopped while publishing holds it. That silence is a
signal of its own; with patch 0021 the route answers the last snapshot instead, marked stale.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime

from prometheus_client.parser import text_string_to_metric_families

from launch.pdlib.unresponsive import no_answer

WEDGED = "scheduler wedged"
IDLE_SECONDS = "sglang:scheduler_idle_seconds_total"
STAGE_SECONDS = "sglang:scheduler_stage_seconds_total"
# The stage counter's own labels; the rest name the scheduler (tp_rank, dp_rank, ...).
STAGE_LABELS = ("category", "forward_overlap")
# A live scheduler refreshes both signals about every second; this is ten of those.
WEDGED_AFTER_S = 10.0
# /v1/loads answers in milliseconds (with patch 0021 within 0.5 s whatever the scheduler does).
LOADS_TIMEOUT_S = 3.0
LOADS_PATH = "/v1/loads?include=core"


@dataclass
class Snapshot:
    """One GET /v1/loads: how old each DP rank's snapshot was when the engine answered."""

    # "" when it answered 200 with sglang's JSON; else what happened, in words.
    error: str = ""
    # No answer at all (timed out, or nothing listening), as opposed to an error status.
    silent: bool = False
    # Per DP rank (as a string, for JSON): the scheduler's timestamp and its age in seconds.
    stamps: dict[str, float] = field(default_factory=dict)
    ages: dict[str, float] = field(default_factory=dict)
    # Patch 0021 answered from its last read: the scheduler held the snapshot's lock past 0.5 s.
    stale: bool = False
    # Where the age was read: "engine" (the answer's own clock) or "here" (this host's).
    clock: str = "engine"

    @property
    def oldest(self) -> tuple[str, float] | None:
        return max(self.ages.items(), key=lambda kv: kv[1]) if self.ages else None


def read_snapshot(body, now: float | None = None) -> Snapshot:
    """A Snapshot from /v1/loads' JSON; `now` (this host's clock) only where the answer
    carries no time of its own."""
    if not isinstance(body, dict) or not isinstance(body.get("loads"), list):
        return Snapshot(error="/v1/loads: not the JSON sglang answers")
    answered, clock = _answer_time(body.get("timestamp"))
    if answered is None:
        answered, clock = (time.time() if now is None else now), "here"
    snap = Snapshot(clock=clock)
    for load in body["loads"]:
        if not isinstance(load, dict):
            return Snapshot(error="/v1/loads: not the JSON sglang answers")
        stamp = load.get("timestamp")
        if not isinstance(stamp, int | float) or stamp <= 0:
            continue
        rank = str(load.get("dp_rank", 0))
        snap.stamps[rank] = float(stamp)
        snap.ages[rank] = round(max(0.0, answered - float(stamp)), 3)
        snap.stale = snap.stale or bool(load.get("stale"))
    return snap


def snapshot_from(status: int | None, body: bytes, error: str, timeout_s: float) -> Snapshot:
    """A Snapshot from one HTTP exchange: status None when no answer came (error says why)."""
    if status is None:
        return Snapshot(error=no_answer("/v1/loads", error, timeout_s), silent=True)
    if status != 200:
        return Snapshot(error=f"/v1/loads: HTTP {status}")
    try:
        return read_snapshot(json.loads(body.decode(errors="replace")))
    except ValueError:
        return Snapshot(error="/v1/loads: not the JSON sglang answers")


def _answer_time(value) -> tuple[float | None, str]:
    try:
        return datetime.fromisoformat(value).timestamp(), "engine"
    except (TypeError, ValueError):
        return None, "here"


def scheduler_seconds(text: str) -> dict[str, float]:
    """Per scheduler (its label set, the stage labels left out): idle plus stage seconds. Empty
    when the engine exports neither (no --enable-metrics, or not sglang). ValueError for text
    that is not Prometheus's format."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in (IDLE_SECONDS, STAGE_SECONDS) or math.isnan(sample.value):
                continue
            key = ",".join(
                f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in STAGE_LABELS
            )
            out[key] = out.get(key, 0.0) + sample.value
    return out


@dataclass
class Life:
    """What an engine's scheduler showed: one or two /v1/loads reads, and its time counters in
    one or two /metrics reads `window_s` apart."""

    window_s: float = 0.0
    first: Snapshot | None = None
    last: Snapshot | None = None
    seconds_before: dict[str, float] = field(default_factory=dict)
    seconds_after: dict[str, float] | None = None

    def _reads(self) -> list[Snapshot]:
        return [s for s in (self.first, self.last) if s is not None]

    def runs(self, after_s: float) -> bool:
        """Something moved: a counter grew, a snapshot was refreshed between the reads, or the
        newest read is younger than after_s."""
        if self.seconds_after is not None and any(
            self.seconds_after.get(k, 0.0) > v for k, v in self.seconds_before.items()
        ):
            return True
        if self.first and self.last and self.first.stamps and self.last.stamps:
            if self.first.stamps != self.last.stamps:
                return True
        newest = next((s for s in reversed(self._reads()) if s.oldest is not None), None)
        return newest is not None and newest.oldest[1] < after_s

    def _still(self) -> list[str]:
        """The schedulers whose counters did not grow between the two reads."""
        if self.seconds_after is None:
            return []
        return [k for k, v in self.seconds_before.items() if self.seconds_after.get(k) == v]

    def stopped(self, after_s: float) -> tuple[list[str], list[str]]:
        """(signals that say the scheduler stopped, supporting facts), in words. A signal: the
        newest snapshot older than after_s, /v1/loads silent, or the counters still for a
        window of after_s or more. A counter still over a shorter window only supports: a live
        scheduler adds to it about once a second. Nothing when anything moved."""
        if self.runs(after_s):
            return [], []
        signals, support = [], []
        last = next((s for s in reversed(self._reads()) if s.oldest is not None), None)
        if last is not None:
            rank, age = last.oldest
            unchanged = (
                f" and unchanged over the {self.window_s:g} s window"
                if self.first and self.last and self.first.stamps and self.last.stamps
                else ""
            )
            clock = "" if last.clock == "engine" else " (by this host's clock)"
            text = (
                f"its load snapshot (/v1/loads loads[dp_rank {rank}].timestamp) was last "
                f"refreshed {age:.1f} s ago{clock}{unchanged}; a running scheduler refreshes it "
                "about every second"
            )
            if last.stale:
                text += (
                    "; /v1/loads answered it marked stale: the scheduler has held the "
                    "snapshot's lock since it began to publish"
                )
            signals.append(text)
        silent = [s.error for s in self._reads() if s.silent]
        if silent:
            signals.append(silent[-1])
        still = self._still()
        if still:
            total = sum(self.seconds_before[k] for k in still)
            text = (
                f"{IDLE_SECONDS} + {STAGE_SECONDS} stood at {total:.1f} s over the "
                f"{self.window_s:g} s window"
            )
            (signals if self.window_s >= after_s else support).append(text)
        return signals, support

    def describe(self) -> str:
        """The evidence, whatever it shows."""
        parts = []
        reads = self._reads()
        if reads:
            ages = []
            for s in reads:
                if s.error:
                    ages.append(s.error.removeprefix("/v1/loads: "))
                elif s.oldest is None:
                    ages.append("none published")
                else:
                    ages.append(f"{s.oldest[1]:.1f} s" + (" (stale)" if s.stale else ""))
            parts.append(f"load snapshot age {' -> '.join(ages)}")
        if self.seconds_before:
            total = f"{sum(self.seconds_before.values()):.1f}"
            if self.seconds_after is not None:
                total += f" -> {sum(self.seconds_after.values()):.1f}"
            parts.append(f"scheduler idle+stage seconds {total}")
        return "scheduler: " + ", ".join(parts) if parts else ""


@dataclass(frozen=True)
class Wedged:
    name: str  # the instance, as launch/pd names it: decode, or decode/2 of several
    url: str
    answered: str  # what its HTTP server answered: "/health: HTTP 200 in 0.004 s"
    signals: tuple[str, ...]
    support: tuple[str, ...] = ()

    def describe(self) -> str:
        return (
            f"{self.name} ({self.url}) answers over HTTP ({self.answered}) but its scheduler "
            "does not run: " + "; ".join(self.signals + self.support)
        )


def reason(wedged: list[Wedged], running: list[str]) -> str:
    """The verdict's 'because': whose scheduler stopped, what showed it, and whose runs."""
    text = "; ".join(w.describe() for w in wedged)
    if len(running) == 1:
        text += f"; {running[0]}'s scheduler runs"
    elif running:
        text += f"; the schedulers of {', '.join(running)} run"
    return text
