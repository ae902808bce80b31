"""An engine's load snapshot file goes when the engine goes.

Each engine start makes a new ``/dev/shm/sglang_loads_<instance_id>_<hash>.shm``
(``load_snapshot.shm_path_for``, ``instance_id`` random per ``PortArgs``), and upstream removes
it only in CI (``stale_shm_cleanup``, at the next start). Every start and stop therefore left one
more file in /dev/shm, which is memory.

The process that launches the schedulers registers the file here. It is removed when that
process ends: at a normal exit (``atexit``), and where sglang ends the process with SIGKILL on
itself (``kill_process_tree`` with the calling process as parent: after a child died, which is
also how a process group's SIGTERM ends, or on a fatal error), where ``atexit`` never runs. A
SIGKILL from outside leaves the file; ``launch/pd`` removes it for the instances it stops.
"""

from __future__ import annotations

import atexit
import logging
import os

from sglang.srt.managers.load_snapshot import shm_path_for

logger = logging.getLogger(__name__)

_registered: list[str] = []


def remove_at_exit(port_args) -> None:
    """Remove this engine's load snapshot file when this process ends."""
    if not _registered:
        atexit.register(remove_registered)
    _registered.append(shm_path_for(port_args.instance_id))


def remove_registered() -> None:
    """Remove the registered files now (each once); a file already gone is no error."""
    while _registered:
        path = _registered.pop()
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("could not remove the load snapshot file %s: %s", path, exc)
            continue
        logger.info("removed the load snapshot file %s", path)
