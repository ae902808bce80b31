"""How the suite splits between parallel workers (`./build.sh test` runs pytest-xdist's `-n 2`;
a plain `pytest` run is unchanged).

Each test file goes to one worker whole, so a module's stack or fixture is set up once. The
files that start real sglang engines or watch what engines leave behind run together, in order,
on one worker (the ENGINES group, scheduled first because it is the longest): they read every
sglang load snapshot file in /dev/shm and every process on the machine, so an engine another
worker started beside them would read as theirs. The two files that share the top-k TP2 check
(one session run of bench/dsv4_check) go together too. Every other file (sim stacks, the
router, promtool, the kernel's interpreter and compiler checks) goes to whichever worker is free:
most of them wait on subprocesses and sockets, and fill the time the engine tests leave idle.
"""

from __future__ import annotations

import pytest

# File paths (relative to tests/) or folders, each group run by one worker in this order.
ENGINES = (
    "engine/",  # the env/cpu stack and its faults
    "dsv4/test_pd_dsv4.py",  # the DSV4 PD stack
    "dsv4/test_dsv4_check.py",  # shares conftest's c4c128 check with the PD test
    "pd/test_load_snapshot_cleanup.py",  # writes sglang_loads_* files in /dev/shm
    "launch/test_loadfiles.py",  # the same
)
TOPK_TP2 = ("dsv4/test_cpu_tp.py", "dsv4/test_dsv4_routing.py")


def _group(path: str) -> str:
    for name, members in (("engines", ENGINES), ("topk-tp2", TOPK_TP2)):
        if any(path.startswith(m) if m.endswith("/") else path == m for m in members):
            return name
    return path


def _scope(nodeid: str) -> str:
    return _group(nodeid.split("::")[0].removeprefix("tests/"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's load-scope scheduler with a scope per group or file (above), handed out in the
    order the workers collected them (ENGINES first, below)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    config.option.loadscopereorder = False
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # not an xdist worker: the usual order
        return
    rank = {"engines": 0, "topk-tp2": 1}
    keyed = [(rank.get(_scope(item.nodeid), 2), i, item) for i, item in enumerate(items)]
    items[:] = [item for _, _, item in sorted(keyed, key=lambda k: k[:2])]
