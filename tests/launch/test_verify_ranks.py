"""verify's env layer reads the knobs in each scheduler rank, not only in the port's owner.

A real process tree stands in for a decode engine at TP 2: a process that listens on decode's
port, and under it two processes titled by setproctitle as sglang titles its ranks
("sglang::scheduler_TP0", "sglang::scheduler_TP1"). Under setproctitle's default the title is
written over the environment, so /proc/PID/environ of a rank reads empty (seen on a real TP 2
engine); with SPT_NOENV=1 it stays readable. These are real processes read through /proc, as
verify reads an engine's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from launch_harness import make_env_dir

from launch.pdlib import checks
from launch.pdlib.stack import load_stack

ENGINE = r"""
import os, socket, subprocess, sys, time
port, ranks = int(sys.argv[1]), sys.argv[2:]
RANK = "import setproctitle, sys, time; setproctitle.setproctitle(sys.argv[1]); time.sleep(120)"
children = []
for spec in ranks:
    title, _, override = spec.partition(" ")
    env = dict(os.environ)
    if override:
        key, _, value = override.partition("=")
        env[key] = value
    children.append(subprocess.Popen([sys.executable, "-c", RANK, title], env=env))
server = socket.socket()
server.bind(("127.0.0.1", port))
server.listen()
print("ready", flush=True)
time.sleep(120)
"""


def start_engine(
    env: dict[str, str], port: int, ranks: list[str], started: list[subprocess.Popen]
) -> subprocess.Popen:
    """The engine; each rank "TITLE" or "TITLE KEY=VALUE" (that rank's own value of KEY)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(port), *ranks],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    started.append(proc)
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 30
    while True:  # until both ranks carry their titles
        names = [c.name() for c in psutil.Process(proc.pid).children()]
        if len(names) == len(ranks) and all(n.startswith("sglang::schedul") for n in names):
            return proc
        assert time.monotonic() < deadline, names
        time.sleep(0.05)


@pytest.fixture
def decode(tmp_path: Path):
    """The decode role of a stack from a copy of env/ and the environment its files give it."""
    stack = load_stack(make_env_dir(tmp_path), sim=False)
    role = stack.role("decode")
    env = {**os.environ, **stack.env.role_env("decode")}
    procs: list[subprocess.Popen] = []

    def run(ranks: list[str], **extra: str):
        start_engine({**env, **extra}, role.port, ranks, procs)
        return checks.environ_checks(replace(stack, roles={role.name: role}))

    yield run
    for proc in procs:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            child.kill()
        proc.kill()
        proc.wait(10)


def lines(results) -> list[str]:
    return [c.line() for c in results]


def test_every_rank_holds_the_knob(decode):
    got = lines(decode(["sglang::scheduler_TP0", "sglang::scheduler_TP1"], SPT_NOENV="1"))
    for who in ("pid", "sglang::scheduler_TP0 pid", "sglang::scheduler_TP1 pid"):
        assert any(
            ln.startswith("ok   decode SGLANG_SM120_MMA_TARGET_CTAS=512 live in " + who)
            for ln in got
        ), (who, got)
    assert not [ln for ln in got if ln.startswith("FAIL")], got


def test_a_rank_with_another_value_fails_naming_the_rank(decode):
    got = lines(
        decode(
            ["sglang::scheduler_TP0", "sglang::scheduler_TP1 SGLANG_SM120_MMA_TARGET_CTAS=64"],
            SPT_NOENV="1",
        )
    )
    failed = [ln for ln in got if ln.startswith("FAIL")]
    assert len(failed) == 1, got
    assert failed[0].startswith("FAIL decode SGLANG_SM120_MMA_TARGET_CTAS: sglang::scheduler_TP1")
    assert "has '64', the env files say '512'" in failed[0]


def test_a_rank_whose_title_blanked_its_environment_fails_naming_spt_noenv(decode):
    got = lines(decode(["sglang::scheduler_TP0", "sglang::scheduler_TP1"], SPT_NOENV=""))
    failed = [ln for ln in got if ln.startswith("FAIL")]
    assert len(failed) == 2, got
    for ln in failed:
        assert "reads empty" in ln and "SPT_NOENV=1" in ln, ln
    assert any("live in pid" in ln for ln in got), got  # the port owner's is still read


def test_an_engine_without_scheduler_ranks_is_a_failure(decode):
    got = lines(decode([], SPT_NOENV="1"))
    assert any("no scheduler process" in ln and ln.startswith("FAIL") for ln in got), got
