"""The decode transfer queue: what bounds a request holding pre-allocated KV.

Upstream's receiver bounds WaitingForInput with SGLANG_DISAGGREGATION_WAITING_TIMEOUT
from the moment decode sends its destination to prefill; the metadata-gate
patch bounds the state that escaped it (KV received, metadata row empty).
"""

from __future__ import annotations

from pd_harness import WAITING_TIMEOUT_S, tick_for
from sglang.srt.disaggregation.metadata_gate_timeout import ENV_NAME
from sglang.srt.managers.schedule_batch import FINISH_ABORT


def test_received_kv_whose_metadata_never_lands_is_failed_and_released(transfer_queue, clock):
    queue = transfer_queue
    before = queue.free_counts()
    decode_req = queue.admit_preallocated("no-metadata", room=31)
    assert queue.free_counts() != before
    # The KV lands well inside the receiver's own waiting timeout; the
    # metadata row never does.
    tick_for(queue, clock, WAITING_TIMEOUT_S / 2)
    queue.kv_arrives(decode_req)
    assert queue.tick() == []

    # Upstream's receiver deadline (init_time + timeout) passes: the receiver
    # concluded Success, so only the gate's own clock can end this.
    assert tick_for(queue, clock, WAITING_TIMEOUT_S - 1) == []
    assert queue.queue == [decode_req]
    assert queue.scheduler.metrics_collector.transfer_failed == 0

    clock.advance(1)
    assert queue.tick() == []
    assert queue.queue == []
    assert queue.free_counts() == before
    req = decode_req.req
    assert req.kv.req_pool_idx is None
    assert queue.scheduler.output_streamer.streamed == [req]
    assert isinstance(req.finished_reason, FINISH_ABORT)
    message = req.finished_reason.message
    assert f"{ENV_NAME}={WAITING_TIMEOUT_S}s" in message
    assert "metadata" in message and "bootstrap_room=31" in message
    assert queue.scheduler.metrics_collector.transfer_failed == 1
    # The slot is handed to its next owner cleared ("not yet written").
    assert queue.metadata_buffers.bootstrap_room[decode_req.metadata_buffer_index, 0] == 0


def test_metadata_landing_one_tick_before_the_deadline_concludes_as_success(transfer_queue, clock):
    queue = transfer_queue
    slots_before = queue.req_to_metadata_buffer_idx_allocator.available_size()
    decode_req = queue.admit_preallocated("late-metadata", room=32)
    queue.kv_arrives(decode_req)
    assert queue.tick() == []
    assert tick_for(queue, clock, WAITING_TIMEOUT_S - 1) == []

    queue.metadata_arrives(decode_req, first_token=9)
    assert queue.tick() == [decode_req.req]
    assert queue.queue == []
    assert list(decode_req.req.output_ids) == [9]
    assert not isinstance(decode_req.req.finished_reason, FINISH_ABORT)
    assert queue.scheduler.metrics_collector.transfer_failed == 0
    # The request keeps its KV to decode with; the metadata slot is free again.
    assert decode_req.req.kv.req_pool_idx is not None
    assert queue.req_to_metadata_buffer_idx_allocator.available_size() == slots_before


def test_metadata_and_kv_together_pass_the_gate_at_once(transfer_queue, clock):
    queue = transfer_queue
    decode_req = queue.admit_preallocated("healthy", room=33)
    assert queue.tick() == []
    queue.metadata_arrives(decode_req)
    queue.kv_arrives(decode_req)
    assert queue.tick() == [decode_req.req]


def test_prefill_that_never_completes_fails_on_the_upstream_waiting_timeout(transfer_queue, clock):
    """Already sound upstream: KV pre-allocated for a room whose prefill never
    sends anything is released WAITING_TIMEOUT after decode sent its destination."""
    queue = transfer_queue
    before = queue.free_counts()
    decode_req = queue.admit_preallocated("prefill-gone", room=34)
    assert queue.tick() == []
    assert tick_for(queue, clock, WAITING_TIMEOUT_S - 1) == []
    assert queue.queue == [decode_req]

    clock.advance(1)
    assert queue.tick() == []
    assert queue.queue == []
    assert queue.free_counts() == before
    message = decode_req.req.finished_reason.message
    assert "KVPoll.WaitingForInput" in message and "timed out" in message
    # Patch 0010: the message names the variable that bounds the wait, and its value.
    assert message.endswith(f"bounded by SGLANG_DISAGGREGATION_WAITING_TIMEOUT={WAITING_TIMEOUT_S}")
    assert queue.scheduler.metrics_collector.transfer_failed == 1
