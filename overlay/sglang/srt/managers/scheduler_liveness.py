"""/health answers 503 while a scheduler has stopped running, so the router takes the engine out.

An sglang engine is an HTTP process in front of one scheduler process per DP rank. With
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`` ``/health`` answers from the HTTP process alone,
so a scheduler stopped by SIGSTOP, a deadlock or a hung device call leaves it answering 200,
and the router (smg acts on ``/health``: ``--health-check-endpoint``, failure threshold,
interval) keeps sending requests that will never run. With generation on, ``/health`` waits up
to ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) for any output, longer than smg waits (5 s).

What only a running scheduler moves is its load snapshot (``LoadSnapshot.timestamp``, the
scheduler's clock at its last publish): every pass of its loop while idle, every 50 ms while
requests wait without a batch, after each prefill batch and every ``load_snapshot_publish_interval``
decode batches (sglang 0.5.23, scheduler.py). ``unhealthy_reason`` reads the snapshots without
waiting on their lock (patch 0021's reader) and, when one DP rank's is older than
``SGLANG_HEALTH_SCHEDULER_STALL_S`` seconds, ``/health`` answers 503 with the reason, in both
health modes and before any generation is queued. The snapshot moves again as soon as the
scheduler runs, and ``/health`` answers 200 at the next call.

A busy scheduler publishes after each prefill batch and every few decode batches, so only one
forward pass longer than the bound reads as a stop. On a GPU a pass takes milliseconds to a few
seconds; in Triton's interpreter (the CPU DeepSeek-V4 stacks) a pass can take minutes, and those
env files raise the bound. ``0`` turns the check off.
"""

from __future__ import annotations

import logging
import math
import os
import time

from sglang.srt.managers.load_snapshot_nonblocking import read_loads

logger = logging.getLogger(__name__)

VARIABLE = "SGLANG_HEALTH_SCHEDULER_STALL_S"
# Six times the longest gap wedged-scheduler triage allows (launch/pdlib/wedged.py: 10 s), and
# with smg's checks every 2 s, three failures to leave, the engine is out within 40 s.
DEFAULT_S = 30.0

# The DP ranks whose stall was logged, so each stall is logged once when it starts and once
# when it ends, however often /health is polled.
_stalled_ranks: set[int] = set()


def stall_bound_s(environ: dict[str, str] | None = None) -> float:
    """The bound from the environment: a number of seconds >= 0 (0: off); anything else is an
    error naming the variable."""
    raw = (environ if environ is not None else os.environ).get(VARIABLE, "").strip()
    if not raw:
        return DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{VARIABLE}={raw!r}: expected a number of seconds >= 0 (0 turns it off)")
    return value


async def unhealthy_reason(tokenizer_manager, now: float | None = None) -> str | None:
    """Why /health must answer 503 now, or None. Never waits on the snapshot file's lock (a
    scheduler stopped mid-publish holds it: the last snapshot read then counts, and its age)."""
    bound = stall_bound_s()
    reader = getattr(tokenizer_manager, "load_snapshot_reader", None)
    if bound == 0 or reader is None:
        return None
    loads = await read_loads(reader)
    now = time.time() if now is None else now
    # A rank that has not published yet (timestamp 0) is starting, which /health says already.
    ages = {load.dp_rank: now - load.timestamp for load in loads if load.timestamp}
    stalled = {rank: age for rank, age in ages.items() if age > bound}
    for rank in sorted(_stalled_ranks - set(stalled)):
        if rank in ages:
            logger.info("scheduler of dp_rank %d publishes its load snapshot again", rank)
            _stalled_ranks.discard(rank)
    if not stalled:
        return None
    rank, age = max(stalled.items(), key=lambda item: item[1])
    reason = (
        f"scheduler of dp_rank {rank} has not published its load snapshot for {age:.1f} s "
        f"(more than {VARIABLE}={bound:g}): stopped, wedged, or in one forward pass that long"
    )
    if rank not in _stalled_ranks:
        _stalled_ranks.add(rank)
        logger.error("/health answers 503: %s", reason)
    return reason
