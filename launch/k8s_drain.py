"""An engine pod's preStop hook (rendered by `launch/pd k8s`): wait until the engine holds no
request, then return so that the kubelet sends SIGTERM.

usage: python3 k8s_drain.py --port PORT [--timeout S] [--api-key-file FILE]

By the time this runs the pod is terminating, and smg's Kubernetes discovery has dropped it from
its workers (a pod with a deletion timestamp leaves smg's desired set at once), so no new
request arrives; the ones the engine holds finish here. It polls the engine's load snapshot
(GET /v1/loads, what `launch/pd rolling-restart` waits on: nothing running, nothing in any
queue, nothing in prefill's inflight queue) on the pod's own address (POD_IP) until it holds
nothing or --timeout passes (the pod's terminationGracePeriodSeconds leaves time for the
engine's own stop after it). Standard library only: the engine image needs nothing of ours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

# Requests in any queue of a PD engine, as the snapshot names them (launch/pdlib/loads.py).
REQUESTS = ("num_running_reqs", "num_waiting_reqs")


def holding(loads: list[dict]) -> int:
    """Requests running or queued, and rooms in a PD queue, over every DP rank."""
    total = 0
    for load in loads:
        total += sum(load.get(name) or 0 for name in REQUESTS)
        for name, value in (load.get("disaggregation") or {}).items():
            if name.endswith("_queue_reqs"):
                total += value or 0
    return total


def read(url: str, key: str) -> list[dict] | None:
    """Every rank's snapshot, or None where it cannot be read or is stale (patch 0021)."""
    request = urllib.request.Request(url)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            loads = json.loads(reply.read())["loads"]
    except (OSError, ValueError, KeyError, TypeError, urllib.error.URLError):
        return None
    if not isinstance(loads, list) or any(not isinstance(x, dict) or x.get("stale") for x in loads):
        return None
    return loads


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the engine's HTTP port")
    parser.add_argument("--timeout", type=float, default=600.0, help="default: 600")
    parser.add_argument("--api-key-file", help="the API key's file (the pod's Secret volume)")
    parser.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    key = open(args.api_key_file).read().strip() if args.api_key_file else ""
    host = os.environ.get("POD_IP") or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    url = f"http://{host}:{args.port}/v1/loads"
    started = time.monotonic()
    while True:
        loads = read(url, key)
        if loads is not None and holding(loads) == 0:
            print(f"drained after {time.monotonic() - started:.1f} s")
            return 0
        if time.monotonic() - started >= args.timeout:
            print(f"not drained after {args.timeout:g} s; stopping anyway")
            return 0
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
