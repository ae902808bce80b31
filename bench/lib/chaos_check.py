"""bench/chaos's invariants, checked on its history, and its report.

The history is what `history.jsonl` holds, one dict per line, each with a "type":
- "run": the seed, the schedule, the bounds (`bound_base_s`, `settle_s`, `recover_s`) and
  the command that replays the schedule (`replay`, without --only-fault);
- "reference": a greedy prompt's answer on the healthy stack (`prompt`, `output_ids`);
- "request": one request (`id`, `kind` short/long/session, `prompt`, `window`, `start`,
  `end`, `ok`, `error`, `output_ids` for greedy kinds);
- "fault": one fault (`index`, `kind`, `describe`, `start`, `end`, `parts` with each
  action's outcome, `triage`);
- "recovery": the first success after a fault ended (`fault`, `recovered_s` or null);
- "settle": whether every engine held nothing within the settle bound once load paused
  (`window`, `settled`, `settle_s`, `held`);
- "alerts": with --prometheus, each alert a fault expected (`fault`, `alerts` with `alert`,
  `instance`, `fired` and `resolved` times or null, `wait_s`, `error`);
- "stop": the run ended early (`after` a fault, `why`, the faults `not_run`);
- "interrupted": Ctrl-C or SIGTERM ended the run (`signal`, `at`, the `window` it was in).
Times are seconds from the run's start. Windows are named by the fault they hold ("1", "2",
...) and "final" for the closing settle. Every check here is a pure function of that list,
so the tests feed it literal histories.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from bench.lib.chaos_plan import CATALOGUE

WRONG = "no wrong answer"
HANG = "no hang"
HELD = "nothing held"
NAMED = "failures named"
RECOVERED = "recovered"
FAULT_RAN = "fault ran as written"
ALERTED = "alerts fired and resolved"
SERVED = "no failure where none is expected"
GREEDY_KINDS = ("short", "long")


@dataclass(frozen=True)
class Violation:
    invariant: str
    window: str  # the fault's index as text, or "final"
    message: str

    def line(self) -> str:
        where = "final settle" if self.window == "final" else f"fault #{self.window}"
        return f"{where}: {self.invariant}: {self.message}"


def _of(history: list[dict], kind: str) -> list[dict]:
    return [r for r in history if r.get("type") == kind]


def _run(history: list[dict]) -> dict:
    runs = _of(history, "run")
    return runs[0] if runs else {}


# Two tokens whose logprobs in the reference differ by at most this are tied: greedy decoding
# may take either, and which one it takes is the kernels' tie-break, not the model's answer.
# The tiny models' logits are bf16: on env/cpu an exact tie reads a gap of 0, the other gaps at a
# reference's first tokens read 0.0117 and more, and answers equal to their reference differ
# from it by at most 4.8e-7 (bench/README.md, seed 21).
TIE_LOGPROB = 1e-4


def tie_break(ref: dict, got: list[int], tolerance: float = TIE_LOGPROB) -> dict | None:
    """Where `got` leaves the reference's token ids at a position whose reference top
    logprobs (`top`: [[token, logprob], ...] per position) tie the token taken with the
    reference's: that position and the two tokens; None otherwise (equal answers included)."""
    want = ref.get("output_ids") or []
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    top = ref.get("top") or []
    if at is None or at >= len(top):
        return None
    logprob = {int(t): lp for t, lp in top[at]}
    if want[at] in logprob and got[at] in logprob:
        if abs(logprob[want[at]] - logprob[got[at]]) <= tolerance:
            return {"at": at, "took": got[at], "reference": want[at]}
    return None


def tie_tolerance(history: list[dict]) -> float:
    """The run's --tie-logprob."""
    return float(_run(history).get("tie_logprob", TIE_LOGPROB))


def ties(history: list[dict]) -> list[dict]:
    """The greedy answers that took the other side of a tie in their reference's logits
    (`tie_break`): not wrong, and listed in the report."""
    refs = {r["prompt"]: r for r in _of(history, "reference")}
    tolerance = tie_tolerance(history)
    found = []
    for r in _of(history, "request"):
        ref = refs.get(r.get("prompt"))
        if r.get("kind") in GREEDY_KINDS and r.get("ok") and ref and r.get("output_ids"):
            tie = tie_break(ref, r["output_ids"], tolerance)
            if tie is not None:
                found.append({"id": r["id"], "prompt": r["prompt"], "window": r["window"]} | tie)
    return found


def wrong_answers(history: list[dict]) -> list[Violation]:
    """A greedy request that succeeded with other tokens than its reference (other text, where
    the reference has no token ids: a simulated engine's)."""
    refs = {r["prompt"]: r for r in _of(history, "reference")}
    tolerance = tie_tolerance(history)
    found = []
    for r in _of(history, "request"):
        if r.get("kind") not in GREEDY_KINDS or not r.get("ok"):
            continue
        ref = refs.get(r["prompt"])
        want = None if ref is None else ref["output_ids"]
        if ref is None:
            found.append(Violation(WRONG, r["window"], f"{r['id']}: no reference taken"))
        elif want is None:
            if r.get("text") != ref.get("text"):
                found.append(
                    Violation(
                        WRONG,
                        r["window"],
                        f"{r['id']} ({r['prompt']}) answered the text {r.get('text')!r:.60} "
                        f"against its reference's {ref.get('text')!r:.60}",
                    )
                )
        elif (
            r.get("output_ids") != want
            and tie_break(ref, r.get("output_ids") or [], tolerance) is None
        ):
            got = r.get("output_ids") or []
            at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
            at = min(len(got), len(want)) if at is None else at
            found.append(
                Violation(
                    WRONG,
                    r["window"],
                    f"{r['id']} ({r['prompt']}) answered {len(got)} tokens that differ from its "
                    f"reference's {len(want)} from token {at}: {got[at : at + 4]} against "
                    f"{want[at : at + 4]}",
                )
            )
    return found


def fault_time(history: list[dict], start: float, end: float) -> float:
    """Seconds of [start, end] during which a fault was active."""
    total = 0.0
    for f in _of(history, "fault"):
        total += max(0.0, min(end, f["end"]) - max(start, f["start"]))
    return total


def bound_of(history: list[dict], request: dict) -> float:
    """The longest a request may take: the run's base bound (the serving allowance plus the
    stack's PD timeouts) plus the time faults were active while it was out."""
    return _run(history)["bound_base_s"] + fault_time(history, request["start"], request["end"])


def hangs(history: list[dict]) -> list[Violation]:
    found = []
    for r in _of(history, "request"):
        bound = bound_of(history, r)
        took = r["end"] - r["start"]
        if took > bound or r.get("hung"):
            found.append(
                Violation(
                    HANG,
                    r["window"],
                    f"{r['id']} ({r['kind']}, sent at {r['start']:.1f} s) took {took:.1f} s"
                    + (" and was cut off" if r.get("hung") else "")
                    + f": its bound is {bound:.1f} s ({_run(history)['bound_base_s']:g} s base "
                    f"+ {bound - _run(history)['bound_base_s']:.1f} s of faults while it was out)",
                )
            )
    return found


def held(history: list[dict]) -> list[Violation]:
    """A settle that did not reach nothing held, and processes or files a stopped or killed
    engine left behind."""
    found = []
    for s in _of(history, "settle"):
        if not s["settled"]:
            what = "; ".join(f"{name}: {state}" for name, state in s["held"].items())
            found.append(
                Violation(
                    HELD,
                    s["window"],
                    f"not every engine held nothing within {s['bound_s']:g} s of the load "
                    f"pausing: {what}",
                )
            )
    for f in _of(history, "fault"):
        for p in f["parts"]:
            for key, what in (
                ("left", "process(es) of the stopped instance still alive"),
                ("files_left", "load snapshot file(s) of the stopped engine left"),
                ("still_stopped", "process(es) still stopped after SIGCONT"),
            ):
                if p.get(key):
                    found.append(
                        Violation(
                            HELD,
                            str(f["index"]),
                            f"{p['kind']} {p['target']}: {what}: {', '.join(p[key])}",
                        )
                    )
    return found


def unnamed(history: list[dict]) -> list[Violation]:
    """A fault window with failed requests whose triage ran and named none of the faulted
    components. Where triage could not run, the fault record says why, and that is no
    violation (the report shows it)."""
    failed = defaultdict(int)
    for r in _of(history, "request"):
        if not r["ok"]:
            failed[r["window"]] += 1
    found = []
    for f in _of(history, "fault"):
        t = f.get("triage") or {}
        window = str(f["index"])
        if failed[window] and t.get("ran") and not t.get("named"):
            found.append(
                Violation(
                    NAMED,
                    window,
                    f"{failed[window]} request(s) failed and triage read "
                    f"`{t.get('verdict')}`, naming none of {', '.join(t.get('expected', []))}: "
                    f"{t.get('reason', '')[:300]}",
                )
            )
    return found


def unrecovered(history: list[dict]) -> list[Violation]:
    found = []
    for r in _of(history, "recovery"):
        if r["recovered_s"] is None and not r.get("skipped"):
            found.append(
                Violation(
                    RECOVERED,
                    str(r["fault"]),
                    f"no request succeeded within {r['bound_s']:g} s of the fault ending",
                )
            )
    return found


def failed_actions(history: list[dict]) -> list[Violation]:
    """A restart command that failed, or a stop that found nothing to stop."""
    found = []
    for f in _of(history, "fault"):
        for p in f["parts"]:
            if p.get("error"):
                what = f"{p['kind']} {p['target']}: {p['error']}"
                found.append(Violation(FAULT_RAN, str(f["index"]), what))
    return found


def unalerted(history: list[dict]) -> list[Violation]:
    """With --prometheus: an expected alert that did not fire while its fault was held, or did
    not resolve after it."""
    found = []
    for a in _of(history, "alerts"):
        window = str(a["fault"])
        why = f" (Prometheus: {a['error']})" if a.get("error") else ""
        for alert in a["alerts"]:
            name = f"{alert['alert']} for {alert['instance']}"
            if alert["fired"] is None:
                message = f"{name} did not fire within {a['wait_s']:g} s past the hold{why}"
            elif alert["resolved"] is None:
                message = f"{name} did not resolve within {a['wait_s']:g} s of the fault{why}"
            else:
                continue
            found.append(Violation(ALERTED, window, message))
    return found


def failed_unexpectedly(history: list[dict]) -> list[Violation]:
    """A failed request in the window of a fault the stack is meant to serve through (the
    catalogue's fails_none kinds: a rolling restart)."""
    failed = defaultdict(list)
    for r in _of(history, "request"):
        if not r["ok"]:
            failed[r["window"]].append(r)
    found = []
    for f in _of(history, "fault"):
        kind = CATALOGUE.get(f["kind"])
        bad = failed[str(f["index"])]
        if kind is not None and kind.fails_none and bad:
            found.append(
                Violation(
                    SERVED,
                    str(f["index"]),
                    f"{len(bad)} request(s) failed during a {f['kind']}, first "
                    f"{bad[0]['id']}: {(bad[0]['error'] or '')[:200]}",
                )
            )
    return found


def check(history: list[dict]) -> list[Violation]:
    return [
        *failed_actions(history),
        *wrong_answers(history),
        *hangs(history),
        *held(history),
        *unnamed(history),
        *unrecovered(history),
        *failed_unexpectedly(history),
        *unalerted(history),
    ]


# ---- the report ---------------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _longest(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    missing = len(values) - len(known)
    text = _seconds(max(known)) if known else "-"
    return text + (f" ({missing} none)" if missing else "")


def window_rows(history: list[dict]) -> list[dict]:
    """Per fault: its record, its requests' counts, its recovery and settle."""
    requests = defaultdict(list)
    for r in _of(history, "request"):
        requests[r["window"]].append(r)
    recovery = {str(r["fault"]): r["recovered_s"] for r in _of(history, "recovery")}
    settle = {s["window"]: s for s in _of(history, "settle")}
    wrong = defaultdict(int)
    for v in wrong_answers(history):
        wrong[v.window] += 1
    hung = defaultdict(int)
    for v in hangs(history):
        hung[v.window] += 1
    rows = []
    for f in _of(history, "fault"):
        window = str(f["index"])
        reqs = requests[window]
        s = settle.get(window)
        rows.append(
            {
                "fault": f,
                "served": sum(1 for r in reqs if r["ok"]) - wrong[window],
                "failed": sum(1 for r in reqs if not r["ok"]),
                "wrong": wrong[window],
                "hung": hung[window],
                "recovery": recovery.get(window),
                "settle": s["settle_s"] if s and s["settled"] else None,
            }
        )
    return rows


def triage_text(f: dict) -> str:
    t = f.get("triage") or {}
    if not t.get("ran"):
        return f"not run: {t.get('why_not', '')}"
    named = ", ".join(t.get("named") or []) or "none of the faulted"
    return f"`{t['verdict']}`, names {named}"


def render(history: list[dict], violations: list[Violation]) -> str:
    run = _run(history)
    rows = window_rows(history)
    lines = ["# bench/chaos report", ""]
    for stop in _of(history, "interrupted"):
        where = (
            "the final load" if stop["window"] == "final" else f"fault #{stop['window']}'s window"
        )
        during = (
            f", while injecting {stop['injecting']} (that fault has no row: it did not end)"
            if stop.get("injecting")
            else ""
        )
        killed = "".join(
            f" `{cmd}` was running and was killed: `launch/pd status` shows what it left."
            for cmd in stop.get("commands_killed") or []
        )
        lines += [
            f"**Interrupted** by {stop['signal']} at {stop['at']:.1f} s, in {where}{during}: "
            "this report covers the history until then, and every process the run stopped was "
            f"continued.{killed}",
            "",
        ]
    lines += [
        f"Seed {run.get('seed')}, {len(rows)} fault(s) run of {len(run.get('schedule', []))} "
        f"drawn, stack `{run.get('env_dir')}`; the schedule: `{run.get('replay')}`.",
        f"Bounds: a request's {run.get('bound_base_s', 0):g} s (serving allowance "
        f"{run.get('serve_s', 0):g} s + PD timeouts {run.get('pd_timeouts_s', 0):g} s) plus "
        f"the time faults were active while it was out; settle {run.get('settle_s', 0):g} s; "
        f"recovery {run.get('recover_s', 0):g} s.",
        "",
        "**Result: "
        + (
            (
                "every invariant held so far.**"
                if _of(history, "interrupted")
                else "every invariant held.**"
            )
            if not violations
            else f"{len(violations)} broken invariant(s).**"
        ),
        "",
        "## Per fault kind",
        "",
        "| kind | injected | requests served | failed with error | wrong | hung "
        "| longest recovery | longest settle |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_kind = defaultdict(list)
    for row in rows:
        by_kind[row["fault"]["kind"]].append(row)
    for kind, group in by_kind.items():
        lines.append(
            f"| {kind} | {len(group)} | {sum(r['served'] for r in group)} "
            f"| {sum(r['failed'] for r in group)} | {sum(r['wrong'] for r in group)} "
            f"| {sum(r['hung'] for r in group)} | {_longest([r['recovery'] for r in group])} "
            f"| {_longest([r['settle'] for r in group])} |"
        )
    lines += [
        "",
        "Recovery: from the fault's end to the end of the first request sent after it that "
        "succeeded. Settle: from the load pausing (every request ended) to every engine's "
        "/v1/loads holding no request and no KV.",
        "",
        "## Faults",
        "",
        "| # | fault | active | served / failed | recovery | settle | triage |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        f = row["fault"]
        lines.append(
            f"| {f['index']} | {f['describe'].split(': ', 1)[-1]} "
            f"| {f['start']:.1f}-{f['end']:.1f} s | {row['served']} / {row['failed']} "
            f"| {_seconds(row['recovery'])} | {_seconds(row['settle'])} | {triage_text(f)} |"
        )
    for stop in _of(history, "stop"):
        later = ", ".join(f"#{i}" for i in stop["not_run"]) or "none"
        lines += [
            "",
            f"The run stopped after fault #{stop['after']}: {stop['why']}. Faults not run: "
            f"{later}.",
        ]
    lines += ["", *alert_lines(history)]
    final = [s for s in _of(history, "settle") if s["window"] == "final"]
    if final:
        s = final[0]
        state = f"held nothing after {s['settle_s']:.1f} s" if s["settled"] else "did not settle"
        lines += ["", f"Final settle: {state}."]
    tied = ties(history)
    if tied:
        shown = "; ".join(
            f"{t['id']} ({t['prompt']}, fault #{t['window']}) took {t['took']} for "
            f"{t['reference']} at token {t['at']}"
            for t in tied[:5]
        )
        lines += [
            "",
            f"Ties: {len(tied)} greedy answer(s) took another token where their reference's "
            f"logprobs tie it with the reference's own (within {tie_tolerance(history):g}), so not "
            f"wrong: "
            f"{shown}{' ...' if len(tied) > 5 else ''}.",
        ]
    diffs = [r["logprob_diff"] for r in _of(history, "request") if "logprob_diff" in r]
    if diffs:
        lines += [
            "",
            f"Logprobs of the greedy answers equal to their reference: largest difference "
            f"{max(diffs):.2g} over {len(diffs)} answers (recorded, not judged).",
        ]
    errors = defaultdict(int)
    for r in _of(history, "request"):
        if not r["ok"]:
            errors[(r["error"] or "")[:90]] += 1
    if errors:
        lines += ["", "## Errors seen", ""]
        for text, count in sorted(errors.items(), key=lambda kv: -kv[1])[:12]:
            lines.append(f"- {count} x `{text}`")
    if violations:
        lines += ["", "## Broken invariants", ""]
        for v in violations:
            lines.append(f"- {v.line()}")
            if v.window != "final":
                lines.append(f"  replay: `{replay_command(run, v.window)}`")
    return "\n".join(lines) + "\n"


def alert_lines(history: list[dict]) -> list[str]:
    """The report's alerts: each expected one's firing and resolved times, or why none were
    checked."""
    run = _run(history)
    if not run.get("prometheus"):
        return ["Alerts: not checked (no --prometheus)."]
    records = _of(history, "alerts")
    if not records:
        return [f"Alerts: checked on {run['prometheus']}; no fault run expected one."]
    lines = [
        f"## Alerts on {run['prometheus']}",
        "",
        "| # | alert | instance | fired (after the fault began) | resolved (after it ended) |",
        "|---|---|---|---|---|",
    ]
    for a in records:
        for alert in a["alerts"]:
            fired = alert["fired"]
            resolved = alert["resolved"]
            lines.append(
                f"| {a['fault']} | {alert['alert']} | {alert['instance']} "
                f"| {_seconds(None if fired is None else fired - a['fault_start'])} "
                f"| {_seconds(None if resolved is None else resolved - a['fault_end'])} |"
            )
    return lines


def replay_command(run: dict, window: str) -> str:
    return f"{run.get('replay', 'bench/chaos')} --only-fault {window}"
