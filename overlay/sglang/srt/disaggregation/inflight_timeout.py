"""Bound how long a finished prefill request may wait in the inflight queue.

A prefill request that has run its forward waits in the inflight queue, holding
its KV pages, its req_to_token row and its metadata buffer, until its KV sender
reports Success or Failed. Upstream bounds only the Bootstrapping state (the
bootstrap timeout); a sender that stays in WaitingForInput or Transferring, for
example because the decode peer restarted or lost the transfer, pins those
resources for the life of the process.

With SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT set, a request whose local poll is
still WaitingForInput or Transferring that many seconds after it entered the
inflight queue is turned into Failed *before* the polls are MIN-all-reduced
across the attention TP/CP group. Failed is the minimum, so every rank reaches
the verdict in the same tick and takes upstream's existing failure path
(handle_inflight_transfer_failure) together; a rank-local verdict applied after
the reduction would let the ranks' inflight queues diverge.

Unset, nothing here changes upstream behaviour.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVSender
from sglang.srt.environ import envs

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)

ENV_NAME = "SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT"

# Set on the Req: when its sender was first polled in the inflight queue past
# bootstrap, on the time.monotonic() clock. Both scheduler loops poll the
# inflight queue right after the batch result that appended the request, so
# this is the moment it entered the queue.
CLOCK_ATTR = "disagg_inflight_started_at"

_NON_TERMINAL_AFTER_BOOTSTRAP = (KVPoll.WaitingForInput, KVPoll.Transferring)
_POLL_NAMES = {
    KVPoll.Failed: "Failed",
    KVPoll.Bootstrapping: "Bootstrapping",
    KVPoll.WaitingForInput: "WaitingForInput",
    KVPoll.Transferring: "Transferring",
    KVPoll.Success: "Success",
}


def parse_inflight_timeout(raw: str | None) -> float | None:
    """Seconds from the variable's raw text; None (unset) keeps upstream behaviour."""
    if raw is None:
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{ENV_NAME}={raw!r} is not valid: expected a positive number of seconds "
            f"(for example 60 or 2.5), or leave {ENV_NAME} unset to keep upstream "
            "behaviour (no bound on WaitingForInput/Transferring)"
        )
    return value


def inflight_timeout_from_env() -> float | None:
    """The configured timeout; raises ValueError on a malformed value.

    Read through upstream's registry as a raw string: its numeric fields only
    warn and fall back to the default on a malformed value, which would leave a
    mistyped timeout silently disabled.
    """
    return parse_inflight_timeout(envs.SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT.get())


def timeout_reason(timeout: float, last_poll: int | None = None) -> str:
    state = "" if last_poll is None else f" (last state {_POLL_NAMES.get(last_poll, last_poll)})"
    return (
        f"KV transfer did not conclude within {timeout:g}s of entering the prefill "
        f"inflight queue{state}; bounded by {ENV_NAME}={timeout:g}"
    )


def inflight_verdict(poll: int, started_at: float | None, now: float, timeout: float | None) -> int:
    """The poll this rank contributes to the MIN all-reduce.

    Only WaitingForInput and Transferring are bounded: Bootstrapping stays under
    the bootstrap timeout, and a terminal poll is never changed, so a transfer
    that concludes before the deadline is untouched.
    """
    if timeout is None or started_at is None:
        return poll
    if poll not in _NON_TERMINAL_AFTER_BOOTSTRAP:
        return poll
    if now - started_at < timeout:
        return poll
    return KVPoll.Failed


def _conclude_sender_failed(req: Req, reason: str) -> None:
    sender = req.disagg_kv_sender
    if isinstance(sender, CommonKVSender):
        # Same marking as upstream's _check_bootstrap_timeout: failure_exception()
        # then reports this reason, and the transfer worker sees the room Failed.
        sender.kv_mgr.record_failure(sender.bootstrap_room, reason)
        sender.kv_mgr.update_status(sender.bootstrap_room, KVPoll.Failed)
        sender.conclude_state = KVPoll.Failed
    else:
        sender.abort()


class _InflightDeadlinePoller:
    """Stands in for a sender in poll_and_all_reduce: same poll(), bounded."""

    __slots__ = ("req", "now", "timeout")

    def __init__(self, req: Req, now: float, timeout: float):
        self.req = req
        self.now = now
        self.timeout = timeout

    def poll(self) -> int:
        req = self.req
        poll = int(req.disagg_kv_sender.poll())
        if req.pending_bootstrap:
            # Parked before bootstrap finished: the bootstrap timeout owns it, and
            # its inflight clock starts once bootstrap completes.
            setattr(req, CLOCK_ATTR, None)
            return poll
        started_at = getattr(req, CLOCK_ATTR, None)
        if started_at is None:
            setattr(req, CLOCK_ATTR, self.now)
            started_at = self.now
        verdict = inflight_verdict(poll, started_at, self.now, self.timeout)
        if verdict != poll:
            reason = timeout_reason(self.timeout, poll)
            logger.warning("Request %s bootstrap_room=%s: %s", req.rid, req.bootstrap_room, reason)
            _conclude_sender_failed(req, reason)
        return verdict


def inflight_pollers(queue: list[Req]) -> list:
    """The pollers process_disagg_prefill_inflight_queue all-reduces.

    Unset: the senders themselves, exactly as upstream.
    """
    timeout = inflight_timeout_from_env()
    if timeout is None:
        return [req.disagg_kv_sender for req in queue]
    now = time.monotonic()
    return [_InflightDeadlinePoller(req, now, timeout) for req in queue]


def annotate_inflight_failure(req: Req, error_message: str) -> str:
    """Name the timeout in a failed request's client-visible error.

    Decided on this rank's own clock after the all-reduce, so a rank whose local
    poll was not the one that expired still names the timeout when its request
    has been inflight that long.
    """
    timeout = inflight_timeout_from_env()
    started_at = getattr(req, CLOCK_ATTR, None)
    if timeout is None or started_at is None or ENV_NAME in error_message:
        return error_message
    if time.monotonic() - started_at < timeout:
        return error_message
    return f"{error_message}; {timeout_reason(timeout)}"
