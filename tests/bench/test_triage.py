from datetime import UTC, datetime

from bench.lib import promtext
from bench.lib.triage import (
    CONNECTION,
    INCONCLUSIVE,
    SATURATED,
    STALLED,
    UNRESPONSIVE,
    WEDGED,
    EngineLoad,
    Probe,
    decide,
)
from launch.pdlib.rotation import RouterList
from launch.pdlib.wedged import Life, Snapshot, read_snapshot

# /metrics excerpt as an SGLang decode server exposes it (two label sets summed).
DECODE_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",tp_rank="0"} 30.0
sglang:num_running_reqs{engine_type="unified",tp_rank="1"} 23.0
sglang:num_queue_reqs{engine_type="unified",tp_rank="0"} 3.0
sglang:num_decode_transfer_queue_reqs{tp_rank="0"} 1.0
sglang:gen_throughput{tp_rank="0"} 812.5
sglang:generation_tokens_total{is_streaming="true"} 10234.0
"""


def test_prometheus_text_is_summed_per_metric():
    load = promtext.load_of(promtext.parse(DECODE_METRICS))
    assert load == {
        "running": 53.0,
        "queued": 4.0,
        "gen_throughput": 812.5,
        "generation_tokens_total": 10234.0,
        "prompt_tokens_total": None,
        "realtime_tokens_total": None,
    }


def _load(running, queued, tokens, thr=None):
    return {
        "running": running,
        "queued": queued,
        "gen_throughput": thr,
        "generation_tokens_total": tokens,
    }


def _engines(before, after):
    return [
        EngineLoad(
            "prefill",
            "http://127.0.0.1:1",
            True,
            window_s=1.0,
            before=_load(0, 0, 0),
            after=_load(0, 0, 0),
        ),
        EngineLoad("decode", "http://127.0.0.1:2", True, window_s=1.0, before=before, after=after),
    ]


FAST = [
    Probe("client URL", "http://127.0.0.1:3", True, 0.012, 4),
    Probe("router (direct)", "http://127.0.0.1:4", True, 0.010, 4),
]
SLOW = [
    Probe("client URL", "http://127.0.0.1:3", False, 5.0, error="no complete answer within 5 s"),
    Probe("router (direct)", "http://127.0.0.1:4", False, 5.0, error="no complete answer"),
]


def test_idle_engines_and_fast_fresh_connections_blame_the_connection_layer():
    v = decide(FAST, _engines(_load(0, 0, 500), _load(0, 0, 500)), fast_s=2.0)
    assert v.verdict == CONNECTION
    assert any("answered in 0.012 s" in e for e in v.evidence)
    assert any("decode http://127.0.0.1:2: running 0 -> 0, queued 0 -> 0" in e for e in v.evidence)


def test_busy_engines_producing_tokens_with_slow_probes_are_saturated():
    v = decide(SLOW, _engines(_load(53, 4, 1000), _load(53, 6, 1800)), fast_s=2.0)
    assert v.verdict == SATURATED


def test_queued_requests_without_tokens_are_a_stalled_engine():
    v = decide(SLOW, _engines(_load(8, 2, 1000, thr=0.0), _load(8, 3, 1000, thr=0.0)), fast_s=2.0)
    assert v.verdict == STALLED
    assert "decode" in v.reason


def _prefill(before, after):
    """A prefill server's load: no generation tokens; prompt tokens as given."""
    return EngineLoad(
        "prefill", "http://127.0.0.1:1", True, window_s=1.0, before=before, after=after
    )


def _prefill_load(running, queued, prompt=None, realtime=None):
    return {
        "running": running,
        "queued": queued,
        "gen_throughput": 0.0,
        "generation_tokens_total": 0.0,
        "prompt_tokens_total": prompt,
        "realtime_tokens_total": realtime,
    }


def test_a_prefill_handing_requests_on_is_not_stalled():
    # Recorded from a sim stack with decode saturated: prefill's one request left it within the
    # window, and a prefill server makes no generation tokens at all.
    decode = EngineLoad(
        "decode",
        "http://127.0.0.1:2",
        True,
        window_s=1.0,
        before=_load(8, 12, 54, thr=75.52),
        after=_load(8, 24, 126, thr=75.38),
    )
    v = decide(SLOW, [_prefill(_prefill_load(1, 0), _prefill_load(0, 0)), decode], fast_s=1.0)
    assert v.verdict == SATURATED, v.reason


def test_prefill_progress_is_read_from_prompt_and_realtime_counters():
    for before, after in [
        (_prefill_load(2, 3, prompt=100), _prefill_load(2, 3, prompt=164)),
        (_prefill_load(2, 3, realtime=100), _prefill_load(2, 3, realtime=612)),
    ]:
        v = decide(
            SLOW, [_prefill(before, after), _engines(_load(0, 0, 0), _load(0, 0, 0))[1]], 2.0
        )
        assert v.verdict != STALLED, (before, after, v.reason)


def test_a_busy_prefill_with_no_counter_moving_is_stalled():
    before = _prefill_load(2, 3, prompt=100, realtime=400)
    v = decide(
        SLOW, [_prefill(before, dict(before)), _engines(_load(0, 0, 0), _load(0, 0, 0))[1]], 2.0
    )
    assert v.verdict == STALLED
    assert v.reason.startswith("requests are on prefill but it made no progress")


def test_metrics_answered_without_load_are_inconclusive_not_a_guess():
    engines = _engines(_load(0, 0, 0), _load(0, 0, 0))
    error = "ClientResponseError: 404, message='Not Found'"
    engines[1] = EngineLoad("decode", "http://127.0.0.1:2", False, error=error)
    v = decide(FAST, engines, fast_s=2.0)
    assert v.verdict == INCONCLUSIVE
    assert v.reason.startswith("engine load could not be read from decode: it answered")
    assert any("unreadable" in e for e in v.evidence)


# ---- an engine that does not answer ----------------------------------------------------------

SILENT = ["/metrics: no answer within 10 s", "/health: no answer within 10 s"]
# What smg answered the client in the frozen-decode case on env/cpu.
NO_DECODE = (
    'HTTP 503: {"error":{"type":"server_error","code":"no_available_workers","message":"No '
    'available servers: No available decode workers (all circuits open or unhealthy)"}}'
)


def _answering(role: str, port: int) -> EngineLoad:
    idle = _load(0, 0, 0)
    return EngineLoad(
        role, f"http://127.0.0.1:{port}", True, window_s=1.0, before=idle, after=dict(idle)
    )


def _silent(role: str, port: int) -> EngineLoad:
    return EngineLoad(role, f"http://127.0.0.1:{port}", False, no_answer=list(SILENT))


def test_a_frozen_decode_is_named_with_what_it_did_not_answer_and_the_routers_word():
    router = Probe("client URL", "http://127.0.0.1:3", False, 0.012, error=NO_DECODE, status=503)
    engines = [_answering("prefill", 1), _silent("decode", 2)]
    v = decide(
        [router],
        engines,
        2.0,
        RouterList(
            True, ({"url": "http://127.0.0.1:2", "is_healthy": False, "status": "not_ready"},)
        ),
    )
    assert v.verdict == UNRESPONSIVE
    assert v.reason.startswith(
        "decode (http://127.0.0.1:2) did not answer: /metrics: no answer within 10 s; "
        "/health: no answer within 10 s; prefill answered"
    ), v.reason
    assert v.router == [f"to the probe: {NO_DECODE}", "decode: listed unhealthy, status not_ready"]
    rendered = v.render()
    assert "the router says:\n  - to the probe: HTTP 503" in rendered
    assert "  - decode http://127.0.0.1:2: /metrics: no answer within 10 s" in rendered


def test_a_frozen_prefill_is_named_even_before_the_router_notices():
    # The router still lists prefill healthy and the probe timed out through it: decode's
    # answer is what makes the silence evidence.
    probe = Probe(
        "client URL", "http://127.0.0.1:3", False, 10.0, error="no complete answer within 10 s"
    )
    engines = [_silent("prefill", 1), _answering("decode", 2)]
    workers = RouterList(
        True, ({"url": "http://127.0.0.1:1", "is_healthy": True, "status": "ready"},)
    )
    v = decide([probe], engines, 2.0, workers)
    assert v.verdict == UNRESPONSIVE
    assert v.reason.startswith("prefill (http://127.0.0.1:1) did not answer")
    assert "decode answered" in v.reason
    assert v.router == ["prefill: listed healthy, status ready"]


def test_one_frozen_instance_of_several_is_the_one_named():
    engines = [
        _answering("prefill/1", 1),
        _answering("prefill/2", 2),
        _answering("decode/1", 3),
        _silent("decode/2", 4),
    ]
    v = decide(
        FAST, engines, 2.0, RouterList(True, ({"url": "http://127.0.0.1:3", "is_healthy": True},))
    )
    assert v.verdict == UNRESPONSIVE
    assert v.reason.startswith("decode/2 (http://127.0.0.1:4) did not answer")
    assert "prefill/1, prefill/2, decode/1 answered" in v.reason
    assert v.router == ["decode/2: not in its worker list"]


def test_every_engine_silent_but_the_router_answering_is_still_a_verdict():
    router = Probe("client URL", "http://127.0.0.1:3", False, 0.01, error=NO_DECODE, status=503)
    v = decide([router], [_silent("prefill", 1), _silent("decode", 2)], 2.0, RouterList(True))
    assert v.verdict == UNRESPONSIVE
    assert v.reason.count("did not answer") == 2


def test_nothing_answering_at_all_is_inconclusive():
    probe = Probe(
        "client URL", "http://127.0.0.1:3", False, 10.0, error="no complete answer within 10 s"
    )
    workers = RouterList(False, error="GET /workers: no answer within 10 s")
    v = decide([probe], [_silent("prefill", 1), _silent("decode", 2)], 2.0, workers)
    assert v.verdict == INCONCLUSIVE
    assert v.reason.startswith("nothing in the stack answered, the router included")
    assert v.router == ["nothing about its workers: GET /workers: no answer within 10 s"]


def test_a_router_that_refuses_the_worker_list_still_answered():
    # A wrong key: the engines are silent, the probe timed out, but the router did answer 401.
    probe = Probe("client URL", "http://127.0.0.1:3", False, 10.0, error="no complete answer")
    refused = RouterList(True, error="GET /workers: 401")
    v = decide([probe], [_silent("prefill", 1), _silent("decode", 2)], 2.0, refused)
    assert v.verdict == UNRESPONSIVE
    assert v.router == [f"nothing about its workers: {refused.error}"]


def test_silence_is_worded_by_its_cause():
    from launch.pdlib.unresponsive import no_answer

    assert no_answer("/metrics", "TimeoutError: ", 5) == "/metrics: no answer within 5 s"
    refused = "ClientConnectorError: Cannot connect to host 127.0.0.1:2 [Connection refused]"
    assert no_answer("/health", refused, 5) == (
        "/health: connection refused (nothing listens on the port)"
    )
    assert no_answer("/metrics", "ServerDisconnectedError: gone", 5) == (
        "/metrics: no answer (ServerDisconnectedError: gone)"
    )


def test_idle_engines_with_failing_fresh_requests_are_inconclusive():
    v = decide(SLOW, _engines(_load(0, 0, 0), _load(0, 0, 0)), fast_s=2.0)
    assert v.verdict == INCONCLUSIVE


def test_text_outside_the_prometheus_format_is_an_error_not_a_silent_zero():
    import pytest

    with pytest.raises(ValueError):
        promtext.parse("sglang:num_running_reqs{tp_rank=0 not closed 3\n")


# ---- a scheduler that does not run behind an answering HTTP server ---------------------------

SCHEDULER = "engine_type=decode,tp_rank=0"


def _scheduler(age_s: float | None, seconds: float, grew: float = 0.0) -> Life:
    """Two reads a second apart: a snapshot `age_s` old at the first (None: refreshed at each
    read) and the scheduler's time counters, grown by `grew` between them."""
    stamp = 1796424800.0

    def read(later: float) -> Snapshot:
        published = stamp + later if age_s is None else stamp
        answered = datetime.fromtimestamp(stamp + (age_s or 0.01) + later, UTC).isoformat()
        return read_snapshot({"timestamp": answered, "loads": [{"timestamp": published}]})

    return Life(
        window_s=1.0,
        first=read(0.0),
        last=read(1.0),
        seconds_before={SCHEDULER: seconds},
        seconds_after={SCHEDULER: seconds + grew},
    )


def _with_scheduler(engine: EngineLoad, life: Life, health: str = "HTTP 200 in 0.004 s"):
    engine.scheduler, engine.health = life, health
    return engine


def test_a_wedged_decode_next_to_idle_engines_is_named_not_read_as_idle():
    # Without the scheduler's signals this reads `connection layer` (engines idle, probes fast).
    engines = [
        _with_scheduler(_answering("prefill", 1), _scheduler(None, 812.0, grew=1.9)),
        _with_scheduler(_answering("decode", 2), _scheduler(23.4, 640.5)),
    ]
    v = decide(FAST, engines, 2.0)
    assert v.verdict == WEDGED
    assert v.reason == (
        "decode (http://127.0.0.1:2) answers over HTTP (/health: HTTP 200 in 0.004 s) but its "
        "scheduler does not run: its load snapshot (/v1/loads loads[dp_rank 0].timestamp) was "
        "last refreshed 24.4 s ago and unchanged over the 1 s window; a running scheduler "
        "refreshes it about every second; sglang:scheduler_idle_seconds_total + "
        "sglang:scheduler_stage_seconds_total stood at 640.5 s over the 1 s window; prefill's "
        "scheduler runs"
    )
    assert any(
        e.startswith("decode http://127.0.0.1:2: running 0 -> 0")
        and e.endswith(
            "; scheduler: load snapshot age 23.4 s -> 24.4 s, scheduler idle+stage seconds "
            "640.5 -> 640.5"
        )
        for e in v.evidence
    ), v.evidence
    assert v.measurements["engines"][1]["scheduler"]["first"]["ages"] == {"0": 23.4}


def test_a_wedged_scheduler_with_requests_on_it_is_wedged_not_stalled():
    decode = EngineLoad(
        "decode",
        "http://127.0.0.1:2",
        True,
        window_s=1.0,
        before=_load(8, 2, 1000, thr=0.0),
        after=_load(8, 2, 1000, thr=0.0),
    )
    prefill = _with_scheduler(_answering("prefill", 1), _scheduler(None, 812.0, grew=1.0))
    v = decide(SLOW, [prefill, _with_scheduler(decode, _scheduler(40.0, 90.0))], 2.0)
    assert v.verdict == WEDGED and v.reason.startswith("decode (http://127.0.0.1:2) answers")


def test_a_young_snapshot_is_not_yet_wedged_and_its_threshold_is_an_option():
    engines = [
        _with_scheduler(_answering("prefill", 1), _scheduler(None, 812.0, grew=1.9)),
        _with_scheduler(_answering("decode", 2), _scheduler(4.0, 640.5)),
    ]
    assert decide(FAST, engines, 2.0).verdict == CONNECTION
    assert decide(FAST, engines, 2.0, wedged_after_s=3.0).verdict == WEDGED


def test_an_engine_that_does_not_answer_at_all_stays_unresponsive():
    engines = [
        _with_scheduler(_answering("prefill", 1), _scheduler(30.0, 812.0)),
        _silent("decode", 2),
    ]
    assert decide(FAST, engines, 2.0, RouterList(True)).verdict == UNRESPONSIVE
