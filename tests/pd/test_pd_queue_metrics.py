"""Patch 0025: the PD queues on /metrics, refreshed each time the scheduler writes its load
snapshot (overlay/sglang/srt/managers/pd_queue_metrics.py).

The requests carry sglang's own time stats (`SchedulerReqTimeStats`), stamped by its own setters
at known times, so an age read back from the registry is measured against those stamps, not
against the code under test. The live side (real engines, a room pinned in a queue while the
age grows, the alerts on it) is in tests/engine/test_cpu_engines.py.
"""

from __future__ import annotations

import logging
import math
import time
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers import pd_queue_metrics
from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats

LABELS = {"model_name": "tiny", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}


def req(mode: DisaggregationMode, setter: str, at: float) -> SimpleNamespace:
    stats = SchedulerReqTimeStats(disagg_mode=mode)
    getattr(stats, setter)(at)
    return SimpleNamespace(time_stats=stats)


def scheduler(enabled: bool = True, **queues) -> SimpleNamespace:
    """A scheduler with the attributes the hook reads: its metrics reporter and collector, the
    waiting queue and the four PD queue attributes sglang's Scheduler has (None when not in
    that mode)."""
    return SimpleNamespace(
        metrics_reporter=SimpleNamespace(current_scheduler_metrics_enabled=enabled),
        metrics_collector=SimpleNamespace(labels=dict(LABELS)),
        waiting_queue=queues.get("waiting", []),
        disagg_prefill_bootstrap_queue=queues.get("bootstrap"),
        disagg_prefill_inflight_queue=queues.get("inflight"),
        disagg_decode_prealloc_queue=queues.get("prealloc"),
        disagg_decode_transfer_queue=queues.get("transfer"),
    )


def value(name: str, **labels) -> float | None:
    return REGISTRY.get_sample_value(name, {**LABELS, **labels})


def test_a_prefill_schedulers_queues_and_the_age_of_its_oldest_room():
    now = time.perf_counter()
    prefill = DisaggregationMode.PREFILL
    inflight = [
        req(prefill, "set_prefill_transfer_queue_entry_time", now - 42.0),
        req(prefill, "set_prefill_transfer_queue_entry_time", now - 3.0),
    ]
    bootstrap = SimpleNamespace(queue=[req(prefill, "set_prefill_bootstrap_queue_entry_time", now)])
    sched = scheduler(bootstrap=bootstrap, inflight=inflight, waiting=[object()] * 3)
    pd_queue_metrics.publish(sched, SimpleNamespace(num_running_reqs=2, num_used_tokens=640))
    after = time.perf_counter()
    counts = {q: value("sglang:pd_queue_requests", queue=q) for q in pd_queue_metrics.COUNTED}
    assert counts == {
        "running": 2,
        "waiting": 3,
        "prefill_bootstrap": 1,
        "prefill_inflight": 2,
        "decode_prealloc": 0,
        "decode_transfer": 0,
        "decode_retracted": 0,
    }
    oldest = value("sglang:pd_queue_oldest_seconds", queue="prefill_inflight")
    assert 42.0 <= oldest <= 42.0 + (after - now)
    assert value("sglang:pd_queue_oldest_seconds", queue="decode_transfer") == 0
    assert value("sglang:pd_used_tokens") == 640
    # Emptied: the next publish reads 0 everywhere, the age included.
    sched.disagg_prefill_inflight_queue = []
    pd_queue_metrics.publish(sched, SimpleNamespace(num_running_reqs=0, num_used_tokens=0))
    assert value("sglang:pd_queue_requests", queue="prefill_inflight") == 0
    assert value("sglang:pd_queue_oldest_seconds", queue="prefill_inflight") == 0


def test_a_decode_schedulers_queues_are_read_through_their_decode_requests():
    now = time.perf_counter()
    decode = DisaggregationMode.DECODE
    held = req(decode, "set_decode_transfer_queue_entry_time", now - 7.5)
    prealloc = SimpleNamespace(
        queue=[SimpleNamespace(req=req(decode, "set_decode_prealloc_queue_entry_time", now - 1))],
        retracted_queue=[object()],
    )
    transfer = SimpleNamespace(queue=[SimpleNamespace(req=held)])
    sched = scheduler(prealloc=prealloc, transfer=transfer)
    pd_queue_metrics.publish(sched, SimpleNamespace(num_running_reqs=0, num_used_tokens=96))
    assert value("sglang:pd_queue_requests", queue="decode_transfer") == 1
    assert value("sglang:pd_queue_requests", queue="decode_retracted") == 1
    assert 7.5 <= value("sglang:pd_queue_oldest_seconds", queue="decode_transfer") < 8.5
    assert 1.0 <= value("sglang:pd_queue_oldest_seconds", queue="decode_prealloc") < 2.0
    # A room not stamped yet (entry time 0) is not taken for one that entered at time 0.
    transfer.queue.append(SimpleNamespace(req=req(decode, "set_wait_queue_entry_time", now)))
    pd_queue_metrics.publish(sched, SimpleNamespace(num_running_reqs=0, num_used_tokens=96))
    assert value("sglang:pd_queue_oldest_seconds", queue="decode_transfer") < 9.0


def test_without_enable_metrics_nothing_is_published_and_nothing_is_asked_again():
    sched = scheduler(enabled=False)
    del sched.metrics_collector  # sglang has no collector without --enable-metrics
    pd_queue_metrics.publish(sched, SimpleNamespace(num_running_reqs=1, num_used_tokens=1))
    assert sched._sm120pd_queue_metrics is None
    pd_queue_metrics.publish(sched, SimpleNamespace(num_running_reqs=1, num_used_tokens=1))


ERRORS = "sglang:pd_queue_metrics_errors_total"
LOAD = SimpleNamespace(num_running_reqs=0, num_used_tokens=0)


def test_a_failed_refresh_clears_the_gauges_counts_the_error_and_the_next_one_restores(caplog):
    """A publish that raises (here a bootstrap queue that is no list) never reaches the
    scheduler's loop: every gauge reads NaN instead of its last value, the error counter moves
    once per failure, one warning covers the run of failures, and the next publish that works
    refreshes every gauge again."""
    ok = scheduler(bootstrap=SimpleNamespace(queue=[]), inflight=[], waiting=[1, 2])
    pd_queue_metrics.publish(ok, LOAD)
    assert value("sglang:pd_queue_requests", queue="waiting") == 2
    errors = value(ERRORS) or 0.0
    broken = scheduler(bootstrap=SimpleNamespace(queue=None), inflight=[])
    broken._sm120pd_queue_metrics = ok._sm120pd_queue_metrics
    with caplog.at_level(logging.INFO, logger=pd_queue_metrics.__name__):
        pd_queue_metrics.publish(broken, LOAD)
        pd_queue_metrics.publish(broken, LOAD)
        for queue in pd_queue_metrics.COUNTED:
            assert math.isnan(value("sglang:pd_queue_requests", queue=queue)), queue
        for queue in pd_queue_metrics.AGED:
            assert math.isnan(value("sglang:pd_queue_oldest_seconds", queue=queue)), queue
        assert math.isnan(value("sglang:pd_used_tokens"))
        assert value(ERRORS) == errors + 2
        pd_queue_metrics.publish(ok, LOAD)
    assert value("sglang:pd_queue_requests", queue="waiting") == 2
    assert value("sglang:pd_used_tokens") == 0
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "PD queue metrics not refreshed" in m]) == 1, said
    assert "PD queue metrics refreshed again" in said


def test_the_fault_point_fails_every_publish_while_its_file_exists(tmp_path, monkeypatch):
    fault = tmp_path / "fault"
    monkeypatch.setenv(pd_queue_metrics.FAULT_FILE, str(fault))
    sched = scheduler(bootstrap=SimpleNamespace(queue=[]), inflight=[], waiting=[1])
    pd_queue_metrics.publish(sched, LOAD)
    errors = value(ERRORS) or 0.0
    fault.touch()
    pd_queue_metrics.publish(sched, LOAD)
    assert value(ERRORS) == errors + 1
    assert math.isnan(value("sglang:pd_queue_requests", queue="waiting"))
    fault.unlink()
    pd_queue_metrics.publish(sched, LOAD)
    assert value("sglang:pd_queue_requests", queue="waiting") == 1 and value(ERRORS) == errors + 1


@pytest.mark.parametrize("field", sorted(pd_queue_metrics.AGED.values()))
def test_every_entry_time_read_is_one_sglang_stamps(field):
    """Each field the ages read exists on sglang's time stats, starts at 0 and is set by the
    setter of the same name (the contract the hook depends on)."""
    stats = SchedulerReqTimeStats(disagg_mode=DisaggregationMode.NULL)
    assert getattr(stats, field) == 0.0
    getattr(stats, "set_" + field)(123.0)
    assert getattr(stats, field) == 123.0
