"""SGLANG_DISAGGREGATION_INFLIGHT_TIMEOUT through the real prefill inflight queue."""

from __future__ import annotations

import pytest
from pd_harness import tick_for
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.inflight_timeout import ENV_NAME, parse_inflight_timeout
from sglang.srt.managers.schedule_batch import FINISH_ABORT

TIMEOUT_S = 60
# The bootstrap timeout the scheduler fixture's manager carries (upstream's default).
BOOTSTRAP_TIMEOUT_S = 300


@pytest.fixture
def inflight_timeout(monkeypatch) -> int:
    monkeypatch.setenv(ENV_NAME, str(TIMEOUT_S))
    return TIMEOUT_S


@pytest.mark.parametrize("stuck_state", [KVPoll.WaitingForInput, KVPoll.Transferring])
def test_stuck_transfer_is_released_after_inflight_timeout(
    scheduler, clock, inflight_timeout, stuck_state
):
    before = scheduler.free_counts()
    req = scheduler.admit_finished_prefill("stuck", room=11)
    scheduler.set_status(req, KVPoll.WaitingForInput)
    scheduler.set_status(req, stuck_state)
    assert scheduler.free_counts() != before

    assert scheduler.tick() == []
    assert tick_for(scheduler, clock, inflight_timeout - 1) == []
    assert scheduler.disagg_prefill_inflight_queue == [req]

    clock.advance(1)
    assert scheduler.tick() == [req]
    assert scheduler.disagg_prefill_inflight_queue == []
    assert scheduler.free_counts() == before
    assert req.kv.req_pool_idx is None and req.metadata_buffer_index == -1
    assert req.disagg_kv_sender.poll() == KVPoll.Failed


def test_transfer_succeeding_one_tick_before_the_timeout_concludes_as_success(
    scheduler, clock, inflight_timeout
):
    before = scheduler.free_counts()
    req = scheduler.admit_finished_prefill("late-but-fine", room=12)
    scheduler.set_status(req, KVPoll.Transferring)
    assert scheduler.tick() == []
    assert tick_for(scheduler, clock, inflight_timeout - 1) == []

    scheduler.set_status(req, KVPoll.Success)
    assert scheduler.tick() == [req]
    assert not isinstance(req.finished_reason, FINISH_ABORT)
    assert scheduler.metrics_collector.transfer_failed == 0
    assert scheduler.free_counts() == before


def test_bootstrapping_sender_still_follows_the_bootstrap_timeout(
    scheduler, clock, inflight_timeout
):
    assert inflight_timeout < BOOTSTRAP_TIMEOUT_S
    req = scheduler.admit_finished_prefill("no-decode-yet", room=13)
    # Optimistic prefill: the forward ran before the decode peer bootstrapped,
    # the one way a Bootstrapping sender sits in the inflight queue.
    req.pending_bootstrap = True
    assert scheduler.tick() == []
    assert tick_for(scheduler, clock, BOOTSTRAP_TIMEOUT_S - 1) == []
    assert scheduler.disagg_prefill_inflight_queue == [req]

    clock.advance(1)
    # The bootstrap-failure path streams the error itself and returns nothing.
    assert scheduler.tick() == []
    assert scheduler.output_streamer.streamed == [req]
    message = req.finished_reason.message
    assert "KVPoll.Bootstrapping" in message
    assert ENV_NAME not in message
    # Patch 0010: the message names the variable that bounds bootstrapping, and its value.
    assert message.endswith(
        f"bounded by SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT={BOOTSTRAP_TIMEOUT_S}"
    )
    assert scheduler.disagg_prefill_inflight_queue == []
    assert scheduler.metrics_collector.bootstrap_failed == 1


def test_unset_timeout_keeps_a_stuck_transfer_inflight(scheduler, clock, monkeypatch):
    monkeypatch.delenv(ENV_NAME, raising=False)
    req = scheduler.admit_finished_prefill("pinned", room=14)
    scheduler.set_status(req, KVPoll.Transferring)
    assert tick_for(scheduler, clock, 10 * BOOTSTRAP_TIMEOUT_S, step=100) == []
    assert scheduler.disagg_prefill_inflight_queue == [req]
    assert req.kv.req_pool_idx is not None


def test_client_error_names_the_timeout_and_failure_counter_moves(
    scheduler, clock, inflight_timeout
):
    req = scheduler.admit_finished_prefill("client-sees-it", room=15)
    scheduler.set_status(req, KVPoll.WaitingForInput)
    done = tick_for(scheduler, clock, inflight_timeout + 1)

    assert done == [req]
    assert scheduler.output_streamer.streamed == [req]
    assert isinstance(req.finished_reason, FINISH_ABORT)
    message = req.finished_reason.message
    assert f"within {inflight_timeout}s" in message
    assert f"{ENV_NAME}={inflight_timeout}" in message
    assert "WaitingForInput" in message
    assert scheduler.metrics_collector.transfer_failed == 1


def test_clock_starts_when_the_request_enters_the_inflight_queue(
    scheduler, clock, inflight_timeout
):
    first = scheduler.admit_finished_prefill("early", room=16)
    scheduler.set_status(first, KVPoll.Transferring)
    assert scheduler.tick() == []
    assert tick_for(scheduler, clock, inflight_timeout / 2) == []
    second = scheduler.admit_finished_prefill("later", room=17)
    scheduler.set_status(second, KVPoll.Transferring)
    assert scheduler.tick() == []

    assert tick_for(scheduler, clock, inflight_timeout / 2) == [first]
    assert scheduler.disagg_prefill_inflight_queue == [second]
    assert tick_for(scheduler, clock, inflight_timeout / 2) == [second]


@pytest.mark.parametrize("raw", ["0", "-5", "abc", "", "nan", "inf", "60s"])
def test_invalid_timeout_is_an_error_naming_the_variable(raw):
    with pytest.raises(ValueError, match=ENV_NAME) as excinfo:
        parse_inflight_timeout(raw)
    assert "positive number of seconds" in str(excinfo.value)


@pytest.mark.parametrize("raw, seconds", [("60", 60.0), (" 2.5 ", 2.5), (None, None)])
def test_valid_timeout_values_parse(raw, seconds):
    assert parse_inflight_timeout(raw) == seconds
