"""Just enough of the Prometheus text format to read SGLang engine load."""

from __future__ import annotations

from launch.pdlib.promtext import sample_sums

RUNNING = "sglang:num_running_reqs"
QUEUED = (
    "sglang:num_queue_reqs",
    "sglang:num_prefill_bootstrap_queue_reqs",
    "sglang:num_prefill_inflight_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
)
GEN_THROUGHPUT = "sglang:gen_throughput"
GEN_TOKENS = "sglang:generation_tokens_total"
# Prefill makes no generation tokens in PD; these move when it works. SGLang counts prompt tokens
# as requests finish and "realtime" tokens (modes prefill_compute, prefill_cache, decode) on each
# logged batch; the sim counts prompt tokens as a prefill starts.
PROMPT_TOKENS = "sglang:prompt_tokens_total"
REALTIME_TOKENS = "sglang:realtime_tokens_total"


def parse(text: str) -> dict[str, float]:
    """Sum of samples per metric name (label sets added together), with prometheus_client's
    parser (launch/pdlib/promtext.py); ValueError for text that is not the format."""
    return sample_sums(text)


def load_of(metrics: dict[str, float]) -> dict[str, float | None]:
    """Running and queued requests and token progress; None for a metric the engine lacks."""
    queued = [metrics[q] for q in QUEUED if q in metrics]
    return {
        "running": metrics.get(RUNNING),
        "queued": sum(queued) if queued else None,
        "gen_throughput": metrics.get(GEN_THROUGHPUT),
        "generation_tokens_total": metrics.get(GEN_TOKENS),
        "prompt_tokens_total": metrics.get(PROMPT_TOKENS),
        "realtime_tokens_total": metrics.get(REALTIME_TOKENS),
    }
