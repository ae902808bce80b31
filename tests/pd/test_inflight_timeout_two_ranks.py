"""Two TP ranks over a real gloo group: the MIN all-reduce carries one rank's
inflight-timeout verdict to the other in the same tick."""

from __future__ import annotations

import os

from pd_harness import MiniPrefillScheduler, run_two_ranks
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.inflight_timeout import ENV_NAME
from sglang.srt.managers.schedule_batch import FINISH_ABORT

TIMEOUT_S = 60
# Seconds each tick takes on each rank's clock: rank 1's lags, as if its request
# entered the queue later, so when rank 0's deadline passes rank 1's local poll
# is still Transferring and only the all-reduce can conclude it.
TICK_S = {0: 1.0, 1: 0.9}


def _rank_main(rank, group, clock) -> dict:
    os.environ[ENV_NAME] = str(TIMEOUT_S)
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
    return {
        "tick": concluded_at,
        "aborted": isinstance(req.finished_reason, FINISH_ABORT),
        "message": req.finished_reason.message if req.finished_reason else "",
        "released": scheduler.free_counts() == before,
    }


def test_two_ranks_with_one_timed_out_reach_failed_in_the_same_tick():
    rank0, rank1 = run_two_ranks(_rank_main)
    # Rank 0's deadline passes on its tick TIMEOUT_S; rank 1's would pass
    # later, but MIN(Failed, Transferring) concludes both in that tick.
    assert rank0["tick"] == rank1["tick"] == TIMEOUT_S
    assert rank0["aborted"] and rank1["aborted"]
    assert rank0["released"] and rank1["released"]
    assert f"{ENV_NAME}={TIMEOUT_S}" in rank0["message"]
    assert "another rank" in rank1["message"]
