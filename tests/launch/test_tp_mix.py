"""Prefill and decode at different attention TP sizes: env check and up accept an MLA model
(DeepSeek-V4, a DeepSeek-V3-like model) with a note and refuse any other (a gpt-oss-like hybrid
SWA model, the tiny Llama of env/cpu) before anything starts. The mix is read on attention TP
as sglang resolves it (DP attention divides the TP group), not on the TP size.

The models are config.json files only: sglang resolves each engine's command line and reads
ModelConfig from them, and no engine loads them. One question to sglang answers for every
engine of every scenario (the `asked` fixture; importing sglang takes about 15 s on two cores),
and each test runs the rule on those answers; the env check and up test asks on its own, as
the command does.

What each model should get is written here from what sglang 0.5.23 is known to build, not read
through the rule's own chain: DeepSeek-V3's MLA attention an `MLATokenToKVPool`, gpt-oss's
sliding-window layers an `SWAKVPool`, Llama an `MHATokenToKVPool`, DeepSeek-V4 its own
`DeepSeekV4TokenToKVPool` (ModelConfig calls it MHA; PD moves it as MLA).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from launch_harness import ROOT, kill_all, processes_using, run_pd, set_free_ports, set_values

from launch.pdlib import engine_args, tp_mix
from launch.pdlib.envfiles import EnvDir
from tools import tiny_dsv4

PYTHON = ROOT / ".venv" / "bin" / "python"
# The Llama tools/make_tiny_model.py makes for env/cpu, as its config.json reads.
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
# DeepSeek-V3's config.json at tiny sizes: MLA attention (kv_lora_rank, q_lora_rank, the split
# head dims) and a routed MoE after one dense layer.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 300,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 64,
    "q_lora_rank": 96,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "max_position_embeddings": 4096,
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}
# gpt-oss's config.json at tiny sizes: sliding-window and full attention layers alternate.
GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 300,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "experts_per_token": 2,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 4096,
    "rope_theta": 150000,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "torch_dtype": "bfloat16",
}
# gpt-oss refuses env/cpu's torch_native attention backend when sglang resolves its command
# line; no engine runs here, so a GPU backend stands in.
GPT_OSS_BACKEND = "--attention-backend triton"
# name: (model, prefill TP, prefill's extra arguments, decode TP, decode's extra arguments)
SCENARIOS = {
    "dsv4": ("dsv4", 1, "", 2, ""),
    "v3": ("v3", 1, "", 2, ""),
    "swa": ("swa", 1, GPT_OSS_BACKEND, 2, GPT_OSS_BACKEND),
    "llama": ("llama", 1, "", 2, ""),
    "llama-tp-2-3": ("llama", 2, "", 3, ""),
    "llama-dp-prefill": ("llama", 2, "--enable-dp-attention --dp-size 2", 1, ""),
    "llama-dp-decode": ("llama", 2, "", 2, "--enable-dp-attention --dp-size 2"),
    "v3-dp-decode": ("v3", 2, "", 2, "--attn-dp-size 2"),
}
NOT_MLA = "sglang 0.5.23 pairs prefill and decode ranks by attention TP"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    configs = {
        "llama": LLAMA,
        "v3": DEEPSEEK_V3,
        "swa": GPT_OSS,
        "dsv4": tiny_dsv4.config(tiny_dsv4.STANDARD["swa"], vocab_size=300, bos=1, eos=2),
    }
    for name, config in configs.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    return {name: root / name for name in configs}


def copy_env(name: str, tmp: Path, model: str) -> Path:
    """env/NAME with free ports, its own run dir, MODEL_PATH=model and decode at TP 2."""
    env = tmp / name
    shutil.copytree(ROOT / "env" / name, env)
    set_free_ports(env, tmp / "run", MODEL_PATH=model)
    set_values(env / "decode.env", TP_SIZE="2")
    return env


def add_args(env: Path, role: str, words: str) -> None:
    file, key = env / f"{role}.env", f"{role.upper()}_ARGS"
    set_values(file, **{key: f'"{EnvDir(env).values(f"{role}.env")[key]} {words}"'})


def scenario_env(root: Path, name: str, models: dict[str, Path]) -> Path:
    model, prefill_tp, prefill_args, decode_tp, decode_args = SCENARIOS[name]
    env = copy_env("cpu", root / name, str(models[model]))
    set_values(env / "prefill.env", TP_SIZE=str(prefill_tp))
    set_values(env / "decode.env", TP_SIZE=str(decode_tp))
    for role, words in (("prefill", prefill_args), ("decode", decode_args)):
        if words:
            add_args(env, role, words)
    return env


def _key(question: dict) -> str:
    return json.dumps([question["argv"], question["env"]], sort_keys=True)


@pytest.fixture(scope="module")
def asked(tmp_path_factory, models):
    """(each scenario's env dir, an `ask` for tp_mix.problems that answers from one question
    to sglang about every engine of every scenario)."""
    root = tmp_path_factory.mktemp("scenarios")
    envs = {name: scenario_env(root, name, models) for name in SCENARIOS}
    questions = {}
    for env in envs.values():
        for pair in tp_mix.candidate_pairs(EnvDir(env)):
            for engine in pair:
                question = {"argv": engine.argv, "env": engine.env}
                questions[_key(question)] = question
    assert PYTHON.is_file(), "no .venv: ./build.sh test installs sglang there"
    replies = tp_mix.ask_sglang(str(PYTHON), list(questions.values()))
    answers = dict(zip(questions, replies, strict=True))

    def ask(python: str, engines: list[dict]) -> list[dict]:
        return [answers[_key(q)] for q in engines]

    return envs, ask


def rule(asked, name: str) -> tuple[list[str], list[str], Path]:
    """(refusals, notes, env dir) of the rule on one scenario."""
    envs, ask = asked
    notes: list[str] = []
    found = tp_mix.problems(EnvDir(envs[name]), notes, ask=ask)
    return found, notes, envs[name]


def line_of(path: Path, key: str) -> int:
    lines = path.read_text().splitlines()
    return next(n for n, text in enumerate(lines, 1) if text.startswith(f"{key}="))


def tp_line(env: Path, role: str) -> str:
    file = env / f"{role}.env"
    return f"{file}:{line_of(file, 'TP_SIZE')}: TP_SIZE="


def env_check(env: Path):
    return run_pd("env", "check", "--env-dir", str(env), timeout=300)


def test_dsv4_at_tp_1_and_2_is_accepted_with_a_note_on_the_ranks(asked):
    found, notes, env = rule(asked, "dsv4")
    assert found == []
    (note,) = notes
    assert f"{tp_line(env, 'decode')}2 (decode: attention TP 2)" in note
    assert f"{tp_line(env, 'prefill')}1 (prefill: attention TP 1)" in note
    assert "is MLA (DeepseekV4ForCausalLM: sglang's ModelConfig attention_arch MHA" in note
    assert "KV pool DeepSeekV4TokenToKVPool" in note and "is_mla_backend True" in note
    assert "takes the whole KV and state from prefill attention-TP rank 0" in note


def test_a_deepseek_v3_like_mla_model_at_tp_1_and_2_is_accepted(asked):
    found, notes, _ = rule(asked, "v3")
    assert found == []
    (note,) = notes
    assert "is MLA (DeepseekV3ForCausalLM: sglang's ModelConfig attention_arch MLA" in note
    assert "KV pool MLATokenToKVPool (KVCacheConfigurator._build_mla_kv_pool)" in note


def test_a_hybrid_swa_model_at_tp_1_and_2_is_refused(asked):
    found, notes, env = rule(asked, "swa")
    assert notes == []
    (refusal,) = found
    assert f"{tp_line(env, 'decode')}2 (decode: attention TP 2)" in refusal
    assert "is not MLA (GptOssForCausalLM" in refusal
    assert "KV pool SWAKVPool (KVCacheConfigurator._build_hybrid_swa_kv_pool)" in refusal
    assert "is_mla_backend False" in refusal
    # sglang slices an SWA model's heads and refuses only some of its states: the refusal is
    # this project's, and says which of sglang's own apply.
    assert "SWA hybrid models with pipeline parallelism" in refusal and NOT_MLA in refusal
    assert "for MLA models only" in refusal


def test_env_check_and_up_refuse_a_tp_mix_on_a_model_that_is_not_mla(models, tmp_path):
    env = copy_env("cpu", tmp_path, str(models["llama"]))
    done = env_check(env)
    assert done.returncode == 1, done.stdout + done.stderr
    fails = [ln for ln in done.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1, done.stdout
    model = f"{env}/common.env:{line_of(env / 'common.env', 'MODEL_PATH')}: MODEL_PATH="
    assert f"{tp_line(env, 'decode')}2 (decode: attention TP 2)" in fails[0]
    assert f"{env}/common.env:{line_of(env / 'common.env', 'TP_SIZE')}: TP_SIZE=1" in fails[0]
    assert f"{model}{models['llama']} is not MLA" in fails[0]
    assert "LlamaForCausalLM" in fails[0] and "MHATokenToKVPool" in fails[0]
    assert "only by slicing heads" in fails[0] and "MiniMax" in fails[0]
    assert "for MLA models only" in fails[0]
    # up says the same and starts nothing: --sim, so a regression starts no real engine.
    try:
        up = run_pd("up", "--env-dir", str(env), "--sim", "--no-wait", timeout=300)
        assert up.returncode == 2, up.stdout + up.stderr
        assert fails[0] in up.stderr
        assert "up: nothing started or stopped" in up.stderr
        assert not list((tmp_path / "run").glob("*.pid"))
        assert processes_using(env) == []
    finally:
        kill_all(env, tmp_path / "run")


def test_different_tp_sizes_at_one_attention_tp_size_are_no_mix_for_any_model(asked):
    """Prefill at TP 2 with DP attention over 2 groups has attention TP 1, as decode at TP 1:
    each decode rank reads one prefill rank, so even an MHA model passes."""
    found, notes, env = rule(asked, "llama-dp-prefill")
    assert found == []
    (note,) = notes
    prefill_args = env / "prefill.env"
    where = f"{prefill_args}:{line_of(prefill_args, 'PREFILL_ARGS')}: PREFILL_ARGS:"
    assert f"{where} --dp-size 2 --enable-dp-attention (prefill: attention TP 1 = " in note
    assert "TP 2 / attention DP 2)" in note
    assert f"{tp_line(env, 'decode')}1 (decode: attention TP 1)" in note
    assert "the TP sizes differ, the attention TP sizes do not" in note


def test_one_tp_size_with_dp_attention_on_decode_only_is_a_mix(asked):
    """Both at TP 2; decode's DP attention over 2 groups makes its attention TP 1."""
    found, notes, env = rule(asked, "llama-dp-decode")
    assert notes == []
    (refusal,) = found
    assert "(decode: attention TP 1 = TP 2 / attention DP 2)" in refusal
    assert f"{tp_line(env, 'prefill')}2 (prefill: attention TP 2)" in refusal
    assert "is not MLA (LlamaForCausalLM" in refusal and NOT_MLA in refusal
    found, notes, _ = rule(asked, "v3-dp-decode")
    assert found == []
    (note,) = notes
    assert "--attn-dp-size 2 (decode: attention TP 1 = TP 2 / attention DP 2)" in note
    assert "is MLA (DeepseekV3ForCausalLM" in note
    assert (
        "decode attention-TP rank r takes the whole KV and state from prefill attention-TP " in note
    )
    assert "rank r * 2" in note


def test_attention_tp_sizes_that_do_not_divide_are_refused(asked):
    found, notes, _ = rule(asked, "llama-tp-2-3")
    assert notes == []
    (refusal,) = found
    assert "(decode: attention TP 3) and" in refusal and "(prefill: attention TP 2)" in refusal
    assert "one attention TP size must divide the other" in refusal


def test_a_hub_id_gets_a_note_that_the_tp_mix_was_not_checked(tmp_path):
    env = copy_env("cpu", tmp_path, "deepseek-ai/DeepSeek-V4-Flash")
    notes: list[str] = []
    assert tp_mix.problems(EnvDir(env), notes, ask=None) == []
    (note,) = [n for n in notes if "(decode)" in n]
    assert f"{tp_line(env, 'decode')}2 (decode)" in note
    assert "MODEL_PATH=deepseek-ai/DeepSeek-V4-Flash is MLA were not checked" in note
    assert "a model-hub id" in note


def test_the_same_parallel_flags_ask_nothing(models, tmp_path):
    """One TP size and the same DP attention on both sides: the attention TP sizes agree
    without asking sglang (`ask=None` would fail if called)."""
    env = copy_env("cpu", tmp_path, str(models["llama"]))
    set_values(env / "decode.env", TP_SIZE="1")
    notes: list[str] = []
    assert tp_mix.problems(EnvDir(env), notes, ask=None) == [] and notes == []
    set_values(env / "decode.env", TP_SIZE="2")
    set_values(env / "prefill.env", TP_SIZE="2")
    for role in ("prefill", "decode"):
        add_args(env, role, "--enable-dp-attention --dp 2")
    assert tp_mix.problems(EnvDir(env), notes, ask=None) == [] and notes == []


def test_the_option_table_marks_sglang_parallel_flags():
    table = engine_args.option_table()
    assert table is not None, "no sglang option table: ./build.sh test installs sglang in .venv"
    flags = {f for o in engine_args.group_options(table, "parallel") for f in o["flags"]}
    assert {"--tp-size", "--dp-size", "--enable-dp-attention", "--attn-cp-size"} <= flags
    assert {"--enable-prefill-cp", "--attn-dp-size"} <= flags
    assert "--model-path" not in flags and "--port" not in flags


def test_a_tp_size_in_the_engine_args_counts_as_sglang_parser_reads_it(tmp_path):
    table = engine_args.option_table()
    assert table is not None, "no sglang option table: ./build.sh test installs sglang in .venv"
    parser = engine_args.parser_from_table(table)
    for words in (
        ["--tp-size", "2"],
        ["--tp-size=2"],
        ["--tp", "2"],
        ["--tensor-parallel-size", "2"],
        ["--tens", "2"],
        ["--tp-size", "4", "--tp-size", "2"],
    ):
        base = ["--model-path", "m", "--tp-size", "1"]
        assert parser.parse_args(base + words).tp_size == 2, words
        assert tp_mix.tp_flag(words)[1] == "2", words
    env = copy_env("cpu", tmp_path, "deepseek-ai/DeepSeek-V4-Flash")
    set_values(env / "decode.env", TP_SIZE="1")
    args = env / "prefill.env"
    add_args(env, "prefill", "--tp 2")
    notes: list[str] = []
    tp_mix.problems(EnvDir(env), notes, ask=None)
    assert f"{args}:{line_of(args, 'PREFILL_ARGS')}: PREFILL_ARGS: --tp 2 (prefill)" in notes[0]
