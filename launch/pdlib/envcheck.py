"""launch/pd env check: every rule an env dir must pass before anything starts, from the format
of each line (envfiles) to the topology (stack) and each engine's command line (engine_args).
It sits apart from envfiles because it needs the stack, which is built from envfiles.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from launch.pdlib import engine_args, model_path, router_args, tp_mix
from launch.pdlib.envfiles import (
    FILES,
    EnvDir,
    EnvFileError,
    instance_files,
    knob_value_error,
    parse_file,
    registered_sglang_names,
)
from launch.pdlib.stack import topology_problems


def _close_names(name: str, known: set[str]) -> list[str]:
    return difflib.get_close_matches(name, sorted(known), n=2, cutoff=0.85)


def check(env_dir: Path) -> tuple[list[str], list[str]]:
    """(problems, notes). Problems make `env check` fail."""
    problems: list[str] = []
    notes: list[str] = []
    present = []
    for name in FILES + instance_files(env_dir):
        path = Path(env_dir) / name
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        try:
            present.append(parse_file(path))
        except EnvFileError as exc:
            problems.append(str(exc))
    known, source = registered_sglang_names()
    notes.append(f"SGLANG_* names checked against the {source}")
    for lines in present:
        seen: dict[str, int] = {}
        for line in lines:
            where = f"{line.path}:{line.number}"
            if line.key in seen:
                problems.append(f"{where}: {line.key} set again (first on line {seen[line.key]})")
            seen[line.key] = line.number
            if line.key.startswith(("SGLANG_", "SGL_")) and line.key not in known:
                hint = _close_names(line.key, known)
                extra = f"; did you mean {' or '.join(hint)}?" if hint else ""
                problems.append(
                    f"{where}: {line.key} is not a knob sglang knows (a typo is "
                    f"silently ignored at run time){extra}"
                )
            error = knob_value_error(line.key, line.value)
            if error:
                problems.append(f"{where}: {error}")
    if not problems:
        problems += topology_problems(EnvDir(env_dir), notes)
    if not problems:
        problems += model_path.model_problems(EnvDir(env_dir), notes)
    if not problems:
        # A model path's problem does not hide the command lines' (they do not depend on it).
        problems += model_path.problems(EnvDir(env_dir), notes)
        problems += tp_mix.problems(EnvDir(env_dir), notes)
        _check_engine_args(Path(env_dir), present, problems, notes)
        _check_router_args(Path(env_dir), problems, notes)
    return problems, notes


# Flags launch/router.sh builds from a variable of its own; the rest come from ROUTER_ARGS.
_ROUTER_FLAG_VARIABLES = {
    "--shutdown-grace-period-secs": "ROUTER_SHUTDOWN_GRACE_S",
    "--host": "ROUTER_HOST",
    "--port": "ROUTER_PORT",
    "--prometheus-port": "ROUTER_PROMETHEUS_PORT",
    "--prometheus-host": "ROUTER_PROMETHEUS_HOST",
}


def _check_router_args(env_dir: Path, problems: list[str], notes: list[str]) -> None:
    """The router's full command line, parsed by the parser of the smg that SMG_BIN runs."""
    env = EnvDir(env_dir)
    values = env.role_env("router")
    # Found as launch/router.sh finds it: a bare name on the router's PATH (an env file's PATH,
    # else this process's), a path with a slash under the repository root.
    name = values.get("SMG_BIN") or "smg"
    smg_bin = router_args.find_smg_bin(name, values.get("PATH"))
    if smg_bin is None or not smg_bin.is_file():
        if values.get("SMG_BIN"):
            where = f"{env.origin('router', None, 'SMG_BIN')}={name}"
        else:
            where = (
                f"{Path(env_dir) / 'router.env'}: SMG_BIN is not set (launch/router.sh runs smg)"
            )
        found = "no such executable on PATH" if smg_bin is None else f"no such file ({smg_bin})"
        problems.append(f"{where}: {found}; launch/router.sh could not start the router")
        return
    python = router_args.smg_python(smg_bin)
    try:
        argv = router_args.launch_args(router_args.router_command(env_dir))
        refused = router_args.ask_smg(python, "refusals", argv)
    except router_args.RouterArgsError as exc:
        notes.append(f"router flags not checked: {exc}")
        return
    notes.append(
        f"router command line checked with smg's parser (smg/router_args.py, {python}; "
        f"SMG_BIN {smg_bin})"
    )
    extra = values.get("ROUTER_ARGS", "").split()
    for flag, message in refused:
        if flag and flag in extra:
            name = "ROUTER_ARGS"
        else:
            name = _ROUTER_FLAG_VARIABLES.get(flag or "", "ROUTER_ARGS")
        where = env.origin("router", None, name)
        problems.append(
            f"{where}: {flag or 'the command line'}: smg launch would refuse it in the "
            f"router's command line ({message})"
        )


def _check_engine_args(env_dir: Path, present, problems: list[str], notes: list[str]) -> None:
    """Each engine's full command line, parsed by the installed sglang's own parser."""
    table = engine_args.option_table()
    if table is None:
        notes.append("engine flags not checked: sglang is not installed for this Python")
        return
    notes.append("engine command lines checked with sglang.launch_server's parser")
    env = EnvDir(env_dir)
    for role in ("prefill", "decode"):
        for index in env.instances(role) or [None]:
            name = role if index is None else f"{role}/{index}"
            values = {}
            for file in env.files(role, index):
                for line in env.lines[file]:
                    values[line.key] = (str(line.path), line.number, line.value)
            try:
                argv = engine_args.engine_argv(env_dir, role, index)
            except engine_args.EngineArgsError as exc:
                problems.append(f"launch/{role}.sh --dry-run ({name}): {exc}")
                continue
            for flag, message in engine_args.refusals(argv, table):
                where = engine_args.origin(flag, role, values)
                problems.append(
                    f"{where}: {flag or 'the command line'}: sglang.launch_server would refuse "
                    f"it in the {name} engine's command line ({message})"
                )
