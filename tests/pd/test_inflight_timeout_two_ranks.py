"""Two TP ranks over a real gloo group: the MIN all-reduce carries one rank's
inflight-timeout verdict to the other in the same tick."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import time
import traceback

import torch.distributed as dist
from pd_harness import FakeClock, MiniPrefillScheduler
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.inflight_timeout import ENV_NAME
from sglang.srt.managers.schedule_batch import FINISH_ABORT

TIMEOUT_S = 60
# Seconds each tick takes on each rank's clock: rank 1's lags, as if its request
# entered the queue later, so when rank 0's deadline passes rank 1's local poll
# is still Transferring and only the all-reduce can conclude it.
TICK_S = {0: 1.0, 1: 0.9}
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
        os.environ[ENV_NAME] = str(TIMEOUT_S)
        timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
        group = dist.ProcessGroupGloo(store, rank, 2, timeout)
        scheduler = MiniPrefillScheduler(group)
        before = scheduler.free_counts()
        req = scheduler.admit_finished_prefill("two-ranks", room=21)
        scheduler.set_status(req, KVPoll.Transferring)
        concluded_at = None
        for tick in range(2 * TIMEOUT_S):
            if scheduler.tick():
                concluded_at = tick
                break
            clock.advance(TICK_S[rank])
        results.put(
            (
                rank,
                concluded_at,
                isinstance(req.finished_reason, FINISH_ABORT),
                req.finished_reason.message if req.finished_reason else "",
                scheduler.free_counts() == before,
            )
        )
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        # os._exit skips the queue's feeder thread: flush it first.
        results.close()
        results.join_thread()
        os._exit(0)


def test_two_ranks_with_one_timed_out_reach_failed_in_the_same_tick():
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
    # Rank 0's deadline passes on its tick TIMEOUT_S; rank 1's would pass
    # later, but MIN(Failed, Transferring) concludes both in that tick.
    assert rank0[1] == rank1[1] == TIMEOUT_S
    assert rank0[2] and rank1[2]
    assert rank0[4] and rank1[4]
    assert f"{ENV_NAME}={TIMEOUT_S}" in rank0[3]
    assert "another rank" in rank1[3]
