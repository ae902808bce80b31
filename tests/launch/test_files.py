"""launch/pdlib/files.py: write_whole in a directory others can write (node_exporter's textfile
directory, a run dir). A link planted at any name it could use leaves the link's target as it
was; a failure part way leaves the old file whole and no temporary file; the mode is the one
asked for whatever the umask."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from launch.pdlib import files
from launch.pdlib.files import write_whole

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the directory that a planted link points at."""
    path = tmp_path / "elsewhere" / "victim"
    path.parent.mkdir()
    path.write_text("precious\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def textfile_dir(tmp_path: Path) -> Path:
    path = tmp_path / "textfile"
    path.mkdir()
    path.chmod(0o1777)  # like /tmp: anyone may create names in it
    return path


def assert_untouched(victim: Path) -> None:
    assert victim.read_text() == "precious\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_links_planted_at_the_old_temporary_names_leave_their_target_alone(textfile_dir, victim):
    target = textfile_dir / "pd_verify.prom"
    # The old scheme's temporary name was .{name}.{pid}.tmp: this process's pid, and every pid
    # up to 4096 past it, for good measure.
    pids = {os.getpid(), *range(1, 4097), *range(os.getpid(), os.getpid() + 4097)}
    for pid in pids:
        (textfile_dir / f".{target.name}.{pid}.tmp").symlink_to(victim)
    write_whole(target, "pd_verify_ok 1\n", 0o644)
    assert_untouched(victim)
    assert target.read_text() == "pd_verify_ok 1\n" and not target.is_symlink()
    assert mode_of(target) == 0o644
    # Only the planted links and the target are there: no temporary file left behind.
    left = {p.name for p in textfile_dir.iterdir()} - {f".{target.name}.{p}.tmp" for p in pids}
    assert left == {target.name}


def test_a_link_planted_at_the_target_itself_is_replaced_not_followed(textfile_dir, victim):
    target = textfile_dir / "workers.json"
    target.symlink_to(victim)
    write_whole(target, "[]\n", 0o644)
    assert_untouched(victim)
    assert not target.is_symlink() and target.read_text() == "[]\n"


def test_the_temporary_file_is_new_private_to_us_and_in_the_target_directory(tmp_path, monkeypatch):
    made = []
    real = files.tempfile.mkstemp

    def mkstemp(*args, **kwargs):
        fd, name = real(*args, **kwargs)
        made.append((name, os.fstat(fd)))
        return fd, name

    monkeypatch.setattr(files.tempfile, "mkstemp", mkstemp)
    target = tmp_path / "table.json"
    write_whole(target, "{}")
    ((name, st),) = made
    assert Path(name).parent == tmp_path
    assert Path(name).name != f".{target.name}.{os.getpid()}.tmp"
    # mkstemp's file is 0600 until fchmod: nobody else could open it meanwhile.
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert (target.stat().st_dev, target.stat().st_ino) == (st.st_dev, st.st_ino)


@pytest.mark.parametrize("fails", ["write", "fsync", "fchmod", "replace"])
def test_a_failure_part_way_leaves_the_old_file_whole_and_no_temporary(tmp_path, fails):
    target = tmp_path / "pd_verify.prom"
    old = "pd_verify_ok 1\n" * 1000
    target.write_text(old)
    target.chmod(0o640)
    real_write = os.write

    def broken(*args):
        if fails == "write":
            # Half of the first chunk goes out, then the disk is full.
            fd, data = args
            real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, fails, broken)
        with pytest.raises(OSError, match="No space left"):
            write_whole(target, "pd_verify_ok 0\n" * 5000, 0o644)
    assert target.read_text() == old
    assert mode_of(target) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


FULL_DISK = r"""
import resource, signal, sys
from pathlib import Path
from launch.pdlib.files import write_whole
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    write_whole(Path(sys.argv[1]), "x" * 65536, 0o644)
except OSError as exc:
    print("refused", exc.errno)
"""


def test_a_file_too_big_for_the_file_system_leaves_the_old_file_whole(tmp_path):
    # A real write failure part way (the file size limit, as a full disk would), whatever the
    # writer calls to write.
    target = tmp_path / "pd_verify.prom"
    target.write_text("pd_verify_ok 1\n")
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(target)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == f"refused {errno.EFBIG}", done.stderr
    assert target.read_text() == "pd_verify_ok 1\n"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_an_interrupt_part_way_leaves_no_temporary(tmp_path):
    target = tmp_path / "workers.json"
    with pytest.MonkeyPatch.context() as mp:

        def interrupted(fd):
            raise KeyboardInterrupt

        mp.setattr(os, "fsync", interrupted)
        with pytest.raises(KeyboardInterrupt):
            write_whole(target, "[]\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", [0o644, 0o600, 0o640])
def test_the_mode_is_the_one_asked_for_under_a_restrictive_umask(tmp_path, mode):
    target = tmp_path / "rules.yml"
    old = os.umask(0o077)
    try:
        write_whole(target, "groups: []\n", mode)
    finally:
        os.umask(old)
    assert mode_of(target) == mode
    assert target.read_text() == "groups: []\n"


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_without_a_mode_the_file_gets_what_a_new_file_would(tmp_path, umask, mode):
    target = tmp_path / "workers.json"
    old = os.umask(umask)
    try:
        write_whole(target, "[]\n")
    finally:
        os.umask(old)
    assert mode_of(target) == mode


def test_replacing_keeps_readers_of_the_old_file_whole(tmp_path):
    target = tmp_path / "workers.json"
    write_whole(target, "old\n", 0o644)
    with open(target) as reader:
        write_whole(target, "new\n", 0o644)
        assert reader.read() == "old\n"
    assert target.read_text() == "new\n"
