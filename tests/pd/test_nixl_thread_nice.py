"""Patch 0020: SGLANG_DISAGGREGATION_NIXL_THREAD_NICE puts NIXL's own threads at a lower priority.

A real NIXL agent is made the way sglang's transfer engine makes it (progress thread on, the UCX
backend created from a helper thread, as `run_with_deadline` does), in a child process so the
test's own threads keep their priority. The native threads NIXL started get the nice value; the
threads that were there before, and a Python thread started in between, keep theirs. The real
engines' threads are checked in tests/engine/test_cpu_engines.py.

The module is this checkout's overlay file, loaded by its path, so these tests need no rebuilt
wheel; its CPU-engine test is the installed sglang's `is_cpu`, as patch 0016's is. Set on an
engine that is not a CPU engine, the variable stops it with an error naming it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "overlay" / "sglang" / "srt" / "disaggregation" / "nixl_thread_nice.py"


def _load():
    spec = importlib.util.spec_from_file_location("overlay_nixl_thread_nice", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nixl_thread_nice = _load()

CHILD = r"""
import importlib.util, json, logging, os, sys, threading, time
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

# The module by its path: importing sglang's package would cost seconds here.
spec = importlib.util.spec_from_file_location("nixl_thread_nice", sys.argv[1])
nixl_thread_nice = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nixl_thread_nice)

logging.basicConfig(level=logging.INFO)

def nices():
    return {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}

first = nices()
before = nixl_thread_nice.snapshot()
stop = threading.Event()
python_thread = threading.Thread(target=stop.wait, daemon=True)
python_thread.start()
agent = nixl_agent("a", nixl_agent_config(
    backends=[], num_threads=8, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
helper = threading.Thread(target=lambda: agent.create_backend("UCX", {"num_threads": "8"}))
helper.start()
helper.join()
lowered = nixl_thread_nice.lower_started_since(before)
time.sleep(0.5)  # NIXL's progress thread polls meanwhile
print(json.dumps({"first": first, "after": nices(), "lowered": lowered,
                  "python": python_thread.native_id}))
stop.set()
"""


def _child(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != nixl_thread_nice.ENV}
    if value is not None:
        env[nixl_thread_nice.ENV] = value
    env["UCX_NET_DEVICES"] = "lo"
    env["SGLANG_USE_CPU_ENGINE"] = "1"  # a CPU engine, as env/cpu's engines are
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(MODULE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_nixls_native_threads_get_the_nice_value_and_nothing_else_does():
    done = _child("19")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    first = {int(k): v for k, v in got["first"].items()}
    after = {int(k): v for k, v in got["after"].items()}
    lowered = set(got["lowered"])
    # NIXL started native threads (its progress thread among them), and each is at nice 19.
    assert lowered, done.stderr[-2000:]
    assert {after[t] for t in lowered if t in after} == {19}
    # Threads from before the agent, and the Python thread started in between, keep theirs.
    assert got["python"] not in lowered
    assert after[got["python"]] == first[next(iter(first))]
    for tid, nice in first.items():
        assert tid not in lowered and after.get(tid, nice) == nice
    assert "NIXL native thread(s) at nice 19" in done.stderr


def test_unset_changes_nothing():
    done = _child(None)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["lowered"] == []
    assert set(got["after"].values()) == set(got["first"].values())
    assert "at nice" not in done.stderr


@pytest.mark.parametrize("value", ["-1", "20", "nice", "1.5"])
def test_a_bad_value_is_refused_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv(nixl_thread_nice.ENV, value)
    with pytest.raises(ValueError, match=rf"{nixl_thread_nice.ENV}='{value}'.*0 to 19"):
        nixl_thread_nice.snapshot()


@pytest.mark.parametrize(("value", "nice"), [("", None), ("0", 0), (" 19 ", 19)])
def test_good_values(value, nice, monkeypatch):
    monkeypatch.setenv(nixl_thread_nice.ENV, value)
    monkeypatch.setattr(nixl_thread_nice, "_cpu_engine", lambda: True)
    assert nixl_thread_nice.target_nice() == nice


ENGINES = r"""
import importlib.util, json, os, sys
from sglang.srt.utils import is_cpu

spec = importlib.util.spec_from_file_location("nixl_thread_nice", sys.argv[1])
nixl_thread_nice = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nixl_thread_nice)

said = {}
for engine in json.loads(sys.argv[2]):
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    if engine is not None:
        os.environ["SGLANG_USE_CPU_ENGINE"] = engine
    is_cpu.cache_clear()
    try:
        said[str(engine)] = ["snapshot", len(nixl_thread_nice.snapshot())]
    except ValueError as exc:
        said[str(engine)] = ["refused", str(exc)]
    is_cpu.cache_clear()
    try:
        said[str(engine)].append(nixl_thread_nice.lower_started_since(None))
    except ValueError as exc:
        said[str(engine)].append(str(exc))
print(json.dumps(said))
"""


def test_set_on_an_engine_that_is_not_a_cpu_engine_it_stops_it_naming_the_variable():
    """Both hooks of patch 0020 (before and after the agent is created) refuse, before any
    thread's priority changes, unless upstream's is_cpu says this is a CPU engine."""
    engines = [None, "0", "true", "1"]
    env = {**os.environ, nixl_thread_nice.ENV: "19"}
    done = subprocess.run(
        [sys.executable, "-c", ENGINES, str(MODULE), json.dumps(engines)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    for engine in ("None", "0", "true"):
        refused, message, after = said[engine]
        assert refused == "refused", (engine, said[engine])
        assert message.startswith(f"{nixl_thread_nice.ENV}='19' is for a CPU engine"), message
        assert "SGLANG_USE_CPU_ENGINE=1" in message and "unset it" in message
        assert after == message
    # SGLANG_USE_CPU_ENGINE=1 on this (x86_64 or aarch64) host: a CPU engine, the knob acts.
    assert said["1"][0] == "snapshot" and said["1"][1] > 0
    assert said["1"][2] == []  # nothing was snapshotted here, so nothing to lower
