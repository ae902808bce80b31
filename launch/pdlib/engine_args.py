"""Engine command lines checked against sglang.launch_server's own argument parser.

`env check` and the simulated engine refuse exactly what the installed sglang would refuse at
start-up (a misspelled flag, a value outside a flag's choices, a missing value), so a typo in
DECODE_ARGS fails here, not on the GPU host a minute after `up`.

The parser is sglang's: `ServerArgs.add_cli_args` on a plain `argparse.ArgumentParser`, as
`sglang.srt.server_args.prepare_server_args` builds it. Importing sglang for it takes seconds
(torch), too slow for every simulated engine start, so its option table (flags, how many values,
choices, int/float types, the ServerArgs field each sets and that field's group, e.g.
`parallel`) is read once per installed sglang version and kept in `~/.cache/sm120pd/`
(`$SM120PD_CACHE`); the parser is rebuilt from that table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
from importlib import metadata
from pathlib import Path

from launch.pdlib import argv_refusals
from launch.pdlib.files import write_whole

LAUNCH_DIR = Path(__file__).resolve().parents[1]
_TYPES = {"int": int, "float": float}
# Part of the cached table's name: a table written in an older format is read again from sglang.
TABLE_FORMAT = 2


class EngineArgsError(ValueError):
    """sglang's parser refused a command line; the message is argparse's."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit
        raise EngineArgsError(message)


def _cache_dir() -> Path:
    return Path(os.environ.get("SM120PD_CACHE") or Path.home() / ".cache" / "sm120pd")


def _sglang_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def _table_from_sglang() -> list[dict]:
    from sglang.srt.arg_groups.arg_utils import namespace_of
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    groups = namespace_of(ServerArgs)
    table = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        kind = getattr(action.type, "__name__", None)
        table.append(
            {
                "flags": list(action.option_strings),
                "nargs": action.nargs,
                "choices": list(action.choices) if action.choices is not None else None,
                "type": kind if kind in _TYPES else None,
                "dest": action.dest,
                "group": groups.get(action.dest, "").split(".")[0] or None,
            }
        )
    return table


def option_table() -> list[dict] | None:
    """sglang.launch_server's options, or None when sglang is not installed here."""
    version = _sglang_version()
    if version is None:
        return None
    path = _cache_dir() / f"launch-server-args-{version}-t{TABLE_FORMAT}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    table = _table_from_sglang()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps(table))
    return table


def parser_from_table(table: list[dict]) -> argparse.ArgumentParser:
    parser = _Parser(prog="sglang.launch_server", add_help=False)
    for option in table:
        if option["nargs"] == 0:
            parser.add_argument(*option["flags"], dest=option["dest"], action="store_true")
            continue
        parser.add_argument(
            *option["flags"],
            dest=option["dest"],
            nargs=option["nargs"],
            choices=option["choices"],
            type=_TYPES.get(option["type"]),
        )
    return parser


def group_options(table: list[dict], group: str) -> list[dict]:
    """The options that set a field of one ServerArgs group (`parallel`: TP, DP, CP, EP...)."""
    return [option for option in table if option["group"] == group]


def refusals(argv: list[str], table: list[dict]) -> list[tuple[str, str]]:
    """[(flag, argparse's message)] for everything sglang's parser refuses in argv."""
    found, _ = argv_refusals.peel(parser_from_table(table).parse_args, argv, EngineArgsError)
    return found


def engine_argv(env_dir: Path, role: str, index: int | None = None) -> list[str]:
    """The arguments launch/ROLE.sh gives sglang.launch_server (its --dry-run, parsed)."""
    instance = ["--instance", str(index)] if index is not None else []
    done = subprocess.run(
        ["bash", str(LAUNCH_DIR / f"{role}.sh"), "--env-dir", str(env_dir), *instance, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0:
        raise EngineArgsError(done.stderr.strip() or f"launch/{role}.sh --dry-run failed")
    lines = done.stdout.splitlines()
    command = shlex.split(lines[lines.index("# command") + 1])
    if command[1:3] != ["-m", "sglang.launch_server"]:
        raise EngineArgsError(f"launch/{role}.sh does not run sglang.launch_server: {command[:3]}")
    return command[3:]


# Flags launch/ROLE.sh builds from a variable; every other flag comes from ROLE_ARGS.
_FLAG_VARIABLES = {
    "--model-path": "MODEL_PATH",
    "--served-model-name": "SERVED_MODEL_NAME",
    "--tp-size": "TP_SIZE",
    "--api-key": "API_KEY",
    "--config": "API_KEY",
    "--disaggregation-transfer-backend": "TRANSFER_BACKEND",
    "--disaggregation-bootstrap-port": "PREFILL_BOOTSTRAP_PORT",
}


def origin(flag: str | None, role: str, values: dict[str, tuple[str, int, str]]) -> str:
    """'FILE:LINE: VARIABLE' for the env line a refused flag came from."""
    extra = f"{role.upper()}_ARGS"
    if flag and flag in values.get(extra, ("", 0, ""))[2].split():
        name = extra
    elif flag in ("--host", "--port"):
        name = f"{role.upper()}_{flag[2:].upper()}"
    else:
        name = _FLAG_VARIABLES.get(flag or "", extra)
    path, line, _ = values.get(name, ("", 0, ""))
    return f"{path}:{line}: {name}" if path else name
