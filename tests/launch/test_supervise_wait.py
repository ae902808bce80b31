"""launch/pd's stop treats an exited server as gone without waiting for it to be reaped."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from launch.pdlib.supervise import wait_exited


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
