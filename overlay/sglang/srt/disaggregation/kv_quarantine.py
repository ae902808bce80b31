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
stay allocated to the failed request until one of two proofs that no write for it can land:
- prefill's ACK, sent once every handle of the room settled; a room whose writes prefill could
  not see settle (a post error, a handle still running after a failure) is ACKed once prefill
  proved them drained (nixl_drain_proof), and a prefill that cannot prove it exits, which is
  the second case;
- the prefill process the room was sent to is gone: decode's heartbeat declared it lost
  (`CommonKVManager._handle_node_failure`: SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE missed
  beats), or saw another process answer at its bootstrap address (prefill_instance), after the
  room's first metadata left decode. A loss seen before that is another prefill generation's
  and does not count. The publish time is taken when the first metadata message is sent, so a
  room published to some prefill ranks only (its init_time never set) is covered too.
Both times are decode's own monotonic clock.

A heartbeat verdict counts as a proof only when one of its missed beats was refused (nothing
listens at the address: the process is gone) or another process answered. Beats that only
time out leave the prefill unreachable, not gone: a prefill stopped whole (SIGSTOP of its
process group, a frozen VM, a host cut off) misses them too and may write when it runs again,
so its rooms stay held while it is stopped, and the heartbeat keeps watching the address
(`watched`) until it is refused or restarted; when it runs again its ACK ends its rooms. A
prefill whose scheduler alone is stopped answers every beat and holds its rooms the same way.
A prefill hung in a forward is ended by sglang's own watchdog (--watchdog-timeout, 300 s),
and then it is gone.

Each quarantined room is logged when it enters and when it leaves, and counted; the gauges
`sglang:decode_kv_quarantined_rooms`, `sglang:decode_kv_quarantined_tokens` and
`sglang:decode_kv_quarantine_oldest_timestamp_seconds` (when the oldest held room entered; 0
when none, for an alert on its age) show a quarantine that does not end, and
`sglang:decode_kv_quarantines_total` counts them. The release outcome upstream observes says
why a room left: drained, prefill_lost or prefill_restarted. At decode TP > 1 the release is
agreed over every rank (a MIN all-reduce), so a room still held on any rank is held, and
counted, on all; attention-TP rank 0 publishes, so one room is counted once.

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

from sglang.srt.disaggregation.prefill_instance import take_restarted

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
# On a decode-mode CommonKVManager: bootstrap address -> (time.monotonic(), reason) of the latest
# heartbeat verdict that proved the prefill there gone.
LOST_ATTR = "sm120pd_prefill_lost_at"
# On a decode-mode CommonKVManager: addresses whose latest verdict proved nothing (every missed
# beat timed out); the heartbeat keeps beating them.
UNPROVEN_ATTR = "sm120pd_prefill_unreachable"
# On a decode-mode CommonKVManager: addresses whose current streak of missed beats has a refusal.
REFUSED_ATTR = "sm120pd_prefill_refused"
# On a CommonKVReceiver: time.monotonic() when its first metadata message was sent.
PUBLISHED_ATTR = "sm120pd_published_at"
# On a DecodeTransferQueue: its KVQuarantine.
QUEUE_ATTR = "sm120pd_kv_quarantine"

DRAINED = "drained"
PREFILL_LOST = "prefill_lost"
PREFILL_RESTARTED = "prefill_restarted"
# The outcomes upstream's observe_decode_deferred_kv_release accepts besides its own.
RELEASE_OUTCOMES = (PREFILL_LOST, PREFILL_RESTARTED)
WHY = {
    DRAINED: "prefill acknowledged the abort",
    PREFILL_LOST: "prefill {addr} is gone (decode's heartbeat was refused there) since the "
    "room's metadata left decode",
    PREFILL_RESTARTED: "prefill {addr} restarted (another process answers its bootstrap "
    "address) since the room's metadata left decode",
}


def _attr(obj: Any, name: str, make):
    value = getattr(obj, name, None)
    if value is None:
        value = make()
        setattr(obj, name, value)
    return value


def note_publish(receiver: Any) -> None:
    """The receiver's first metadata message is about to leave decode (a partial send counts:
    the ranks it reached may write)."""
    setattr(receiver, PUBLISHED_ATTR, time.monotonic())


def note_beat(kv_mgr: Any, bootstrap_addr: str, error: BaseException | None) -> None:
    """One heartbeat to `bootstrap_addr`: answered 200 (error None) or failed with `error`."""
    refused = _attr(kv_mgr, REFUSED_ATTR, set)
    if error is None:
        # An unreachable prefill answering again stays watched: its ACK ends its rooms, and if
        # it never comes, a later refusal or restart still does.
        refused.discard(bootstrap_addr)
    elif _is_refusal(error):
        refused.add(bootstrap_addr)


def _is_refusal(error: BaseException) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ConnectionRefusedError):
            return True
        for arg in getattr(error, "args", ()):
            if isinstance(arg, BaseException) and _is_refusal(arg):
                return True
        error = error.__cause__ or error.__context__ or getattr(error, "reason", None)
    return False


def watched(kv_mgr: Any, addresses) -> list[str]:
    """The addresses the heartbeat beats: upstream's, plus every prefill whose verdict proved
    nothing, so that a frozen prefill's rooms end when it is refused or restarted."""
    extra = getattr(kv_mgr, UNPROVEN_ATTR, set())
    return list(addresses) + sorted(extra.difference(addresses))


def note_prefill_lost(kv_mgr: Any, bootstrap_addr: str) -> None:
    """Decode's heartbeat declared the prefill at `bootstrap_addr` lost (heartbeat thread,
    first thing in _handle_node_failure). A proof when the address refused a beat of this
    streak or another process answers there; otherwise the address stays watched."""
    unproven = _attr(kv_mgr, UNPROVEN_ATTR, set)
    if take_restarted(kv_mgr, bootstrap_addr):
        reason = PREFILL_RESTARTED
    elif bootstrap_addr in getattr(kv_mgr, REFUSED_ATTR, ()):
        reason = PREFILL_LOST
    else:
        if bootstrap_addr in unproven:
            return
        unproven.add(bootstrap_addr)
        logger.warning(
            "Prefill %s misses decode's heartbeats, but none was refused: it may be stopped, "
            "not gone, so its rooms' KV stays held until it is refused, restarted or answers",
            bootstrap_addr,
        )
        return
    unproven.discard(bootstrap_addr)
    _attr(kv_mgr, LOST_ATTR, dict)[bootstrap_addr] = (time.monotonic(), reason)


def prefill_gone(decode_req: Any) -> str | None:
    """Why no write can land for this room any more, as a release outcome (PREFILL_LOST,
    PREFILL_RESTARTED), or None. A room whose metadata never left decode waits for the ACK."""
    receiver = decode_req.kv_receiver
    lost = getattr(receiver.kv_mgr, LOST_ATTR, {}).get(receiver.bootstrap_addr)
    published_at = getattr(receiver, PUBLISHED_ATTR, None)
    if lost is None or published_at is None or lost[0] < published_at:
        return None
    return lost[1]


@dataclass
class _Held:
    room: int
    rid: str
    prefill: str
    since: float  # time.monotonic()
    entered_at: float  # time.time(), for the oldest-room gauge only
    tokens: int


class _Metrics:
    """The four series, in the scheduler's process registry with the scheduler collector's
    labels (created once per process: prometheus names are process-global)."""

    _families: tuple | None = None

    def __init__(self, labels: dict):
        if _Metrics._families is None:
            from prometheus_client import Counter, Gauge

            def gauge(name: str, documentation: str) -> Gauge:
                return Gauge(
                    name=name,
                    documentation=documentation,
                    labelnames=list(labels),
                    multiprocess_mode="mostrecent",
                )

            _Metrics._families = (
                gauge(
                    "sglang:decode_kv_quarantined_rooms",
                    f"Failed decode rooms whose KV is held past {TIMEOUT_ENV} because no "
                    "proof has come that prefill can no longer write it (its ACK, or its "
                    "process gone).",
                ),
                gauge(
                    "sglang:decode_kv_quarantined_tokens",
                    "KV tokens held by quarantined decode rooms.",
                ),
                gauge(
                    "sglang:decode_kv_quarantine_oldest_timestamp_seconds",
                    "Unix time at which the oldest room now quarantined entered the "
                    "quarantine; 0 when none is.",
                ),
                Counter(
                    name="sglang:decode_kv_quarantines",
                    documentation="Decode rooms that entered the KV quarantine.",
                    labelnames=list(labels),
                ),
            )
        rooms, tokens, oldest, total = _Metrics._families
        self.rooms = rooms.labels(**labels)
        self.tokens = tokens.labels(**labels)
        self.oldest = oldest.labels(**labels)
        self.total = total.labels(**labels)


class KVQuarantine:
    """The quarantined rooms of one DecodeTransferQueue."""

    def __init__(self, queue: Any):
        self._queue = queue
        self._held: dict[int, _Held] = {}
        labels = None
        # As upstream's own scheduler metrics: the attention-TP rank 0 publishes (every rank
        # holds the room while any rank does, so one room is counted once).
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

    def hold(self, decode_req: Any, now: float, deadline: float) -> None:
        """The room stays held after the ranks agreed (some rank has neither an ACK nor a proof
        that its prefill is gone). Past the deadline where upstream released it anyway, it
        enters the quarantine, on every rank, whichever rank holds it."""
        if now >= deadline and id(decode_req) not in self._held:
            self._enter(decode_req, now)

    def released(self, decode_req: Any, drained: bool, now: float) -> str:
        """A held room is being released: `drained` when every prefill rank of this decode rank
        acknowledged. Returns the release outcome (DRAINED, PREFILL_LOST, PREFILL_RESTARTED)."""
        held = self._held.pop(id(decode_req), None)
        room = decode_req.req.bootstrap_room
        # Not drained here, yet released: every rank agreed, so this rank's prefill is gone.
        outcome = DRAINED if drained else prefill_gone(decode_req) or PREFILL_LOST
        why = WHY[outcome].format(addr=decode_req.kv_receiver.bootstrap_addr)
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
        return outcome

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
            entered_at=time.time(),
            tokens=kv_private_tokens(decode_req.req.kv, page_size),
        )
        self._held[id(decode_req)] = held
        if self._metrics is not None:
            self._metrics.total.inc()
        self._publish()
        logger.warning(
            "KV quarantine: room %s (rid %s) was failed %gs ago and prefill %s has not "
            "acknowledged its abort; its %d KV tokens stay out of the free list until prefill "
            "acknowledges (its writes drained) or its process is proven gone, not "
            "released at %s (now %d room(s), %d tokens quarantined)",
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
            self._metrics.oldest.set(min((h.entered_at for h in self._held.values()), default=0))


def of(queue: Any) -> KVQuarantine:
    """The queue's quarantine, made on first use (which also publishes its zero gauges)."""
    quarantine = getattr(queue, QUEUE_ATTR, None)
    if quarantine is None:
        quarantine = KVQuarantine(queue)
        setattr(queue, QUEUE_ATTR, quarantine)
    return quarantine
