"""Bound how long the decode metadata gate may hold a received transfer.

On the decode server a request waits in the transfer queue with its
pre-allocated KV pages, its req_to_token row and its metadata buffer slot until
the poll of its KV receiver, MIN-all-reduced across the attention TP group,
reads Success or Failed. Upstream bounds the receiver itself with
SGLANG_DISAGGREGATION_WAITING_TIMEOUT: the clock starts when the receiver sends
its destination metadata to prefill (init_time in CommonKVReceiver), and a room
still WaitingForInput after that many seconds concludes as Failed.

That bound ends when the receiver concludes Success. Before the all-reduce,
upstream's metadata gate (_apply_metadata_gate in disaggregation/utils.py) turns
Success back into Transferring while the request's metadata row still reads
bootstrap_room 0, i.e. while the first output token and its companions written
by prefill have not landed. A receiver that concluded is never timed out again,
so a row that never lands keeps the request Transferring for the life of the
process, holding its KV.

Here the gate gets the same bound: counted from the first tick the gate held
the request, a request still gated SGLANG_DISAGGREGATION_WAITING_TIMEOUT seconds
later is turned into Failed, still before the all-reduce, so every rank takes
upstream's decode failure path in the same tick (KV, row and metadata slot
released, the client gets an error naming the timeout and the variable, the
transfer-failure metric counts it).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.environ import envs

logger = logging.getLogger(__name__)

ENV_NAME = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"

# Set on the DecodeRequest: the first time.monotonic() at which the gate held
# it (receiver Success, metadata row empty).
CLOCK_ATTR = "disagg_metadata_gate_since"


def waiting_timeout(decode_req: Any) -> float:
    """The receiver manager's copy of the variable (read once at its startup);
    the registry's value where the receiver has no manager."""
    mgr = getattr(decode_req.kv_receiver, "kv_mgr", None)
    value = getattr(mgr, "waiting_timeout", None)
    if value is None:
        value = envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()
    return float(value)


def metadata_gate_poll(decode_req: Any) -> int:
    """The local poll for a request whose receiver reported Success while its
    metadata row is still empty: Transferring within the timeout, then Failed.

    Failed carries its reason in the receiver manager's failure records, where
    the decode failure path (failure_exception) reads it for the client error.
    """
    now = time.monotonic()
    since = getattr(decode_req, CLOCK_ATTR, None)
    if since is None:
        setattr(decode_req, CLOCK_ATTR, now)
        since = now
    timeout = waiting_timeout(decode_req)
    held = now - since
    if held < timeout:
        return int(KVPoll.Transferring)

    room = decode_req.req.bootstrap_room
    reason = (
        f"KV for bootstrap_room={room} was received but its metadata (first output "
        f"token) did not arrive within {ENV_NAME}={timeout:g}s (held {held:.1f}s by the "
        "metadata gate); the transfer is failed and its KV released"
    )
    mgr = getattr(decode_req.kv_receiver, "kv_mgr", None)
    if mgr is not None and hasattr(mgr, "record_failure"):
        mgr.record_failure(room, reason)
    logger.warning("%s (rid=%s)", reason, decode_req.req.rid)
    return int(KVPoll.Failed)
