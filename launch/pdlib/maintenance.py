"""Maintenance marks: launch/pd tells Prometheus which instance it is stopping or restarting, so
that the down, unrouted and crash-loop alerts stay quiet through planned work and can wait
minutes, not a start-up timeout, for everything else.

With PD_TEXTFILE_DIR set in common.env (node_exporter's textfile directory), every verb that
stops or starts an instance writes `sm120pd_maintenance_until_timestamp_seconds{stack,
pd_instance}` into PD_TEXTFILE_DIR/sm120pd_maintenance_<PD_UNIT_PREFIX>.prom:

- starting or restarting: now + the role's health timeout + a minute, so a launch/pd that dies
  half-way silences nothing for longer than the start it was waiting for;
- taken out of rotation by rolling-restart: now + the drain and router timeouts on top;
- stopped (`down`): +Inf, until the next `up` of that instance;
- healthy again (and back in rotation): 0.

The rules silence an instance while the mark is in the future. A `--sim` stack writes no mark:
it may share PD_UNIT_PREFIX with the real stack on the host. The state lives in PD_RUN_DIR
(the user's own directory) and the textfile is rendered whole from it under a lock, so two
launch/pd runs on one host keep each other's marks.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

from launch.pdlib.files import write_whole
from launch.pdlib.stack import Role, Stack, from_root
from launch.pdlib.supervise import private_run_dir

METRIC = "sm120pd_maintenance_until_timestamp_seconds"
VARIABLE = "PD_TEXTFILE_DIR"
# Seconds a mark outlives the wait it covers.
MARGIN_S = 60.0
HELP = (
    "Until when launch/pd is stopping, starting or restarting this instance (unix seconds; "
    "+Inf: stopped on purpose; 0: in service)."
)


def textfile_dir(stack: Stack) -> Path | None:
    value = stack.env.common().get(VARIABLE, "")
    return from_root(value) if value else None


def _named(stack: Stack, what: str) -> Path | None:
    """PD_TEXTFILE_DIR/sm120pd_WHAT_<PD_UNIT_PREFIX>.prom: a file per stack, so two stacks
    sharing one node_exporter never write over each other's file."""
    where = textfile_dir(stack)
    if where is None:
        return None
    return where / f"sm120pd_{what}_{re.sub(r'[^A-Za-z0-9_.-]', '_', stack.unit_prefix)}.prom"


def textfile(stack: Stack) -> Path | None:
    return _named(stack, "maintenance")


def verify_textfile(stack: Stack) -> Path | None:
    """Where `launch/pd verify --textfile` writes with no PATH."""
    return _named(stack, "verify")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(stack: Stack, marks: dict[str, float]) -> str:
    lines = [f"# HELP {METRIC} {HELP}", f"# TYPE {METRIC} gauge"]
    for name in sorted(marks):
        until = marks[name]
        # Rounded up to the millisecond: a mark never ends before the time it was set for.
        value = "+Inf" if math.isinf(until) else f"{math.ceil(until * 1000) / 1000:.3f}"
        labels = f'stack="{_label(stack.unit_prefix)}",pd_instance="{_label(name)}"'
        lines.append(f"{METRIC}{{{labels}}} {value}")
    return "\n".join(lines) + "\n"


@contextmanager
def _locked(stack: Stack):
    """The marks' lock, in the run dir (this user's own, as supervise makes it; never a link)."""
    private_run_dir(stack.run_dir)
    fd = os.open(
        stack.run_dir / "maintenance.lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _set(stack: Stack, role: Role, until: float) -> str | None:
    """Record the mark and render the textfile; None, or why the textfile was not written
    (the verb goes on: a mark is a courtesy to the on-call, not a step of the work)."""
    path = textfile(stack)
    if path is None or stack.sim:  # a simulated stack never speaks for the real one
        return None
    state = stack.run_dir / "maintenance.json"
    with _locked(stack):
        try:
            marks = json.loads(state.read_text())
        except (OSError, ValueError):
            marks = {}
        marks[role.name] = until
        write_whole(state, json.dumps(marks), 0o600)
        if not path.parent.is_dir():
            return f"{VARIABLE}={path.parent}: no such directory; maintenance mark not written"
        try:
            write_whole(path, render(stack, marks), 0o644)
        except OSError as exc:
            return f"{path}: {exc}; maintenance mark not written"
    return None


def starting(stack: Stack, role: Role, extra_s: float = 0.0) -> str | None:
    return _set(stack, role, time.time() + role.health_timeout_s + extra_s + MARGIN_S)


def stopped(stack: Stack, role: Role) -> str | None:
    return _set(stack, role, math.inf)


def in_service(stack: Stack, role: Role) -> str | None:
    return _set(stack, role, 0.0)


def read(stack: Stack) -> dict[str, float]:
    """The marks as recorded (for tests and `status`)."""
    try:
        return json.loads((stack.run_dir / "maintenance.json").read_text())
    except (OSError, ValueError):
        return {}
