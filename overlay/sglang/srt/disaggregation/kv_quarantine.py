"""Decode keeps a failed room's KV out of the free list until prefill can no longer write it.

With NIXL (and Mooncake), prefill sends a room's KV as one-sided writes into the pages decode
pre-allocated for it; decode is not told of each write. When decode fails a room whose writes
may still come (its waiting timeout, a transport error), upstream holds the pages and tells
prefill to abort the room (ABORT). Prefill marks the room Failed, lets its transfer worker
drain what it already dequeued, and only then answers ABORT_ACK: after the ACK no write for
the room can land. Decode releases the pages on that ACK, or after
SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT (30 s) without it ("releasing
anyway", `DecodeTransferQueue.resolve_deferred_releases`). A prefill whose scheduler is
stopped (a GPU hang, SIGSTOP) never ACKs, yet it is not gone: when it runs again, a chunk it
had queued, or a write it had posted before it stopped, can land in pages that decode has by
then given to another request. Upstream's own comment there: "A timeout cannot prove that a
remote write has stopped".

Here the timeout no longer releases. A held room that outlives it is quarantined: its pages
stay allocated to the failed request until prefill's ACK arrives, or until decode's heartbeat
declares that prefill lost (`CommonKVManager._handle_node_failure`: its bootstrap server
missed SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE beats; a prefill that is restarted misses
them too, and the new process never knew the room) after the room sent prefill its
destinations. A loss seen before that send is another prefill generation's and does not count.
Each quarantined room is logged when it enters and when it leaves, and counted; the gauges
`sglang:decode_kv_quarantined_rooms` and `sglang:decode_kv_quarantined_tokens` show a
quarantine that does not end, and `sglang:decode_kv_quarantines_total` counts them.

Pool accounting stays upstream's: a quarantined room stays in the transfer queue's list of held
releases, its pages stay allocated to its request (`/v1/loads` counts them in
num_used_tokens), and the scheduler is not idle while any release is held, so sglang's idle
leak check (which is skipped while a release is held) runs again, on a balanced pool, once the
quarantine ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
# On a decode-mode CommonKVManager: bootstrap address -> time.time() of the latest heartbeat
# verdict that the prefill there is lost.
LOST_ATTR = "sm120pd_prefill_lost_at"
# On a DecodeTransferQueue: its KVQuarantine.
QUEUE_ATTR = "sm120pd_kv_quarantine"


def note_prefill_lost(kv_mgr: Any, bootstrap_addr: str) -> None:
    """Decode's heartbeat declared the prefill at `bootstrap_addr` lost (heartbeat thread)."""
    lost = getattr(kv_mgr, LOST_ATTR, None)
    if lost is None:
        lost = {}
        setattr(kv_mgr, LOST_ATTR, lost)
    lost[bootstrap_addr] = time.time()


def prefill_lost_since_send(decode_req: Any) -> bool:
    """Whether the prefill this room sent its destinations to has been declared lost since.
    A room whose send time is unknown (a partial send) waits for the ACK."""
    receiver = decode_req.kv_receiver
    lost_at = getattr(receiver.kv_mgr, LOST_ATTR, {}).get(receiver.bootstrap_addr)
    sent_at = getattr(receiver, "init_time", None)
    return lost_at is not None and sent_at is not None and lost_at >= sent_at


@dataclass
class _Held:
    room: int
    rid: str
    prefill: str
    since: float
    tokens: int


class _Metrics:
    """The three series, in the scheduler's process registry with the scheduler collector's
    labels (created once per process: prometheus names are process-global)."""

    _families: tuple | None = None

    def __init__(self, labels: dict):
        if _Metrics._families is None:
            from prometheus_client import Counter, Gauge

            _Metrics._families = (
                Gauge(
                    name="sglang:decode_kv_quarantined_rooms",
                    documentation=(
                        "Failed decode rooms whose KV is held past "
                        f"{TIMEOUT_ENV} because prefill has not acknowledged their abort "
                        "(a resumed prefill could still write into those pages)."
                    ),
                    labelnames=list(labels),
                    multiprocess_mode="mostrecent",
                ),
                Gauge(
                    name="sglang:decode_kv_quarantined_tokens",
                    documentation="KV tokens held by quarantined decode rooms.",
                    labelnames=list(labels),
                    multiprocess_mode="mostrecent",
                ),
                Counter(
                    name="sglang:decode_kv_quarantines",
                    documentation="Decode rooms that entered the KV quarantine.",
                    labelnames=list(labels),
                ),
            )
        rooms, tokens, total = _Metrics._families
        self.rooms = rooms.labels(**labels)
        self.tokens = tokens.labels(**labels)
        self.total = total.labels(**labels)


class KVQuarantine:
    """The quarantined rooms of one DecodeTransferQueue."""

    def __init__(self, queue: Any):
        self._queue = queue
        self._held: dict[int, _Held] = {}
        labels = None
        # As upstream's own scheduler metrics: the attention-TP rank 0 publishes (every rank
        # quarantines its copy of the room's pages; one room is counted once).
        if getattr(queue.scheduler.metrics_reporter, "current_scheduler_metrics_enabled", False):
            labels = getattr(queue.scheduler.metrics_collector, "labels", None)
        self._metrics = _Metrics(labels) if labels is not None else None
        self._publish()

    @property
    def rooms(self) -> int:
        return len(self._held)

    @property
    def tokens(self) -> int:
        return sum(h.tokens for h in self._held.values())

    def sync(self) -> None:
        """Forget rooms the queue dropped without releasing them (its pool torn down by
        release_memory_occupation)."""
        if self._held and not self._queue._deferred_releases:
            self._held.clear()
            self._publish()

    def may_release_undrained(self, decode_req: Any, now: float, deadline: float) -> bool:
        """Whether a held room that prefill has not acknowledged may be released: only once
        its prefill is lost. Past the deadline where upstream released it anyway, it enters
        the quarantine."""
        if prefill_lost_since_send(decode_req):
            return True
        if now >= deadline and id(decode_req) not in self._held:
            self._enter(decode_req, now)
        return False

    def released(self, decode_req: Any, drained: bool, now: float) -> None:
        """A held room is being released: `drained` when every prefill rank acknowledged."""
        held = self._held.pop(id(decode_req), None)
        room = decode_req.req.bootstrap_room
        why = (
            "prefill acknowledged the abort"
            if drained
            else f"prefill {decode_req.kv_receiver.bootstrap_addr} was declared lost by decode's "
            "heartbeat after the room sent it its destinations"
        )
        if held is not None:
            self._publish()
            logger.warning(
                "KV quarantine: room %s (rid %s) leaves after %.1fs, its %d KV tokens "
                "released: %s (now %d room(s), %d tokens quarantined)",
                room,
                held.rid,
                now - held.since,
                held.tokens,
                why,
                self.rooms,
                self.tokens,
            )
        elif not drained:
            logger.warning("Deferred KV release for room %s without a drain ack: %s", room, why)

    def _enter(self, decode_req: Any, now: float) -> None:
        from sglang.srt.managers.scheduler_components.pool_stats_observer import (
            kv_private_tokens,
        )

        page_size = self._queue.scheduler.token_to_kv_pool_allocator.page_size
        held = _Held(
            room=decode_req.req.bootstrap_room,
            rid=decode_req.req.rid,
            prefill=decode_req.kv_receiver.bootstrap_addr,
            since=now,
            tokens=kv_private_tokens(decode_req.req.kv, page_size),
        )
        self._held[id(decode_req)] = held
        if self._metrics is not None:
            self._metrics.total.inc()
        self._publish()
        logger.warning(
            "KV quarantine: room %s (rid %s) was failed %gs ago and prefill %s has not "
            "acknowledged its abort; its %d KV tokens stay out of the free list until prefill "
            "acknowledges or decode's heartbeat declares it lost, not released at %s "
            "(now %d room(s), %d tokens quarantined)",
            held.room,
            held.rid,
            self._queue.deferred_kv_release_timeout,
            held.prefill,
            held.tokens,
            TIMEOUT_ENV,
            self.rooms,
            self.tokens,
        )

    def _publish(self) -> None:
        if self._metrics is not None:
            self._metrics.rooms.set(self.rooms)
            self._metrics.tokens.set(self.tokens)


def of(queue: Any) -> KVQuarantine:
    """The queue's quarantine, made on first use (which also publishes its zero gauges)."""
    quarantine = getattr(queue, QUEUE_ATTR, None)
    if quarantine is None:
        quarantine = KVQuarantine(queue)
        setattr(queue, QUEUE_ATTR, quarantine)
    return quarantine
