"""Prefill and decode at different TP sizes: accepted for an MLA model, refused for any other.

sglang 0.5.23 decides how KV moves between engines of different TP sizes from the KV pool each
engine builds: `disaggregation.utils.is_mla_backend(pool)`, true for an `MLATokenToKVPool` (and
its subclasses) and a `DeepSeekV4TokenToKVPool`. That is not ModelConfig's `attention_arch`
alone: DeepseekV4ForCausalLM's is MHA, yet its pool is DeepSeek-V4's and PD moves it as MLA.
An MLA engine's KV has no head dimension, so each decode rank takes the whole KV and state from
one prefill rank. Any other model's KV is sliced by heads between the two sizes, and the first
transfer fails for most hybrid state kinds (`REFUSALS`); where it does not, sglang warns that
performance is not guaranteed. This project runs mixed TP sizes for MLA models only.

`env check` and the verbs that start engines ask sglang, under the env files' PD_PYTHON, which
pool the model gets, and refuse a mix the engines would refuse at the first transfer. That
question runs this file under PD_PYTHON (`python -m launch.pdlib.tp_mix MODEL_PATH [FLAG...]`,
JSON on stdout), since importing sglang takes seconds; it is asked only when the sizes differ.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from launch.pdlib import model_path
from launch.pdlib.envfiles import EnvDir

ROOT = Path(__file__).resolve().parents[2]
# Importing sglang took 14 s on a loaded 2-core host.
PROBE_TIMEOUT_S = 120
# The flags that set the TP size, each with its shortest prefix that argparse takes for it in
# sglang 0.5.23's parser (a unique prefix of a long flag is that flag).
TP_FLAGS = {"--tp-size": "--tp", "--tensor-parallel-size": "--te"}
# Engine flags the model's reading depends on, passed to the question as the engine has them.
MODEL_FLAGS = ("--trust-remote-code", "--disable-hybrid-swa-memory")
# What sglang 0.5.23 raises at the first transfer between different TP sizes for a model that is
# not MLA (disaggregation/nixl/conn.py and common/conn.py).
REFUSALS = (
    '"PD Disaggregation does NOT support PD different TP sizes for non-MLA {KIND} hybrid '
    'models yet" for the kinds SWA, BLOCK_SCALE, BLOCK_SCALE_SWA, QSA_PENDING, QSA_COMPRESSED, '
    'SWA_RING, C128_STATE and REQUEST_ROW; "MiniMax sparse PD requires matching '
    'attention TP sizes"; "PD Disaggregation does NOT support different attention TP sizes '
    'with MXFP8 KV cache"'
)
NOT_GUARANTEED = '"Performance is NOT guaranteed when using different TP sizes for non-MLA models"'


@dataclass(frozen=True)
class EngineTP:
    name: str  # prefill, decode/2
    size: int
    source: str  # FILE:LINE: TP_SIZE=2, or FILE:LINE: DECODE_ARGS: --tp-size 2


def tp_flag(words: list[str]) -> tuple[str, str] | None:
    """(the words, the value) of the last TP size flag in an engine's extra arguments, as
    argparse reads it: the last one counts, `--tp-size 2`, `--tp-size=2` or a prefix (`--tp 2`)."""
    found = None
    for i, word in enumerate(words):
        flag, eq, value = word.partition("=")
        if not any(f.startswith(flag) and len(flag) >= len(s) for f, s in TP_FLAGS.items()):
            continue
        if eq:
            found = (word, value)
        elif i + 1 < len(words):
            found = (f"{word} {words[i + 1]}", words[i + 1])
    return found


def engine_tp(env: EnvDir, role: str, index: int | None) -> EngineTP | None:
    """An engine's TP size and the line it comes from; None where it is not a positive integer
    (env check's engine flags refuse that)."""
    values = env.role_env(role, index)
    args = f"{role.upper()}_ARGS"
    given = tp_flag(values.get(args, "").split())
    if given:
        source, value = f"{env.origin(role, index, args)}: {given[0]}", given[1]
    else:
        value = values.get("TP_SIZE", "")
        source = f"{env.origin(role, index, 'TP_SIZE')}={value}"
    if not value.isdigit() or int(value) < 1:
        return None
    return EngineTP(role if index is None else f"{role}/{index}", int(value), source)


def mixed_pairs(env: EnvDir) -> list[tuple[EngineTP, EngineTP]]:
    """(prefill, decode) pairs at different TP sizes, one per pair of lines: the router pairs
    any prefill with any decode."""
    engines = {
        role: [engine_tp(env, role, i) for i in env.instances(role) or [None]]
        for role in ("prefill", "decode")
    }
    if any(e is None for found in engines.values() for e in found):
        return []
    pairs: dict[tuple[str, str], tuple[EngineTP, EngineTP]] = {}
    for p in engines["prefill"]:
        for d in engines["decode"]:
            if p.size != d.size:
                pairs.setdefault((p.source, d.source), (p, d))
    return list(pairs.values())


def _source_rank(prefill: int, decode: int) -> str:
    """Where an MLA model's decode ranks read from (sglang's _resolve_rank_mapping in
    disaggregation/common/conn.py; the other prefill ranks send a decode rank only a dummy)."""
    whole = "takes the whole KV and state from prefill rank"
    if prefill == 1:
        return f"each decode rank {whole} 0"
    if decode > prefill:
        return f"decode rank r {whole} r // {decode // prefill}"
    return f"decode rank r {whole} r * {prefill // decode}"


def _python(value: str) -> str:
    """PD_PYTHON as launch/lib.sh resolves it: absolute as given, a path under the repository
    root, or a bare name on PATH."""
    if value.startswith("/"):
        return value
    if "/" in value:
        return str(ROOT / value)
    return shutil.which(value) or value


def ask_sglang(python: str, path: Path, flags: list[str], env: dict[str, str]) -> dict:
    """attention_kind() under the engines' interpreter; RuntimeError (its reason) when it cannot
    answer."""
    try:
        done = subprocess.run(
            [python, "-m", "launch.pdlib.tp_mix", str(path), *flags],
            cwd=ROOT,
            env=os.environ | env,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"{python} could not run: {exc}") from exc
    if done.returncode == 3:
        raise RuntimeError(f"sglang is not installed for {python}")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{python}: {tail}")
    return json.loads(lines[-1])


def problems(env: EnvDir, notes: list[str]) -> list[str]:
    """The TP mixes the engines would refuse; a note for each one they accept, or could not be
    checked. Nothing when prefill and decode have one TP size."""
    pairs = mixed_pairs(env)
    if not pairs:
        return []
    first = ("decode", (env.instances("decode") or [None])[0])
    values = env.role_env(*first)
    value = values.get("MODEL_PATH", "")
    model = f"{env.origin(*first, 'MODEL_PATH')}={value}"
    found: list[str] = []
    for p, d in pairs:
        if max(p.size, d.size) % min(p.size, d.size):
            found.append(
                f"{d.source} ({d.name}) and {p.source} ({p.name}): one TP size must divide "
                "the other. sglang 0.5.23 maps decode ranks to prefill ranks by integer "
                "division of the sizes, so a decode rank would read from a prefill rank that "
                "does not exist, or a prefill rank would have no decode rank to send to"
            )
    pairs = [(p, d) for p, d in pairs if max(p.size, d.size) % min(p.size, d.size) == 0]
    if not pairs:
        return found
    mix = "; ".join(f"{d.source} ({d.name}), {p.source} ({p.name})" for p, d in pairs)
    path = model_path.resolve(value)
    if not (path / "config.json").is_file():
        why = (
            "a model-hub id"
            if model_path.hub_id_reason(value) is None and not path.exists()
            else f"no {path}/config.json on this host"
        )
        notes.append(
            f"TP sizes differ ({mix}): whether {model} is MLA was not checked ({why}); sglang "
            "moves KV between different TP sizes for MLA models only"
        )
        return found
    python = _python(values.get("PD_PYTHON") or "python3")
    words = values.get("DECODE_ARGS", "").split()
    try:
        kind = ask_sglang(python, path, [f for f in MODEL_FLAGS if f in words], values)
    except (RuntimeError, ValueError) as exc:
        notes.append(
            f"TP sizes differ ({mix}): could not decide whether {model} is MLA ({exc}); the "
            "engines would find out at the first transfer"
        )
        return found
    how = (
        f"{kind['architecture']}: sglang's ModelConfig attention_arch {kind['attention_arch']}, "
        f"KV pool {kind['pool']}, PD's is_mla_backend {kind['mla']}; asked {python}"
    )
    if kind["mla"]:
        for p, d in pairs:
            notes.append(
                f"{d.source} ({d.name}) differs from {p.source} ({p.name}); {model} is MLA "
                f"({how}), so {_source_rank(p.size, d.size)}"
            )
        return found
    for p, d in pairs:
        found.append(
            f"{d.source} ({d.name}) differs from {p.source} ({p.name}), and {model} is not MLA "
            f"({how}). sglang 0.5.23 moves a non-MLA model's KV between different TP sizes "
            f"only by slicing heads, refuses it at the first transfer for hybrid state kinds "
            f"({REFUSALS}), and otherwise warns {NOT_GUARANTEED}. This project runs mixed TP "
            "sizes for MLA models only: give prefill and decode the same TP size"
        )
    return found


# --- run under PD_PYTHON ---------------------------------------------------------------------


def attention_kind(path: str, flags: list[str]) -> dict:
    """How the installed sglang reads the model: its ModelConfig, the KV pool its
    kv_cache_configurator builds for it (the branches that decide MLA or not), and whether PD's
    is_mla_backend counts that pool as MLA (for a hybrid linear pool: its full-attention pool,
    as sglang sets is_hybrid_mla_backend)."""
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig, is_deepseek_v4
    from sglang.srt.disaggregation.utils import is_mla_backend
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    config = ModelConfig(
        path,
        trust_remote_code="--trust-remote-code" in flags,
        disable_hybrid_swa_memory="--disable-hybrid-swa-memory" in flags,
    )
    mla_arch = config.attention_arch == AttentionArch.MLA
    full = memory_pool.MLATokenToKVPool if mla_arch else memory_pool.MHATokenToKVPool
    if is_deepseek_v4(config.hf_config):
        name, reader = DeepSeekV4TokenToKVPool.__name__, DeepSeekV4TokenToKVPool
    elif config.is_hybrid_swa:
        name, reader = SWAKVPool.__name__, SWAKVPool
    elif mambaish_config(config) is not None:
        name, reader = f"HybridLinearKVPool over {full.__name__}", full
    else:
        name, reader = full.__name__, full
    return {
        "architecture": config.hf_config.architectures[0],
        "attention_arch": config.attention_arch.name,
        "pool": name,
        "mla": bool(is_mla_backend(reader.__new__(reader))),
    }


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m launch.pdlib.tp_mix MODEL_PATH [ENGINE_FLAG...]", file=sys.stderr)
        return 2
    try:
        import sglang.srt.configs.model_config  # noqa: F401
    except ImportError:
        return 3
    print(json.dumps(attention_kind(argv[0], argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
