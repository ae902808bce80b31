#!/usr/bin/env python3
"""Make the tiny random-weight Llama that env/cpu serves with real sglang engines on a CPU.

Nothing is downloaded: a byte-level BPE tokenizer is trained here on a generated word corpus,
a chat template is attached, and a 2-layer Llama (hidden 128, 4 heads, the tokenizer's
vocabulary) gets seeded random weights in bfloat16. The same command gives the same files.
The model is written to $SM120PD_CACHE/tiny-llama (default ~/.cache/sm120pd/tiny-llama) and
build/tiny-llama in the repository links to it (env/cpu's MODEL_PATH). An existing model of
this recipe is reused.
"""

import argparse
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = 1  # bump when the files below change
WORDS = (
    "the quick brown fox jumps over lazy dog prefill decode router engine token cache kernel "
    "split head block tile wave memory page index request answer question hello world one two "
    "three four five six seven eight nine ten"
).split()
SPECIALS = ["<|begin|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def default_out() -> Path:
    cache = os.environ.get("SM120PD_CACHE") or Path.home() / ".cache" / "sm120pd"
    return Path(cache) / "tiny-llama"


def make(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(2000)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1]
    )
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "sm120pd_recipe.json").write_text(json.dumps({"recipe": RECIPE}) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__)
    p.add_argument("--out", type=Path, default=default_out(), help="(default: %(default)s)")
    p.add_argument("--force", action="store_true", help="remake it even if it exists")
    args = p.parse_args(argv)
    marker = args.out / "sm120pd_recipe.json"
    fresh = (
        args.force or not marker.is_file() or json.loads(marker.read_text()) != {"recipe": RECIPE}
    )
    if fresh:
        print(f"make_tiny_model: writing {args.out}", flush=True)
        make(args.out)
    else:
        print(f"make_tiny_model: {args.out} is up to date")
    link = ROOT / "build" / "tiny-llama"
    link.parent.mkdir(exist_ok=True)
    if link.is_symlink() or link.exists():
        if link.resolve() != args.out.resolve():
            link.unlink()
    if not link.is_symlink():
        link.symlink_to(args.out.resolve())
    print(f"make_tiny_model: {link.relative_to(ROOT)} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
