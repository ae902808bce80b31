"""How the repository's Python entry points start (launch/pd, the bench/ commands, the kernel
toolchain, tools/make_tiny_model.py): under the project's .venv when the caller's Python lacks a
dependency and .venv exists, else with one line that names the missing module and the command
that fixes it, and exit status 2. Never a traceback for a missing dependency.

Standard library only: it runs before anything else is importable.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
# Our own packages: a module of these that is missing is a bug of ours, not a dependency.
OURS = ("bench", "launch", "tools")
FIX = "run ./build.sh test once (it creates .venv with every dependency), or use .venv/bin/python"


def _ours(name: str | None) -> bool:
    return bool(name) and name.split(".")[0] in OURS


def _in_venv() -> bool:
    return VENV.is_dir() and Path(sys.prefix).resolve() == VENV.resolve()


def _to_venv(script: str | None) -> None:
    """Run the same command under .venv's Python, when there is one and this is not it."""
    python = VENV / "bin" / "python"
    if script and not _in_venv() and python.exists():
        os.execv(python, [str(python), script, *sys.argv[1:]])


def missing(name: str, module: str | None, fix: str = FIX) -> NoReturn:
    print(
        f"{name}: needs the Python module {module or '(unknown)'}, which {sys.executable} "
        f"does not have; {fix}",
        file=sys.stderr,
    )
    sys.exit(2)


def require(name: str, *modules: str, script: str | None = None, fix: str = FIX) -> None:
    """Before a script imports its dependencies: each of modules importable, else .venv's
    Python runs the script instead (when given and there is one), else one line and exit 2;
    fix replaces the usual remedy where another environment provides the modules."""
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if absent:
        _to_venv(script)
        missing(name, absent[0], fix)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def call(name: str, main: Callable[[], int | None]) -> NoReturn:
    """Exit with main()'s status; a dependency it imports late and lacks ends in one line."""
    try:
        status = main()
    except ModuleNotFoundError as exc:
        if _ours(exc.name):
            raise
        missing(name, exc.name)
    sys.exit(status)


def run(name: str, module: str, script: str | None = None) -> NoReturn:
    """An entry point that is only `module.main()`: import it (under .venv's Python when this
    one lacks a dependency and the script is given), then exit with main()'s status."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        main = importlib.import_module(module).main
    except ModuleNotFoundError as exc:
        if _ours(exc.name):
            raise
        _to_venv(script)
        missing(name, exc.name)
    call(name, main)
