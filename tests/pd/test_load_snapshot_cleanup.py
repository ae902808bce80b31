"""Patch 0022: an engine's load snapshot file in /dev/shm goes when the process that launched
its schedulers ends, by a normal exit or by sglang's kill_process_tree on itself (how it ends
after a child died, a process group's SIGTERM included). A file it did not register stays: the
removal is the hook's. A real engine's file is checked in tests/engine/test_cpu_engines.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

from sglang.srt.managers.load_snapshot import shm_path_for

# One child imports sglang once (seconds) and forks a process per way of ending; each creates
# two snapshot files, registers one, and ends that way. The child prints each one's exit.
CHILD = r"""
import json, os, sys
from types import SimpleNamespace
from sglang.srt.managers.load_snapshot import shm_path_for
from sglang.srt.managers.load_snapshot_cleanup import remove_at_exit
from sglang.srt.utils.common import kill_process_tree

ends = {}
for how, registered, unregistered in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        for instance_id in (registered, unregistered):
            open(shm_path_for(instance_id), "wb").close()
        remove_at_exit(SimpleNamespace(instance_id=registered))
        if how == "kill_process_tree":
            kill_process_tree(os.getpid())
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    ends[how] = os.waitstatus_to_exitcode(status)
print(json.dumps(ends))
"""


def test_the_registered_file_goes_at_exit_and_when_the_process_kills_itself():
    cases = [
        (how, uuid.uuid4().hex[:12], uuid.uuid4().hex[:12]) for how in ("exit", "kill_process_tree")
    ]
    try:
        child = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(cases)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == 0, child.stderr[-3000:]
        ends = json.loads(child.stdout.splitlines()[-1])
        assert ends == {"exit": 0, "kill_process_tree": -signal.SIGKILL}, child.stderr[-3000:]
        for how, registered, unregistered in cases:
            assert not os.path.exists(shm_path_for(registered)), (how, child.stderr[-3000:])
            assert os.path.exists(shm_path_for(unregistered)), how
    finally:
        for _, *ids in cases:
            for instance_id in ids:
                if os.path.exists(shm_path_for(instance_id)):
                    os.unlink(shm_path_for(instance_id))
