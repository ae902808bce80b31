"""bench/kernel/interp_time.py: the interpreted kernel's timing tool runs and refuses bad input."""

import re
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "bench" / "kernel" / "interp_time.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300
    )


def test_it_prints_each_timed_call_and_their_mean():
    done = _run("--rows", "2", "--c4-entries", "3", "--repeat", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines[:2]] == ["call 1", "call 2"]
    assert re.fullmatch(
        r"rows 2, heads 4, c4 entries 3/512: mean \d+\.\d{3} s per interpreted call", lines[2]
    )


def test_bad_input_is_refused_naming_the_option():
    for args, name in ((["--rows", "0"], "--rows"), (["--c4-entries", "513"], "--c4-entries")):
        done = _run(*args)
        assert done.returncode == 2 and name in done.stderr, done.stderr
