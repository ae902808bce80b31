"""An engine's state as its scheduler publishes it: GET /v1/loads.

sglang's scheduler writes a load snapshot on every pass of its loop when idle and every 50 ms
when it is not (sglang 0.5.23, `Scheduler.on_idle`); /v1/loads answers the latest one. The
/metrics gauges are no substitute for a state: the scheduler sets them when it logs a batch and,
once idle, at most every 30 s. A request that waits in a PD queue after its batch (a prefill
room waiting for its KV to be taken) is never published there: the inflight-queue gauge reads
0 the whole time. So anything that waits for an engine to hold no request reads this.
"""

from __future__ import annotations

from launch.pdlib.stack import http

# Requests in any queue of a PD engine, as the snapshot names them. num_waiting_reqs already
# counts the waiting, bootstrap, prealloc, transfer and retracted queues; the inflight queue
# (prefill rooms whose KV is being sent) is counted only under "disaggregation".
REQUESTS = ("num_running_reqs", "num_waiting_reqs")
TOKENS = "num_used_tokens"


def read(url: str, api_key: str = "", timeout_s: float = 5.0) -> list[dict] | str:
    """Every DP rank's load snapshot, or why it could not be read."""
    reply = http(url + "/v1/loads", timeout=timeout_s, api_key=api_key)
    if reply.status != 200:
        return f"GET /v1/loads: {reply.status or reply.error}"
    try:
        loads = reply.json()["loads"]
    except (ValueError, KeyError, TypeError):
        return "GET /v1/loads: not the JSON sglang answers"
    if not isinstance(loads, list) or not all(isinstance(x, dict) for x in loads):
        return "GET /v1/loads: not the JSON sglang answers"
    stale = [x for x in loads if x.get("stale")]
    if stale:
        # Patch 0021: the scheduler kept its snapshot file locked, so the engine answered the
        # last snapshot it read. That is no state: it says nothing of what the engine holds now.
        age = max(float(x.get("snapshot_age_s") or 0) for x in stale)
        return (
            f"GET /v1/loads: stale: the scheduler holds its snapshot file locked (stopped or "
            f"wedged while publishing?); the last snapshot read is {age:.1f} s old"
        )
    return loads


def held(loads: list[dict], tokens: bool = True) -> dict[str, int]:
    """What the engine still holds, summed over its ranks, without the zeros: requests running
    or queued, requests in a PD queue, and (tokens) KV tokens in use."""
    total: dict[str, int] = {}
    for load in loads:
        names = [*REQUESTS, *([TOKENS] if tokens else [])]
        counts = {name: load.get(name) or 0 for name in names}
        for name, value in (load.get("disaggregation") or {}).items():
            if name.endswith("_queue_reqs"):
                counts[name] = value or 0
        for name, value in counts.items():
            total[name] = total.get(name, 0) + value
    return {name: value for name, value in total.items() if value}


def describe(counts: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in counts.items()) or "nothing held"
