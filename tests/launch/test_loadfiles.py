"""launch/pdlib/loadfiles.py: an engine's load snapshot file, named from the processes that hold
it open, kept in the run dir, removed once they are gone. Real engines:
tests/engine/test_cpu_engines.py."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from launch.pdlib import loadfiles

HOLDER = r"""
import sys
files = [open(p, "rb") for p in sys.argv[1:]]
print("open", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def shm_files():
    made: list[Path] = []

    def make(prefix: str = "sglang_loads_") -> Path:
        path = Path("/dev/shm") / f"{prefix}{uuid.uuid4().hex[:12]}_0123abcd.shm"
        path.write_bytes(b"\0" * 16)
        made.append(path)
        return path

    yield make
    for path in made:
        path.unlink(missing_ok=True)


def hold(*paths: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *map(str, paths)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "open"
    return proc


def end(proc: subprocess.Popen) -> None:
    proc.communicate("\n", timeout=10)


def test_a_file_named_while_its_engine_ran_goes_after_it_died(shm_files, tmp_path):
    snapshot, other = shm_files(), shm_files("not_sglang_")
    engine = hold(snapshot, other)
    group = [psutil.Process(engine.pid)]
    assert loadfiles.open_by(group) == {str(snapshot)}
    loadfiles.remember(tmp_path, "decode", group)
    assert loadfiles.remembered(tmp_path, "decode") == {str(snapshot)}
    # It dies on its own (a crash, a kill from outside); the stop later finds no process.
    end(engine)
    assert loadfiles.remove(tmp_path, "decode", set(), []) == [str(snapshot)]
    assert not snapshot.exists() and other.exists()
    assert not loadfiles.record(tmp_path, "decode").exists()
    assert loadfiles.said([str(snapshot)]) == f"; removed its load snapshot file {snapshot}"
    assert loadfiles.said([]) == ""


def test_a_file_still_held_open_stays(shm_files, tmp_path):
    snapshot = shm_files()
    engine = hold(snapshot)
    group = [psutil.Process(engine.pid)]
    try:
        names = loadfiles.open_by(group)
        assert loadfiles.remove(tmp_path, "prefill", names, group) == []
        assert snapshot.exists()
    finally:
        end(engine)
    assert loadfiles.remove(tmp_path, "prefill", names, group) == [str(snapshot)]


def test_a_record_names_only_snapshot_files(tmp_path, shm_files):
    keep = shm_files("sglang_loadsX_")
    loadfiles.record(tmp_path, "decode").write_text(f'["{keep}", "/etc/passwd", 3]\n')
    assert loadfiles.remembered(tmp_path, "decode") == set()
    assert loadfiles.remove(tmp_path, "decode", set(), []) == []
    assert keep.exists()
