"""Which engine instances the router routes to, through smg's own file discovery.

With several instances the router runs with `--discovery-provider file`: it reads its worker
list from a JSON manifest under the run dir and rereads it as soon as it changes. pd writes
that file (whole, to a temporary file renamed over it, so smg never reads half of it) and reads
the router's `GET /workers` to see what smg made of it. The manifest's fields are smg's:
`id` (the instance name, which smg keeps as the worker's `smg.ai/discovery-id` label), `url`,
`worker_type` (prefill or decode) and, for a prefill, `bootstrap_port`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from launch.pdlib import loads
from launch.pdlib.files import write_whole
from launch.pdlib.stack import Role, Stack, http
from launch.pdlib.unresponsive import no_answer

MANIFEST_VERSION = 1
# rolling-restart's defaults: the longest drain, and the router's drop (and take-back) of one
# instance. monitoring's PDInstanceNotRouted waits out a whole rolling restart with them.
DRAIN_TIMEOUT_S = 600.0
ROUTER_TIMEOUT_S = 120.0
DISCOVERY_ID = "smg.ai/discovery-id"


def worker_entry(role: Role) -> dict:
    entry = {"id": role.name, "url": role.url, "worker_type": role.kind}
    if role.bootstrap_port is not None:
        entry["bootstrap_port"] = role.bootstrap_port
    return entry


def listed(stack: Stack) -> list[str]:
    """Instance names in the router's worker file (empty when there is none)."""
    try:
        workers = json.loads(stack.workers_file.read_text())["workers"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [w["id"] for w in workers if isinstance(w, dict) and "id" in w]


def write(stack: Stack, names: list[str]) -> None:
    """Make the worker file list exactly these instances, in the stack's order."""
    engines = [r for r in stack.roles.values() if r.kind != "router" and r.name in names]
    manifest = {"version": MANIFEST_VERSION, "workers": [worker_entry(r) for r in engines]}
    stack.run_dir.mkdir(parents=True, exist_ok=True)
    write_whole(stack.workers_file, json.dumps(manifest, indent=1) + "\n")


def put(stack: Stack, role: Role, in_rotation: bool) -> bool:
    """Add the instance to the worker file or take it out; True when the file changed."""
    names = listed(stack)
    if (role.name in names) == in_rotation:
        return False
    write(stack, names + [role.name] if in_rotation else [n for n in names if n != role.name])
    return True


@dataclass(frozen=True)
class RouterList:
    """What the router's GET /workers gave: whether it answered at all, its workers, and what
    was wrong when it gave none."""

    answered: bool
    workers: tuple[dict, ...] = ()
    error: str = ""


def list_workers(router_url: str, api_key: str = "", timeout_s: float = 5.0) -> RouterList:
    reply = http(router_url + "/workers", timeout=timeout_s, api_key=api_key)
    if reply.status is None:
        return RouterList(False, error=no_answer("GET /workers", reply.error, timeout_s))
    if reply.status != 200:
        return RouterList(True, error=f"GET /workers: {reply.status}")
    try:
        workers = reply.json()["workers"]
    except (ValueError, KeyError, TypeError):
        workers = None
    if not isinstance(workers, list):
        return RouterList(True, error="GET /workers: not the JSON smg answers")
    return RouterList(True, tuple(w for w in workers if isinstance(w, dict)))


def router_workers(stack: Stack) -> dict[str, dict] | str:
    """The router's workers by instance name (GET /workers), or why they cannot be read."""
    listing = list_workers(stack.role("router").url, stack.api_key)
    if listing.error:
        return listing.error
    return {w.get("labels", {}).get(DISCOVERY_ID) or w.get("url", "?"): w for w in listing.workers}


def routable(worker: dict | None) -> bool:
    return bool(worker) and worker.get("is_healthy") is True and worker.get("status") == "ready"


@dataclass(frozen=True)
class Waited:
    ok: bool
    seconds: float
    detail: str


def wait_router(stack: Stack, role: Role, in_rotation: bool, timeout_s: float) -> Waited:
    """Poll the router until it lists the instance as ready (in_rotation) or not at all."""
    started = time.time()
    while True:
        workers = router_workers(stack)
        now = time.time() - started
        if not isinstance(workers, str):
            present = role.name in workers
            if in_rotation and routable(workers.get(role.name)):
                return Waited(True, now, f"the router routes to {role.name} again")
            if not in_rotation and not present:
                return Waited(True, now, f"the router no longer lists {role.name}")
            last = f"status {workers[role.name].get('status')}" if present else "not listed"
        else:
            last = workers
        if now >= timeout_s:
            want = "to route to it" if in_rotation else "to drop it"
            return Waited(False, now, f"router did not come {want} within {timeout_s:g} s ({last})")
        time.sleep(stack.poll_interval_s)


def wait_drained(stack: Stack, role: Role, timeout_s: float, progress) -> Waited:
    """Poll the engine's load snapshot until it holds no request: none running, none in any
    queue, none in prefill's inflight queue (a room whose KV decode has not taken yet)."""
    started = time.time()
    last_shown = -1.0
    while True:
        snapshot = loads.read(role.url, stack.api_key)
        now = time.time() - started
        if isinstance(snapshot, str):
            state = snapshot
        else:
            holding = loads.held(snapshot, tokens=False)
            state = loads.describe(holding)
            if not holding:
                return Waited(True, now, state)
        if now >= timeout_s:
            return Waited(False, now, f"drain timeout {timeout_s:g} s reached ({state})")
        if now - last_shown >= 5:
            progress(f"waiting for {role.name} to drain: {state} ({now:.0f} s)")
            last_shown = now
        time.sleep(stack.poll_interval_s)
