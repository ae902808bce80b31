"""MODEL_PATH told apart from a typo before anything starts.

sglang takes a MODEL_PATH it cannot find on disk for a model-hub id and tries to download it, so
a misspelled local path fails only once the engine starts, with the hub's error. `env check`
accepts a directory holding config.json (or a .gguf file), and a value that can only be a hub
id (`org/name`, and nothing of that name here) with a note that the engines will download it.
Everything else is refused with the file, line and variable. A path on another host cannot be
seen from here: it gets a note, not a verdict.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from launch.pdlib import envfiles
from launch.pdlib.envfiles import EnvDir
from launch.pdlib.stack import is_local

ROOT = Path(__file__).resolve().parents[2]
# A model-hub repository id: one owner, one name, each of the hub's allowed characters.
HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
# Top-level directories of this repository that hold models made here: a path under one of them
# is local even on a fresh clone that has not made it yet.
LOCAL_TOPS = ("build",)
# The tiny models tools/make_tiny_model.py makes (build/tiny-llama, build/tiny-dsv4-...): absent
# on a fresh clone until it runs, so their absence is a note.
MADE_HERE_RE = re.compile(r"build/tiny-(llama|dsv4(-[a-z0-9]+)*)")


def resolve(value: str) -> Path:
    """MODEL_PATH as launch/lib.sh resolves it: absolute as given, else under the repo root."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else ROOT / path


def hub_id_reason(value: str) -> str | None:
    """Why value cannot be a hub id; None when it can only be one (nothing of that name here)."""
    if not HUB_ID_RE.fullmatch(value) or ".." in value or "--" in value:
        return "a hub id is ORG/NAME"
    top = value.split("/", 1)[0]
    if top in LOCAL_TOPS or (ROOT / top).is_dir():
        return f"{top}/ is a directory of this repository, so it names a local path"
    return None


def _is_model(path: Path) -> bool:
    return (path / "config.json").is_file() or (path.is_file() and path.suffix == ".gguf")


def problems(env: EnvDir, notes: list[str]) -> list[str]:
    found: list[str] = []
    said: set[tuple[str, str]] = set()
    for role in ("prefill", "decode"):
        for index in env.instances(role) or [None]:
            values = env.role_env(role, index)
            value = values.get("MODEL_PATH", "")
            where = env.origin(role, index, "MODEL_PATH")
            host = values.get(f"{role.upper()}_HOST", "")
            if (where, host) in said:
                continue
            said.add((where, host))
            if not value:
                found.append(f"{where}: MODEL_PATH is not set; the engines need a model")
                continue
            problem, note = _judge(value, where, host)
            if problem:
                found.append(problem)
            if note and note not in notes:
                notes.append(note)
    return found


def _judge(value: str, where: str, host: str) -> tuple[str | None, str | None]:
    """(problem, note) for one MODEL_PATH line as the engine on host would read it."""
    path = resolve(value)
    if hub_id_reason(value) is None and not path.exists():
        return None, (
            f"{where}={value} is a model-hub id (no such path under {ROOT}): the engines will "
            "download it on first start, unless their hub cache holds it"
        )
    if not is_local(host):
        return None, (
            f"{where}={value}: a path on {host}, not this host, so it was not checked here"
        )
    if _is_model(path):
        return None, None
    if not path.exists() and MADE_HERE_RE.fullmatch(value):
        return None, (
            f"{where}={value}: not made yet on this host; tools/make_tiny_model.py makes it "
            "before the engines start"
        )
    if path.exists():
        what = "a directory without config.json" if path.is_dir() else "not a model directory"
        return (
            f"{where}={value}: {path} is {what}; the engines load a model from a directory "
            "holding config.json"
        ), None
    return (
        f"{where}={value}: no such directory ({path}), and not a model-hub id either "
        f"({hub_id_reason(value)}); a typo? The engines would try the hub for it and fail "
        "only after they start"
    ), None


def model_problems(env: EnvDir, notes: list[str] | None = None) -> list[str]:
    """Every engine serves the same model (PD moves one model's KV between them), the
    DSV4-only settings sit next to a DSV4 model, and the CPU-only settings on CPU engines.
    `env check` runs this, and so does `up` before it starts anything."""
    return _model_problems(env, notes) + envfiles.cpu_engine_problems(env)


def _model_problems(env: EnvDir, notes: list[str] | None = None) -> list[str]:
    problems: list[str] = []
    notes = [] if notes is None else notes
    engines = [(r, i) for r in ("prefill", "decode") for i in env.instances(r) or [None]]
    models = {}
    for role, index in engines:
        value = env.role_env(role, index).get("MODEL_PATH", "")
        path = resolve(value)
        models[(role, index)] = (value, path.resolve() if path.exists() else value)
    first = engines[0]
    for other in engines[1:]:
        if models[other][1] != models[first][1]:
            problems.append(
                f"{env.origin(other[0], other[1], 'MODEL_PATH')}={models[other][0]} differs from "
                f"{env.origin(first[0], first[1], 'MODEL_PATH')}={models[first][0]}: prefill and "
                "decode must serve the same model (decode reads the KV prefill computed)"
            )
    if problems:
        return problems
    for role, index in engines:
        values = env.role_env(role, index)
        dsv4_on = [k for k in envfiles.DSV4_SETTINGS if values.get(k, "").strip() not in ("", "0")]
        config = resolve(values.get("MODEL_PATH", "")) / "config.json"
        if not dsv4_on:
            continue
        if not config.is_file():
            notes.append(f"{config}: not found here, so the model type was not checked")
            continue
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError) as exc:
            problems.append(f"{config}: not readable as JSON ({exc})")
            continue
        if model_type != "deepseek_v4":
            problems.append(
                f"{env.origin(role, index, dsv4_on[0])}={values[dsv4_on[0]]} takes DeepSeek-V4's "
                f"SM120 attention path, but MODEL_PATH={values['MODEL_PATH']} is model_type "
                f"{model_type!r}: set it to a DSV4 model or unset {dsv4_on[0]}"
            )
            break
    return problems
