"""The tiny DeepSeek-V4 (tools/make_tiny_model.py dsv4): written in DeepSeek's checkpoint
layout, read back exactly by transformers' own V4 conversion, and named and configured the way
sglang's DSV4 loader and config read them."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools import make_tiny_model, tiny_dsv4  # noqa: E402

# DeepSeek's V4 checkpoint names (what sglang's remap_weight_name_to_dpsk_hf_format and
# transformers' conversion_mapping both start from).
TOP_LEVEL = {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base"}
TOP_LEVEL |= {"hc_head_scale"}
LAYER = re.compile(
    r"layers\.\d+\.("
    r"attn\.(wq_a|wq_b|wkv|wo_a|wo_b|q_norm|kv_norm)\.weight|attn\.attn_sink"
    r"|attn\.compressor\.(wkv|wgate|norm)\.weight|attn\.compressor\.ape"
    r"|attn\.indexer\.(wq_b|weights_proj)\.weight"
    r"|attn\.indexer\.compressor\.(wkv|wgate|norm)\.weight|attn\.indexer\.compressor\.ape"
    r"|ffn\.gate\.(weight|bias|tid2eid)|ffn\.experts\.\d+\.w[123]\.weight"
    r"|ffn\.shared_experts\.w[123]\.weight"
    r"|(attn|ffn)_norm\.weight|hc_(attn|ffn)_(fn|base|scale)"
    r")"
)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The c4c128 standard model, written once for the module."""
    out = tmp_path_factory.mktemp("dsv4")
    shape = tiny_dsv4.STANDARD["c4c128"]
    names = tiny_dsv4.make(out, shape, make_tiny_model.tokenizer())
    return out, shape, names


def test_every_tensor_has_a_deepseek_checkpoint_name(made):
    out, shape, names = made
    strange = [n for n in names if n not in TOP_LEVEL and not LAYER.fullmatch(n)]
    assert not strange, strange
    # The c4 layer has the indexer and both compressors, the c128 layer one compressor.
    assert "layers.1.attn.indexer.compressor.ape" in names
    assert "layers.2.attn.compressor.ape" in names
    assert not any(n.startswith("layers.0.attn.compressor") for n in names)
    assert not any(n.startswith("layers.2.attn.indexer") for n in names)
    assert "layers.0.ffn.gate.tid2eid" in names  # the hash-routed layer
    # The attention's KV norm under sglang's name (MQALayer.kv_norm), not transformers' `norm`.
    assert "layers.0.attn.kv_norm.weight" in names
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(n).dtype for n in names if "tid2eid" not in n} == {torch.bfloat16}


def test_transformers_reads_it_back_exactly(made):
    """transformers' V4 conversion (the path a real DeepSeek checkpoint takes) maps every
    tensor back, nothing missing or left over, equal to the model the seed builds."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    out, shape, _ = made
    loaded, info = DeepseekV4ForCausalLM.from_pretrained(
        out, output_loading_info=True, dtype=torch.bfloat16
    )
    assert not any(info.values()), info
    cfg = json.loads((out / "config.json").read_text())
    ref = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg))
    tiny_dsv4._fill(ref, shape.seed)
    ref = ref.to(torch.bfloat16).state_dict()
    got = loaded.state_dict()
    assert set(got) == set(ref)
    assert not [k for k in got if not torch.equal(got[k], ref[k])]
    assert loaded.config.layer_types == [tiny_dsv4.LAYER_TYPE[r] for r in shape.compress_ratios]


def test_nothing_is_left_at_zero_and_greedy_choices_are_clear(made):
    """A zero sink, bias, position table or hash table would hide a layout mistake; flat
    logits would make greedy tokens a coin toss."""
    from transformers import DeepseekV4ForCausalLM

    out, _, names = made
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        zero = [n for n in names if not f.get_tensor(n).float().abs().sum()]
        tid2eid = f.get_tensor("layers.0.ffn.gate.tid2eid")
    assert not zero, zero
    assert all(len(set(row.tolist())) == row.numel() for row in tid2eid)  # distinct experts
    model = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.arange(3, 40).unsqueeze(0)).logits[0]
    top2 = logits.topk(2).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.1, top2


def test_sglang_reads_the_names_and_the_schedule(made):
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    from sglang.srt.utils.hf_transformers_utils import get_config

    out, shape, names = made
    layers = len(shape.compress_ratios)
    remap = DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format
    mapped = {remap(n, num_hidden_layers=layers) for n in names}
    assert all(m.startswith(("model.", "lm_head.")) for m in mapped), sorted(mapped)
    assert "model.layers.1.self_attn.compressor.indexer.ape" not in mapped  # not nested twice
    assert "model.layers.0.mlp.topk.tid2eid" in mapped
    assert "model.hc_head_fn" in mapped and "lm_head.weight" in mapped
    sg = get_config(str(out), trust_remote_code=False)  # what sglang's ModelConfig reads
    assert sg.model_type == "deepseek_v4" and sg.architectures == ["DeepseekV4ForCausalLM"]
    assert list(sg.compress_ratios) == list(shape.compress_ratios)
    assert (sg.window_size, sg.num_hash_layers) == (128, shape.hash_layers)
    assert (sg.qk_nope_head_dim, sg.qk_rope_head_dim, sg.v_head_dim) == (448, 64, 512)
    assert (sg.index_head_dim, sg.index_topk, sg.num_key_value_heads) == (128, 512, 1)


def _make(*args, env_cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "SM120PD_CACHE": str(env_cache)},
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--compress-ratios", "0,8"], "compress ratios [0, 8]: each layer's must be one of"),
        (["--compress-ratios", "0,x"], "comma-separated integers, one per layer"),
        (["--heads", "3"], "--heads 3: must be a positive even number"),
        (["--hidden", "100"], "--hidden 100: must be a positive multiple of 64"),
        (["--experts", "2", "--experts-per-token", "3"], "--experts-per-token 3: must be 1.."),
    ],
)
def test_bad_shapes_are_refused_by_name(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.setenv("SM120PD_CACHE", str(tmp_path))
    try:
        code = make_tiny_model.main(["dsv4", *args])
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_the_swa_standard_is_made_once_and_then_reused(tmp_path):
    first = _make("dsv4", "--standard", "swa", "--out", str(tmp_path / "m"), env_cache=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "writing" in first.stdout and "layers [0, 0]" in first.stdout, first.stdout
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["compress_ratios"] == [0, 0] and cfg["layer_types"] == ["sliding_attention"] * 2
    again = _make("dsv4", "--standard", "swa", "--out", str(tmp_path / "m"), env_cache=tmp_path)
    assert again.returncode == 0 and "is up to date" in again.stdout, again.stdout


def test_both_read_the_same_rope_from_the_config():
    """Sliding-window layers rotate with the plain main RoPE, c4/c128 layers with YaRN on
    compress_rope_theta: the frequencies transformers builds from the config equal the ones
    sglang's DSV4 layers precompute from it (precompute_freqs_cis, with the layer's arguments
    as deepseek_v4.py derives them), and neither scales cos and sin."""
    from sglang.kernels.ops.attention.dsv4.rope import precompute_freqs_cis
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4RotaryEmbedding,
    )

    cfg = tiny_dsv4.config(tiny_dsv4.STANDARD["c4c128"], 421, 0, 1)
    rope = DeepseekV4RotaryEmbedding(DeepseekV4Config(**cfg))
    scaling = cfg["rope_scaling"]
    for compressed, theirs in ((False, rope.main_inv_freq), (True, rope.compress_inv_freq)):
        ours = precompute_freqs_cis(
            dim=cfg["qk_rope_head_dim"],
            seqlen=2,
            original_seq_len=scaling["original_max_position_embeddings"] if compressed else 0,
            base=cfg["compress_rope_theta"] if compressed else cfg["rope_theta"],
            factor=scaling["factor"],  # deepseek_v4.py passes it to every layer
            beta_fast=scaling["beta_fast"],
            beta_slow=scaling["beta_slow"],
        )[1].angle()
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
    assert rope.main_attention_scaling == rope.compress_attention_scaling == 1.0
    # YaRN does change the compressed layers' frequencies (the check above is not vacuous).
    assert not torch.allclose(rope.main_inv_freq, rope.compress_inv_freq)
