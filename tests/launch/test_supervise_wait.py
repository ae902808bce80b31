"""launch/pd's stop treats an exited server as gone without waiting for it to be reaped; what
it reads back from the run dir (pid files) signals only the processes it started, and a run dir
another user owns is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from launch.pdlib.supervise import SuperviseError, private_run_dir, sweep, wait_exited


def pid_record(proc: subprocess.Popen) -> str:
    return json.dumps({"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time()})


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
    (run_dir / "decode.pid").write_text(pid_record(recorded))
    try:
        assert sweep(run_dir, marker) == 2
        assert named.wait(timeout=10) != 0 and recorded.wait(timeout=10) != 0
        assert bystander.poll() is None
    finally:
        for proc in (named, recorded, bystander):
            proc.kill()
            proc.wait()


def test_sweep_leaves_a_process_alone_whose_pid_file_is_not_its_own(tmp_path):
    # A pid file from an earlier process whose pid number another process now has (its start
    # time differs), and one without a start time: neither process is signalled.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sleeper = "import time; time.sleep(30)"
    reused = subprocess.Popen([sys.executable, "-c", sleeper])
    bare = subprocess.Popen([sys.executable, "-c", sleeper])
    started = psutil.Process(reused.pid).create_time()
    (run_dir / "prefill.pid").write_text(
        json.dumps({"pid": reused.pid, "create_time": started - 3600})
    )
    (run_dir / "decode.pid").write_text(json.dumps({"pid": bare.pid}))
    try:
        assert sweep(run_dir, tmp_path / "no-such-marker") == 0
        time.sleep(0.2)
        assert reused.poll() is None and bare.poll() is None
    finally:
        for proc in (reused, bare):
            proc.kill()
            proc.wait()


def test_the_run_dir_is_made_private_and_one_of_another_user_is_refused(tmp_path):
    fresh = tmp_path / "a" / "run"
    private_run_dir(fresh)
    assert fresh.stat().st_mode & 0o777 == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)
    private_run_dir(loose)
    assert loose.stat().st_mode & 0o777 == 0o700
    # A link is followed to a directory of ours nobody else can write, and not chmodded through.
    link = tmp_path / "link"
    link.symlink_to(fresh)
    private_run_dir(link)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (tmp_path / "to-shared").symlink_to(shared)
    with pytest.raises(SuperviseError, match="writable by nobody else"):
        private_run_dir(tmp_path / "to-shared")
    assert shared.stat().st_mode & 0o7777 == 0o1777
    if os.geteuid() != 0:
        return
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(SuperviseError, match="belongs to uid 65534"):
        private_run_dir(theirs)
    (tmp_path / "to-theirs").symlink_to(theirs)
    with pytest.raises(SuperviseError, match="uid 65534"):
        private_run_dir(tmp_path / "to-theirs")
