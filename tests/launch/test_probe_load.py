"""What `launch/pd probe` prints for an engine's load, read from real Prometheus text.

sglang's load gauges carry labels (tp_rank, ...), and prometheus_client lists a labelled gauge's
samples only once a child is set, so a fresh engine's /metrics names the gauge but has no value
for it until its first batch's stats are logged.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from launch.pdlib.checks import _load_text
from launch.pdlib.promtext import sample_sums


def _engine_metrics():
    registry = CollectorRegistry()
    running = Gauge("sglang:num_running_reqs", "running", ["tp_rank"], registry=registry)
    queued = Gauge("sglang:num_queue_reqs", "queued", ["tp_rank"], registry=registry)
    return registry, running, queued


def test_a_fresh_engine_reads_as_not_published_yet():
    registry, _, _ = _engine_metrics()
    text = generate_latest(registry).decode()
    assert "sglang:num_running_reqs" in text  # named, but without a sample
    assert _load_text(sample_sums(text)) == (
        "load gauges not published yet (sglang sets them with its first batch's stats)"
    )


def test_set_gauges_are_summed_over_ranks():
    registry, running, queued = _engine_metrics()
    for rank, (r, q) in enumerate([(2, 1), (1, 0)]):
        running.labels(tp_rank=str(rank)).set(r)
        queued.labels(tp_rank=str(rank)).set(q)
    assert _load_text(sample_sums(generate_latest(registry).decode())) == "running=3 queued=1"


def test_a_missing_queue_gauge_is_shown_not_raised():
    assert _load_text({"sglang:num_running_reqs": 4.0}) == "running=4 queued=n/a"
    assert _load_text("unreachable: connection refused") == "unreachable: connection refused"
