"""The router's own decisions during a measured window, from smg's Prometheus counters.

smg (1.13.0) takes decisions of its own under load: a PD dispatch waits for a slot in decode's
running window and sheds after --pd-admission-wait-secs; an overloaded worker is left out of
routing (when every worker is, the request goes to the least-loaded one, or is shed with
--worker-overload-shed); failed requests are retried; the circuit breaker opens. Each is a
counter on smg's Prometheus endpoint. bench/ab reads them before and after every run and keeps
the difference, so that an arm that won by shedding or retrying shows it.
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from typing import Any

# What is recorded, and the smg counters each one sums (names as smg 1.13.0 exports them).
# smg exports the overload, retry and breaker families from its start; the admission and error
# families appear with their first event, so an absent family reads as 0.
COUNTERS: dict[str, tuple[str, ...]] = {
    # Dispatches that waited for a slot in decode's running window (--pd-admission-wait-secs).
    "admission_waits": ("smg_pd_admission_waits_total",),
    # ... and those shed with 503 when no slot freed in time.
    "admission_sheds": ("smg_pd_admission_sheds_total",),
    # Requests refused with 503 because every worker was overloaded (--worker-overload-shed),
    # by stage: selection, dispatch, pd_admission.
    "overload_sheds": ("smg_worker_overload_shed_total",),
    # smg's count of its leave-outs: requests routed to the least-loaded worker because every
    # worker was over --worker-overload-waiting-requests / --worker-overload-token-usage (or
    # vetoed by liveness). A worker left out while another was free is not counted by smg.
    "overload_fallbacks": (
        "smg_worker_overload_fallback_total",
        "smg_worker_liveness_fallback_total",
    ),
    "retries": ("smg_worker_retries_total", "smg_router_upstream_send_retries_total"),
    "retries_exhausted": ("smg_worker_retries_exhausted_total",),
    "cb_transitions": ("smg_worker_cb_transitions_total",),
    # Errors the router counted: its own request errors, workers' errors, PD bootstrap and KV
    # transfer failures, prefill-admission and admission-queue refusals.
    "router_errors": (
        "smg_router_request_errors_total",
        "smg_worker_errors_total",
        "smg_pd_bootstrap_failures_total",
        "smg_pd_kv_transfer_failures_total",
        "smg_pd_prefill_admission_rejections_total",
        "smg_admission_queue_rejected_total",
    ),
}
# Responses the router answered with a 4xx/5xx status (smg_http_responses_total{status_code}).
HTTP_ERRORS = "http_error_responses"
HTTP_RESPONSES = "smg_http_responses_total"
# Families whose presence says this is an smg that exports the decisions above.
STARTUP_FAMILIES = ("smg_worker_overload_shed_total", "smg_worker_retries_total")
SHEDS = ("admission_sheds", "overload_sheds")
RETRIES = ("retries",)


class CountersError(RuntimeError):
    pass


def read(text: str) -> dict[str, float]:
    """The recorded counts from one scrape of smg's /metrics (ValueError: not Prometheus text)."""
    # Imported here: bench/report renders summaries without it (and without the venv).
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    families = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = family
    if not any(name.removesuffix("_total") in families for name in STARTUP_FAMILIES):
        raise ValueError(
            f"none of {', '.join(STARTUP_FAMILIES)}: not the metrics of an smg router that "
            "counts its decisions"
        )
    for key, names in COUNTERS.items():
        totals[key] = sum(_sum(families.get(name.removesuffix("_total")), name) for name in names)
    responses = families.get(HTTP_RESPONSES.removesuffix("_total"))
    totals[HTTP_ERRORS] = sum(
        s.value
        for s in (responses.samples if responses else [])
        if s.name == HTTP_RESPONSES and s.labels.get("status_code", "")[:1] in ("4", "5")
    )
    return totals


def _sum(family, sample_name: str) -> float:
    if family is None:
        return 0.0
    return sum(s.value for s in family.samples if s.name == sample_name and not math.isnan(s.value))


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            text = resp.read().decode()
    except (OSError, urllib.error.URLError) as exc:
        raise CountersError(f"{url}: {exc}") from exc
    try:
        return read(text)
    except ValueError as exc:
        raise CountersError(f"{url}: {exc}") from exc


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the router counted between two scrapes; a counter that went down means the router
    restarted in between, and the window's counts are unknown."""
    counts = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    reset = sorted(k for k, v in counts.items() if v < 0)
    return {"counts": {k: int(round(v)) for k, v in counts.items()}, "reset": reset}


def sheds(record: dict[str, Any]) -> int:
    return sum(record["counts"].get(k, 0) for k in SHEDS)


def retries(record: dict[str, Any]) -> int:
    return sum(record["counts"].get(k, 0) for k in RETRIES)


def flags(record: dict[str, Any]) -> list[str]:
    """What a run's router did that an engineer must see beside its throughput."""
    if not record.get("read"):
        return []
    counts = record["counts"]
    out = []
    if sheds(record):
        out.append(
            f"router shed {sheds(record)} request(s) (admission {counts['admission_sheds']}, "
            f"overload {counts['overload_sheds']})"
        )
    if retries(record):
        out.append(
            f"router retried {retries(record)} time(s) ({counts['retries_exhausted']} request(s) "
            "exhausted their retries)"
        )
    if counts.get("cb_transitions"):
        out.append(f"circuit breaker changed state {counts['cb_transitions']} time(s)")
    if record.get("reset"):
        out.append(f"router counters went down ({', '.join(record['reset'])}): it restarted")
    return out
