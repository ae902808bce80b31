"""A tiny DeepSeek-V4 with seeded random weights, written the way DeepSeek ships V4.

transformers' `DeepseekV4ForCausalLM` builds it from a config; the files are the checkpoint
layout that both sglang's DSV4 loader (`remap_weight_name_to_dpsk_hf_format`) and transformers'
own V4 conversion read: `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`,
`embed.weight`, `head.weight`, `hc_head_fn`, ... (`checkpoint_name` is the one mapping from
transformers' names). The config carries both spellings of the schedule: sglang reads
`compress_ratios`, `window_size` and `num_hash_layers` (DeepSeek's name, which transformers also
takes), transformers `layer_types`,
`sliding_window` and `mlp_layer_types`.

Sizes the DSV4 code asserts keep their real values (head_dim 512 = 448 + 64 rope, one KV head,
sliding window 128, index_head_dim 128, index_topk 512, compress ratios from {0, 4, 128});
hidden size, heads, LoRA ranks, experts, vocabulary and layers are tiny. Every tensor is drawn
from the seed, none is left at transformers' zero init (a zero sink, bias or position table
would hide a layout mistake), and the scales keep attention far from uniform.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

COMPRESS_RATIOS = (0, 4, 128)
LAYER_TYPE = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}
YARN = {"factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
# What sglang's DSV4 code asserts (see the module docstring).
HEAD_DIM, ROPE_DIM, WINDOW, INDEX_HEAD_DIM, INDEX_TOPK = 512, 64, 128, 128, 512


@dataclass(frozen=True)
class Shape:
    compress_ratios: tuple[int, ...] = (0, 4, 128)
    heads: int = 8
    hidden: int = 256
    experts: int = 4
    # Every expert on for every token: routing then has no discrete choice, so comparing sglang
    # (bf16) with transformers (float32) measures attention and the FP8 KV, not which side of a
    # near-tie the router lands on (a 0.005 score margin between the 2nd and 3rd expert flipped
    # one step's output, cosine 0.94, with 2 of 4).
    experts_per_token: int = 4
    hash_layers: int = 1
    seed: int = 1

    def check(self) -> None:
        bad = [r for r in self.compress_ratios if r not in COMPRESS_RATIOS]
        if bad or not self.compress_ratios:
            raise ValueError(
                f"compress ratios {list(self.compress_ratios)}: each layer's must be one of "
                f"{list(COMPRESS_RATIOS)} (0: sliding window only, 4: c4 with the indexer, "
                "128: c128), one per layer"
            )
        if self.heads < 1 or self.heads % 2:
            raise ValueError(f"--heads {self.heads}: must be a positive even number")
        if self.hidden < 64 or self.hidden % 64:
            raise ValueError(f"--hidden {self.hidden}: must be a positive multiple of 64")
        if not 1 <= self.experts_per_token <= self.experts:
            raise ValueError(
                f"--experts-per-token {self.experts_per_token}: must be 1..--experts "
                f"({self.experts})"
            )
        if not 0 <= self.hash_layers <= len(self.compress_ratios):
            raise ValueError(
                f"--hash-layers {self.hash_layers}: must be 0..the number of layers "
                f"({len(self.compress_ratios)})"
            )

    @property
    def name(self) -> str:
        ratios = "-".join(str(r) for r in self.compress_ratios)
        routing = ""  # the standard routing keeps the names models were cached under
        if (self.experts, self.experts_per_token, self.hash_layers) != (4, 4, 1):
            routing = f"-e{self.experts}k{self.experts_per_token}x{self.hash_layers}"
        return f"tiny-dsv4-r{ratios}-h{self.heads}-d{self.hidden}{routing}-s{self.seed}"


# The two standard models: sliding window only, and one layer of each kind.
STANDARD = {
    "swa": Shape(compress_ratios=(0, 0)),
    "c4c128": Shape(compress_ratios=(0, 4, 128)),
}


def config(shape: Shape, vocab_size: int, bos: int, eos: int) -> dict:
    """config.json: transformers' DeepseekV4Config fields plus the ones sglang's
    DeepSeekV4Config reads under other names."""
    layers = len(shape.compress_ratios)
    q_lora = max(64, shape.hidden // 2)
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab_size,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "hidden_size": shape.hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "qk_rope_head_dim": ROPE_DIM,
        "qk_nope_head_dim": HEAD_DIM - ROPE_DIM,
        "v_head_dim": HEAD_DIM,
        "q_lora_rank": q_lora,
        "o_groups": 2,
        "o_lora_rank": q_lora // 2,
        "moe_intermediate_size": shape.hidden // 2,
        "n_routed_experts": shape.experts,
        "num_experts_per_tok": shape.experts_per_token,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "index_n_heads": 4,
        "index_head_dim": INDEX_HEAD_DIM,
        "index_topk": INDEX_TOPK,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "max_position_embeddings": 65536,
        # YaRN on the c4/c128 layers (sliding-window layers keep the plain main RoPE), as
        # DeepSeek's V4 configs have it; sglang reads rope_scaling, transformers the "compress"
        # rope parameters. attention_factor 1: sglang's precompute_freqs_cis scales the
        # frequencies only, where transformers' yarn would also scale cos and sin by
        # 0.1 ln(factor) + 1.
        "rope_scaling": dict(YARN, type="yarn"),
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0},
            "compress": dict(YARN, rope_type="yarn", rope_theta=160000.0, attention_factor=1.0),
        },
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        # Fields of DeepSeek's V4 config that sglang reads (DeepseekV2MoE's gate), with
        # groups sized for the few experts here.
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
        # sglang's names for the schedule
        "compress_ratios": list(shape.compress_ratios),
        "window_size": WINDOW,
        "num_hash_layers": shape.hash_layers,  # what sglang's DeepseekV2MoE reads
        "n_hash_layers": shape.hash_layers,  # sglang's DeepSeekV4Config field
        # transformers' names for the same schedule
        "layer_types": [LAYER_TYPE[r] for r in shape.compress_ratios],
        "sliding_window": WINDOW,
        "mlp_layer_types": ["hash_moe"] * shape.hash_layers
        + ["moe"] * (layers - shape.hash_layers),
        "compress_rates": {LAYER_TYPE[4]: 4, LAYER_TYPE[128]: 128},
    }


# transformers' save_pretrained already turns its module names back into DeepSeek's, except
# for the "model." prefix and the top-level tensors.
_TOP_LEVEL = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
    "lm_head.weight": "head.weight",
}


# transformers reads both `attn.norm` and `attn.kv_norm` for the attention's KV norm (its
# `.norm.` -> `.kv_norm.` rename does not touch `kv_norm`), and writes back `attn.norm`; sglang's
# loader wants `attn.kv_norm` (MQALayer.kv_norm), as DeepSeek ships it.
_ATTN_KV_NORM = re.compile(r"(layers\.\d+\.attn)\.norm\.weight")


def checkpoint_name(saved: str) -> str:
    """DeepSeek's checkpoint name for a tensor that transformers' save_pretrained wrote."""
    if saved in _TOP_LEVEL:
        return _TOP_LEVEL[saved]
    if saved == "head.weight":
        return saved
    if saved.startswith("model.layers."):
        return _ATTN_KV_NORM.sub(r"\1.kv_norm.weight", saved.removeprefix("model."))
    raise ValueError(f"no DeepSeek-V4 checkpoint name for {saved!r}")


def _fill(model, seed: int) -> None:
    """Seeded values for every parameter and persistent buffer (rotary tables excepted)."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def normal(t, std, mean=0.0):
        t.copy_(torch.randn(t.shape, generator=gen) * std + mean)

    persistent = {n for n, _ in model.named_buffers() if "rotary_emb" not in n}
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n in persistent})
    with torch.no_grad():
        for name, t in sorted(tensors.items()):
            if name.endswith("tid2eid"):
                experts, k = model.config.n_routed_experts, t.shape[1]
                rows = [torch.randperm(experts, generator=gen)[:k] for _ in range(t.shape[0])]
                t.copy_(torch.stack(rows))
            elif name.endswith(("q_a_norm.weight", "kv_norm.weight")):
                # RMS-normed q and k with these gains give attention logits of std ~2-3.
                normal(t, 0.1, mean=1.5)
            elif re.search(r"(norm|layernorm)\.weight$", name) or name.endswith(("scale",)):
                normal(t, 0.1, mean=1.0)
            elif name.endswith("embed_tokens.weight"):
                normal(t, 1.0)
            elif name == "lm_head.weight":
                # Logits of std ~3: clear greedy choices, which a comparison can check.
                normal(t, 3.0 / math.sqrt(t.shape[-1]))
            elif name.endswith(("sinks", "position_bias", "base", "e_score_correction_bias")):
                normal(t, 0.5)
            elif t.dim() >= 2:
                normal(t, 1.0 / math.sqrt(t.shape[-1]))
            else:
                normal(t, 0.1)


# DeepSeek-V4's special tokens, spelled as deepseek-recipe's SpecialTokens spells them by default.
# sglang serves DSV4 chat through deepseek-recipe, which refuses a tokenizer without them.
DEEPSEEK_BOS, DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
DEEPSEEK_SPECIALS = [
    "<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
    "<｜latest_reminder｜>", "｜DSML｜", "<｜image｜>", "<｜ref｜>",
    "<｜/ref｜>", "<｜box｜>", "<｜/box｜>", "<｜point｜>",
    "<｜/point｜>", "<｜polygon｜>", "<｜/polygon｜>",
]  # fmt: skip


def with_deepseek_specials(tokenizer):
    """`tokenizer` (a transformers fast tokenizer) with DeepSeek's BOS/EOS and special tokens
    added; BOS and EOS become DeepSeek's."""
    tokenizer.add_special_tokens(
        {
            "bos_token": DEEPSEEK_BOS,
            "eos_token": DEEPSEEK_EOS,
            "additional_special_tokens": DEEPSEEK_SPECIALS,
        }
    )
    return tokenizer


def make(out: Path, shape: Shape, tokenizer) -> list[str]:
    """Write the model and `tokenizer` (a transformers tokenizer) to `out`; returns the
    checkpoint's tensor names."""
    import tempfile

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    shape.check()
    tokenizer = with_deepseek_specials(tokenizer)
    cfg = config(shape, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    torch.manual_seed(shape.seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg))
    _fill(model, shape.seed)
    model = model.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tensors = {}
        for file in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    tensors[checkpoint_name(key)] = f.get_tensor(key)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return sorted(tensors)
