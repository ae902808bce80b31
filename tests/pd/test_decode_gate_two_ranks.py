"""Two TP ranks over a real gloo group: one rank's metadata row never lands, the
other's does; the MIN all-reduce holds both until the gate's deadline on the
first and then concludes both as Failed in the same tick."""

from __future__ import annotations

from pd_harness import WAITING_TIMEOUT_S, MiniDecodeTransferQueue, run_two_ranks
from sglang.srt.disaggregation.metadata_gate_timeout import ENV_NAME
from sglang.srt.managers.schedule_batch import FINISH_ABORT

STEP_S = 5.0


def _rank_main(rank, group, clock) -> dict:
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
    return {
        "tick": concluded_at,
        "aborted": isinstance(req.finished_reason, FINISH_ABORT),
        "message": req.finished_reason.message if req.finished_reason else "",
        "released": queue.free_counts() == before,
    }


def test_two_ranks_one_gated_past_the_deadline_fail_in_the_same_tick():
    rank0, rank1 = run_two_ranks(_rank_main)
    # Rank 1's local poll is Success from the first tick, but MIN keeps it
    # Transferring while rank 0 is gated; rank 0's deadline concludes both.
    assert rank0["tick"] == rank1["tick"] == int(WAITING_TIMEOUT_S / STEP_S)
    assert rank0["aborted"] and rank1["aborted"]
    assert rank0["released"] and rank1["released"]
    assert f"{ENV_NAME}={WAITING_TIMEOUT_S}s" in rank0["message"]
    assert "another rank" in rank1["message"]


def _rank_main_prefill_gone(rank, group, clock) -> dict:
    """Both ranks wait for a room whose prefill never sends; rank 1 sent its destination a
    second earlier (its clock started first), so its own waiting timeout runs out first."""
    queue = MiniDecodeTransferQueue(group)
    if rank == 1:
        clock.advance(-1.0)
    decode_req = queue.admit_preallocated("prefill-gone", room=42)
    if rank == 1:
        clock.advance(1.0)
    concluded_at = None
    for tick in range(2 * int(WAITING_TIMEOUT_S)):
        queue.tick()
        if not queue.queue:
            concluded_at = tick
            break
        clock.advance(1.0)
    req = decode_req.req
    return {
        "tick": concluded_at,
        "message": req.finished_reason.message if req.finished_reason else "",
    }


def test_a_room_timed_out_on_another_rank_names_the_variable_on_rank_0():
    """Patch 0028. Rank 0's error is the one the client gets. Upstream's rank 0 said only
    "Failed due to an unknown reason from another rank" when rank 1's waiting timeout ended
    the room; now it also says where the cause is logged, and how long it had
    waited against SGLANG_DISAGGREGATION_WAITING_TIMEOUT."""
    rank0, rank1 = run_two_ranks(_rank_main_prefill_gone)
    assert rank0["tick"] == rank1["tick"] == int(WAITING_TIMEOUT_S) - 1
    variable = f"SGLANG_DISAGGREGATION_WAITING_TIMEOUT={WAITING_TIMEOUT_S:g}"
    assert "timed out" in rank1["message"] and rank1["message"].endswith(variable)
    message = rank0["message"]
    assert "rank=0" in message and "unknown reason from another rank" in message
    assert "log line for bootstrap_room=42 names the cause" in message
    assert f"This rank had waited {WAITING_TIMEOUT_S - 1:.1f}s" in message
    assert message.endswith(variable), message
