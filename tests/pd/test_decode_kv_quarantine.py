"""The decode KV quarantine (patches 0024, 0029): a failed room's pages stay out of the free list
until prefill acknowledges the abort or the prefill process the room was sent to is proven gone.

Upstream's real DecodeTransferQueue over tiny real pools (pd_harness), with deferred release
on: a room is published with the real send_metadata (its messages captured instead of a
socket), its prefill never sends, decode fails it on its waiting timeout, sends prefill the
ABORT and holds the room. Upstream released it
SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT later whatever prefill did; here it
is quarantined, logged and counted, until the ACK or the proof. The heartbeat is upstream's
own thread (patched), fed real `requests` outcomes: a 200 from a real aiohttp server naming
an instance id, a refused connect, a read timeout.
"""

from __future__ import annotations

import collections
import functools
import logging
import socket
import threading

import numpy as np
import pytest
import requests
import zmq
from pd_harness import WAITING_TIMEOUT_S, MiniDecodeTransferQueue, run_two_ranks, tick_for
from prometheus_client import REGISTRY
from sglang.srt.disaggregation.common.conn import AbortAck, AbortNotification
from sglang.srt.disaggregation.kv_quarantine import watched
from sglang.srt.disaggregation.prefill_instance import INSTANCE_HEADER, note_route_answer
from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector

DEFERRED_S = 30.0
PREFILL = "127.0.0.1:0"  # the bootstrap address pd_harness's receivers use
QUARANTINE_LOG = "sglang.srt.disaggregation.kv_quarantine"


class CapturedSocket:
    """What the receiver sends prefill, without a socket; `broken` raises as a dead peer's
    socket does."""

    def __init__(self, broken: bool = False):
        self.sent: list[list[bytes]] = []
        self.broken = broken

    def send_multipart(self, frames) -> None:
        if self.broken:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        self.sent.append(frames)


class NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class ReleaseOutcomes:
    """The counter family upstream's observe_decode_deferred_kv_release increments: records the
    outcome label of each release it accepted (it raises on an outcome it does not know)."""

    def __init__(self, outcomes: list):
        self.outcomes = outcomes

    def labels(self, outcome: str) -> ReleaseOutcomes:
        self.outcomes.append(outcome)
        return self

    def inc(self, amount: int) -> None:
        pass


class ReleaseCollector:
    """The fields of upstream's collector that its observe_decode_deferred_kv_release reads."""

    def __init__(self, outcomes: list):
        self.labels = {}
        self.decode_deferred_kv_release_seconds = None
        self.decode_deferred_kv_release_total = ReleaseOutcomes(outcomes)

    def _log_histogram(self, histogram, value) -> None:
        pass


class Quarantined:
    """The transfer queue with upstream's deferred release on, and the two ticks the decode
    scheduler runs each pass (pop_transferred, then resolve_deferred_releases)."""

    def __init__(self, queue, name: str, rank_ports=(2,)):
        self.queue = queue
        self.rank_ports = rank_ports
        self.prefill = PREFILL
        queue.enable_deferred_kv_release = True
        queue.deferred_kv_release_timeout = DEFERRED_S
        mgr = queue.kv_manager
        mgr.enable_deferred_decode_kv_release = True
        mgr._deferred_abort_ack_tracker = {}
        mgr._deferred_abort_generation = 0
        mgr.local_ip, mgr.rank_port = "127.0.0.1", 1
        mgr.prefill_info_table, mgr.heartbeat_failures = {}, {}
        mgr.enable_staging = False
        mgr.build_receiver_metadata_message = lambda bootstrap_room, **_: [
            b"META",
            str(bootstrap_room).encode(),
        ]
        queue.scheduler.token_to_kv_pool_allocator = queue.token_to_kv_pool_allocator
        self.socket = CapturedSocket()
        self.outcomes: list[str] = []
        collector = queue.scheduler.metrics_collector
        collector.labels = {"quarantine_test": name}
        collector.observe_decode_deferred_kv_release = functools.partial(
            SchedulerMetricsCollector.observe_decode_deferred_kv_release,
            ReleaseCollector(self.outcomes),
        )
        self.labels = collector.labels

    def admit(self, rid: str, room: int, reachable: int | None = None):
        """The room through the prealloc queue and upstream's send_metadata to every prefill
        rank, or to the first `reachable` ones only (the next one's socket fails)."""
        decode_req = self.queue.admit_preallocated(rid, room=room)
        receiver = decode_req.kv_receiver
        receiver.bootstrap_addr = self.prefill
        receiver.init_time = None
        receiver.required_dst_info_num = 1
        receiver.bootstrap_infos = [
            {"rank_ip": "127.0.0.1", "rank_port": port, "is_dummy": False}
            for port in self.rank_ports
        ]
        broken = CapturedSocket(broken=True)

        def connect(info):
            index = self.rank_ports.index(info["rank_port"])
            return (broken if reachable is not None and index >= reachable else self.socket), (
                NoLock()
            )

        receiver._connect_to_bootstrap_server = connect
        receiver.send_metadata(np.arange(room % 7, room % 7 + 5, dtype=np.int32))
        return decode_req

    def tick(self) -> list:
        done = self.queue.pop_transferred()
        self.queue.resolve_deferred_releases()
        return done

    def abort_sent(self, room: int) -> AbortNotification:
        (frames,) = [f for f in self.socket.sent if f[0] == b"ABORT" and int(f[1]) == room]
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


def fail_on_the_waiting_timeout(held: Quarantined, clock, rid: str, room: int, **admit):
    decode_req = held.admit(rid, room, **admit)
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


class Prefill:
    """A real bootstrap server (upstream's CommonKVBootstrapServer, patched to name its
    instance) on a loopback port, which can be stopped, restarted on the same port, or
    replaced by a socket that accepts and never answers."""

    def __init__(self):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.addr = f"127.0.0.1:{self.port}"
        self.server = None
        self.silent = None

    def start(self) -> str:
        from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

        self.server = CommonKVBootstrapServer("127.0.0.1", self.port)
        return wait_answering(self.addr)

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server.thread.join(timeout=10)
            self.server = None
        if self.silent is not None:
            self.silent.close()
            self.silent = None

    def hang(self) -> None:
        """Stopped, not gone: connects are accepted (the kernel's backlog) and never answered."""
        self.stop()
        self.silent = socket.socket()
        self.silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.silent.bind(("127.0.0.1", self.port))
        self.silent.listen(16)


def wait_answering(addr: str) -> str:
    """The instance id of the bootstrap server at `addr`, once it answers."""
    for _ in range(200):
        try:
            return requests.get(f"http://{addr}/health", timeout=1).headers[INSTANCE_HEADER]
        except requests.ConnectionError:
            threading.Event().wait(0.05)
    raise AssertionError(f"no bootstrap server answered at {addr}")


class Heartbeat:
    """Upstream's heartbeat thread (patched) on the decode manager, beating every 50 ms."""

    def __init__(self, mgr, addr: str):
        self.mgr = mgr
        mgr.prefill_info_table = {addr: "its parallel info"}
        mgr.heartbeat_interval, mgr.max_failures = 0.05, 2
        mgr.session_pool = collections.defaultdict(requests.Session)
        mgr.session_pool_lock = threading.Lock()
        mgr._heartbeat_shutdown = threading.Event()
        self.thread = mgr._start_heartbeat_checker_thread()

    def stop(self) -> None:
        self.mgr._heartbeat_shutdown.set()
        self.thread.join(timeout=10)


@pytest.fixture
def prefill(held):
    """A started prefill whose id decode took from its answer (as from /route's), and decode's
    heartbeat on it; both stopped at the end."""
    server = Prefill()
    server.start()
    mgr = held.queue.kv_manager
    note_route_answer(mgr, server.addr, requests.get(f"http://{server.addr}/health", timeout=5))
    held.prefill = server.addr
    beat = Heartbeat(mgr, server.addr)
    yield server
    beat.stop()
    server.stop()
    for session in mgr.session_pool.values():
        session.close()


def wait_until(condition, seconds: float = 30) -> None:
    for _ in range(int(seconds / 0.05)):
        if condition():
            return
        threading.Event().wait(0.05)
    raise AssertionError("timed out")


def wait_released(held: Quarantined, clock, before: dict, seconds: float = 30) -> None:
    """Ticks (the fake clock moving a second each) while the real heartbeat runs, until the
    room's pages are free again."""
    for _ in range(int(seconds / 0.05)):
        held.tick()
        if held.queue.free_counts() == before:
            return
        clock.advance(1)
        threading.Event().wait(0.05)
    raise AssertionError(f"still held: {held.queue.free_counts()} != {before}")


def quarantine(held: Quarantined, clock, rid: str, room: int, **admit) -> dict:
    """A room published, failed on the waiting timeout and quarantined; the free counts from
    before it."""
    before = held.queue.free_counts()
    fail_on_the_waiting_timeout(held, clock, rid, room, **admit)
    tick_for(held, clock, DEFERRED_S + 5)
    assert held.metric("sglang:decode_kv_quarantined_rooms") == 1
    return before


def test_a_prefill_restarted_within_the_heartbeats_window_frees_the_room_by_its_new_id(
    held, prefill, clock, caplog
):
    """The bootstrap port is closed for well under two beats: upstream's count of misses never
    reaches its limit, yet the room's process is gone. Its new id says so."""
    caplog.set_level(logging.INFO)
    before = quarantine(held, clock, "restarted-prefill", room=42)
    old = wait_answering(prefill.addr)
    prefill.stop()
    new = prefill.start()
    assert new != old
    wait_released(held, clock, before)
    assert held.metric("sglang:decode_kv_quarantined_rooms") == 0
    assert held.metric("sglang:decode_kv_quarantine_oldest_timestamp_seconds") == 0
    assert f"Prefill at {prefill.addr} restarted (instance {new}, was {old})" in caplog.text
    assert f"prefill {prefill.addr} restarted (another process answers" in caplog.text
    assert held.outcomes == ["prefill_restarted"]


def test_a_prefill_whose_port_refuses_the_heartbeat_is_gone_and_frees_the_room(
    held, prefill, clock, caplog
):
    caplog.set_level(logging.INFO, logger=QUARANTINE_LOG)
    before = quarantine(held, clock, "gone-prefill", room=43)
    prefill.stop()
    wait_released(held, clock, before)
    assert f"prefill {prefill.addr} is gone (decode's heartbeat was refused there)" in caplog.text
    assert held.outcomes == ["prefill_lost"]


def test_a_prefill_that_only_times_out_holds_the_room_until_it_is_refused(
    held, prefill, clock, caplog
):
    """Beats that time out prove nothing (a prefill stopped whole misses them and writes when it
    runs again): upstream's verdict comes, the room stays held, and the heartbeat keeps beating
    the address after upstream dropped it; a refusal then frees the room."""
    caplog.set_level(logging.INFO, logger=QUARANTINE_LOG)
    before = quarantine(held, clock, "stopped-prefill", room=44)
    held_counts = held.queue.free_counts()
    prefill.hang()
    mgr = held.queue.kv_manager
    # Upstream's heartbeat waits 3 s for each answer: two misses, then its verdict.
    wait_until(lambda: prefill.addr not in mgr.prefill_info_table)
    tick_for(held, clock, 600, step=60)
    assert held.queue.free_counts() == held_counts
    assert f"Prefill {prefill.addr} misses decode's heartbeats, but none was refused" in (
        caplog.text
    )
    assert watched(mgr, mgr.prefill_info_table) == [prefill.addr]
    prefill.stop()
    wait_released(held, clock, before)
    assert held.outcomes == ["prefill_lost"]


def test_a_half_published_room_is_freed_once_its_prefill_is_gone(held, prefill, clock):
    """Two prefill ranks; the room's metadata reached the first, the send to the second failed,
    so upstream never set its init_time: the first rank may write, and a loss must count."""
    held.rank_ports = (2, 3)
    before = held.queue.free_counts()
    decode_req = held.admit("half-published", room=45, reachable=1)
    assert decode_req.kv_receiver.init_time is None
    assert [f[0] for f in held.socket.sent] == [b"META"]
    held.tick()
    assert held.queue.queue == [] and held.queue.scheduler.output_streamer.streamed
    tick_for(held, clock, DEFERRED_S + 5)
    assert held.metric("sglang:decode_kv_quarantined_rooms") == 1
    prefill.stop()
    wait_released(held, clock, before)
    assert held.outcomes == ["prefill_lost"]


def test_a_loss_proven_before_the_room_sent_its_destinations_does_not_release_it(
    held, prefill, clock
):
    """That loss was another prefill generation's: the one at that address now may write."""
    mgr = held.queue.kv_manager
    prefill.stop()
    wait_until(lambda: prefill.addr not in mgr.prefill_info_table)
    clock.advance(1)
    before = quarantine(held, clock, "new-generation", room=46)
    counts = held.queue.free_counts()
    tick_for(held, clock, 600, step=10)
    assert held.queue.free_counts() == counts
    held.ack(46)
    held.tick()
    assert held.queue.free_counts() == before
    assert held.outcomes == ["drained"]


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


def _rank_main_one_ack(rank, group, clock) -> dict:
    """Both ranks fail the room; only rank 0's prefill rank acknowledges."""
    queue = MiniDecodeTransferQueue(group)
    queue.scheduler.metrics_reporter.current_scheduler_metrics_enabled = rank == 0
    held = Quarantined(queue, f"two-ranks-{rank}")
    before = held.queue.free_counts()
    fail_on_the_waiting_timeout(held, clock, "one-ack", room=47)
    if rank == 0:
        held.ack(47)
    tick_for(held, clock, DEFERRED_S + 600, step=10)
    seen = {
        "held": held.queue.free_counts() != before,
        "rooms": held.metric("sglang:decode_kv_quarantined_rooms"),
        "total": held.metric("sglang:decode_kv_quarantines_total"),
    }
    if rank == 1:
        held.ack(47)
    held.tick()
    seen["released"] = held.queue.free_counts() == before
    seen["outcomes"] = held.outcomes
    return seen


def test_two_ranks_one_unacknowledged_hold_the_room_on_both_and_count_it_once():
    """Rank 0 has its ACK, rank 1 has none: the MIN all-reduce holds the room on both, and rank
    0, the only rank that publishes, counts it although its own ACK came."""
    rank0, rank1 = run_two_ranks(_rank_main_one_ack)
    assert rank0["held"] and rank1["held"]
    assert (rank0["rooms"], rank0["total"]) == (1, 1)
    assert (rank1["rooms"], rank1["total"]) == (None, None)
    assert rank0["released"] and rank1["released"]
    assert rank0["outcomes"] == rank1["outcomes"] == ["drained"]
