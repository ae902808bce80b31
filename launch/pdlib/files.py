"""Files other processes read while pd writes them (smg's worker list, Prometheus's targets and
rules, node_exporter's textfile, the cached option table): written whole to a temporary file
beside the target, then renamed over it, so a reader sees the old file or the new one.

Such a directory may be writable by others (a textfile directory, a shared run dir), so nothing
here opens a name someone else could have chosen: the temporary file is a new one from mkstemp
(O_CREAT | O_EXCL, an unpredictable name), everything after that goes through its descriptor,
and the rename replaces whatever is at the target's name (a planted link included) without
following it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _umask() -> int:
    """This process's umask, read without changing it where Linux tells it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_whole(path: Path, text: str, mode: int | None = None) -> None:
    """Write text to path atomically, with mode (e.g. 0o644; umask not applied) or, without one,
    the mode a new file would get (0o666 less the umask). The temporary file is removed when
    anything fails, and the old file at path stays as it was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, (0o666 & ~_umask()) if mode is None else mode)
            data = memoryview(text.encode())
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
            # The name must still be the file this descriptor wrote (nobody swapped it).
            written, named = os.fstat(fd), os.lstat(tmp)
            if (named.st_dev, named.st_ino) != (written.st_dev, written.st_ino):
                raise OSError(f"{tmp}: replaced by another file while it was written")
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """The rename itself on disk (best effort: some file systems refuse a directory fsync)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
