"""What a decode TP rank says when the room failed on another rank.

A decode engine at TP > 1 has one KV receiver per rank for each room, and the ranks agree on
a room's state by a MIN all-reduce of their polls. When one rank fails the room (its waiting
timeout ran out first, or its transfer failed), the others read Failed with no failure record
of their own, and upstream raises "Failed due to an unknown reason from another rank". Rank
0's error is the one the client gets, so at TP > 1 a waiting timeout reached the client
without the variable that bounded it (seen on env/cpu-dsv4-tp with prefill stopped: rank 1
timed out after 20.0 s, and the client read only "unknown reason from another rank").

The reason here (after upstream's words, and after the "rank=N" that the decode failure line
already starts with) says where the cause is and what this rank knows for certain: how long it had
waited for the room's KV, against SGLANG_DISAGGREGATION_WAITING_TIMEOUT, which bounds every
rank's wait alike (the ranks start their clocks within one scheduler pass of each other).
"""

from __future__ import annotations

import time
from typing import Any

UNKNOWN = "Failed due to an unknown reason from another rank"


def another_rank(receiver: Any) -> str:
    """The failure reason of a receiver whose room failed on another TP rank."""
    kv_mgr = getattr(receiver, "kv_mgr", None)
    reason = (
        f"{UNKNOWN} of this decode engine; that rank's log line for bootstrap_room="
        f"{getattr(receiver, 'bootstrap_room', '?')} names the cause"
    )
    started = getattr(receiver, "init_time", None)
    timeout = getattr(kv_mgr, "waiting_timeout", None)
    if started is not None and timeout is not None:
        reason += (
            f". This rank had waited {time.time() - started:.1f}s for the room's KV, "
            f"bounded by SGLANG_DISAGGREGATION_WAITING_TIMEOUT={timeout:g}"
        )
    return reason
