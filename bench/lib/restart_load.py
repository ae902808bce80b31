"""Failed requests and wall time of a restart command run under closed-loop load.

C requests stay in flight through the stack's router from before the command starts until it
ends; then the requests in flight finish and are counted too. Both the load and the command are
bounded: at most --max-requests requests, each at most --request-timeout-s, and the command at
most --command-timeout-s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.lib.client import first_model_id, resolve_api_key
from bench.lib.load import LoadSpec, run_load

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RestartUnderLoad:
    command: list[str]
    returncode: int
    command_s: float
    output: str
    sent: int
    failed: int
    errors: list[str]
    # From the first failed request's start to the last one's end: how long clients saw errors.
    failing_s: float

    def summary(self) -> dict:
        return {
            "command": " ".join(self.command),
            "returncode": self.returncode,
            "command_s": round(self.command_s, 2),
            "requests": self.sent,
            "failed": self.failed,
            "failing_s": round(self.failing_s, 2),
            "first_errors": self.errors[:5],
        }


async def restart_under_load(
    url: str,
    command: list[str],
    concurrency: int,
    api_key: str = "",
    max_requests: int = 100_000,
    request_timeout_s: float = 60.0,
    command_timeout_s: float = 900.0,
    output_tokens: int = 32,
    warmup_s: float = 1.0,
) -> RestartUnderLoad:
    model = await first_model_id(url, 10.0, api_key)
    spec = LoadSpec(concurrency, max_requests, 32, output_tokens, 0, request_timeout_s)
    done = asyncio.Event()
    load = asyncio.create_task(run_load(url, model, spec, api_key=api_key, until=done.is_set))
    await asyncio.sleep(warmup_s)
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *command, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), command_timeout_s)
    except TimeoutError:
        proc.kill()
        output, _ = await proc.communicate()
        output += f"\n(killed after {command_timeout_s:g} s)".encode()
    command_s = time.perf_counter() - started
    done.set()
    outputs, _ = await load
    failed = [o for o in outputs if not o.success]
    return RestartUnderLoad(
        command=command,
        returncode=proc.returncode if proc.returncode is not None else -1,
        command_s=command_s,
        output=output.decode(errors="replace"),
        sent=len(outputs),
        failed=len(failed),
        errors=[o.error for o in failed],
        failing_s=(
            max(o.start_time + o.latency_s for o in failed) - min(o.start_time for o in failed)
            if failed
            else 0.0
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/restart_load",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--env-dir",
        type=Path,
        default=argparse.SUPPRESS,
        help="the stack's env dir (default: this checkout's env/)",
    )
    parser.add_argument("--sim", action="store_true", help="pass --sim to launch/pd")
    parser.add_argument(
        "--verb",
        action="append",
        dest="verbs",
        metavar="'VERB [ARGS]'",
        help="launch/pd command to run under load, e.g. 'co-restart' or 'rolling-restart "
        "decode'; repeat to run several one after the other (default: co-restart)",
        default=argparse.SUPPRESS,
    )
    parser.add_argument("--concurrency", type=int, default=16, help="requests kept in flight")
    parser.add_argument("--output-tokens", type=int, default=32, help="max_tokens per request")
    parser.add_argument(
        "--request-timeout-s", type=float, default=60.0, help="seconds one request may take"
    )
    parser.add_argument(
        "--max-requests", type=int, default=100_000, help="requests sent at most, in all"
    )
    parser.add_argument(
        "--command-timeout-s", type=float, default=900.0, help="seconds each command may take"
    )
    parser.add_argument(
        "--api-key", default=argparse.SUPPRESS, help="Bearer key (default: API_KEY of --env-dir)"
    )
    args = parser.parse_args(argv)
    args.env_dir = getattr(args, "env_dir", ROOT / "env")
    for name in ("concurrency", "output_tokens", "max_requests"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not (args.env_dir / "router.env").is_file():
        parser.error(f"--env-dir {args.env_dir}: no router.env there")
    from launch.pdlib.stack import load_stack

    stack = load_stack(args.env_dir, args.sim)
    url = stack.role("router").url
    api_key = resolve_api_key(getattr(args, "api_key", None), args.env_dir)
    rc = 0
    for verb in getattr(args, "verbs", None) or ["co-restart"]:
        command = [str(ROOT / "launch" / "pd"), *verb.split(), "--env-dir", str(args.env_dir)]
        command += ["--sim"] if args.sim else []
        print(f"running `launch/pd {verb}` under C={args.concurrency} load ...", flush=True)
        result = asyncio.run(
            restart_under_load(
                url,
                command,
                args.concurrency,
                api_key,
                args.max_requests,
                args.request_timeout_s,
                args.command_timeout_s,
                args.output_tokens,
            )
        )
        print(json.dumps({"verb": verb, **result.summary()}), flush=True)
        if result.returncode != 0:
            print(result.output[-3000:], file=sys.stderr)
            rc = 1
    return rc
