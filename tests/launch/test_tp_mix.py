"""Prefill and decode at different TP sizes: env check and up accept an MLA model (DeepSeek-V4)
with a note and refuse any other (the tiny Llama of env/cpu) before anything starts.

The models are config.json files only: sglang's ModelConfig reads nothing else, and no engine
loads them. Each question to sglang imports it (about 15 s on two cores).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
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


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    configs = {
        "llama": LLAMA,
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


def line_of(path: Path, key: str) -> int:
    lines = path.read_text().splitlines()
    return next(n for n, text in enumerate(lines, 1) if text.startswith(f"{key}="))


def env_check(env: Path) -> subprocess.CompletedProcess:
    return run_pd("env", "check", "--env-dir", str(env), timeout=300)


def test_env_checks_rule_accepts_dsv4_prefill_tp1_decode_tp2_with_a_note_on_the_ranks(
    models, tmp_path
):
    """The rule as env check runs it (envcheck.py calls tp_mix.problems; the refusal below
    goes through the whole command), without the rest of env check's parsers."""
    env = copy_env("cpu-dsv4", tmp_path, str(models["dsv4"]))
    notes: list[str] = []
    assert tp_mix.problems(EnvDir(env), notes) == []
    note = next(n for n in notes if "is MLA" in n)
    assert f"{env}/decode.env:{line_of(env / 'decode.env', 'TP_SIZE')}: TP_SIZE=2 (decode)" in note
    assert f"{env}/common.env:{line_of(env / 'common.env', 'TP_SIZE')}: TP_SIZE=1 (prefill)" in note
    assert "DeepseekV4ForCausalLM" in note and "DeepSeekV4TokenToKVPool" in note
    assert "takes the whole KV and state from prefill rank 0" in note


def test_env_check_and_up_refuse_a_tp_mix_on_a_model_that_is_not_mla(models, tmp_path):
    env = copy_env("cpu", tmp_path, str(models["llama"]))
    done = env_check(env)
    assert done.returncode == 1, done.stdout + done.stderr
    fails = [ln for ln in done.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1, done.stdout
    decode_tp = f"{env}/decode.env:{line_of(env / 'decode.env', 'TP_SIZE')}: TP_SIZE=2 (decode)"
    prefill_tp = f"{env}/common.env:{line_of(env / 'common.env', 'TP_SIZE')}: TP_SIZE=1 (prefill)"
    model = f"{env}/common.env:{line_of(env / 'common.env', 'MODEL_PATH')}: MODEL_PATH="
    assert decode_tp in fails[0] and prefill_tp in fails[0]
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


def test_a_hub_id_gets_a_note_that_the_tp_mix_was_not_checked(tmp_path):
    env = copy_env("cpu", tmp_path, "deepseek-ai/DeepSeek-V4-Flash")
    notes: list[str] = []
    assert tp_mix.problems(EnvDir(env), notes) == []
    note = next(n for n in notes if "TP_SIZE=2 (decode)" in n)
    assert "MODEL_PATH=deepseek-ai/DeepSeek-V4-Flash is MLA was not checked" in note
    assert "a model-hub id" in note


def test_equal_tp_sizes_ask_nothing(tmp_path):
    env = copy_env("cpu", tmp_path, "deepseek-ai/DeepSeek-V4-Flash")
    set_values(env / "decode.env", TP_SIZE="1")
    notes: list[str] = []
    assert tp_mix.problems(EnvDir(env), notes) == [] and notes == []


def test_tp_sizes_that_do_not_divide_are_refused_without_asking_sglang(tmp_path):
    env = copy_env("cpu", tmp_path, "deepseek-ai/DeepSeek-V4-Flash")
    set_values(env / "common.env", TP_SIZE="2")
    set_values(env / "decode.env", TP_SIZE="3")
    found = tp_mix.problems(EnvDir(env), [])
    assert len(found) == 1 and "one TP size must divide the other" in found[0]


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
    value = EnvDir(env).values("prefill.env")["PREFILL_ARGS"]
    set_values(args, PREFILL_ARGS=f'"{value} --tp 2"')
    notes: list[str] = []
    tp_mix.problems(EnvDir(env), notes)
    assert f"{args}:{line_of(args, 'PREFILL_ARGS')}: PREFILL_ARGS: --tp 2 (prefill)" in notes[0]


def test_the_rule_agrees_with_sglang_on_both_models(models):
    """sglang's own reading, asked directly: ModelConfig's attention_arch, is_deepseek_v4 (the
    branch that builds DeepSeek-V4's pool) and is_mla_backend on that pool. ModelConfig alone
    calls DeepSeek-V4 MHA; the PD transfer moves it as MLA."""
    code = (
        "import json, sys\n"
        "from sglang.srt.configs.model_config import ModelConfig, is_deepseek_v4\n"
        "from sglang.srt.disaggregation.utils import is_mla_backend\n"
        "from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool\n"
        "from launch.pdlib.tp_mix import attention_kind\n"
        "out = {}\n"
        "for path in sys.argv[1:]:\n"
        "    c = ModelConfig(path, trust_remote_code=False)\n"
        "    out[path] = dict(arch=c.attention_arch.name, dsv4=is_deepseek_v4(c.hf_config),\n"
        "        dsv4_pool_mla=is_mla_backend(DeepSeekV4TokenToKVPool.__new__(\n"
        "            DeepSeekV4TokenToKVPool)), rule=attention_kind(path, []))\n"
        "print(json.dumps(out))\n"
    )
    python = str(PYTHON) if PYTHON.is_file() else sys.executable
    done = subprocess.run(
        [python, "-c", code, str(models["llama"]), str(models["dsv4"])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    llama, dsv4 = seen[str(models["llama"])], seen[str(models["dsv4"])]
    assert llama["arch"] == "MHA" and not llama["dsv4"]
    assert llama["rule"]["mla"] is False
    assert dsv4["arch"] == "MHA" and dsv4["dsv4"] and dsv4["dsv4_pool_mla"]
    assert dsv4["rule"]["mla"] is True
