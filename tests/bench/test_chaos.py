"""bench/chaos without engines: the seeded schedule, the invariant checks on histories written
out here as literal data, the report, and the command line's refusals. The run against a real
stack is tests/engine/test_cpu_engines.py's chaos test."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import logging
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from bench.lib import chaos, chaos_alerts, chaos_check, chaos_plan, simstack
from bench.lib.chaos_proxy import ChaosProxy
from bench.lib.triage import CONNECTION
from launch.pdlib import envfiles, monitoring
from launch.pdlib.stack import free_loopback_ports
from launch.pdlib.supervise import sweep

ROOT = Path(__file__).resolve().parents[2]
CPU = {"prefill": ["prefill"], "decode": ["decode"]}
TWO_BY_TWO = {"prefill": ["prefill/1", "prefill/2"], "decode": ["decode/1", "decode/2"]}


def chaos_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---- the schedule ---------------------------------------------------------------------------


def runnable(instances: dict[str, list[str]], sim: bool = False) -> list[str]:
    return [k for k in chaos_plan.BUILT if not chaos_plan.refusal(k, instances, sim)]


def test_the_same_seed_draws_the_same_schedule_and_another_seed_another():
    kinds = runnable(CPU)
    first = chaos_plan.draw(7, 12, 300, kinds, CPU)
    assert first == chaos_plan.draw(7, 12, 300, kinds, CPU)
    assert first != chaos_plan.draw(8, 12, 300, kinds, CPU)
    # The command line prints it the same way from one run to the next (another process).
    runs = [chaos_cli("--env-dir", "env/cpu", "--seed", "7", "--dry-run") for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout
    other = chaos_cli("--env-dir", "env/cpu", "--seed", "8", "--dry-run")
    assert other.stdout.splitlines()[1:] != runs[0].stdout.splitlines()[1:]
    assert re.search(r"^#1 at [\d.]+ s: ", runs[0].stdout, re.M), runs[0].stdout


def test_the_schedule_keeps_to_its_kinds_targets_times_and_holds():
    schedule = chaos_plan.draw(3, 200, 120, list(chaos_plan.BUILT), TWO_BY_TWO, (2.0, 5.0))
    engines = TWO_BY_TWO["prefill"] + TWO_BY_TWO["decode"]
    assert [f.index for f in schedule] == list(range(1, 201))
    assert [f.at_s for f in schedule] == sorted(f.at_s for f in schedule)
    assert all(0 <= f.at_s < 120 for f in schedule)
    assert {f.kind for f in schedule} == set(chaos_plan.BUILT)
    for f in schedule:
        first = f.parts[0]
        if first.kind in chaos_plan.STOPS:
            assert 2.0 <= first.hold_s <= 5.0 and first.target in engines, f
        if f.kind == "engine-kill":
            assert first.target in engines and not first.hold_s, f
        if f.kind in ("router-restart", "co-restart"):
            assert first.target == {"router-restart": "router", "co-restart": "stack"}[f.kind]
        if f.kind == "overlap":
            second = f.parts[1]
            assert first.kind in chaos_plan.STOPS
            assert 0 < second.after_s < first.hold_s, f
            if second.kind == "engine-kill":
                # The other role's engine: a prefill stopped while a decode is killed, or back.
                assert first.target.split("/")[0] != second.target.split("/")[0], f
            else:
                assert second.target == "router", f
        if f.kind == "rolling-restart":
            assert first.target in ("prefill", "decode") and not first.hold_s, f
        if f.kind in chaos_plan.PROXIES:
            assert first.target == "clients" and 2.0 <= first.hold_s <= 5.0, f
    only_stops = chaos_plan.draw(3, 50, 120, ["scheduler-stop"], CPU)
    assert {f.kind for f in only_stops} == {"scheduler-stop"}


def test_kinds_a_stack_cannot_run_are_refused_with_their_reason():
    assert chaos_plan.refusal("scheduler-stop", CPU) is None
    assert "unknown fault kind 'freeze'" in chaos_plan.refusal("freeze", CPU)
    assert "needs a prefill and a decode" in chaos_plan.refusal("overlap", {"prefill": ["p"]})
    assert "two or more instances" in chaos_plan.refusal("rolling-restart", CPU)
    assert chaos_plan.refusal("rolling-restart", TWO_BY_TWO) is None
    # One role with two instances is enough, and only that role is drawn.
    one_two = {"prefill": ["prefill"], "decode": ["decode/1", "decode/2"]}
    assert chaos_plan.refusal("rolling-restart", one_two) is None
    drawn = chaos_plan.draw(1, 20, 60, ["rolling-restart"], one_two)
    assert {f.parts[0].target for f in drawn} == {"decode"}
    assert "no sglang scheduler" in chaos_plan.refusal("scheduler-stop", TWO_BY_TWO, sim=True)
    assert all(chaos_plan.refusal(k, CPU) is None for k in chaos_plan.PROXIES)
    assert runnable(TWO_BY_TWO, sim=True) == [
        k for k in chaos_plan.CATALOGUE if k != "scheduler-stop"
    ]


def test_on_simulated_engines_an_overlap_stops_a_whole_engine():
    kinds = runnable(TWO_BY_TWO, sim=True)
    schedule = chaos_plan.draw(4, 200, 60, kinds, TWO_BY_TWO, sim=True)
    stops = {f.parts[0].kind for f in schedule if f.kind == "overlap"}
    assert stops == {"engine-stop"}
    # Real engines draw both stops, and the kinds of old keep their old schedule.
    real = chaos_plan.draw(4, 200, 60, list(chaos_plan.BUILT), TWO_BY_TWO)
    assert {f.parts[0].kind for f in real if f.kind == "overlap"} == set(chaos_plan.STOPS)


def test_each_kind_names_the_alerts_it_expects_and_an_overlap_its_stops():
    stop = chaos_plan.Part("engine-stop", "decode/2", hold_s=3.0)
    kill = chaos_plan.Part("engine-kill", "prefill/1", after_s=1.0)
    assert chaos_plan.expected_alerts(chaos_plan.Fault(1, "overlap", 0.0, (stop, kill))) == [
        ("PDInstanceDown", "decode/2")
    ]
    sched = chaos_plan.Part("scheduler-stop", "prefill", hold_s=12.0)
    assert chaos_plan.expected_alerts(chaos_plan.Fault(1, "scheduler-stop", 0.0, (sched,))) == [
        ("PDSchedulerStalled", "prefill")
    ]
    for kind in ("router-restart", "co-restart", "rolling-restart", *chaos_plan.PROXIES):
        part = chaos_plan.Part(kind, "router")
        assert chaos_plan.expected_alerts(chaos_plan.Fault(1, kind, 0.0, (part,))) == [], kind
        assert "no alert" in chaos_plan.CATALOGUE[kind].expected.lower(), kind


# ---- the invariants, on literal histories -----------------------------------------------------


RUN = {
    "type": "run",
    "seed": 7,
    "env_dir": "env/cpu",
    "schedule": [{"index": 1}],
    "serve_s": 60,
    "pd_timeouts_s": 20,
    "bound_base_s": 80,
    "settle_s": 60,
    "recover_s": 120,
    "replay": "bench/chaos --env-dir env/cpu --seed 7 --faults 1",
}
REFERENCE = {"type": "reference", "prompt": "short/1", "output_ids": [5, 6, 7, 8], "logprobs": []}


def fault(triage: dict | None = None, parts: list | None = None) -> dict:
    return {
        "type": "fault",
        "index": 1,
        "kind": "engine-stop",
        "describe": "#1 at 3.0 s: engine-stop decode for 5.0 s",
        "planned_s": 3.0,
        "start": 10.0,
        "end": 16.0,
        "parts": parts or [{"kind": "engine-stop", "target": "decode", "hold_s": 5.0}],
        "triage": triage or {"ran": False, "why_not": "test"},
    }


def request(rid: str, start: float, end: float, ok: bool = True, **extra) -> dict:
    record = {
        "type": "request",
        "id": rid,
        "kind": "short",
        "prompt": "short/1",
        "window": "1",
        "start": start,
        "end": end,
        "ok": ok,
        "error": "" if ok else "HTTP 500: failed",
        "output_ids": [5, 6, 7, 8],
    }
    return record | extra


def settled(window: str = "1", ok: bool = True, held: dict | None = None) -> dict:
    return {
        "type": "settle",
        "window": window,
        "paused": 20.0,
        "settled": ok,
        "settle_s": 0.5 if ok else 60.2,
        "bound_s": 60,
        "held": held or {},
    }


def clean_history() -> list[dict]:
    return [
        RUN,
        REFERENCE,
        request("short/1#1", 8.0, 9.0),
        request("short/1#2", 9.5, 30.0),  # waited out the stop: 20.5 s, bound 80 + 6
        request("short/2#1", 11.0, 12.0, ok=False),
        request("short/2#2", 16.5, 17.2),
        fault(),
        {"type": "recovery", "fault": 1, "recovered_s": 1.2, "bound_s": 120},
        settled(),
        settled("final"),
    ]


def test_a_clean_history_passes_every_invariant():
    assert chaos_check.check(clean_history()) == []


def test_a_wrong_answer_is_caught_and_an_error_is_not_one():
    history = clean_history()
    history.insert(3, request("short/1#9", 12.0, 13.0, output_ids=[5, 6, 9, 9]))
    history.insert(3, request("short/1#10", 12.0, 13.0, ok=False, output_ids=[1]))
    (v,) = chaos_check.check(history)
    assert v.invariant == chaos_check.WRONG and v.window == "1"
    assert v.message == (
        "short/1#9 (short/1) answered 4 tokens that differ from its reference's 4 from token "
        "2: [9, 9] against [7, 8]"
    )


def test_an_answer_that_breaks_an_exact_tie_the_other_way_is_listed_not_wrong():
    """Seed 21 on env/cpu (fault #21): short/5's reference [56, 308, 308, 345] had, at token 2,
    308 and 345 at the same logprob (the tiny Llama's bf16 logits tie exactly: the engine's
    own top logprobs, -5.3641772 both); one answer in 184 took 345 there. Not wrong, and
    listed. A gap of one bf16 step (0.0117 at token 3 of the same reference) is no tie."""
    top = [
        [[56, -5.4971218], [413, -5.4971218]],
        [[308, -5.4241605], [329, -5.4436917]],
        [[308, -5.3641772], [345, -5.3641772]],
        [[345, -5.3599706], [308, -5.3716893]],
    ]
    ref = REFERENCE | {"prompt": "short/5", "output_ids": [56, 308, 308, 345], "top": top}
    history = clean_history()
    history.insert(1, ref)
    history.insert(4, request("short/1#7", 12.0, 13.0, output_ids=[56, 308, 345, 396]))
    history[4]["prompt"] = "short/5"
    assert chaos_check.check(history) == []
    (tie,) = chaos_check.ties(history)
    assert tie == {"id": "short/1#7", "prompt": "short/5", "window": "1"} | {
        "at": 2,
        "took": 345,
        "reference": 308,
    }
    report = chaos_check.render(history, [])
    assert "Ties: 1 greedy answer(s) took another token" in report
    assert "short/1#7 (short/5, fault #1) took 345 for 308 at token 2" in report
    for wrong in ([56, 308, 308, 308], [56, 308, 396, 396], [56, 329, 308, 345]):
        history[4]["output_ids"] = wrong
        (v,) = chaos_check.check(history)
        assert v.invariant == chaos_check.WRONG, wrong
    # --tie-logprob 0.02 (the run record's): the one-step gap at token 3 is a tie too.
    history[0] = RUN | {"tie_logprob": 0.02}
    history[4]["output_ids"] = [56, 308, 308, 308]
    assert chaos_check.check(history) == []
    assert "(within 0.02)" in chaos_check.render(history, [])
    history[1] = ref | {"top": None}
    history[4]["output_ids"] = [56, 308, 345, 396]
    (v,) = chaos_check.check(history)
    assert v.invariant == chaos_check.WRONG  # no top logprobs: no tie can be told


def test_a_hang_is_caught_naming_the_request_and_its_bound():
    history = clean_history()
    # Cut off by the tool at its bound: a hang however long it took.
    history.insert(3, request("session/1#2", 40.0, 41.0, ok=False, hung=True))
    # 90 s out, of which the fault (10-16 s) was active 6 s: bound 86 s.
    history.insert(3, request("long/1#4", 2.0, 92.0, kind="long"))
    found = chaos_check.check(history)
    assert [v.invariant for v in found] == [chaos_check.HANG, chaos_check.HANG]
    assert found[0].message == (
        "long/1#4 (long, sent at 2.0 s) took 90.0 s: its bound is 86.0 s (80 s base + 6.0 s "
        "of faults while it was out)"
    )
    assert found[1].message.startswith("session/1#2 (short, sent at 40.0 s) took 1.0 s and was cut")


def test_kv_held_after_the_settle_bound_is_caught():
    history = clean_history()
    history[-2] = settled(ok=False, held={"decode": "num_used_tokens=2400"})
    (v,) = chaos_check.check(history)
    assert v.invariant == chaos_check.HELD and v.window == "1"
    assert v.message == (
        "not every engine held nothing within 60 s of the load pausing: decode: "
        "num_used_tokens=2400"
    )


def test_a_process_left_by_a_killed_engine_is_caught():
    history = clean_history()
    part = {"kind": "engine-kill", "target": "prefill", "left": ["pid 4242 (python, sleeping)"]}
    history[6] = fault(parts=[part])
    (v,) = chaos_check.check(history)
    assert v.invariant == chaos_check.HELD
    assert v.message == (
        "engine-kill prefill: process(es) of the stopped instance still alive: pid 4242 "
        "(python, sleeping)"
    )


def test_failed_requests_that_triage_did_not_name_are_caught():
    history = clean_history()
    wrong = {"ran": True, "verdict": "inconclusive", "reason": "?", "expected": ["decode"]}
    history[6] = fault(triage=wrong | {"named": []})
    (v,) = chaos_check.check(history)
    assert v.invariant == chaos_check.NAMED
    assert v.message.startswith("1 request(s) failed and triage read `inconclusive`, naming none")
    history[6] = fault(triage=wrong | {"verdict": "engine unresponsive", "named": ["decode"]})
    assert chaos_check.check(history) == []
    # Without a failed request, triage's verdict is recorded, not judged.
    history = [r for r in history if r.get("ok", True)]
    history[5] = fault(triage=wrong | {"named": []})
    assert chaos_check.check(history) == []


def test_no_recovery_and_a_failed_restart_are_caught():
    history = clean_history()
    history[7] = {"type": "recovery", "fault": 1, "recovered_s": None, "bound_s": 120}
    part = {"kind": "engine-kill", "target": "decode", "error": "launch/pd restart exited 1"}
    history[6] = fault(parts=[part])
    found = chaos_check.check(history)
    assert [(v.invariant, v.message) for v in found] == [
        (chaos_check.FAULT_RAN, "engine-kill decode: launch/pd restart exited 1"),
        (chaos_check.RECOVERED, "no request succeeded within 120 s of the fault ending"),
    ]


def test_a_live_bound_counts_the_fault_now_active():
    shared = chaos.Shared(chaos.History.__new__(chaos.History), 80.0)
    shared.history.records = clean_history()
    assert shared.bound(0.0, 20.0) == 86.0
    shared.active_since = 50.0
    assert shared.bound(40.0, 65.0) == 95.0


# ---- the report -----------------------------------------------------------------------------


def test_the_report_counts_per_kind_and_gives_the_replay_of_a_broken_fault():
    history = clean_history()
    report = chaos_check.render(history, chaos_check.check(history))
    assert "**Result: every invariant held.**" in report
    assert "| engine-stop | 1 | 3 | 1 | 0 | 0 | 1.2 s | 0.5 s |" in report, (
        report
    )  # served 3, failed 1, wrong 0, hung 0, recovery 1.2 s, settle 0.5 s
    assert "| 1 | engine-stop decode for 5.0 s | 10.0-16.0 s | 3 / 1 | 1.2 s | 0.5 s |" in report
    assert "Final settle: held nothing after 0.5 s." in report
    history.insert(3, request("short/1#9", 12.0, 13.0, output_ids=[1, 2, 3, 4]))
    broken = chaos_check.check(history)
    report = chaos_check.render(history, broken)
    assert "**Result: 1 broken invariant(s).**" in report
    assert "| engine-stop | 1 | 3 | 1 | 1 | 0 | 1.2 s | 0.5 s |" in report, report
    assert "  replay: `bench/chaos --env-dir env/cpu --seed 7 --faults 1 --only-fault 1`" in report


# ---- the command line -----------------------------------------------------------------------


def test_help_lists_every_option_with_its_default():
    text = " ".join(chaos.parser().format_help().split("options:", 1)[1].split())
    options = [a.option_strings[-1] for a in chaos.parser()._actions if a.dest != "help"]
    # Each option's entry: from its name to the next option's, in the order --help lists them.
    for option, following in zip(options, [*options[1:], None], strict=True):
        entry = text.split(option + " ", 1)[1]
        entry = entry.split(" " + following + " ", 1)[0] if following else entry
        assert "(default: " in entry, (option, entry)
    assert "(default: bench/results/chaos-<UTC time>)" in text
    assert "(default: None)" not in text


def test_bad_input_is_refused_with_a_message_naming_it(tmp_path, capsys):
    cases = [
        (("--env-dir", "env/cpu", "--kinds", "freeze"), "--kinds: unknown fault kind 'freeze'"),
        (("--env-dir", "env/cpu", "--kinds", "rolling-restart"), "two or more instances"),
        (("--env-dir", "env/cpu", "--sim", "--kinds", "scheduler-stop"), "no sglang scheduler"),
        (("--env-dir", str(tmp_path / "none")), "not a directory"),
        (("--env-dir", "env/cpu", "--faults", "2", "--only-fault", "3"), "has 2 faults"),
        (("--env-dir", "env/cpu", "--hold-s", "5,2"), "wants 0 < MIN <= MAX"),
        (("--env-dir", "env/cpu", "--faults", "0"), "wants a number > 0"),
        (
            ("--env-dir", "env/cpu", "--triage-fast-s", "30", "--triage-probe-s", "30"),
            "--triage-probe-s 30: a probe must be allowed more than --triage-fast-s (30 s)",
        ),
    ]
    for args, said in cases:
        with pytest.raises(SystemExit) as ended:
            chaos.main(list(args))
        err = capsys.readouterr().err
        assert ended.value.code == 2 and said in err, (args, err)


def test_the_replay_command_carries_the_load_and_judgement_options_but_not_the_key(capsys):
    given = [
        "--short-tokens", "4", "--wedged-after-s", "60", "--triage-fast-s", "40",
        "--tie-logprob", "0.1", "--serve-s", "300", "--session-rounds", "2",
        "--session-words", "8", "--session-tokens", "4", "--triage-window-s", "45",
    ]  # fmt: skip
    args = ["--env-dir", "env/cpu", "--seed", "5", "--faults", "4", *given]
    assert chaos.main([*args, "--api-key", "s3cret", "--out", "/nonexistent", "--dry-run"]) == 0
    replay = capsys.readouterr().out.splitlines()[0].split("schedule (", 1)[1].rstrip("):")
    assert "s3cret" not in replay and "--out" not in replay and "--api-key" not in replay
    words = shlex.split(replay)
    assert words[0] == "bench/chaos"
    again, first = chaos.parser().parse_args(words[1:]), chaos.parser().parse_args(args)
    # The kinds are spelled out (the ones env/cpu can run); every other option is as given.
    assert again.kinds.split(",") == runnable(CPU)
    for dest in vars(first).keys() - {"kinds"}:
        assert getattr(again, dest) == getattr(first, dest), dest
    # Options left at their default are not repeated.
    assert "--short-clients" not in replay and "--recover-s" not in replay


def test_a_stack_that_is_not_up_is_refused_before_anything_starts(tmp_path, capsys):
    env_dir = tmp_path / "env"
    shutil.copytree(ROOT / "env" / "cpu", env_dir)
    prefill, boot, decode, router, prom = free_loopback_ports(5)
    envfiles.set_values(
        env_dir / "common.env",
        {
            "PREFILL_PORT": str(prefill),
            "PREFILL_BOOTSTRAP_PORT": str(boot),
            "DECODE_PORT": str(decode),
            "ROUTER_PORT": str(router),
            "ROUTER_PROMETHEUS_PORT": str(prom),
            "PD_RUN_DIR": str(tmp_path / "run"),
        },
    )
    out = tmp_path / "out"
    assert chaos.main(["--env-dir", str(env_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"the stack of {env_dir} is not up: prefill http://127.0.0.1:{prefill}/health" in err
    assert f"Start it with launch/pd up --env-dir {env_dir}" in err
    assert not out.exists()


def test_triage_runs_where_it_can_name_the_fault_and_says_why_not_elsewhere():
    injector = chaos.Injector.__new__(chaos.Injector)
    injector.opts = types.SimpleNamespace(wedged_after_s=10.0)

    def plan(*parts: chaos_plan.Part):
        return injector.triage_plan(chaos_plan.Fault(1, parts[0].kind, 0.0, parts))

    short = chaos_plan.Part("scheduler-stop", "decode", hold_s=10.9)
    assert plan(short) == (
        None,
        "the 10.9 s hold is shorter than triage needs to tell a stopped scheduler from a busy "
        "one (--wedged-after-s 10 s + 1 s)",
    )
    long = chaos_plan.Part("scheduler-stop", "decode", hold_s=11.0)
    assert plan(long) == (long, "")
    stop = chaos_plan.Part("engine-stop", "prefill", hold_s=2.0)
    assert plan(stop, chaos_plan.Part("router-restart", "router", after_s=1.0)) == (stop, "")
    assert plan(chaos_plan.Part("router-restart", "router")) == (
        None,
        "it has no verdict for a router that is down (it reads the engines, which answer)",
    )
    assert plan(chaos_plan.Part("co-restart", "stack"))[1].startswith("every component restarts")


def test_a_recovery_not_waited_for_once_the_request_budget_is_spent_is_no_violation():
    history = clean_history()
    history[7] = {"type": "recovery", "fault": 1, "recovered_s": None, "skipped": "spent"}
    assert chaos_check.check(history) == []


def test_the_schedule_depends_on_which_kinds_not_on_their_order(capsys):
    printed = []
    for kinds in (
        "router-restart,engine-stop,scheduler-stop",
        "scheduler-stop,engine-stop,router-restart",
    ):
        assert (
            chaos.main(["--env-dir", "env/cpu", "--seed", "6", "--kinds", kinds, "--dry-run"]) == 0
        )
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1]
    assert "--kinds scheduler-stop,engine-stop,router-restart " in printed[0]


def test_a_run_stopped_on_a_stack_that_did_not_come_back_says_which_faults_it_left_out():
    history = clean_history()[:-1]
    history[7] = {"type": "recovery", "fault": 1, "recovered_s": None, "bound_s": 120}
    why = "the stack did not recover"
    history.append({"type": "stop", "after": 1, "why": why, "not_run": [2, 3]})
    report = chaos_check.render(history, chaos_check.check(history))
    assert (
        "The run stopped after fault #1: the stack did not recover. Faults not run: #2, #3."
        in report
    )
    assert "- fault #1: recovered: no request succeeded within 120 s of the fault ending" in report


# ---- what this version added: alerts, rolling restarts, interruptions, simulated answers ---------


def alerts_record(fired: float | None = 14.0, resolved: float | None = 18.0) -> dict:
    return {
        "type": "alerts",
        "fault": 1,
        "wait_s": 30,
        "fault_start": 10.0,
        "fault_end": 16.0,
        "alerts": [
            {"alert": "PDInstanceDown", "instance": "decode", "fired": fired, "resolved": resolved}
        ],
        "error": "",
    }


def test_an_expected_alert_that_did_not_fire_or_resolve_is_caught_and_reported():
    history = clean_history()
    history[0] = RUN | {"prometheus": "http://127.0.0.1:9090"}
    history.insert(8, alerts_record())
    assert chaos_check.check(history) == []
    report = chaos_check.render(history, [])
    assert "## Alerts on http://127.0.0.1:9090" in report
    assert "| 1 | PDInstanceDown | decode | 4.0 s | 2.0 s |" in report
    history[8] = alerts_record(fired=None, resolved=None) | {"error": "ConnectionRefusedError"}
    (v,) = chaos_check.check(history)
    assert (v.invariant, v.window) == (chaos_check.ALERTED, "1")
    assert v.message == (
        "PDInstanceDown for decode did not fire within 30 s past the hold "
        "(Prometheus: ConnectionRefusedError)"
    )
    assert "| 1 | PDInstanceDown | decode | - | - |" in chaos_check.render(history, [v])
    history[8] = alerts_record(resolved=None)
    (v,) = chaos_check.check(history)
    assert v.message == "PDInstanceDown for decode did not resolve within 30 s of the fault"


def test_without_prometheus_the_report_says_alerts_were_not_checked():
    report = chaos_check.render(clean_history(), [])
    assert "Alerts: not checked (no --prometheus)." in report


def test_a_failed_request_during_a_rolling_restart_is_caught():
    history = clean_history()
    history[6] = fault() | {"kind": "rolling-restart", "describe": "#1: rolling-restart decode"}
    history[6]["parts"] = [{"kind": "rolling-restart", "target": "decode"}]
    (v,) = chaos_check.check(history)
    assert (v.invariant, v.window) == (chaos_check.SERVED, "1")
    assert (
        v.message
        == "1 request(s) failed during a rolling-restart, first short/2#1: HTTP 500: failed"
    )
    # The same failure during an engine-stop is expected.
    assert chaos_check.check(clean_history()) == []


def test_an_interrupted_run_reports_the_history_so_far_and_says_so():
    history = clean_history()[:-1]
    stop = {"type": "interrupted", "signal": "SIGTERM", "at": 21.5, "window": "2"}
    history.append(stop | {"injecting": "#2 at 9.0 s: engine-stop prefill for 30.0 s"})
    history[-1]["commands_killed"] = ["launch/pd restart decode"]
    report = chaos_check.render(history, chaos_check.check(history))
    assert report.startswith(
        "# bench/chaos report\n\n**Interrupted** by SIGTERM at 21.5 s, in fault #2's window, "
        "while injecting #2 at 9.0 s: engine-stop prefill for 30.0 s (that fault has no row: it "
        "did not end): this report covers the history until then"
    )
    assert "**Result: every invariant held so far.**" in report
    assert "`launch/pd restart decode` was running and was killed: `launch/pd status`" in report
    assert "| engine-stop | 1 | 3 | 1 | 0 | 0 | 1.2 s | 0.5 s |" in report


def test_a_simulated_answer_with_other_text_is_wrong():
    history = clean_history()
    history[1] = REFERENCE | {"output_ids": None, "text": "tok0 tok1"}
    for r in history:
        if r["type"] == "request":
            r["output_ids"], r["text"] = None, "tok0 tok1"
    assert chaos_check.check(history) == []
    history[2]["text"] = "tok0 tok9"
    (v,) = chaos_check.check(history)
    assert v.invariant == chaos_check.WRONG
    assert v.message == (
        "short/1#1 (short/1) answered the text 'tok0 tok9' against its reference's 'tok0 tok1'"
    )


async def _served(handler, path: str = "/slow") -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_the_proxy_holds_requests_during_a_stall_and_resets_them_during_a_reset():
    async def scenario():
        release = asyncio.Event()

        async def slow(request):
            if request.query.get("wait"):
                await release.wait()
            return web.Response(text="answer")

        upstream, url = await _served(slow)
        proxy = ChaosProxy(url)
        await proxy.start()
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as s:

            async def get(query: str = "") -> str:
                try:
                    async with s.get(proxy.url + "/slow" + query) as resp:
                        return await resp.text()
                except aiohttp.ClientError as exc:
                    return type(exc).__name__

            try:
                assert await get() == "answer"
                proxy.stall()
                held = asyncio.ensure_future(get())
                await asyncio.sleep(0.5)
                assert not held.done() and proxy.held == 1 and proxy.forwarding == 0
                assert await proxy.idle(0.1)
                proxy.end()
                assert await held == "answer" and proxy.stalled == 1
                # A reset: the request in flight is reset, and a new one during it.
                inflight = asyncio.ensure_future(get("?wait=1"))
                await asyncio.sleep(0.3)
                assert proxy.forwarding == 1 and not await proxy.idle(0.1)
                proxy.begin_reset()
                assert (await inflight).startswith(("ClientOSError", "ServerDisconnected"))
                assert (await get()).startswith(("ClientOSError", "ServerDisconnected"))
                assert await proxy.idle(1.0)
                proxy.end()
                # aiohttp's client tries a reset GET again once on a fresh connection.
                assert await get() == "answer" and proxy.resets >= 2
            finally:
                release.set()
                await proxy.close()
                await upstream.cleanup()

    asyncio.run(scenario())


def test_a_request_the_router_refuses_fails_its_client_connection_quietly(caplog):
    """The router down (a router-restart): the proxy's client meets a failed connection, as it
    would going straight to the router, not an answer the proxy made up, and aiohttp logs no
    handler traceback for it (one per request filled the console during a restart)."""

    async def scenario():
        async def answer(_request):
            return web.Response(text="answer")

        upstream, url = await _served(answer, "/generate")
        proxy = ChaosProxy(url)
        await proxy.start()
        await upstream.cleanup()  # the router's port now refuses
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                try:
                    async with s.get(proxy.url + "/generate") as resp:
                        return f"{resp.status} {await resp.text()}"
                except aiohttp.ClientError as exc:
                    return type(exc).__name__
        finally:
            assert await proxy.idle(1.0)
            await proxy.close()
            assert proxy.upstream_failures >= 1

    with caplog.at_level(logging.DEBUG, logger="aiohttp"):
        got = asyncio.run(scenario())
    assert got.startswith(("ClientOSError", "ServerDisconnected")), got
    assert "Error handling request" not in caplog.text, caplog.text


def test_alerts_are_waited_for_until_they_fire_and_until_they_resolve(monkeypatch):
    monkeypatch.setattr(chaos_alerts, "POLL_S", 0.2)
    state = {"firing": False, "reads": 0}

    async def alerts(_request):
        state["reads"] += 1
        labels = {"alertname": "PDInstanceDown", "pd_instance": "decode/2", "stack": "sm120pd"}
        other = labels | {"stack": "another"}
        listed = [{"labels": other, "state": "firing"}]
        if state["firing"]:
            listed.append({"labels": labels, "state": "firing"})
        else:
            listed.append({"labels": labels, "state": "pending"})
        return web.json_response({"status": "success", "data": {"alerts": listed}})

    async def scenario():
        runner, url = await _served(alerts, "/api/v1/alerts")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        wanted = [("PDInstanceDown", "decode/2")]
        try:
            # Pending is not firing, and another stack's alert is not this one's.
            seen, error = await chaos_alerts.wait(
                url, "sm120pd", wanted, True, 0.6, lambda: loop.time() - t0
            )
            assert seen == {wanted[0]: None} and error == "" and state["reads"] >= 2
            loop.call_later(0.5, state.update, {"firing": True})
            seen, _ = await chaos_alerts.wait(url, "sm120pd", wanted, True, 5, loop.time)
            assert seen[wanted[0]] is not None
            loop.call_later(0.5, state.update, {"firing": False})
            seen, _ = await chaos_alerts.wait(url, "sm120pd", wanted, False, 5, loop.time)
            assert seen[wanted[0]] is not None
        finally:
            await runner.cleanup()
        # Prometheus gone: the error is said, and nothing fired.
        seen, error = await chaos_alerts.wait(url, "sm120pd", wanted, True, 0.1, loop.time)
        assert seen == {wanted[0]: None} and "ClientConnectorError" in error

    asyncio.run(scenario())


def test_a_held_faults_alert_time_is_when_it_fired_not_the_end_of_the_hold(monkeypatch):
    """An engine-stop held 3 s whose alert fires 1 s in: the time recorded is about 1 s, not
    3 s (seed 21 on env/cpu read every alert of a stop at its hold's end: "fired 8.0 s" for an
    8.0 s hold, where PDInstanceDown fires about 4 s in)."""
    monkeypatch.setattr(chaos_alerts, "POLL_S", 0.1)
    state = {"firing": False}

    async def alerts(_request):
        labels = {"alertname": "PDInstanceDown", "pd_instance": "decode", "stack": "sm120pd"}
        listed = [{"labels": labels, "state": "firing" if state["firing"] else "pending"}]
        return web.json_response({"status": "success", "data": {"alerts": listed}})

    async def scenario():
        runner, url = await _served(alerts, "/api/v1/alerts")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        opts = types.SimpleNamespace(prometheus=url, alert_wait_s=10)
        target = types.SimpleNamespace(stack=types.SimpleNamespace(unit_prefix="sm120pd"))
        shared = types.SimpleNamespace(history=types.SimpleNamespace(now=lambda: loop.time() - t0))
        injector = chaos.Injector(opts, target, shared, None, "m", None)
        part = chaos_plan.Part("engine-stop", "decode", hold_s=3.0)
        fault = chaos_plan.Fault(1, "engine-stop", 0.0, (part,))
        record = {"start": 0.0}
        loop.call_later(1.0, state.update, {"firing": True})
        try:
            await injector._hold(part, record, None, fault, 0.5)
        finally:
            await runner.cleanup()
        return record, loop.time() - t0

    record, took = asyncio.run(scenario())
    ((alert),) = record["alerts"]
    assert 0.9 < alert["fired"] < 2.0, record
    assert took >= 3.0  # still held its drawn 3 s


# ---- on a simulated 2P2D stack (launch/pd up --sim, the real smg) -------------------------------


@pytest.fixture(scope="module")
def sim_2p2d(tmp_path_factory):
    """Two simulated prefills and two decodes behind the real smg, on free loopback ports."""
    tmp = tmp_path_factory.mktemp("chaos-2p2d")
    env_dir = simstack.prepare_env(ROOT / "env", tmp / "env", {})
    ports = iter(free_loopback_ports(6))
    for role in ("prefill", "decode"):
        for n in (1, 2):
            lines = [f"# {role} instance {n}", f"{role.upper()}_PORT={next(ports)}"]
            if role == "prefill":
                lines.append(f"PREFILL_BOOTSTRAP_PORT={next(ports)}")
            (env_dir / f"{role}.{n}.env").write_text("\n".join(lines) + "\n")
    try:
        up = simstack._pd("up", env_dir, 120)
        assert up.returncode == 0, up.stdout + up.stderr
        yield env_dir
    finally:
        simstack._pd("down", env_dir, 60)
        sweep(tmp / "run", env_dir)


@contextlib.contextmanager
def prometheus_on(env_dir: Path, tmp: Path):
    """A real Prometheus (./build.sh test unpacks Debian's into build/prometheus) with the rules
    and targets `launch/pd monitoring` renders for the stack: every target scraped and every
    rule evaluated each second, an instance down after 3 s."""
    out = tmp / "monitoring"
    done = subprocess.run(
        [str(ROOT / "launch" / "pd"), "monitoring", "--env-dir", str(env_dir), "--out", str(out)]
        + ["--scrape-interval", "1", "--down-after", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    binary = monitoring.tool("prometheus")
    assert binary, "no prometheus: ./build.sh test unpacks Debian's into build/prometheus"
    (port,) = free_loopback_ports(1)
    url = f"http://127.0.0.1:{port}"
    log = tmp / "prometheus.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={out / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
            ]
            + [f"--web.listen-address=127.0.0.1:{port}"],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        for _ in range(600):  # ready within 60 s
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(url + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError(f"prometheus not ready: {log.read_text()[-2000:]}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# Short runs: a gap of 0.5 s before each fault, holds of 1 to 2 s, short prompts.
SIM_RUN = (
    *("--sim", "--gap-s", "0.5", "--hold-s", "1,2", "--duration", "1", "--settle-s", "20"),
    *("--recover-s", "30", "--command-timeout-s", "120", "--long-words", "40"),
)


def test_rolling_restart_proxy_faults_and_alerts_on_a_sim_2p2d_stack_break_no_invariant(
    sim_2p2d, tmp_path
):
    """Seed 2: a rolling restart of both prefills, a proxy reset, a proxy stall, and an
    engine-stop of prefill/1 whose PDInstanceDown a real Prometheus fires and resolves."""
    kinds = "engine-stop,rolling-restart,proxy-stall,proxy-reset"
    out = tmp_path / "out"
    with prometheus_on(sim_2p2d, tmp_path) as prometheus:
        run = chaos_cli(
            *("--env-dir", str(sim_2p2d), "--seed", "2", "--faults", "4", "--kinds", kinds),
            *(*SIM_RUN, "--prometheus", prometheus, "--alert-wait-s", "30"),
            *("--out", str(out)),
            timeout=180,
        )
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    faults = {f["kind"]: f for f in history if f["type"] == "fault"}
    assert list(faults) == ["rolling-restart", "proxy-reset", "proxy-stall", "engine-stop"]
    assert faults["rolling-restart"]["parts"][0]["rc"] == 0
    for kind in chaos_plan.PROXIES:
        triage = faults[kind]["triage"]
        assert triage["verdict"] == CONNECTION and triage["named"] == ["clients"], triage
    assert faults["proxy-stall"]["parts"][0]["stalled"] >= 1
    assert faults["proxy-reset"]["parts"][0]["reset"] >= 1
    (alerts,) = [r for r in history if r["type"] == "alerts"]
    (alert,) = alerts["alerts"]
    assert (alert["alert"], alert["instance"]) == ("PDInstanceDown", "prefill/1")
    assert faults["engine-stop"]["start"] < alert["fired"] < faults["engine-stop"]["end"]
    assert alert["resolved"] > faults["engine-stop"]["end"]
    windows = {str(f["index"]): k for k, f in faults.items()}
    failed = [r for r in history if r["type"] == "request" and not r["ok"]]
    assert {windows[r["window"]] for r in failed} <= {"proxy-reset", "engine-stop"}, failed
    assert [r for r in failed if windows[r["window"]] == "proxy-reset"], "no request was reset"
    report = (out / "report.md").read_text()
    assert "| rolling-restart | 1 |" in report and "| 4 | PDInstanceDown | prefill/1 |" in report


def test_an_interrupted_run_continues_what_it_stopped_and_writes_its_report(sim_2p2d, tmp_path):
    out = tmp_path / "out"
    target = chaos.Target(sim_2p2d, sim=True)
    run = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "chaos"), "--env-dir", str(sim_2p2d)]
        + [*SIM_RUN, "--hold-s", "60,60", "--kinds", "engine-stop", "--faults", "1"]
        + ["--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        group = []
        for _ in range(300):  # until the engine is stopped, 30 s at most
            group = [p for name in target.stack.roles for p in chaos.stopped(target.group(name))]
            if group or run.poll() is not None:
                break
            time.sleep(0.1)
        assert group, "no engine was stopped"
        run.send_signal(signal.SIGTERM)
        output, _ = run.communicate(timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
    print(output[-2000:])
    assert run.returncode == chaos.INTERRUPTED, output[-2000:]
    assert not [p for name in target.stack.roles for p in chaos.stopped(target.group(name))]
    report = (out / "report.md").read_text()
    assert "**Interrupted** by SIGTERM at " in report
    assert "in fault #1's window, while injecting #1 at " in report
    assert "interrupted by SIGTERM; every process it stopped was continued" in output


def test_a_prometheus_without_the_expected_rules_is_refused():
    class Rules(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            rules = [{"type": "alerting", "name": "PDInstanceDown"}]
            body = {"status": "success", "data": {"groups": [{"rules": rules}]}}
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Rules)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert chaos.prometheus_problem(url, ["engine-stop", "engine-kill", "proxy-stall"]) == ""
        # An overlap's alerts are its stops': a scheduler-stop's rule is missing.
        assert chaos.prometheus_problem(url, ["overlap"]) == (
            "no alerting rule PDSchedulerStalled loaded (render them with launch/pd monitoring "
            "for this stack and load its rules.yml)"
        )
    finally:
        server.shutdown()
        server.server_close()
    said = chaos.prometheus_problem(url, ["engine-stop"])
    assert said.startswith("its rules could not be read: ClientConnectorError"), said
