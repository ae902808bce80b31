"""Patch 0021: /v1/loads reads the scheduler's load snapshot without blocking the event loop.

Upstream's own writer publishes into a file and upstream's reader is attached to it, as in an
engine; another process holds the file's LOCK_EX, as a scheduler stopped mid-publish does.
Upstream's read blocks for as long as that lasts. `read_loads` answers within its deadline while
the event loop keeps running, with the last snapshot it read marked stale and aged, and fresh
snapshots again once the lock is released. The real engines' routes are checked in
tests/engine/test_cpu_engines.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest
from sglang.srt.managers import load_snapshot_nonblocking as nonblocking
from sglang.srt.managers.load_snapshot import (
    LoadSnapshot,
    ShmLoadSnapshotReader,
    ShmLoadSnapshotWriter,
)

HOLDER = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, getattr(fcntl, sys.argv[2]))
print("held", flush=True)
sys.stdin.readline()
"""


class HeldLock:
    """Another process holding the file's lock (LOCK_EX, a writer's; LOCK_SH, a reader's)
    until release()."""

    def __init__(self, path, kind="LOCK_EX"):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path), kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout.readline().strip() == "held"

    def release(self):
        if self.proc.poll() is None:
            self.proc.communicate("\n", timeout=10)


@pytest.fixture
def published(tmp_path):
    path = tmp_path / "sglang_loads_test.shm"
    writer = ShmLoadSnapshotWriter(str(path), dp_size=2, dp_rank=0)
    writer.write(LoadSnapshot(timestamp=time.time() - 5.0, dp_rank=0, num_running_reqs=3))
    yield path, writer
    writer.close()


def timed_read(reader, dp_rank=None):
    """read_loads on an event loop that also ticks every 5 ms: (result, seconds, ticks)."""

    async def run():
        ticks = 0
        done = asyncio.Event()

        async def tick():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        ticker = asyncio.create_task(tick())
        started = time.monotonic()
        try:
            result = await nonblocking.read_loads(reader, dp_rank)
        finally:
            done.set()
            await ticker
        return result, time.monotonic() - started, ticks

    return asyncio.run(run())


def test_an_unlocked_file_reads_as_upstream_reads_it(published):
    path, _ = published
    reader = ShmLoadSnapshotReader(str(path), dp_size=2)
    (load,), seconds, _ = timed_read(reader)
    assert load == reader.read_all()[0]
    assert load.num_running_reqs == 3 and "stale" not in load.to_dict()
    assert timed_read(reader, 0)[0] == [load]
    assert timed_read(reader, 1)[0] == []  # rank 1 never published
    assert timed_read(reader, 2)[0] == []
    assert seconds < 0.1


def test_a_held_lock_answers_the_last_snapshot_read_marked_stale_without_blocking(published):
    path, writer = published
    reader = ShmLoadSnapshotReader(str(path), dp_size=2)
    (fresh,), _, _ = timed_read(reader)
    held = HeldLock(path)
    try:
        # Upstream's read waits for the lock for as long as the holder keeps it.
        blocked = threading.Thread(target=reader.read_all, daemon=True)
        blocked.start()
        blocked.join(1.0)
        assert blocked.is_alive(), "upstream's read did not wait: the lock is not held"

        (stale,), seconds, ticks = timed_read(reader)
        assert nonblocking.LOCK_WAIT_S <= seconds < nonblocking.LOCK_WAIT_S + 0.5
        # The loop ran throughout: about one tick per 5 ms of the wait.
        assert ticks >= nonblocking.LOCK_WAIT_S / 0.005 / 2, ticks
        as_dict = stale.to_dict()
        assert as_dict["stale"] == 1
        assert as_dict["num_running_reqs"] == 3 and as_dict["timestamp"] == fresh.timestamp
        assert 5.0 <= as_dict["snapshot_age_s"] < 10.0
        assert timed_read(reader, 0)[0][0].to_dict()["stale"] == 1
    finally:
        held.release()
    blocked.join(5.0)
    assert not blocked.is_alive()
    writer.write(LoadSnapshot(timestamp=time.time(), dp_rank=0, num_running_reqs=1))
    (again,), seconds, _ = timed_read(reader)
    assert again.num_running_reqs == 1 and "stale" not in again.to_dict()
    assert seconds < 0.1


def test_a_reader_that_never_read_answers_nothing_while_locked_and_attaches_later(published):
    path, _ = published
    # Upstream's __init__ attaches (under a blocking lock): detach, to take the attach path.
    reader = ShmLoadSnapshotReader(str(path), dp_size=2)
    reader.close()
    assert reader.mmap is None
    held = HeldLock(path)
    try:
        loads, seconds, _ = timed_read(reader)
        assert loads == [] and seconds < nonblocking.LOCK_WAIT_S + 0.5
        assert reader.mmap is None
    finally:
        held.release()
    (load,), _, _ = timed_read(reader)
    assert load.num_running_reqs == 3 and reader.mmap is not None


def blocks(call) -> threading.Thread:
    """Upstream's call in a thread, still running after a second (it waits on the lock)."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(1.0)
    assert thread.is_alive(), "upstream's call did not wait: the lock is not held"
    return thread


def test_the_dp_controllers_read_returns_at_once_while_a_writer_holds_the_lock(published):
    """Patch 0032: DataParallelController.refresh_load_budget reads with read_all_nowait."""
    path, writer = published
    reader = ShmLoadSnapshotReader(str(path), dp_size=2)
    held = HeldLock(path)
    try:
        blocked = blocks(reader.read_all)
        started = time.monotonic()
        assert nonblocking.read_all_nowait(reader) == []
        assert time.monotonic() - started < 0.05
    finally:
        held.release()
    blocked.join(5.0)
    (load,) = nonblocking.read_all_nowait(reader)
    assert load == reader.read_all()[0] and load.num_running_reqs == 3


def test_the_zmq_owner_copies_snapshots_without_waiting_on_a_stopped_reader(tmp_path):
    """Patch 0032: in zmq mode the socket's owner (the multi-tokenizer router's event loop)
    drains snapshots with poll_nowait. With another process holding LOCK_SH (a reader stopped
    mid-read), upstream's poll waits; poll_nowait returns at once and keeps the rank's latest
    snapshot pending, then writes it at the next poll once the lock is free, with no new
    message (the scheduler may have nothing new to send)."""
    from sglang.srt.managers.load_snapshot import ZmqLoadSnapshotWriter, ZmqShmLoadSnapshotReader

    endpoint = f"ipc://{tmp_path / 'loads.ipc'}"
    shm = tmp_path / "sglang_loads_zmq.shm"
    owner = ZmqShmLoadSnapshotReader(endpoint, str(shm), dp_size=1)
    sender = ZmqLoadSnapshotWriter(endpoint, dp_size=1, dp_rank=0)
    try:

        def send_and_drain(running: int) -> None:
            sender.write(LoadSnapshot(timestamp=time.time(), dp_rank=0, num_running_reqs=running))
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not owner._socket.poll(10):
                pass

        send_and_drain(1)
        nonblocking.poll_nowait(owner)
        assert [s.num_running_reqs for s in nonblocking.read_all_nowait(owner)] == [1]
        # Upstream's poll with a reader's lock held: it waits until the lock goes.
        held = HeldLock(shm, "LOCK_SH")
        try:
            send_and_drain(2)
            blocked = blocks(owner.poll)
        finally:
            held.release()
        blocked.join(5.0)
        assert not blocked.is_alive()
        assert [s.num_running_reqs for s in owner._shm_reader.read_all()] == [2]
        # poll_nowait with the same lock held returns at once; the file keeps the last
        # snapshot written (shared locks do not conflict, so it is read meanwhile).
        held = HeldLock(shm, "LOCK_SH")
        try:
            send_and_drain(3)
            started = time.monotonic()
            nonblocking.poll_nowait(owner)
            assert time.monotonic() - started < 0.05
            assert [s.num_running_reqs for s in owner._shm_reader.read_all()] == [2]
        finally:
            held.release()
        # The pending snapshot lands at the next poll, with no new message.
        nonblocking.poll_nowait(owner)
        assert [s.num_running_reqs for s in owner._shm_reader.read_all()] == [3]
    finally:
        sender.close()
        owner.close()
