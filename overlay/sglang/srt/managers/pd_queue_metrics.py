"""The PD queues on /metrics as the scheduler holds them, refreshed with its load snapshot.

sglang sets its queue gauges (`sglang:num_prefill_inflight_queue_reqs` and the like) when it
logs a batch, and while idle only from the fully-idle branch of `Scheduler.on_idle`. A request
waiting in a PD queue keeps the scheduler from being fully idle, so while a room is stuck there
and nothing else runs, those gauges keep the last value a batch log gave them: often 0. The
load snapshot (`/v1/loads`) is the one place the scheduler refreshes while a queue stands
still: every pass when fully idle, every 50 ms (`LOAD_STALL_REFRESH_S`) when not, and with the
batches otherwise. Patch 0025 calls `publish` each time that snapshot is written, so these
series move exactly when /v1/loads does:

- `sglang:pd_queue_requests{queue=...}`: requests running, in the waiting queue, and in each
  PD queue (prefill_bootstrap, prefill_inflight, decode_prealloc, decode_transfer,
  decode_retracted).
- `sglang:pd_queue_oldest_seconds{queue=...}`: how long the oldest request of each PD queue has
  been in it (0 when the queue is empty), from the entry times sglang stamps on every request
  (`req.time_stats`, `time.perf_counter`). A room stuck in a queue makes it grow every refresh,
  whatever the other rooms do.
- `sglang:pd_used_tokens`: KV tokens in use, as the snapshot counts them.

Only the scheduler that writes the snapshot (rank 0 of its DP rank) publishes, and only with
`--enable-metrics`.

A publish that fails never reaches the scheduler's loop. The gauges are `mostrecent`, so a
publisher that stopped would leave its last values standing, and the queue alerts would fire
forever or never. So a failure sets every gauge of the process to NaN (no comparison holds on
it: the rules stay silent rather than wrong), adds one to
`sglang:pd_queue_metrics_errors_total` (what `PDQueueMetricsFailing` reads), and is logged
once per run of failures; the next publish tries again, and the first one that succeeds
refreshes every gauge and logs that it did.

`SM120PD_FAULT_PD_QUEUE_METRICS_FILE` is a named fault point for tests, off unless set: while
the file it names exists, every publish fails.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

logger = logging.getLogger(__name__)

# The PD queues whose oldest entry is timed, the entry-time field sglang stamps for each, and
# how to reach the requests from the scheduler.
AGED = {
    "prefill_bootstrap": "prefill_bootstrap_queue_entry_time",
    "prefill_inflight": "prefill_transfer_queue_entry_time",
    "decode_prealloc": "decode_prealloc_queue_entry_time",
    "decode_transfer": "decode_transfer_queue_entry_time",
}
COUNTED = ("running", "waiting", *AGED, "decode_retracted")
FAULT_FILE = "SM120PD_FAULT_PD_QUEUE_METRICS_FILE"


class _Metrics:
    """The three families in the scheduler's process registry, with the scheduler collector's
    labels (created once per process: prometheus names are process-global)."""

    _families: tuple | None = None
    _errors: Any = None

    def __init__(self, labels: dict):
        if _Metrics._families is None:
            from prometheus_client import Counter, Gauge

            _Metrics._errors = Counter(
                name="sglang:pd_queue_metrics_errors",
                documentation=(
                    "Times a refresh of the PD queue gauges failed (they read NaN until the "
                    "next one succeeds)."
                ),
                labelnames=list(labels),
            )

            names = [*labels, "queue"]
            _Metrics._families = (
                Gauge(
                    name="sglang:pd_queue_requests",
                    documentation=(
                        "Requests running, waiting and in each PD queue, refreshed with the "
                        "load snapshot (also while a PD queue stands still)."
                    ),
                    labelnames=names,
                    multiprocess_mode="mostrecent",
                ),
                Gauge(
                    name="sglang:pd_queue_oldest_seconds",
                    documentation=(
                        "Seconds the oldest request of each PD queue has been in it (0 when "
                        "empty), refreshed with the load snapshot."
                    ),
                    labelnames=names,
                    multiprocess_mode="mostrecent",
                ),
                Gauge(
                    name="sglang:pd_used_tokens",
                    documentation="KV tokens in use, refreshed with the load snapshot.",
                    labelnames=list(labels),
                    multiprocess_mode="mostrecent",
                ),
            )
        counts, oldest, used = _Metrics._families
        self.counts = {q: counts.labels(**labels, queue=q) for q in COUNTED}
        self.oldest = {q: oldest.labels(**labels, queue=q) for q in AGED}
        self.used = used.labels(**labels)
        self.errors = _Metrics._errors.labels(**labels)
        self.failing = False

    def clear(self) -> None:
        for gauge in (*self.counts.values(), *self.oldest.values(), self.used):
            gauge.set(math.nan)


def _queues(scheduler: Any) -> dict[str, list]:
    """The requests of each PD queue this scheduler has (none for a mode it is not in)."""
    out: dict[str, list] = {}
    bootstrap = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    if bootstrap is not None:
        out["prefill_bootstrap"] = list(bootstrap.queue)
        out["prefill_inflight"] = list(scheduler.disagg_prefill_inflight_queue or [])
    prealloc = getattr(scheduler, "disagg_decode_prealloc_queue", None)
    if prealloc is not None:
        out["decode_prealloc"] = [d.req for d in prealloc.queue]
        out["decode_retracted"] = list(prealloc.retracted_queue)
        transfer = getattr(scheduler, "disagg_decode_transfer_queue", None)
        out["decode_transfer"] = [d.req for d in transfer.queue] if transfer is not None else []
    return out


def oldest_seconds(reqs: list, field: str, now: float) -> float:
    """Seconds since the earliest entry time among reqs (0 for none, or none stamped yet)."""
    stamps = [getattr(r.time_stats, field, 0.0) for r in reqs]
    stamps = [s for s in stamps if s > 0]
    return max(0.0, now - min(stamps)) if stamps else 0.0


def _refresh(metrics: _Metrics, scheduler: Any, load: Any) -> None:
    fault = os.environ.get(FAULT_FILE)
    if fault and os.path.exists(fault):
        raise RuntimeError(f"fault point {FAULT_FILE}: {fault} exists")
    queues = _queues(scheduler)
    now = time.perf_counter()
    metrics.counts["running"].set(load.num_running_reqs)
    metrics.counts["waiting"].set(len(scheduler.waiting_queue))
    for name in (*AGED, "decode_retracted"):
        metrics.counts[name].set(len(queues.get(name, ())))
    for name, field in AGED.items():
        metrics.oldest[name].set(oldest_seconds(queues.get(name, []), field, now))
    metrics.used.set(load.num_used_tokens)


def publish(scheduler: Any, load: Any) -> None:
    """Set the series from the scheduler's queues and the snapshot it just wrote."""
    metrics = getattr(scheduler, "_sm120pd_queue_metrics", False)
    if metrics is None:
        return
    if metrics is False:
        try:
            metrics = None
            if getattr(scheduler.metrics_reporter, "current_scheduler_metrics_enabled", False):
                metrics = _Metrics(scheduler.metrics_collector.labels)
        except Exception as exc:  # never the scheduler's loop
            logger.warning("PD queue metrics off for this process: %s", exc, exc_info=True)
        scheduler._sm120pd_queue_metrics = metrics
        if metrics is None:
            return
    try:
        _refresh(metrics, scheduler, load)
    except Exception as exc:  # never the scheduler's loop
        try:
            metrics.clear()
            metrics.errors.inc()
        except Exception:  # noqa: BLE001 - the registry itself failing: nothing left to say
            pass
        if not metrics.failing:
            metrics.failing = True
            logger.warning(
                "PD queue metrics not refreshed (the gauges read NaN until one is): %s",
                exc,
                exc_info=True,
            )
        return
    if metrics.failing:
        metrics.failing = False
        logger.info("PD queue metrics refreshed again")
