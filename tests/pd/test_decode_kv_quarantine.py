"""The decode KV quarantine (patch 0024): a failed room's pages stay out of the free list until
prefill acknowledges the abort or decode's heartbeat declares that prefill lost.

Upstream's real DecodeTransferQueue over tiny real pools (pd_harness), with deferred release
on: a room whose prefill never sends fails on decode's waiting timeout, decode sends prefill
the ABORT (captured here instead of a socket) and holds the room. Upstream released it
SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT later whatever prefill did; here it
is quarantined, logged and counted, until the ACK or the loss.
"""

from __future__ import annotations

import logging

import pytest
from pd_harness import WAITING_TIMEOUT_S, tick_for
from prometheus_client import REGISTRY
from sglang.srt.disaggregation.common.conn import AbortAck, AbortNotification
from sglang.srt.disaggregation.kv_quarantine import note_prefill_lost

DEFERRED_S = 30.0
PREFILL = "127.0.0.1:0"  # the bootstrap address pd_harness's receivers use
QUARANTINE_LOG = "sglang.srt.disaggregation.kv_quarantine"


class CapturedSocket:
    """What the receiver sends prefill, without a socket."""

    def __init__(self):
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames) -> None:
        self.sent.append(frames)


class NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Quarantined:
    """The transfer queue with upstream's deferred release on, and the two ticks the decode
    scheduler runs each pass (pop_transferred, then resolve_deferred_releases)."""

    def __init__(self, queue, name: str):
        self.queue = queue
        queue.enable_deferred_kv_release = True
        queue.deferred_kv_release_timeout = DEFERRED_S
        mgr = queue.kv_manager
        mgr.enable_deferred_decode_kv_release = True
        mgr._deferred_abort_ack_tracker = {}
        mgr._deferred_abort_generation = 0
        mgr.local_ip, mgr.rank_port = "127.0.0.1", 1
        mgr.prefill_info_table, mgr.heartbeat_failures = {}, {}
        queue.scheduler.token_to_kv_pool_allocator = queue.token_to_kv_pool_allocator
        self.socket = CapturedSocket()
        self.outcomes: list[str] = []
        collector = queue.scheduler.metrics_collector
        collector.labels = {"quarantine_test": name}
        collector.observe_decode_deferred_kv_release = lambda duration_seconds, outcome: (
            self.outcomes.append(outcome)
        )
        self.labels = collector.labels

    def admit(self, rid: str, room: int):
        decode_req = self.queue.admit_preallocated(rid, room=room)
        receiver = decode_req.kv_receiver
        receiver.bootstrap_infos = [{"rank_ip": "127.0.0.1", "rank_port": 2}]
        receiver._connect_to_bootstrap_server = lambda info: (self.socket, NoLock())
        return decode_req

    def tick(self) -> list:
        done = self.queue.pop_transferred()
        self.queue.resolve_deferred_releases()
        return done

    def abort_sent(self, room: int) -> AbortNotification:
        (frames,) = [f for f in self.socket.sent if int(f[1]) == room]
        return AbortNotification.from_zmq(frames)

    def ack(self, room: int) -> None:
        """Prefill rank 0's ABORT_ACK for the room's current generation."""
        generation = self.abort_sent(room).generation
        ack = AbortAck(room, 0, generation).to_zmq()
        assert self.queue.kv_manager.handle_abort_ack_message(ack)

    def metric(self, name: str) -> float:
        return REGISTRY.get_sample_value(name, self.labels)


@pytest.fixture
def held(transfer_queue, request) -> Quarantined:
    return Quarantined(transfer_queue, request.node.name)


def fail_on_the_waiting_timeout(held: Quarantined, clock, rid: str, room: int):
    decode_req = held.admit(rid, room)
    assert held.tick() == []
    tick_for(held, clock, WAITING_TIMEOUT_S)
    assert held.queue.queue == [] and held.queue.scheduler.output_streamer.streamed
    assert held.abort_sent(room).generation is not None
    return decode_req


def test_an_unacknowledged_room_stays_quarantined_past_the_timeout_until_prefill_acks(
    held, clock, caplog
):
    caplog.set_level(logging.INFO, logger=QUARANTINE_LOG)
    before = held.queue.free_counts()
    # The decode scheduler's first pass publishes the series, at 0.
    assert held.tick() == []
    assert held.metric("sglang:decode_kv_quarantined_rooms") == 0
    assert held.metric("sglang:decode_kv_quarantines_total") == 0
    fail_on_the_waiting_timeout(held, clock, "stopped-prefill", room=41)
    held_counts = held.queue.free_counts()
    assert held_counts["kv tokens"] == before["kv tokens"] - 5

    # Held as upstream holds it, not yet quarantined.
    tick_for(held, clock, DEFERRED_S - 1)
    assert held.metric("sglang:decode_kv_quarantines_total") == 0
    assert "KV quarantine" not in caplog.text
    # Where upstream released it anyway, it enters the quarantine.
    tick_for(held, clock, 1)
    assert held.metric("sglang:decode_kv_quarantined_rooms") == 1
    assert held.metric("sglang:decode_kv_quarantined_tokens") == 5
    assert held.metric("sglang:decode_kv_quarantines_total") == 1
    assert "KV quarantine: room 41 (rid stopped-prefill) was failed 30s ago" in caplog.text
    assert "its 5 KV tokens stay out of the free list" in caplog.text
    # An hour later the pages are still the failed room's, and it was logged once.
    tick_for(held, clock, 3600, step=60)
    assert held.queue.free_counts() == held_counts
    assert caplog.text.count("was failed") == 1
    assert held.outcomes == []

    held.ack(41)
    assert held.tick() == []
    assert held.queue.free_counts() == before
    assert held.metric("sglang:decode_kv_quarantined_rooms") == 0
    assert held.metric("sglang:decode_kv_quarantined_tokens") == 0
    assert held.metric("sglang:decode_kv_quarantines_total") == 1
    assert "room 41 (rid stopped-prefill) leaves after 3600.0s" in caplog.text
    assert "prefill acknowledged the abort (now 0 room(s), 0 tokens quarantined)" in caplog.text
    assert held.outcomes == ["drained"]


def test_a_quarantined_room_is_released_once_decodes_heartbeat_declares_its_prefill_lost(
    held, clock, caplog
):
    caplog.set_level(logging.INFO, logger=QUARANTINE_LOG)
    before = held.queue.free_counts()
    fail_on_the_waiting_timeout(held, clock, "lost-prefill", room=42)
    tick_for(held, clock, DEFERRED_S + 60)
    assert held.metric("sglang:decode_kv_quarantined_rooms") == 1

    # The heartbeat thread's verdict (SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE missed beats).
    held.queue.kv_manager._handle_node_failure(PREFILL)
    assert held.tick() == []
    assert held.queue.free_counts() == before
    assert held.metric("sglang:decode_kv_quarantined_rooms") == 0
    assert f"prefill {PREFILL} was declared lost by decode's heartbeat" in caplog.text
    assert held.outcomes == ["timeout"]


def test_a_loss_declared_before_the_room_sent_its_destinations_does_not_release_it(held, clock):
    """That loss was another prefill generation's: the one at that address now may write."""
    note_prefill_lost(held.queue.kv_manager, PREFILL)
    clock.advance(1)
    fail_on_the_waiting_timeout(held, clock, "new-generation", room=43)
    counts = held.queue.free_counts()
    tick_for(held, clock, DEFERRED_S + 600, step=10)
    assert held.queue.free_counts() == counts
    assert held.metric("sglang:decode_kv_quarantined_rooms") == 1
    held.ack(43)
    held.tick()
    assert held.metric("sglang:decode_kv_quarantined_rooms") == 0


def test_an_ack_within_the_timeout_releases_the_room_without_a_quarantine(held, clock, caplog):
    caplog.set_level(logging.INFO, logger=QUARANTINE_LOG)
    before = held.queue.free_counts()
    fail_on_the_waiting_timeout(held, clock, "acked", room=44)
    tick_for(held, clock, 5)
    held.ack(44)
    held.tick()
    assert held.queue.free_counts() == before
    assert held.metric("sglang:decode_kv_quarantines_total") == 0
    assert "KV quarantine" not in caplog.text
    assert held.outcomes == ["drained"]


def test_a_rank_other_than_0_quarantines_and_publishes_nothing(transfer_queue, clock, request):
    """At decode TP > 1 every rank holds its copy of the room's pages and quarantines it, and
    only the rank upstream lets publish scheduler metrics (attention-TP rank 0, its
    current_scheduler_metrics_enabled) counts it: one room is one quarantine on /metrics."""
    transfer_queue.scheduler.metrics_reporter.current_scheduler_metrics_enabled = False
    held = Quarantined(transfer_queue, request.node.name)
    before = held.queue.free_counts()
    assert held.tick() == []
    fail_on_the_waiting_timeout(held, clock, "rank-1", room=43)
    tick_for(held, clock, DEFERRED_S)
    assert held.queue.free_counts()["kv tokens"] == before["kv tokens"] - 5  # still held
    for name in ("rooms", "tokens"):
        assert held.metric(f"sglang:decode_kv_quarantined_{name}") is None
    assert held.metric("sglang:decode_kv_quarantines_total") is None
    held.ack(43)
    assert held.tick() == []
    assert held.queue.free_counts() == before
