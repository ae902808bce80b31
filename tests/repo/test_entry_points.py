"""Every entry point run with a bare python3 and no .venv (a fresh clone before ./build.sh test):
one line that names the missing module and the command that fixes it, exit 2, no traceback; or
it works, where it needs nothing outside the standard library.

The checkout is copied without .venv and build/, and `python3` on PATH is the interpreter this
test runs on with -S (no site-packages: the standard library only)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEEDS = "needs the Python module"
# entry point -> (what `--help` gives, what a run without arguments gives): "needs" (the one
# line, exit 2) or "works" (no dependency on that path: usage, or its own message).
ENTRY_POINTS = {
    "launch/pd": ("needs", "needs"),
    "bench/ab": ("needs", "needs"),
    "bench/multiround": ("needs", "needs"),
    "bench/proxy": ("needs", "needs"),
    "bench/triage": ("needs", "needs"),
    "bench/restart_load": ("needs", "needs"),
    "bench/chaos": ("needs", "needs"),
    "bench/report": ("works", "works"),
    "bench/bench_serving_check.py": ("needs", "needs"),
    "bench/dsv4_check": ("works", "needs"),
    "bench/kernel/microbench": ("works", "needs"),
    "bench/kernel/audit": ("needs", "needs"),
    "bench/kernel/gpu_session": ("works", "works"),
    "bench/kernel/interp_time.py": ("needs", "needs"),
    "tools/make_tiny_model.py": ("works", "needs"),
    "tools/series.py": ("works", "needs"),
}

# Executable, but not run by a user: what runs them instead.
NOT_ENTRY_POINTS = {
    "bench/kernel/microbench.py": "bench/kernel/microbench runs it",
    "launch/smg_keyfile.py": "launch/router.sh runs it under smg's own Python",
}


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The checkout's files (tracked and new, not ignored) without .venv and build/, and an
    environment whose python3 has only the standard library."""
    tree = tmp_path_factory.mktemp("bare") / "repo"
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tree / name)
    assert not (tree / ".venv").exists() and not (tree / "build").exists()
    bin_dir = tree.parent / "bin"
    bin_dir.mkdir()
    base = getattr(sys, "_base_executable", sys.executable)
    python = bin_dir / "python3"
    python.write_text(f'#!/bin/sh\nexec "{base}" -S "$@"\n')
    python.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tree.parent / "home"),
        "LANG": "C.UTF-8",
        # The tiny model's cache, so that make_tiny_model does not look at the real one.
        "XDG_CACHE_HOME": str(tree.parent / "cache"),
    }
    return tree, env


def invoke(tree: Path, env: dict[str, str], entry: str, *args: str):
    path = tree / entry
    # A Python script without a shebang we honour here is run the way its docs say: python3 FILE.
    argv = [str(path), *args] if os.access(path, os.X_OK) else ["python3", str(path), *args]
    return subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def test_every_entry_point_is_listed_here():
    """A new entry point (an executable file in launch/, bench/, bench/kernel/, tools/) gets a
    line in ENTRY_POINTS; the launch/*.sh role scripts run no Python of ours."""
    found = set()
    for folder in ("launch", "bench", "bench/kernel", "tools"):
        for path in (ROOT / folder).iterdir():
            if path.is_file() and os.access(path, os.X_OK) and not path.name.endswith(".sh"):
                found.add(str(path.relative_to(ROOT)))
    found |= {"bench/bench_serving_check.py", "tools/series.py"}
    assert found - set(NOT_ENTRY_POINTS) == set(ENTRY_POINTS)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_without_its_venv_an_entry_point_says_what_is_missing_in_one_line(bare, entry):
    tree, env = bare
    for args, expected in zip((("--help",), ()), ENTRY_POINTS[entry], strict=True):
        done = invoke(tree, env, entry, *args)
        said = (entry, args, done.returncode, done.stdout[-800:], done.stderr[-1500:])
        assert "Traceback" not in done.stderr + done.stdout, said
        if expected == "needs":
            assert done.returncode == 2, said
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1 and NEEDS in lines[0], said
            assert "./build.sh" in lines[0] and lines[0].startswith(f"{entry}: "), said
        else:
            assert NEEDS not in done.stderr, said
