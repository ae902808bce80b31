#!/usr/bin/env python3
"""Run sglang.bench_serving and our load generator against the same server, same load.

Prints both runs' output tok/s and request/s and their ratio: the check that our client reports
what the tool SGLang users trust reports. bench_serving needs a HF tokenizer and imports the HF
`datasets` package at start; with no hub access this script builds a word-level tokenizer in a
temporary directory and puts a `datasets` stand-in on bench_serving's path (only its MMMU and
LongBench loaders use it, never the random-ids dataset run here).
"""

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.lib.client import first_model_id  # noqa: E402
from bench.lib.load import LoadSpec, run_load  # noqa: E402
from bench.lib.metrics import summarize_run  # noqa: E402


def build_word_tokenizer(dest: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"t{i}": i + 1 for i in range(4000)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(dest)


def run_bench_serving(url: str, model: str, args: argparse.Namespace, work: Path) -> dict:
    stub = work / "stub" / "datasets"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        "def load_dataset(*a, **k):\n    raise RuntimeError('no dataset hub here')\n"
    )
    build_word_tokenizer(work / "tokenizer")
    out = work / "bench_serving.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "sglang.benchmark.serving",
        "--backend",
        "sglang-oai-chat",
        "--base-url",
        url,
        "--model",
        model,
        "--tokenizer",
        str(work / "tokenizer"),
        "--dataset-name",
        "random-ids",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_tokens),
        "--random-range-ratio",
        "1",
        "--num-prompts",
        str(args.requests),
        "--max-concurrency",
        str(args.concurrency),
        "--request-rate",
        "inf",
        "--warmup-requests",
        "1",
        "--disable-tqdm",
        "--output-file",
        str(out),
        "--ready-check-timeout-sec",
        "10",
    ]
    env = {**os.environ, "PYTHONPATH": str(work / "stub"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    if result.returncode != 0 or not out.exists():
        sys.exit(
            f"bench_serving failed ({result.returncode}):\n{result.stdout[-2000:]}\n"
            f"{result.stderr[-2000:]}"
        )
    return json.loads(out.read_text().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="OpenAI-compatible server (router or sim)")
    parser.add_argument("--concurrency", type=int, default=96, help="default: 96")
    parser.add_argument("--requests", type=int, default=384, help="default: 384 (4 x C96)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens/words (128)")
    parser.add_argument("--output-tokens", type=int, default=64, help="default: 64")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="default: 300")
    args = parser.parse_args()
    if min(args.concurrency, args.requests, args.input_len, args.output_tokens) < 1:
        parser.error("--concurrency, --requests, --input-len, --output-tokens must be >= 1")
    model = asyncio.run(first_model_id(args.url, 10))
    spec = LoadSpec(
        args.concurrency, args.requests, args.input_len, args.output_tokens, 0, args.timeout_s
    )
    asyncio.run(run_load(args.url, model, LoadSpec(8, 8, 16, 4, 1, args.timeout_s)))
    rows = []
    for fresh in (False, True):
        cpu0 = os.times()
        outputs, duration = asyncio.run(
            run_load(args.url, model, dataclasses.replace(spec, fresh_connections=fresh))
        )
        cpu = (os.times().user - cpu0.user) + (os.times().system - cpu0.system)
        ours = summarize_run([o.to_json() for o in outputs], duration)
        name = "ours, fresh connections" if fresh else "ours, keep-alive"
        rows.append((name, ours["output_tok_s"], ours["request_s"], ours["errors"]))
        tokens = max(ours["output_tokens"], 1)
        print(
            f"{name}: client CPU {cpu:.2f} s for {tokens} tokens = "
            f"{cpu / tokens * 1e6:.1f} us/token, {args.requests / duration:.1f} req/s"
        )
    with tempfile.TemporaryDirectory() as tmp:
        theirs = run_bench_serving(args.url, model, args, Path(tmp))
    rows.append(
        (
            "sglang.bench_serving",
            theirs["output_throughput"],
            theirs["request_throughput"],
            args.requests - theirs["completed"],
        )
    )
    print(
        f"load: C{args.concurrency}, {args.requests} requests, {args.input_len} in, "
        f"{args.output_tokens} out, {args.url}"
    )
    for name, tok_s, req_s, errors in rows:
        print(f"{name:22s} output {tok_s:10.1f} tok/s  {req_s:8.2f} req/s  errors {errors}")
    for name, tok_s, _req_s, _errors in rows[:2]:
        print(f"ratio {name} / bench_serving output tok/s: {tok_s / rows[2][1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
