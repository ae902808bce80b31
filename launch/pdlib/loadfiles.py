"""An engine's load snapshot file in /dev/shm, removed once launch/pd has stopped the engine.

Each sglang engine start creates /dev/shm/sglang_loads_<instance_id>_<hash>.shm, its scheduler's
load snapshot (what /v1/loads answers), named after an id drawn at random per start. Patch 0022
makes the engine remove it when it ends; an engine killed from outside (SIGKILL after the stop
grace, a crash, the OOM killer) cannot. The name is known only from the engine's processes, which
hold the file open while they run: launch/pd reads it there once the engine is healthy, keeps it
in the run dir (KEY.loadfiles), and when it stops that instance removes every file so named, plus
any the processes have open at the stop, once they are gone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import psutil

from launch.pdlib.files import write_whole

# The names sglang 0.5.23 gives them (load_snapshot.shm_path_for); nothing else is removed.
SNAPSHOT_FILE = re.compile(r"^/dev/shm/sglang_loads_[A-Za-z0-9._-]+\.shm$")


def open_by(procs: list[psutil.Process]) -> set[str]:
    """The load snapshot files these processes hold open."""
    found = set()
    for proc in procs:
        try:
            files = proc.open_files()
        except psutil.Error:
            continue
        found |= {f.path for f in files if SNAPSHOT_FILE.match(f.path)}
    return found


def record(run_dir: Path, key: str) -> Path:
    return Path(run_dir) / f"{key}.loadfiles"


def remembered(run_dir: Path, key: str) -> set[str]:
    try:
        names = json.loads(record(run_dir, key).read_text())
    except (OSError, ValueError):
        return set()
    return {n for n in names if isinstance(n, str) and SNAPSHOT_FILE.match(n)}


def remember(run_dir: Path, key: str, procs: list[psutil.Process]) -> None:
    """Keep the names of the files the instance's processes hold open (with those kept before:
    a file stays named until its instance is stopped). A run dir pd cannot write is no error:
    the files the processes hold open are still found when they are stopped."""
    kept = remembered(run_dir, key)
    names = open_by(procs)
    if names <= kept:
        return
    try:
        write_whole(record(run_dir, key), json.dumps(sorted(names | kept)) + "\n")
    except OSError:
        pass


def remove(run_dir: Path, key: str, names: set[str], procs: list[psutil.Process]) -> list[str]:
    """After the instance's processes were stopped: remove these files and those kept for it,
    except any that one of the processes still holds open, and the record. Returns the files
    that were still there."""
    removed = []
    for name in sorted((names | remembered(run_dir, key)) - open_by(procs)):
        try:
            Path(name).unlink()
        except OSError:
            continue
        removed.append(name)
    record(run_dir, key).unlink(missing_ok=True)
    return removed


def said(removed: list[str]) -> str:
    """The words a stop adds to its detail."""
    if not removed:
        return ""
    return f"; removed its load snapshot file {', '.join(removed)}"
