"""Prefill and decode at different attention TP sizes: accepted for an MLA model, refused for any
other.

sglang 0.5.23 pairs prefill and decode ranks by attention TP, not by `--tp-size`: each engine
publishes `attn_tp_size = tp_size // attn_dp_size // attn_cp_size` (runtime_context's
`attn_tp_size_of` on the resolved server args), and disaggregation/common/conn.py's
`_resolve_rank_mapping` compares prefill's with decode's. Resolution decides the two divisors
from the whole command line and the model (`--enable-dp-attention --dp-size N` or
`--attn-dp-size N`, `--attn-cp-size`, and model hooks: DeepSeek-V4 and DSA prefill CP
(`--enable-prefill-cp`) take the whole TP group as CP). So two engines at one TP size can
differ in attention TP (a mix), and two at different TP sizes can agree (no mix: each decode
rank reads its one prefill rank, whatever the model).

Where attention TP differs, how KV moves depends on the KV pool each engine builds:
`disaggregation.utils.is_mla_backend(pool)`, true for an `MLATokenToKVPool` (and subclasses)
and a `DeepSeekV4TokenToKVPool` (`is_hybrid_mla_backend` for a hybrid linear pool over one).
That is not ModelConfig's `attention_arch`: DeepseekV4ForCausalLM's is MHA, yet PD moves its
pool as MLA, and an MLA model with sliding-window layers gets an `SWAKVPool`, which is not. An
MLA engine's KV has no head dimension, so each decode rank takes the whole KV and state from
one prefill rank. Any other model's KV is sliced by heads, and the first transfer fails for
several hybrid state kinds (`REFUSALS`); where it does not, sglang warns that performance is
not guaranteed. This project runs mixed attention TP sizes for MLA models only.

`env check` and the verbs that start engines ask sglang, under the env files' PD_PYTHON, both
questions for each engine's command line (`launch/ROLE.sh --dry-run`) and environment: this
file runs there as `python -m launch.pdlib.tp_mix` with the engines as JSON on stdin, and
answers JSON on stdout. Importing sglang takes seconds, so it is asked only when some prefill
and decode engine differ in what sglang's parser reads from its `parallel` flags (TP, DP, CP,
EP...): the resolution steps of sglang 0.5.23 that set the attention DP and CP widths read
those flags and the model, which the engines share, and nothing else.

The pool is sglang's choice: `KVCacheConfigurator._build_token_to_kv_pool`, the dispatch that
ModelRunner's pool init runs, is called on the engine's resolved arguments and ModelConfig.
What it calls next builds the pool (`_build_mla_kv_pool`, `_build_hybrid_swa_kv_pool`, ...)
and cannot run here: it allocates on the engine's device, reads the loaded model's layers and
needs the request pool. Those builders are replaced by a record of which one sglang called and
with which pool classes, and `POOL_FAMILIES` names the pool each builds (a builder may take a
variant within its family: sharded, no-op, MXFP8, which PD reads alike). A builder not listed
there is not guessed at: the answer says sglang chose it, and env check notes it. The few
fields the dispatch reads that ModelRunner sets (`use_mla_backend`, `is_hybrid_swa`, the KV
cache dtype) are set as ModelRunner sets them for a target runner.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from launch.pdlib import engine_args, model_path
from launch.pdlib.envfiles import EnvDir

ROOT = Path(__file__).resolve().parents[2]
# Importing sglang took 14 s on a loaded 2-core host; each engine's question is under a second.
PROBE_TIMEOUT_S = 120
# The flags that set the TP size, each with its shortest prefix that argparse takes for it in
# sglang 0.5.23's parser (a unique prefix of a long flag is that flag).
TP_FLAGS = {"--tp-size": "--tp", "--tensor-parallel-size": "--te"}
# What sglang 0.5.23 raises at the first transfer between different attention TP sizes for a
# model that is not MLA (disaggregation/nixl/conn.py, mooncake/conn.py and common/conn.py).
REFUSALS = (
    '"PD Disaggregation does NOT support PD different TP sizes for non-MLA {KIND} hybrid '
    'models yet" for the kinds BLOCK_SCALE, BLOCK_SCALE_SWA, QSA_PENDING, QSA_COMPRESSED, '
    "SWA_RING, C128_STATE and REQUEST_ROW; for SWA state, sliced by heads otherwise, "
    '"... non-MLA SWA hybrid models with pipeline parallelism yet" and "Head-sliced PD '
    'transfer needs the NHD KV cache layout"; "MiniMax sparse PD requires matching '
    'attention TP sizes"; "PD Disaggregation does NOT support different attention TP sizes '
    'with MXFP8 KV cache"'
)
NOT_GUARANTEED = '"Performance is NOT guaranteed when using different TP sizes for non-MLA models"'
# What each of KVCacheConfigurator's pool builders builds, by name: a class of sglang's
# mem_cache (module, class), or the keyword that hands it the class sglang chose.
POOL_FAMILIES = {
    "_build_dsv4_kv_pool": ("deepseek_v4_memory_pool", "DeepSeekV4TokenToKVPool"),
    "_build_mla_kv_pool": "mla_pool_class",
    "_build_dsa_kv_pool": "dsa_pool_class",
    "_build_mla_fp4_kv_pool": ("memory_pool", "MLATokenToKVPoolFP4"),
    "_build_mha_kv_pool": "mha_pool_class",
    "_build_hybrid_swa_kv_pool": ("swa_memory_pool", "SWAKVPool"),
    "_build_hybrid_mla_swa_kv_pool": ("swa_memory_pool", "SWAKVPool"),
    "_build_minimax_sparse_kv_pool": ("memory_pool", "MiniMaxSparseKVPool"),
    "_build_hybrid_linear_kv_pool": ("memory_pool", "HybridLinearKVPool"),
}


@dataclass(frozen=True)
class EngineTP:
    name: str  # prefill, decode/2
    size: int
    source: str  # FILE:LINE: TP_SIZE=2, or FILE:LINE: DECODE_ARGS: --tp-size 2


@dataclass(frozen=True)
class Engine:
    tp: EngineTP
    # FILE:LINE: DECODE_ARGS: --attn-dp-size 2, the parallel flags other than the TP size that
    # the role's extra arguments set; empty when they set none.
    flags: str
    # What sglang's parser reads from the parallel flags of the whole command line: engines
    # that agree in it and share the model agree in attention TP.
    parallel: tuple
    argv: list[str] = field(compare=False)
    env: dict[str, str] = field(compare=False)

    @property
    def name(self) -> str:
        return self.tp.name

    @property
    def source(self) -> str:
        return f"{self.tp.source}; {self.flags}" if self.flags else self.tp.source


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


def _probe_argv(argv: list[str]) -> list[str]:
    """The command line without `--config FILE`: the file holds only the API key, and a dry run
    does not write it."""
    if "--config" not in argv:
        return argv
    at = argv.index("--config")
    return argv[:at] + argv[at + 2 :]


def _parallel_flags(table: list[dict], argv: list[str], extra: list[str]):
    """(sglang's parser's reading of the parallel flags of the whole command line, the ones the
    role's extra arguments set other than the TP size as `--flag value` words); None where the
    parser refuses the command line (env check's engine flags say why)."""
    parser = engine_args.parser_from_table(table)
    options = engine_args.group_options(table, "parallel")
    base = argv[: len(argv) - len(extra)] if extra and argv[-len(extra) :] == extra else argv
    try:
        whole, without = parser.parse_args(argv), parser.parse_args(base)
    except engine_args.EngineArgsError:
        return None
    # One option per field: an alias or a deprecated spelling sets the same one.
    options = list({o["dest"]: o for o in options}.values())
    reading = tuple((o["dest"], repr(getattr(whole, o["dest"]))) for o in options)
    words = []
    for option in options:
        value = getattr(whole, option["dest"])
        if option["dest"] == "tp_size" or value == getattr(without, option["dest"]):
            continue
        flag = next((f for f in option["flags"] if f.startswith("--")), option["flags"][0])
        if value is True:
            words.append(flag)
        else:
            words += [flag, *map(str, value if isinstance(value, list) else [value])]
    return reading, " ".join(words)


def engines(env: EnvDir) -> dict[str, list[Engine]] | None:
    """Each role's engines; None where an engine's TP size or command line is not one sglang
    would start with (env check's engine flags refuse those)."""
    table = engine_args.option_table()
    found: dict[str, list[Engine]] = {}
    for role in ("prefill", "decode"):
        found[role] = []
        for index in env.instances(role) or [None]:
            tp = engine_tp(env, role, index)
            if tp is None:
                return None
            try:
                argv = engine_args.engine_argv(env.path, role, index)
            except engine_args.EngineArgsError:
                return None
            values = env.role_env(role, index)
            extra_name = f"{role.upper()}_ARGS"
            extra = values.get(extra_name, "").split()
            if table is None:
                # Without sglang's parser every word of the extra arguments counts.
                reading, flags = (tp.size, tuple(extra)), ""
            else:
                read = _parallel_flags(table, argv, extra)
                if read is None:
                    return None
                reading, words = read
                origin = env.origin(role, index, extra_name)
                flags = f"{origin}: {words}" if words else ""
            found[role].append(Engine(tp, flags, reading, _probe_argv(argv), values))
    return found


def candidate_pairs(env: EnvDir) -> list[tuple[Engine, Engine]]:
    """(prefill, decode) pairs whose parallel flags differ, so that their attention TP may:
    the router pairs any prefill with any decode."""
    found = engines(env)
    if found is None:
        return []
    return [(p, d) for p in found["prefill"] for d in found["decode"] if p.parallel != d.parallel]


def _attention(answer: dict) -> str:
    """`attention TP 2`, or `attention TP 1 = TP 2 / attention DP 2`, as sglang resolved it."""
    parts = [
        f"attention {kind} {answer[key]}"
        for kind, key in (("DP", "attn_dp_size"), ("CP", "attn_cp_size"))
        if answer[key] > 1
    ]
    tp = f"TP {answer['tp_size']}"
    split = f" = {' / '.join([tp, *parts])}" if parts else ""
    return f"attention TP {answer['attn_tp_size']}{split}"


def _source_rank(prefill: int, decode: int) -> str:
    """Where an MLA model's decode ranks read from, by attention TP rank (sglang's
    _resolve_rank_mapping in disaggregation/common/conn.py; the other prefill ranks send a
    decode rank only a dummy)."""
    whole = "takes the whole KV and state from prefill attention-TP rank"
    if prefill == 1:
        return f"each decode rank {whole} 0"
    if decode > prefill:
        return f"decode attention-TP rank r {whole} r // {decode // prefill}"
    return f"decode attention-TP rank r {whole} r * {prefill // decode}"


def _python(value: str) -> str:
    """PD_PYTHON as launch/lib.sh resolves it: absolute as given, a path under the repository
    root, or a bare name on PATH."""
    if value.startswith("/"):
        return value
    if "/" in value:
        return str(ROOT / value)
    return shutil.which(value) or value


def ask_sglang(python: str, questions: list[dict]) -> list[dict]:
    """engine_reading() for each {"argv", "env"} under the engines' interpreter, in order;
    RuntimeError (its reason) when it cannot answer at all."""
    try:
        done = subprocess.run(
            [python, "-m", "launch.pdlib.tp_mix"],
            cwd=ROOT,
            env=os.environ | (questions[0]["env"] if questions else {}),
            input=json.dumps(questions),
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
    answers = json.loads(lines[-1])
    if len(answers) != len(questions):
        raise ValueError(f"{python} answered {len(answers)} of {len(questions)} engines")
    return answers


def _how(answers: list[dict], python: str) -> str:
    """What sglang said about the model's pool, once when both engines agree."""

    def one(a: dict) -> str:
        hybrid = "" if a["hybrid_mla"] is None else f", is_hybrid_mla_backend {a['hybrid_mla']}"
        return (
            f"KV pool {a['pool']} (KVCacheConfigurator.{a['builder']}), PD's is_mla_backend "
            f"{a['mla']}{hybrid}"
        )

    p, d = answers
    pools = one(d) if one(p) == one(d) else f"prefill {one(p)}, decode {one(d)}"
    return (
        f"{d['architecture']}: sglang's ModelConfig attention_arch {d['attention_arch']}, "
        f"{pools}; asked {python}"
    )


def problems(env: EnvDir, notes: list[str], ask=ask_sglang) -> list[str]:
    """The attention TP mixes the engines would refuse; a note for each mix or TP size
    difference they accept, or could not be checked. Nothing when every prefill and decode
    engine sets the same parallel flags."""
    pairs = candidate_pairs(env)
    if not pairs:
        return []
    first = ("decode", (env.instances("decode") or [None])[0])
    values = env.role_env(*first)
    value = values.get("MODEL_PATH", "")
    model = f"{env.origin(*first, 'MODEL_PATH')}={value}"
    listed = "; ".join(f"{d.source} ({d.name}), {p.source} ({p.name})" for p, d in pairs)
    path = model_path.resolve(value)
    if not (path / "config.json").is_file():
        why = (
            "a model-hub id"
            if model_path.hub_id_reason(value) is None and not path.exists()
            else f"no {path}/config.json on this host"
        )
        notes.append(
            f"parallel flags differ ({listed}): whether the attention TP sizes differ and "
            f"whether {model} is MLA were not checked ({why}); sglang moves KV between "
            "different attention TP sizes for MLA models only"
        )
        return []
    python = _python(values.get("PD_PYTHON") or "python3")
    asked = list({id(e): e for pair in pairs for e in pair}.values())
    try:
        answers = ask(python, [{"argv": e.argv, "env": e.env} for e in asked])
    except (RuntimeError, ValueError) as exc:
        notes.append(
            f"parallel flags differ ({listed}): could not ask sglang for their attention TP "
            f"and whether {model} is MLA ({exc}); the engines would find out at the first "
            "transfer"
        )
        return []
    answer = {id(e): a for e, a in zip(asked, answers, strict=True)}
    found: list[str] = []
    for p, d in pairs:
        pa, da = answer[id(p)], answer[id(d)]
        both = f"{d.source} ({d.name}) and {p.source} ({p.name})"
        failed = [a["error"] for a in (pa, da) if "error" in a]
        if failed:
            notes.append(
                f"{both}: could not ask sglang for their attention TP and whether {model} is "
                f"MLA ({'; '.join(failed)}); the engines would find out at the first transfer"
            )
            continue
        ps, ds = pa["attn_tp_size"], da["attn_tp_size"]
        described = (
            f"{d.source} ({d.name}: {_attention(da)}) and {p.source} ({p.name}: {_attention(pa)})"
        )
        if ps == ds:
            if p.tp.size != d.tp.size:
                notes.append(
                    f"{described}: the TP sizes differ, the attention TP sizes do not; sglang "
                    "pairs ranks by attention TP, so each decode rank reads one prefill rank "
                    f"whatever the model (asked {python})"
                )
            continue
        if max(ps, ds) % min(ps, ds):
            found.append(
                f"{described}: one attention TP size must divide the other. sglang 0.5.23 maps "
                "decode ranks to prefill ranks by integer division of the attention TP sizes, "
                "so a decode rank would read from a prefill rank that does not exist, or a "
                "prefill rank would have no decode rank to send to"
            )
            continue
        how = _how([pa, da], python)
        accepted = all(a["mla"] or a["hybrid_mla"] for a in (pa, da))
        if accepted:
            notes.append(
                f"{described} differ in attention TP; {model} is MLA ({how}), so "
                f"{_source_rank(ps, ds)}"
            )
            continue
        found.append(
            f"{described} differ in attention TP, and {model} is not MLA ({how}). sglang "
            "0.5.23 pairs prefill and decode ranks by attention TP, moves a non-MLA model's KV "
            "between different attention TP sizes only by slicing heads, refuses it at the "
            f"first transfer for hybrid state kinds ({REFUSALS}), and otherwise warns "
            f"{NOT_GUARANTEED}. This project runs mixed attention TP sizes for MLA models "
            "only: give prefill and decode the same attention TP size"
        )
    return found


# --- run under PD_PYTHON ---------------------------------------------------------------------


class _Chosen(Exception):
    """Raised by a stand-in pool builder: which builder sglang called, with which classes."""


def _pool_choice(model_config) -> tuple[str, dict, object]:
    """(the builder KVCacheConfigurator._build_token_to_kv_pool calls for this engine, the pool
    classes it hands that builder, the configurator) with the published runtime context."""
    import inspect

    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import (
        AttentionArch,
        is_deepseek_dsa,
        is_deepseek_v4,
    )
    from sglang.srt.mem_cache import kv_cache_dtype
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator, _PoolSizes
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.runtime_context import get_model

    def stand_in(name):
        def record(self, **kwargs):
            raise _Chosen(name, {k: v for k, v in kwargs.items() if isinstance(v, type)})

        return record

    builders = {
        name: stand_in(name)
        for name, _ in inspect.getmembers(KVCacheConfigurator, inspect.isfunction)
        if name.startswith("_build_")
        and name.endswith("_kv_pool")
        and name != "_build_mtp_kv_shard_pool"
    }
    recorder = type("PoolChoice", (KVCacheConfigurator,), builders)
    kvc = object.__new__(recorder)
    # The fields the dispatch reads, set as ModelRunner sets them for a target (not a draft)
    # runner whose model is not loaded yet.
    kvc.model_config = model_config
    kvc.is_draft_worker = False
    kvc.is_hybrid_swa = model_config.is_hybrid_swa
    kvc.use_mla_backend = model_config.attention_arch == AttentionArch.MLA
    kvc.mambaish_config = mambaish_config(model_config)
    kvc.kv_shard_rank = None
    resolved, kvc.kv_cache_dtype = kv_cache_dtype.configure_kv_cache_dtype(
        server_args_kv_cache_dtype=get_model().kv_cache_dtype,
        model=None,
        model_dtype=model_config.dtype,
        is_draft_worker=False,
        is_dflash=False,
        speculative_draft_attention_backend=None,
    )
    kvc.kv_cache_dtype_str = resolved or get_model().kv_cache_dtype
    layers = model_config.num_hidden_layers
    kvc.layer_info = ModelLayerInfo(start_layer=0, end_layer=layers, num_effective_layers=layers)
    sizes = _PoolSizes(**{name: 0 for name in _PoolSizes.__struct_fields__})
    try:
        KVCacheConfigurator._build_token_to_kv_pool(
            kvc,
            sizes=sizes,
            is_dsa_model=is_deepseek_dsa(model_config.hf_config),
            is_dsv4_model=is_deepseek_v4(model_config.hf_config),
            req_to_token_pool=None,
        )
    except _Chosen as chosen:
        return (*chosen.args, kvc)
    raise RuntimeError("KVCacheConfigurator._build_token_to_kv_pool called no pool builder")


def engine_reading(argv: list[str]) -> dict:
    """How the installed sglang reads one engine's command line: its attention TP from the
    resolved server args, the KV pool its configurator builds for the model, and whether PD's
    is_mla_backend counts that pool as MLA (for a hybrid linear pool: is_hybrid_mla_backend,
    from its full-attention pool)."""
    import importlib

    from sglang.srt.arg_groups.overrides import model_config_of, resolved_view
    from sglang.srt.disaggregation.utils import is_mla_backend
    from sglang.srt.runtime_context import attn_tp_size_of, publish
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(argv)
    publish(args, role="scheduler")
    view = resolved_view(args)
    model_config = model_config_of(args)
    builder, classes, kvc = _pool_choice(model_config)
    family = POOL_FAMILIES.get(builder)
    if family is None:
        raise LookupError(
            f"sglang builds this KV pool with KVCacheConfigurator.{builder}, "
            "which launch/pdlib/tp_mix.py does not know"
        )
    if isinstance(family, str):
        pool = classes[family]
    else:
        module = importlib.import_module(f"sglang.srt.mem_cache.{family[0]}")
        pool = getattr(module, family[1])
    name, hybrid_mla = pool.__name__, None
    if builder == "_build_hybrid_linear_kv_pool":
        full = kvc._hybrid_full_attention_pool_class(**classes)
        name = f"{name} over {full.__name__}"
        hybrid_mla = bool(is_mla_backend(full.__new__(full)))
    return {
        "architecture": model_config.hf_config.architectures[0],
        "attention_arch": model_config.attention_arch.name,
        "tp_size": view.tp_size,
        "attn_dp_size": view.attn_dp_size,
        "attn_cp_size": view.attn_cp_size,
        "attn_tp_size": attn_tp_size_of(view),
        "builder": builder,
        "pool": name,
        "mla": bool(is_mla_backend(pool.__new__(pool))),
        "hybrid_mla": hybrid_mla,
    }


def _in_child(question: dict) -> dict:
    """engine_reading() in a forked child, under the engine's environment: resolution and
    publish set process-wide state, which each engine must find as its own process does."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            os.environ.update(question["env"])
            answer = engine_reading(question["argv"])
        except BaseException as exc:  # noqa: BLE001 - every failure is the answer
            answer = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}
        with os.fdopen(write, "w") as out:
            json.dump(answer, out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as got:
        text = got.read()
    os.waitpid(pid, 0)
    return json.loads(text) if text else {"error": "the question's process died"}


def main(argv: list[str]) -> int:
    if argv:
        print(
            'usage: echo \'[{"argv": [ENGINE_ARG...], "env": {...}}, ...]\' | '
            "python -m launch.pdlib.tp_mix",
            file=sys.stderr,
        )
        return 2
    try:
        import sglang.srt.server_args  # noqa: F401
    except ImportError:
        return 3
    # Imported once here, not again in each engine's child.
    import sglang.srt.arg_groups.overrides  # noqa: F401
    import sglang.srt.disaggregation.utils  # noqa: F401
    import sglang.srt.mem_cache.kv_cache_configurator  # noqa: F401

    questions = json.load(sys.stdin)
    print(json.dumps([_in_child(q) for q in questions]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
