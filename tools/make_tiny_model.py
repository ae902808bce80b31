#!/usr/bin/env python3
"""Make the tiny random-weight models that run without a GPU: a Llama, or a DeepSeek-V4.

Nothing is downloaded: a byte-level BPE tokenizer is trained here on a generated word corpus,
a chat template is attached, and the model gets seeded random weights in bfloat16. The same
command gives the same files, and an existing model of the same recipe and shape is reused.

  llama (the default): the 2-layer Llama (hidden 128, 4 heads) that env/cpu serves with real
      sglang engines. Written to $SM120PD_CACHE/tiny-llama (default
      ~/.cache/sm120pd/tiny-llama); build/tiny-llama links to it (env/cpu's MODEL_PATH).
  dsv4: a DeepSeek-V4 built with transformers' DeepseekV4ForCausalLM, in the checkpoint layout
      DeepSeek ships and sglang's loader reads (tools/tiny_dsv4.py). --standard swa|c4c128
      picks one of the two standard shapes; the options below change it. Written to
      $SM120PD_CACHE/NAME, NAME spelling the shape (tiny-dsv4-r0-4-128-h8-d256-s1), and
      linked from build/NAME.
"""

import argparse
import contextlib
import fcntl
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECIPE = 1  # bump when the Llama's files below change
DSV4_RECIPE = 5  # bump when tools/tiny_dsv4.py writes different files
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


def cache_dir() -> Path:
    return Path(os.environ.get("SM120PD_CACHE") or Path.home() / ".cache" / "sm120pd")


def default_out() -> Path:
    return cache_dir() / "tiny-llama"


def tokenizer():
    """The tiny byte-level BPE tokenizer with its chat template (the same every time)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    return fast


def make(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = tokenizer()
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


def _ratios(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: comma-separated integers, one per layer (e.g. 0,4,128)"
        ) from None


def _link(out: Path, name: str) -> None:
    link = ROOT / "build" / name
    link.parent.mkdir(exist_ok=True)
    if link.is_symlink() or link.exists():
        if link.resolve() != out.resolve():
            link.unlink()
    if not link.is_symlink():
        link.symlink_to(out.resolve())
    print(f"make_tiny_model: {link.relative_to(ROOT)} -> {out}")


@contextlib.contextmanager
def _locked(out: Path):
    """Hold an exclusive lock on `out`'s lock file (beside it) while it is checked, written and
    linked: two processes making the same model at once (parallel test workers) take turns,
    and the second finds it up to date instead of rewriting files the first is reading."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _fresh(marker: Path, want: dict, force: bool) -> bool:
    return force or not marker.is_file() or json.loads(marker.read_text()) != want


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="model", metavar="{llama,dsv4}")
    for name in ("llama", "dsv4"):
        q = sub.add_parser(name, help=f"the tiny {name} (see below)")
        q.add_argument("--out", type=Path, help="where to write it (default: see below)")
        q.add_argument("--force", action="store_true", help="remake it even if it exists")
    from tools import tiny_dsv4

    q = sub.choices["dsv4"]
    base = tiny_dsv4.STANDARD["c4c128"]
    q.add_argument(
        "--standard",
        choices=sorted(tiny_dsv4.STANDARD),
        default="c4c128",
        help="start from this standard shape (default: %(default)s)",
    )
    q.add_argument(
        "--compress-ratios",
        type=_ratios,
        help="one per layer, each 0, 4 or 128 (default: the standard's; c4c128: 0,4,128, swa: 0,0)",
    )
    q.add_argument("--heads", type=int, help=f"attention heads (default: {base.heads})")
    q.add_argument("--hidden", type=int, help=f"hidden size (default: {base.hidden})")
    q.add_argument("--experts", type=int, help=f"routed experts (default: {base.experts})")
    q.add_argument("--experts-per-token", type=int, help=f"(default: {base.experts_per_token})")
    q.add_argument(
        "--hash-layers",
        type=int,
        help=f"leading layers routed by the token-id hash (default: {base.hash_layers})",
    )
    q.add_argument("--seed", type=int, help=f"(default: {base.seed})")
    # No subcommand: the Llama, as before the DSV4 existed.
    if not argv or argv[0] not in sub.choices and argv[0] not in ("-h", "--help"):
        argv = ["llama", *argv]
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    if args.model == "dsv4":
        return main_dsv4(args)
    out = args.out or default_out()
    with _locked(out):
        if _fresh(out / "sm120pd_recipe.json", {"recipe": RECIPE}, args.force):
            print(f"make_tiny_model: writing {out}", flush=True)
            make(out)
        else:
            print(f"make_tiny_model: {out} is up to date")
        _link(out, "tiny-llama")
    return 0


def main_dsv4(args: argparse.Namespace) -> int:
    import dataclasses

    from tools import tiny_dsv4

    given = {
        "compress_ratios": args.compress_ratios,
        "heads": args.heads,
        "hidden": args.hidden,
        "experts": args.experts,
        "experts_per_token": args.experts_per_token,
        "hash_layers": args.hash_layers,
        "seed": args.seed,
    }
    shape = tiny_dsv4.STANDARD[args.standard]
    shape = dataclasses.replace(shape, **{k: v for k, v in given.items() if v is not None})
    if args.compress_ratios is not None and args.hash_layers is None:
        shape = dataclasses.replace(
            shape, hash_layers=min(shape.hash_layers, len(shape.compress_ratios))
        )
    try:
        shape.check()
    except ValueError as err:
        print(f"make_tiny_model: {err}", file=sys.stderr)
        return 2
    out = args.out or cache_dir() / shape.name
    want = {"recipe": DSV4_RECIPE, "shape": dataclasses.asdict(shape)}
    want["shape"]["compress_ratios"] = list(shape.compress_ratios)
    marker = out / "sm120pd_recipe.json"
    with _locked(out):
        if _fresh(marker, want, args.force):
            print(f"make_tiny_model: writing {out}", flush=True)
            marker.unlink(missing_ok=True)
            names = tiny_dsv4.make(out, shape, tokenizer())
            marker.write_text(json.dumps(want) + "\n")
            print(f"make_tiny_model: {len(names)} tensors, layers {list(shape.compress_ratios)}")
        else:
            print(f"make_tiny_model: {out} is up to date")
        if args.out is None:
            _link(out, shape.name)
    return 0


if __name__ == "__main__":
    from tools.entry import call

    # A dependency main() imports and this Python lacks ends in one line naming it, exit 2.
    call("tools/make_tiny_model.py", main)
