#!/usr/bin/env python3
"""Run smg with its --api-key read from a private file instead of the command line.

usage: PYTHON launch/smg_keyfile.py --api-key-file FILE SMG_ARGS...

Any local user can read a process's command line (`ps`, /proc/PID/cmdline). launch/router.sh
writes the key to FILE (mode 0600, under the run dir; `launch/pd down` removes it) and runs smg
through this file, which hands the key to smg's own entry point (`smg.cli.main`) inside this
process: smg gets exactly the arguments it would have, and argv shows only the file's path.
PYTHON must be the interpreter smg is installed in.
"""

from __future__ import annotations

import sys
from pathlib import Path


def router_argv(argv: list[str]) -> list[str]:
    """SMG_ARGS with `--api-key KEY` after the subcommand (so flags given later still win), KEY
    read from the file --api-key-file names."""
    if len(argv) < 2 or argv[0] != "--api-key-file":
        raise SystemExit("usage: smg_keyfile.py --api-key-file FILE SMG_ARGS...")
    path, rest = Path(argv[1]), argv[2:]
    try:
        key = path.read_text().strip()
    except OSError as err:
        raise SystemExit(
            f"smg_keyfile.py: cannot read the API key file {path}: {err.strerror}"
        ) from None
    if not key:
        raise SystemExit(f"smg_keyfile.py: the API key file {path} is empty")
    return [*rest[:1], "--api-key", key, *rest[1:]]


def main() -> None:
    argv = router_argv(sys.argv[1:])
    from smg.cli import main as smg_main

    smg_main(argv)


if __name__ == "__main__":
    main()
