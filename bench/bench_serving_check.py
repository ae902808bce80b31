#!/usr/bin/env python3
"""Run sglang.benchmark.serving and our load generator against the same server, same load.

sglang.benchmark.serving is the serving benchmark's name from sglang 0.5.23 (the release this
repository pins), where `python -m sglang.bench_serving` only warns and forwards to it; an
sglang without it is refused with one line (older releases are not supported).

Prints both runs' output tok/s, request/s and client CPU per output token, and their ratio: the
check that our client reports what the tool SGLang users trust reports, and that neither client
is the bottleneck. The server is --url, or with --sim a sim stack this script starts on loopback
(launch/pd up --sim: both sim engines behind the real smg router; every request goes through
the router). bench_serving needs a HF tokenizer and imports the HF `datasets` package at start;
with no hub access this script builds a word-level tokenizer in a temporary directory and puts a
`datasets` stand-in on bench_serving's path (only its MMMU and LongBench loaders use it, never
the random-ids dataset run here).
"""

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.entry import require  # noqa: E402

# Under .venv's Python when this one lacks psutil; else one line naming it, exit 2.
require("bench/bench_serving_check.py", "psutil", script=__file__)

import psutil  # noqa: E402

from bench.lib.client import add_api_key_arg, first_model_id, resolve_api_key  # noqa: E402
from bench.lib.load import LoadSpec, run_load  # noqa: E402
from bench.lib.metrics import summarize_run  # noqa: E402
from bench.lib.simstack import NEAR_ZERO, SimStackError, sim_stack  # noqa: E402

# bench_serving prints these around its measured run (after warm-up, before its metrics print).
BS_START = "Starting main benchmark run"
BS_RESULT = "Serving Benchmark Result"


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
        SERVING_MODULE,
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
    env = {
        **os.environ,
        "PYTHONPATH": str(work / "stub"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    # bench_serving sends $OPENAI_API_KEY as a Bearer token (and a bare $API_KEY without the
    # "Bearer " prefix, which no server here accepts): it gets exactly the key ours sends, through
    # its environment, never its command line.
    env.pop("API_KEY", None)
    env.pop("OPENAI_API_KEY", None)
    if args.api_key:
        env["OPENAI_API_KEY"] = args.api_key
    cpu = {}
    lines: list[str] = []
    # Its CPU time is read from the live process at the two markers, so its imports and
    # tokenizer loading are not counted against its per-token cost.
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as proc:
        watchdog = threading.Timer(args.timeout_s, proc.kill)
        watchdog.start()
        try:
            ps = psutil.Process(proc.pid)
            for line in proc.stdout:
                lines.append(line)
                for name, marker in (("start", BS_START), ("result", BS_RESULT)):
                    if marker in line and name not in cpu:
                        times = ps.cpu_times()
                        cpu[name] = times.user + times.system
            proc.wait()
        finally:
            watchdog.cancel()
    if proc.returncode != 0 or not out.exists():
        sys.exit(f"bench_serving failed ({proc.returncode}):\n{''.join(lines)[-4000:]}")
    result = json.loads(out.read_text().splitlines()[-1])
    result["client_cpu_s"] = cpu["result"] - cpu["start"] if len(cpu) == 2 else None
    return result


OURS_KEEP = "ours, keep-alive"
OURS_FRESH = "ours, fresh connections"
THEIRS = "sglang.benchmark.serving"
SERVING_MODULE = THEIRS
CLIENTS = (OURS_KEEP, OURS_FRESH, THEIRS)


@dataclasses.dataclass
class Run:
    client: str
    tok_s: float
    req_s: float
    errors: int
    tokens: int
    duration_s: float
    cpu_s: float | None

    @property
    def us_per_token(self) -> float | None:
        return None if self.cpu_s is None else self.cpu_s / max(self.tokens, 1) * 1e6

    @property
    def core_share(self) -> float | None:
        return None if self.cpu_s is None else self.cpu_s / self.duration_s

    def line(self) -> str:
        cpu = "client CPU not measured"
        if self.cpu_s is not None:
            cpu = (
                f"client CPU {self.cpu_s:.2f} s = {self.us_per_token:.1f} us/token, "
                f"{self.core_share:.0%} of one core"
            )
        return (
            f"{self.client:23s} {self.tok_s:9.1f} tok/s {self.req_s:7.1f} req/s "
            f"errors {self.errors}, {self.tokens} tokens in {self.duration_s:.2f} s, {cpu}"
        )


def _run_ours(url: str, model: str, spec: LoadSpec, fresh: bool, api_key: str) -> Run:
    cpu0 = time.process_time()
    outputs, duration = asyncio.run(
        run_load(url, model, dataclasses.replace(spec, fresh_connections=fresh), api_key=api_key)
    )
    cpu1 = time.process_time()
    ours = summarize_run([o.to_json() for o in outputs], duration)
    return Run(
        OURS_FRESH if fresh else OURS_KEEP,
        ours["output_tok_s"],
        ours["request_s"],
        ours["errors"],
        ours["output_tokens"],
        duration,
        cpu1 - cpu0,
    )


def _run_theirs(url: str, model: str, args: argparse.Namespace) -> Run:
    with tempfile.TemporaryDirectory() as tmp:
        theirs = run_bench_serving(url, model, args, Path(tmp))
    return Run(
        THEIRS,
        theirs["output_throughput"],
        theirs["request_throughput"],
        args.requests - theirs["completed"],
        int(theirs["total_output_tokens"]),
        float(theirs["duration"]),
        theirs["client_cpu_s"],
    )


def run_check(url: str, args: argparse.Namespace) -> dict[str, list[Run]]:
    """Every client `--repeat` times, the order rotating each round so drift hits all three."""
    model = asyncio.run(first_model_id(url, 10, args.api_key))
    spec = LoadSpec(
        args.concurrency, args.requests, args.input_len, args.output_tokens, 0, args.timeout_s
    )
    warm = asyncio.run(
        run_load(url, model, LoadSpec(8, 8, 16, 4, 1, args.timeout_s), api_key=args.api_key)
    )[0]
    if not all(o.success for o in warm):
        sys.exit(f"bench_serving_check: warm-up failed at {url}: {warm[0].error or 'no output'}")
    runs: dict[str, list[Run]] = {c: [] for c in CLIENTS}
    for rnd in range(args.repeat):
        for client in CLIENTS[rnd % 3 :] + CLIENTS[: rnd % 3]:
            if client == THEIRS:
                run = _run_theirs(url, model, args)
            else:
                run = _run_ours(url, model, spec, client == OURS_FRESH, args.api_key)
            runs[client].append(run)
            print(f"round {rnd + 1}: {run.line()}", flush=True)
    return runs


def _summary(runs: dict[str, list[Run]]) -> list[str]:
    def med(values: list[float | None]) -> str:
        known = [v for v in values if v is not None]
        if not known:
            return "n/a"
        text = f"{statistics.median(known):.1f}"
        return text + (f" ({min(known):.1f}-{max(known):.1f})" if len(known) > 1 else "")

    n = len(runs[THEIRS])
    lines = [f"median over {n} round(s) (min-max):" if n > 1 else "result:"]
    for client, rs in runs.items():
        lines.append(
            f"  {client:23s} output {med([r.tok_s for r in rs])} tok/s, "
            f"{med([r.req_s for r in rs])} req/s, client CPU "
            f"{med([r.us_per_token for r in rs])} us/token, "
            f"errors {sum(r.errors for r in rs)}"
        )
    theirs = statistics.median(r.tok_s for r in runs[THEIRS])
    for client in (OURS_KEEP, OURS_FRESH):
        ours = statistics.median(r.tok_s for r in runs[client])
        lines.append(f"ratio {client} / bench_serving output tok/s: {ours / theirs:.3f}")
    return lines


def _has_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="OpenAI-compatible server (router or engine)")
    target.add_argument(
        "--sim",
        action="store_true",
        help="start a sim stack on loopback (launch/pd up --sim on a copy of env/, real smg "
        "router) and measure through its router",
    )
    parser.add_argument(
        "--sim-step-s",
        type=float,
        default=0.0,
        help="with --sim: seconds per decode step; every other sim delay is 0 "
        "(default: 0, near-zero latency)",
    )
    parser.add_argument("--concurrency", type=int, default=96, help="default: 96")
    parser.add_argument("--requests", type=int, default=384, help="default: 384 (4 x C96)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens/words (128)")
    parser.add_argument("--output-tokens", type=int, default=64, help="default: 64")
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds of all three clients (default: 1)"
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="default: 300")
    add_api_key_arg(parser)
    args = parser.parse_args()
    # No env dir here: --api-key, else $API_KEY. With --sim the stack is started with that key.
    args.api_key = resolve_api_key(args.api_key)
    if min(args.concurrency, args.requests, args.input_len, args.output_tokens, args.repeat) < 1:
        parser.error(
            "--concurrency, --requests, --input-len, --output-tokens, --repeat must be >= 1"
        )
    if args.sim_step_s < 0:
        parser.error("--sim-step-s must be >= 0")
    if not _has_module(SERVING_MODULE):
        parser.error(
            f"this sglang has no {SERVING_MODULE} (sglang 0.5.23 and later have it; older "
            "releases, with only sglang.bench_serving, are not supported)"
        )
    if args.sim:
        timing = {**NEAR_ZERO, "PD_SIM_DECODE_STEP_BASE_S": str(args.sim_step_s)}
        try:
            with sim_stack(timing, api_key=args.api_key) as (stack, _env_dir):
                server = (
                    f"sim stack through the smg router at {stack.router_url} (decode step "
                    f"{args.sim_step_s:g} s, all other sim delays 0)"
                )
                print(f"server: {server}", flush=True)
                runs = run_check(stack.router_url, args)
        except SimStackError as exc:
            print(f"bench_serving_check: {exc}", file=sys.stderr)
            return 1
    else:
        server = args.url
        runs = run_check(args.url, args)
    print(
        f"load: C{args.concurrency}, {args.requests} requests, {args.input_len} in, "
        f"{args.output_tokens} out, {server}, API key {'sent' if args.api_key else 'none'}"
    )
    print("\n".join(_summary(runs)))
    return 0


if __name__ == "__main__":
    from tools.entry import call

    # A dependency main() imports and this Python lacks ends in one line naming it, exit 2.
    call("bench/bench_serving_check.py", main)
