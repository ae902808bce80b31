"""launch/pd's stop treats an exited server as gone without waiting for it to be reaped."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil

from launch.pdlib.supervise import sweep, wait_exited


def test_an_exited_unreaped_process_counts_as_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    proc = psutil.Process(child.pid)
    deadline = time.monotonic() + 10
    while proc.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.status() == psutil.STATUS_ZOMBIE
    try:
        assert wait_exited([proc], timeout=5) == []
        # Still a zombie: it was counted as gone, not waited for.
        assert proc.status() == psutil.STATUS_ZOMBIE
    finally:
        child.wait()


def test_a_running_process_is_reported_alive_after_the_timeout():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        proc = psutil.Process(child.pid)
        assert wait_exited([proc], timeout=0.2) == [proc]
    finally:
        child.kill()
        child.wait()
    assert wait_exited([proc], timeout=1) == []


def test_sweep_kills_recorded_pids_and_processes_naming_the_marker(tmp_path):
    marker = tmp_path / "env"
    marker.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sleeper = "import sys, time; time.sleep(30)"
    named = subprocess.Popen([sys.executable, "-c", sleeper, str(marker)])
    recorded = subprocess.Popen([sys.executable, "-c", sleeper])
    bystander = subprocess.Popen([sys.executable, "-c", sleeper])
    (run_dir / "decode.pid").write_text(json.dumps({"pid": recorded.pid}))
    try:
        assert sweep(run_dir, marker) == 2
        assert named.wait(timeout=10) != 0 and recorded.wait(timeout=10) != 0
        assert bystander.poll() is None
    finally:
        for proc in (named, recorded, bystander):
            proc.kill()
            proc.wait()
