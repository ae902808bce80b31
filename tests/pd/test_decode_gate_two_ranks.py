"""Two TP ranks over a real gloo group: one rank's metadata row never lands, the
other's does; the MIN all-reduce holds both until the gate's deadline on the
first and then concludes both as Failed in the same tick."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import time
import traceback

import torch.distributed as dist
from pd_harness import WAITING_TIMEOUT_S, FakeClock, MiniDecodeTransferQueue
from sglang.srt.disaggregation.metadata_gate_timeout import ENV_NAME
from sglang.srt.managers.schedule_batch import FINISH_ABORT

STEP_S = 5.0
JOIN_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, results) -> None:
    try:
        clock = FakeClock()
        time.time = clock
        time.monotonic = clock
        timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
        group = dist.ProcessGroupGloo(store, rank, 2, timeout)
        queue = MiniDecodeTransferQueue(group)
        before = queue.free_counts()
        decode_req = queue.admit_preallocated("two-ranks", room=41)
        queue.kv_arrives(decode_req)
        if rank == 1:
            queue.metadata_arrives(decode_req)
        concluded_at = None
        for tick in range(2 * int(WAITING_TIMEOUT_S / STEP_S)):
            queue.tick()
            if not queue.queue:
                concluded_at = tick
                break
            clock.advance(STEP_S)
        req = decode_req.req
        results.put(
            (
                rank,
                concluded_at,
                isinstance(req.finished_reason, FINISH_ABORT),
                req.finished_reason.message if req.finished_reason else "",
                queue.free_counts() == before,
            )
        )
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        # os._exit skips the queue's feeder thread: flush it first.
        results.close()
        results.join_thread()
        os._exit(0)


def test_two_ranks_one_gated_past_the_deadline_fail_in_the_same_tick():
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        outcomes = {}
        for _ in procs:
            outcome = results.get(timeout=JOIN_TIMEOUT_S)
            outcomes[outcome[0]] = outcome
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()

    for outcome in outcomes.values():
        assert outcome[1] != "error", outcome[2]
    rank0, rank1 = outcomes[0], outcomes[1]
    # Rank 1's local poll is Success from the first tick, but MIN keeps it
    # Transferring while rank 0 is gated; rank 0's deadline concludes both.
    assert rank0[1] == rank1[1] == int(WAITING_TIMEOUT_S / STEP_S)
    assert rank0[2] and rank1[2]
    assert rank0[4] and rank1[4]
    assert f"{ENV_NAME}={WAITING_TIMEOUT_S}s" in rank0[3]
    assert "another rank" in rank1[3]
