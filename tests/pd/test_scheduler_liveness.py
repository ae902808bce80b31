"""Patch 0033: /health answers 503 while a scheduler has stopped publishing its load snapshot.

A writer process publishes with upstream's `ShmLoadSnapshotWriter` the way a scheduler does
(every pass of its loop, its own clock as the timestamp), and upstream's reader is attached to
the file, as the tokenizer manager's is. The writer is stopped with SIGSTOP and resumed with
SIGCONT: `unhealthy_reason` names its rank once the bound has passed, and nothing once it runs
again. Stopped while it holds the lock, the answer still comes within patch 0021's wait. The
real route, with the router acting on it, is in tests/engine/test_cpu_engines.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from sglang.srt.managers import scheduler_liveness as liveness
from sglang.srt.managers.load_snapshot import (
    LoadSnapshot,
    ShmLoadSnapshotReader,
    ShmLoadSnapshotWriter,
)
from sglang.srt.managers.load_snapshot_nonblocking import LOCK_WAIT_S

PUBLISHER = r"""
import sys, time
from sglang.srt.managers.load_snapshot import LoadSnapshot, ShmLoadSnapshotWriter
writer = ShmLoadSnapshotWriter(sys.argv[1], dp_size=2, dp_rank=int(sys.argv[2]))
print("publishing", flush=True)
while True:
    writer.write(LoadSnapshot(timestamp=time.time(), dp_rank=int(sys.argv[2])))
    time.sleep(0.02)
"""
BOUND_S = 1.0


def reason(reader) -> str | None:
    return asyncio.run(liveness.unhealthy_reason(SimpleNamespace(load_snapshot_reader=reader)))


def wait_until(condition, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        time.sleep(0.05)
    return condition()


@pytest.fixture
def publishers(tmp_path, monkeypatch):
    """Two ranks' publishers on one file, as two DP ranks' schedulers share it."""
    monkeypatch.setenv(liveness.VARIABLE, str(BOUND_S))
    path = tmp_path / "sglang_loads_live.shm"
    procs = []
    for rank in (0, 1):
        proc = subprocess.Popen(
            [sys.executable, "-c", PUBLISHER, str(path), str(rank)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "publishing"
        procs.append(proc)
    reader = ShmLoadSnapshotReader(str(path), dp_size=2)
    yield reader, procs
    for proc in procs:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)
    reader.close()


def test_a_stopped_rank_is_named_after_the_bound_and_cleared_when_it_runs_again(publishers):
    reader, (rank0, rank1) = publishers
    assert wait_until(lambda: len(reader.read_all()) == 2, 5)
    assert reason(reader) is None
    os.kill(rank1.pid, signal.SIGSTOP)
    started = time.monotonic()
    got = wait_until(lambda: reason(reader), BOUND_S + 3)
    waited = time.monotonic() - started
    assert got and got.startswith("scheduler of dp_rank 1 has not published"), got
    assert f"more than {liveness.VARIABLE}={BOUND_S:g}" in got
    assert BOUND_S <= waited < BOUND_S + 1.5, waited
    # The running rank keeps publishing; only the stopped one is named.
    assert "dp_rank 0" not in got
    os.kill(rank1.pid, signal.SIGCONT)
    assert wait_until(lambda: reason(reader) is None, 2)


def test_a_rank_stopped_while_it_holds_the_lock_is_named_without_waiting_on_it(tmp_path):
    """A writer stopped mid-publish keeps LOCK_EX: the reason still comes within patch 0021's
    lock wait, from the age of the last snapshot read."""
    path = tmp_path / "sglang_loads_held.shm"
    writer = ShmLoadSnapshotWriter(str(path), dp_size=1, dp_rank=0)
    writer.write(LoadSnapshot(timestamp=time.time() - 40.0, dp_rank=0))
    reader = ShmLoadSnapshotReader(str(path), dp_size=1)
    assert reader.read_all()
    # Read once while free (the last snapshot read is what a locked-out read answers).
    assert "dp_rank 0" in reason(reader)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl,os,sys; fd=os.open(sys.argv[1],os.O_RDWR); "
            "fcntl.flock(fd,fcntl.LOCK_EX); print('held',flush=True); sys.stdin.readline()",
            str(path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        got = reason(reader)
        assert time.monotonic() - started < LOCK_WAIT_S + 0.5
        assert got and "for 4" in got and "dp_rank 0" in got, got
    finally:
        holder.communicate("\n", timeout=10)
        writer.close()
        reader.close()


def test_a_rank_that_never_published_and_a_missing_reader_are_not_judged(tmp_path):
    path = tmp_path / "sglang_loads_new.shm"
    writer = ShmLoadSnapshotWriter(str(path), dp_size=1, dp_rank=0)  # timestamp 0: starting
    reader = ShmLoadSnapshotReader(str(path), dp_size=1)
    try:
        assert reason(reader) is None
        assert reason(None) is None
    finally:
        writer.close()
        reader.close()


def test_zero_turns_the_check_off(tmp_path, monkeypatch):
    path = tmp_path / "sglang_loads_off.shm"
    writer = ShmLoadSnapshotWriter(str(path), dp_size=1, dp_rank=0)
    writer.write(LoadSnapshot(timestamp=time.time() - 3600.0, dp_rank=0))
    reader = ShmLoadSnapshotReader(str(path), dp_size=1)
    try:
        monkeypatch.setenv(liveness.VARIABLE, "0")
        assert reason(reader) is None
        monkeypatch.delenv(liveness.VARIABLE)
        assert "more than SGLANG_HEALTH_SCHEDULER_STALL_S=30" in reason(reader)
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize(
    ("raw", "bound"), [("", 30.0), ("0", 0.0), (" 12.5 ", 12.5), ("600", 600.0)]
)
def test_the_bound_is_read_from_the_environment(raw, bound):
    assert liveness.stall_bound_s({liveness.VARIABLE: raw}) == bound


@pytest.mark.parametrize("raw", ["-1", "abc", "nan", "inf", "30s"])
def test_a_bad_bound_is_an_error_naming_the_variable(raw):
    with pytest.raises(ValueError, match=rf"^{liveness.VARIABLE}="):
        liveness.stall_bound_s({liveness.VARIABLE: raw})


@pytest.mark.parametrize("raw", ["0", "8", "12.5", "600", "-1", "abc", "nan", "inf", "30s"])
def test_env_check_refuses_exactly_the_values_the_engine_refuses(raw):
    """launch/pd env check refuses a bad bound before a launch (launch/pdlib/envfiles.py keeps
    the rule), and what it accepts is what the engine accepts."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from launch.pdlib import envfiles

    try:
        liveness.stall_bound_s({liveness.VARIABLE: raw})
        engine_ok = True
    except ValueError:
        engine_ok = False
    refused = envfiles.knob_value_error(liveness.VARIABLE, raw)
    assert (refused is None) == engine_ok, refused
