"""A scheduler that does not run behind an answering HTTP server (launch/pdlib/wedged.py), read
from what real sglang engines answer, and `launch/pd probe`'s verdict on it.

The /v1/loads body and the /metrics lines below were read from a real env/cpu decode engine
(sglang 0.5.23 with our patches, `curl /v1/loads?include=core` and `curl /metrics`); the live
fault is tested in tests/engine."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from launch.pdlib import checks
from launch.pdlib.stack import Reply, Role
from launch.pdlib.wedged import (
    IDLE_SECONDS,
    LOADS_PATH,
    STAGE_SECONDS,
    WEDGED_AFTER_S,
    Life,
    Snapshot,
    read_snapshot,
    reason,
    scheduler_seconds,
    snapshot_from,
)

LOADS = {
    "timestamp": "2026-12-04T22:54:08.764114+00:00",
    "version": "0.5.23",
    "accelerator": None,
    "num_accelerators": 1,
    "loads": [
        {
            "timestamp": 1796424848.7569287,
            "dp_rank": 0,
            "num_running_reqs": 0,
            "num_waiting_reqs": 0,
            "num_used_tokens": 0,
            "max_total_num_tokens": 16384,
        }
    ],
}
ANSWERED = 1796424848.764114  # the answer's own timestamp, as Unix time

LABELS = 'engine_type="decode",model_name="tiny-llama",moe_ep_rank="0",pp_rank="0",tp_rank="0"'


def metrics(idle: float, stage_idle: float, run_batch: float = 0.51) -> str:
    """/metrics lines as sglang writes the two counters (two of its ten stages)."""
    stage = "sglang:scheduler_stage_seconds_total"
    return (
        f"# HELP {IDLE_SECONDS} Total wall time while the scheduler has no runnable or queued "
        "work.\n"
        f"# TYPE {IDLE_SECONDS} counter\n"
        f"{IDLE_SECONDS}{{{LABELS}}} {idle}\n"
        f"# HELP {stage} Total scheduler-loop wall time exclusively attributed to each stage.\n"
        f"# TYPE {stage} counter\n"
        f'{stage}{{category="run_batch",{LABELS},forward_overlap="none"}} {run_batch}\n'
        f'{stage}{{category="idle",{LABELS},forward_overlap="none"}} {stage_idle}\n'
    )


def aged(seconds: float, stale: bool = False, stamp: float = ANSWERED - 60) -> dict:
    """LOADS as a scheduler that published at `stamp` answers `seconds` later."""
    body = json.loads(json.dumps(LOADS))
    body["timestamp"] = datetime.fromtimestamp(stamp + seconds, UTC).isoformat()
    body["loads"][0]["timestamp"] = stamp
    if stale:
        body["loads"][0] |= {"stale": 1, "snapshot_age_s": seconds}
    return body


def test_the_snapshot_age_is_read_on_the_engines_clock():
    snap = read_snapshot(LOADS, now=0.0)  # this host's clock is ignored when the answer has one
    assert snap.clock == "engine" and not snap.error and not snap.stale
    assert snap.oldest == ("0", snap.ages["0"])
    assert abs(snap.ages["0"] - 0.0072) < 1e-3
    sim = dict(LOADS, timestamp="2026-12-04T22:54:08Z")  # the sim engine's second resolution
    assert read_snapshot(sim).ages["0"] == 0.0


def test_a_snapshot_without_a_time_of_its_own_is_aged_by_this_hosts_clock():
    body = dict(LOADS)
    del body["timestamp"]
    snap = read_snapshot(body, now=ANSWERED + 20)
    assert snap.clock == "here" and round(snap.ages["0"], 1) == 27.0 - 7.0


def test_no_snapshot_published_yet_and_bad_answers_are_no_age():
    assert read_snapshot(dict(LOADS, loads=[])).oldest is None
    assert read_snapshot({"loads": "x"}).error == "/v1/loads: not the JSON sglang answers"
    assert snapshot_from(401, b"", "", 3).error == "/v1/loads: HTTP 401"
    silent = snapshot_from(None, b"", "TimeoutError: timed out", 3)
    assert silent.silent and silent.error == "/v1/loads: no answer within 3 s"
    assert snapshot_from(200, b"<html>", "", 3).error == "/v1/loads: not the JSON sglang answers"


def test_scheduler_seconds_are_summed_per_scheduler_over_the_stages():
    seconds = scheduler_seconds(metrics(146.68, 146.61))
    assert seconds == {LABELS.replace('"', ""): 146.68 + 146.61 + 0.51}
    assert scheduler_seconds("sglang:num_running_reqs 0\n") == {}


def life(before: float, after: float | None, *ages: float, window_s: float = 1.0) -> Life:
    """Two reads of one snapshot `ages` old, or of a fresh one each time (ages under 1 s)."""
    snaps = [read_snapshot(aged(a, stamp=ANSWERED - (a if a < 1 else 60))) for a in ages]
    key = LABELS.replace('"', "")
    return Life(
        window_s=window_s,
        first=snaps[0] if snaps else None,
        last=snaps[1] if len(snaps) > 1 else None,
        seconds_before={key: before},
        seconds_after=None if after is None else {key: after},
    )


def test_a_fresh_snapshot_or_a_growing_counter_is_a_running_scheduler():
    assert life(100, 101, 0.3, 0.2).runs(WEDGED_AFTER_S)
    assert life(100, 100, 0.3, 0.2).stopped(WEDGED_AFTER_S) == ([], [])
    # Counters that grew win over an old snapshot (a publish that failed, not a stop).
    assert life(100, 101, 40, 41).stopped(WEDGED_AFTER_S) == ([], [])


def test_an_old_unchanged_snapshot_names_the_signal_and_how_long():
    signals, support = life(300.5, 300.5, 23.4, 24.4).stopped(WEDGED_AFTER_S)
    assert signals == [
        "its load snapshot (/v1/loads loads[dp_rank 0].timestamp) was last refreshed 24.4 s "
        "ago and unchanged over the 1 s window; a running scheduler refreshes it about every "
        "second"
    ]
    # Still over one second only supports: a live scheduler adds to them about once a second.
    assert support == [f"{IDLE_SECONDS} + {STAGE_SECONDS} stood at 300.5 s over the 1 s window"]


def test_counters_still_for_the_whole_threshold_are_a_signal_on_their_own():
    still = Life(window_s=WEDGED_AFTER_S, seconds_before={"s": 9.0}, seconds_after={"s": 9.0})
    signals, _ = still.stopped(WEDGED_AFTER_S)
    assert signals == [f"{IDLE_SECONDS} + {STAGE_SECONDS} stood at 9.0 s over the 10 s window"]


def test_a_stale_snapshot_and_a_silent_route_are_signals():
    stale = Life(first=read_snapshot(aged(31.0, stale=True)))
    (text,), _ = stale.stopped(WEDGED_AFTER_S)
    assert "last refreshed 31.0 s ago; a running scheduler" in text
    assert text.endswith(
        "marked stale: the scheduler has held the snapshot's lock since it began to publish"
    )
    silent = Life(first=Snapshot(error="/v1/loads: no answer within 3 s", silent=True))
    assert silent.stopped(WEDGED_AFTER_S)[0] == ["/v1/loads: no answer within 3 s"]


def test_no_signal_at_all_is_not_a_stop():
    # The sim engine: no scheduler counters, and a snapshot stamped at every read.
    assert Life(first=Snapshot(error="/v1/loads: HTTP 404")).stopped(WEDGED_AFTER_S) == ([], [])
    assert Life().stopped(WEDGED_AFTER_S) == ([], [])


def test_the_evidence_shows_both_reads():
    assert life(100, 100, 23.4, 24.4).describe() == (
        "scheduler: load snapshot age 23.4 s -> 24.4 s, scheduler idle+stage seconds 100.0 -> 100.0"
    )
    assert reason([], ["prefill/1", "decode/1"]) == "; the schedulers of prefill/1, decode/1 run"


# ---- launch/pd probe --------------------------------------------------------------------------


def role(name: str, port: int) -> Role:
    kind = name.split("/")[0]
    return Role(name, "127.0.0.1", port, "/health", 300.0, Path(f"launch/{kind}.sh"), kind)


def answers(name: str, loads: Reply, idle: float = 146.68) -> dict:
    return {
        (name, "/metrics"): Reply(200, metrics(idle, idle).encode()),
        (name, "/health"): Reply(200, b""),
        (name, LOADS_PATH): loads,
    }


def test_probe_names_the_engine_whose_scheduler_stopped_and_the_one_that_runs():
    engines = [role("prefill", 1), role("decode", 2)]
    replies = answers("prefill", Reply(200, json.dumps(aged(0.4)).encode()))
    replies |= answers("decode", Reply(200, json.dumps(aged(37.25)).encode()))
    wedged, running = checks._wedged(engines, replies)
    assert running == ["prefill"]
    assert reason(wedged, running) == (
        "decode (http://127.0.0.1:2) answers over HTTP (/health: HTTP 200) but its scheduler "
        "does not run: its load snapshot (/v1/loads loads[dp_rank 0].timestamp) was last "
        "refreshed 37.2 s ago; a running scheduler refreshes it about every second; prefill's "
        "scheduler runs"
    )


def test_probe_counts_a_silent_v1_loads_as_its_own_signal():
    engines = [role("decode", 2)]
    silent = Reply(None, b"", "TimeoutError: timed out")
    wedged, running = checks._wedged(engines, answers("decode", silent))
    assert running == [] and [w.signals for w in wedged] == [("/v1/loads: no answer within 3 s",)]
