"""Run metrics from recorded per-request outputs. Pure functions: no I/O, no clock."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN for no values."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def tpot_s(record: dict[str, Any]) -> float | None:
    """Time per output token after the first; None when there is no second token."""
    tokens = int(record.get("output_tokens", 0))
    if not record.get("success") or tokens < 2:
        return None
    return (float(record["latency_s"]) - float(record["ttft_s"])) / (tokens - 1)


def summarize_run(records: Iterable[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    """Throughput, latency distribution and error count of one load run.

    Failed requests count in `requests` and `errors` and add nothing to throughput, so a run
    that lost requests never looks faster than it was.
    """
    records = list(records)
    if duration_s <= 0:
        raise ValueError(f"run duration must be positive, got {duration_s}")
    ok = [r for r in records if r.get("success")]
    ttfts = [float(r["ttft_s"]) for r in ok]
    tpots = [t for t in (tpot_s(r) for r in ok) if t is not None]
    itls = [float(x) for r in ok for x in r.get("itl_s", [])]
    output_tokens = sum(int(r.get("output_tokens", 0)) for r in ok)
    errors = [r.get("error", "") or "unknown error" for r in records if not r.get("success")]
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(errors),
        "error_rate": len(errors) / len(records) if records else 0.0,
        "first_errors": sorted(set(errors))[:3],
        "duration_s": duration_s,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / duration_s,
        "request_s": len(ok) / duration_s,
        "ttft_mean_s": mean(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_mean_s": mean(tpots),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
    }
