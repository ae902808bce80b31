"""The router's command line read with smg's own parser (`smg/router_args.py` of the installed smg).

`smg launch` hands everything after `launch` to `RouterArgs.add_cli_args` on a plain argparse
parser and reads the result back with `RouterArgs.from_cli_args`. `env check` does the same with
the smg that SMG_BIN runs, so a misspelled flag in ROUTER_ARGS (`--worker-overlod-shed`) is named
before any engine loads, not when the router refuses to start after them; bench/ab reads both
arms' routers the same way to compare their settings.

The parser runs under smg's own interpreter (the #! line of SMG_BIN), in a subprocess running
this file: `python router_args.py refusals|settings ARG...` prints JSON. Only the standard
library is imported here, so that interpreter needs nothing of this repository.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

try:
    from launch.pdlib import argv_refusals
except ImportError:  # run as a script under smg's Python: the file next to this one
    import argv_refusals

ROOT = Path(__file__).resolve().parents[2]
# Where a router listens and its key: they differ between stacks by design, not by routing.
NOT_ROUTING = frozenset({"host", "port", "prometheus_host", "prometheus_port", "api_key"})


class RouterArgsError(ValueError):
    """The router's command line could not be read, or smg could not be asked about it."""


class _Refused(Exception):
    pass


def _parser():
    from smg.router_args import RouterArgs

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # argparse would print usage and exit
            raise _Refused(message)

    parser = Parser(prog="smg launch", add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return parser, RouterArgs


def smg_refusals(argv: list[str]) -> list[list[str | None]]:
    """[[flag, message]] for everything smg's parser refuses in argv (run under smg's Python);
    a line that parses is then read back as smg does (from_cli_args)."""
    parser, router_args = _parser()
    refused, namespace = argv_refusals.peel(parser.parse_args, argv, _Refused)
    found: list[list[str | None]] = [list(r) for r in refused]
    if not found and namespace is not None:
        try:
            router_args.from_cli_args(namespace, use_router_prefix=False)
        except Exception as exc:  # noqa: BLE001 - smg's own reading of the values failed
            found.append([None, f"{type(exc).__name__}: {exc}"])
    return found


def smg_settings(argv: list[str]) -> dict[str, object]:
    """Every setting smg reads from argv, defaults included (run under smg's Python)."""
    parser, _ = _parser()
    try:
        namespace = parser.parse_args(argv)
    except _Refused as err:
        raise RouterArgsError(f"smg's parser refuses the router's command line: {err}") from err
    return {k: v for k, v in sorted(vars(namespace).items()) if k not in NOT_ROUTING}


def settings_differences(a: dict | None, b: dict | None) -> list[str]:
    """'--flag: A x, B y' for each routing setting in which two routers differ."""
    if not a or not b or a.get("settings") is None or b.get("settings") is None:
        return []
    sa, sb = a["settings"], b["settings"]
    return [
        f"--{key.replace('_', '-')}: A {sa.get(key)!r}, B {sb.get(key)!r}"
        for key in sorted(set(sa) | set(sb))
        if sa.get(key) != sb.get(key)
    ]


def find_smg_bin(value: str, search_path: str | None = None) -> Path | None:
    """The file launch/router.sh runs for SMG_BIN=value (`from_root` in launch/lib.sh): an
    absolute path as it is, a path with a slash under the repository root, a bare name looked
    up on search_path (the router's PATH; None: this process's), None when no directory of it
    has an executable of that name."""
    if value.startswith("/"):
        return Path(value)
    if "/" in value:
        return ROOT / value
    found = shutil.which(value, path=search_path)
    return Path(found) if found else None


def smg_python(smg_bin: Path) -> str:
    """The interpreter smg is installed in: the #! line of its console script, else this one."""
    try:
        with smg_bin.open("rb") as f:
            first = f.readline(512).decode(errors="replace").strip()
    except OSError:
        return sys.executable
    found = re.fullmatch(r"#!(/\S*python\S*)", first)
    return found.group(1) if found else sys.executable


def ask_smg(python: str, verb: str, argv: list[str]):
    """Run smg_refusals or smg_settings under smg's interpreter; RouterArgsError when it cannot."""
    try:
        done = subprocess.run(
            [python, str(Path(__file__).resolve()), verb, *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RouterArgsError(f"{python} could not run smg's parser: {exc}") from exc
    if done.returncode == 3:
        raise RouterArgsError(f"smg is not installed for {python}")
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RouterArgsError(tail)
    return json.loads(done.stdout)


def router_command(env_dir: Path) -> list[str]:
    """The command launch/router.sh starts smg with for this env dir (its --dry-run, parsed)."""
    import shlex

    done = subprocess.run(
        ["bash", str(ROOT / "launch" / "router.sh"), "--env-dir", str(env_dir), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        raise RouterArgsError(done.stderr.strip() or "launch/router.sh --dry-run failed")
    lines = done.stdout.splitlines()
    return shlex.split(lines[lines.index("# command") + 1])


def launch_args(command: list[str]) -> list[str]:
    """What smg's router parser gets from a command line: the words after `launch`."""
    if "launch" not in command:
        raise RouterArgsError(f"not an `smg launch` command line: {' '.join(command[:4])} ...")
    return command[command.index("launch") + 1 :]


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("refusals", "settings"):
        print("usage: router_args.py refusals|settings ARG...", file=sys.stderr)
        return 2
    try:
        import smg.router_args  # noqa: F401
    except ImportError:
        return 3
    try:
        result = smg_refusals(argv[1:]) if argv[0] == "refusals" else smg_settings(argv[1:])
    except RouterArgsError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
