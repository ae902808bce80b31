"""/v1/loads without waiting on the scheduler's snapshot lock inside the HTTP event loop.

The scheduler publishes its load snapshot into a /dev/shm file under ``flock(LOCK_EX)``
(``ShmLoadSnapshotWriter.write``, every pass of its loop when idle), and upstream's reader takes
``flock(LOCK_SH)`` blocking, called from the ``/v1/loads`` handler on the HTTP server's asyncio
loop. A scheduler stopped while it holds the lock (SIGSTOP, a debugger, a wedged process
mid-publish) then froze the whole HTTP server, ``/health`` and ``/metrics`` included.

Here the lock is asked for with ``LOCK_NB`` and, while the writer holds it, asked again every
``RETRY_S`` with ``asyncio.sleep`` in between, for at most ``LOCK_WAIT_S``. A publish holds the
lock for microseconds, so a live scheduler never makes a reader wait that long; when it does,
the answer is the last snapshot this process read, each marked ``"stale": 1`` with
``"snapshot_age_s"`` (seconds since its scheduler published it, from its own ``timestamp``).
Nothing is read from the file without the lock, so a snapshot is never half-written. A reader
that has never read one gets none (upstream's answer before the first publish).

Two more callers read the file on a loop that must not wait:

- the DP controller's dispatch (``refresh_load_budget``, at most every 20 ms, before each
  request it dispatches) read every rank with a blocking ``LOCK_SH``: one rank's scheduler
  stopped mid-publish stalled dispatch to every rank. ``read_all_nowait`` asks once without
  blocking and returns nothing while the lock is held; the controller keeps its counters (it
  already skips a rank whose snapshot did not change) and asks again at its next refresh.
- in zmq mode the process that owns the PULL socket copies each snapshot into the file under
  a blocking ``LOCK_EX`` (``ZmqShmLoadSnapshotReader.poll``, an ``add_reader`` callback on the
  multi-tokenizer router's event loop, and the first step of every read): a reader process
  stopped while it held ``LOCK_SH`` stalled that loop. ``poll_nowait`` drains the socket and
  writes each rank's latest snapshot only when the lock is free now; one it cannot write stays
  pending, replaced by a newer one of its rank, and is written at the next poll.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
import weakref

from sglang.srt.managers.load_snapshot import (
    LoadSnapshot,
    ShmLoadSnapshotReader,
    ShmLoadSnapshotWriter,
    ZmqShmLoadSnapshotReader,
    snapshot_decoder,
)

logger = logging.getLogger(__name__)

# At most this long a /v1/loads call waits for the snapshot's lock before it answers the last
# snapshot read; well under the 2 s within which /v1/loads, /health and /metrics must answer.
LOCK_WAIT_S = 0.5
RETRY_S = 0.01

# Per reader: the last snapshot read of each DP rank, and whether the lock is held past
# LOCK_WAIT_S now (logged once when that starts and once when it ends).
_last_read: weakref.WeakKeyDictionary[ShmLoadSnapshotReader, dict[int, LoadSnapshot]] = (
    weakref.WeakKeyDictionary()
)
_locked_out: weakref.WeakSet[ShmLoadSnapshotReader] = weakref.WeakSet()
# Per zmq reader: each rank's latest snapshot not yet written into the file (locked out).
_pending: weakref.WeakKeyDictionary[ZmqShmLoadSnapshotReader, dict[int, LoadSnapshot]] = (
    weakref.WeakKeyDictionary()
)


class StaleLoadSnapshot(LoadSnapshot):
    """A snapshot answered from this process's last read because the file stayed locked."""

    snapshot_age_s: float = 0.0

    def to_dict(self, include: set[str] | None = None) -> dict:
        load = super().to_dict(include)
        # Numbers, not booleans: /v1/loads?format=prometheus prints every number as a gauge.
        load["stale"] = 1
        load["snapshot_age_s"] = round(self.snapshot_age_s, 3)
        return load


def _lock_shared(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _attach(reader: ShmLoadSnapshotReader) -> bool | None:
    """Upstream's attach (map the file, check its header) run only while this process holds a
    shared lock of its own on the file, so that the blocking LOCK_SH inside it is granted at
    once (shared locks do not conflict, and no writer holds LOCK_EX meanwhile). True attached,
    False no usable file yet, None locked."""
    if reader.mmap is not None:
        return True
    try:
        fd = os.open(reader.path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        if not _lock_shared(fd):
            return None
        try:
            return reader._attach()
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _try_read(reader: ShmLoadSnapshotReader, ranks: list[int]) -> list | None:
    """The snapshots of these ranks (None where a slot is empty), [] with no usable file yet,
    or None while the writer holds the lock."""
    attached = _attach(reader)
    if not attached:
        return None if attached is None else []
    if not _lock_shared(reader.fd):
        return None
    try:
        return [reader._read_slot(rank) for rank in ranks]
    finally:
        fcntl.flock(reader.fd, fcntl.LOCK_UN)


def _stale(snapshot: LoadSnapshot, now: float) -> StaleLoadSnapshot:
    fields = {name: getattr(snapshot, name) for name in snapshot.__struct_fields__}
    age = now - snapshot.timestamp if snapshot.timestamp else 0.0
    return StaleLoadSnapshot(**fields, snapshot_age_s=max(0.0, age))


async def read_loads(reader, dp_rank: int | None = None) -> list[LoadSnapshot]:
    """What upstream's ``reader.read(dp_rank)`` / ``reader.read_all()`` return, without ever
    blocking the event loop on the file lock (see the module docstring)."""
    if isinstance(reader, ZmqShmLoadSnapshotReader):
        # Drains the zmq socket into the file; its writer is this process.
        poll_nowait(reader)
        reader = reader._shm_reader
    if dp_rank is not None and not 0 <= dp_rank < reader.dp_size:
        return []
    ranks = list(range(reader.dp_size)) if dp_rank is None else [dp_rank]
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        slots = _try_read(reader, ranks)
        if slots is not None:
            break
        if time.monotonic() >= deadline:
            return _answer_stale(reader, ranks)
        await asyncio.sleep(RETRY_S)
    if reader in _locked_out:
        _locked_out.discard(reader)
        logger.info("load snapshot %s readable again", reader.path)
    last = _last_read.setdefault(reader, {})
    for rank, snapshot in zip(ranks, slots, strict=True):
        if snapshot is not None:
            last[rank] = snapshot
    return [snapshot for snapshot in slots if snapshot is not None]


def _answer_stale(reader: ShmLoadSnapshotReader, ranks: list[int]) -> list[LoadSnapshot]:
    if reader not in _locked_out:
        _locked_out.add(reader)
        logger.warning(
            "load snapshot %s stayed locked for %.1f s (its scheduler holds the lock: stopped "
            "or wedged while publishing?); /v1/loads answers the last snapshot read, marked stale",
            reader.path,
            LOCK_WAIT_S,
        )
    last = _last_read.get(reader, {})
    now = time.time()
    return [_stale(last[rank], now) for rank in ranks if rank in last]


def read_all_nowait(reader) -> list[LoadSnapshot]:
    """Upstream's ``reader.read_all()`` for a loop that must not wait (the DP controller's
    dispatch): every rank's snapshot when the file's lock is free now, [] while a writer holds
    it."""
    if isinstance(reader, ZmqShmLoadSnapshotReader):
        poll_nowait(reader)
        reader = reader._shm_reader
    slots = _try_read(reader, list(range(reader.dp_size)))
    return [snapshot for snapshot in slots or [] if snapshot is not None]


def _lock_free_now(path: str) -> bool:
    """Whether nobody holds the file's lock at this instant (asked on a descriptor of its own,
    released at once)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing the descriptor releases its lock
    return True


def _write_nowait(reader: ZmqShmLoadSnapshotReader, snapshot: LoadSnapshot) -> bool:
    writer = reader._shm_writers.get(snapshot.dp_rank)
    if writer is None:
        # Upstream's writer takes a blocking LOCK_EX once, in its constructor, to lay out the
        # file: made only while the lock is free.
        if not _lock_free_now(reader._shm_path):
            return False
        writer = ShmLoadSnapshotWriter(reader._shm_path, reader.dp_size, snapshot.dp_rank)
        reader._shm_writers[snapshot.dp_rank] = writer
    try:
        fcntl.flock(writer.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    try:
        writer._write_payload(snapshot)
    finally:
        fcntl.flock(writer.fd, fcntl.LOCK_UN)
    return True


def poll_nowait(reader: ZmqShmLoadSnapshotReader) -> None:
    """Upstream's ``reader.poll()`` (drain the zmq socket, write each rank's latest snapshot
    into the file) without waiting on the file's lock; see the module docstring."""
    zmq = reader._zmq
    pending = _pending.setdefault(reader, {})
    while True:
        try:
            data = reader._socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            break
        try:
            snapshot = snapshot_decoder.decode(data)
        except Exception as exc:
            logger.warning("load snapshot zmq decode failed: %s", exc)
            continue
        if 0 <= snapshot.dp_rank < reader.dp_size:
            pending[snapshot.dp_rank] = snapshot
    for rank, snapshot in list(pending.items()):
        try:
            written = _write_nowait(reader, snapshot)
        except Exception as exc:
            logger.warning("load snapshot shm write failed for rank %d: %s", rank, exc)
            written = True  # dropped, as upstream drops it
        if written:
            pending.pop(rank, None)
