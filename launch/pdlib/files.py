"""Files other processes read while pd writes them (smg's worker list, Prometheus's targets and
rules, node_exporter's textfile, the cached option table): written whole to a temporary file
beside the target, then renamed over it, so a reader sees the old file or the new one."""

from __future__ import annotations

import os
from pathlib import Path


def write_whole(path: Path, text: str, mode: int | None = None) -> None:
    """Write text to path atomically; mode (e.g. 0o644) is set before the rename. The temporary
    file is removed when anything fails."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        if mode is not None:
            tmp.chmod(mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
