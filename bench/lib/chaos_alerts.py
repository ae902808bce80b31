"""bench/chaos --prometheus: the alerts a fault must fire, read from Prometheus's HTTP API.

`launch/pd monitoring` renders the rules; Prometheus evaluates them against the stack. An alert
is the stack's when its `stack` label is the stack's PD_UNIT_PREFIX (the rules copy the scrape
targets' labels), and the faulted instance's when its `pd_instance` label names it. Firing means
Prometheus's state `firing` (past the rule's `for:`), not `pending`.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

ALERTS_PATH = "/api/v1/alerts"
RULES_PATH = "/api/v1/rules"
POLL_S = 1.0


def firing(alerts: list[dict], stack: str) -> set[tuple[str, str]]:
    """(alertname, pd_instance) of every alert of this stack that is firing."""
    found = set()
    for alert in alerts:
        labels = alert.get("labels") or {}
        if alert.get("state") == "firing" and labels.get("stack") == stack:
            found.add((labels.get("alertname", ""), labels.get("pd_instance", "")))
    return found


async def _get(url: str, path: str, timeout_s: float = 5.0) -> dict:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(url.rstrip("/") + path) as resp:
            resp.raise_for_status()
            body = await resp.json()
    if body.get("status") != "success":
        raise ValueError(f"{path}: status {body.get('status')!r}")
    return body["data"]


async def alert_rules(url: str) -> set[str]:
    """The names of the alerting rules Prometheus has loaded."""
    data = await _get(url, RULES_PATH)
    return {
        rule.get("name", "")
        for group in data.get("groups", [])
        for rule in group.get("rules", [])
        if rule.get("type") == "alerting"
    }


async def read(url: str, stack: str) -> set[tuple[str, str]] | str:
    """What fires now, or why Prometheus could not be read."""
    try:
        return firing((await _get(url, ALERTS_PATH)).get("alerts", []), stack)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError) as exc:
        return f"{type(exc).__name__}: {exc}"[:200]


async def wait(
    url: str, stack: str, wanted: list[tuple[str, str]], fire: bool, limit_s: float, now
) -> tuple[dict[tuple[str, str], float | None], str]:
    """Poll until every wanted alert fires (fire=True) or none of them does (False), at most
    limit_s. Each alert's time (by now()) when it was first seen so, None if never; and the
    last read error, if any."""
    seen: dict[tuple[str, str], float | None] = {key: None for key in wanted}
    deadline = time.monotonic() + limit_s
    error = ""
    while True:
        state = await read(url, stack)
        if isinstance(state, str):
            error = state
        else:
            for key in wanted:
                if seen[key] is None and (key in state) == fire:
                    seen[key] = now()
        if all(t is not None for t in seen.values()) or time.monotonic() >= deadline:
            return seen, error
        await asyncio.sleep(POLL_S)
