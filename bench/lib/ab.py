"""A/B at fixed concurrency: alternate arms over trials, record every request, report deltas."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.lib import arms as arms_mod
from bench.lib import router_counters
from bench.lib.client import add_api_key_arg, first_model_id
from bench.lib.load import LoadSpec, run_load
from bench.lib.metrics import summarize_run
from bench.lib.report import render
from launch.pdlib import router_args

RESULTS = Path(__file__).resolve().parent.parent / "results"


@dataclass(frozen=True)
class Plan:
    concurrency: list[int]
    trials: int
    requests_per_c: int
    input_words: int
    output_tokens: int
    seed: int
    warmup: int
    request_timeout_s: float
    max_error_rate: float
    fresh_connections: bool = False
    max_router_diff_rate: float = 0.0


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _router_counts(arm, before: dict[str, float] | None, error: str | None) -> dict[str, Any]:
    """The run's router decisions: the counters' difference over the measured window."""
    if arm.metrics_url is None:
        return {"required": False, "read": False, "detail": "router metrics URL not given"}
    record: dict[str, Any] = {"required": True, "read": False, "url": arm.metrics_url}
    if error is None:
        try:
            after = router_counters.scrape(arm.metrics_url)
        except router_counters.CountersError as exc:
            error = str(exc)
        else:
            record.update(router_counters.delta(before or {}, after), read=True)
    if error is not None:
        record["detail"] = f"not read: {error}"
    record["flags"] = router_counters.flags(record)
    return record


def _scrape_before(arm) -> tuple[dict[str, float] | None, str | None]:
    if arm.metrics_url is None:
        return None, None
    try:
        return router_counters.scrape(arm.metrics_url), None
    except router_counters.CountersError as exc:
        return None, str(exc)


def check_router_settings(arm_a, arm_b) -> dict[str, Any] | None:
    """Both arms' routers as they would start: a routing setting that differs stops the A/B
    before anything is started (the knob must be the only difference)."""
    a, b = arm_a.planned_router_settings(), arm_b.planned_router_settings()
    differences = router_args.settings_differences(a, b)
    if differences:
        raise arms_mod.ArmError(
            "the arms' routers would run with different routing settings, so the A/B would "
            "not measure the knob alone: " + "; ".join(differences)
        )
    return None if a is None else {"source": a["source"], "settings": a["settings"]}


def _scrubbed(value: Any, redact) -> Any:
    """value with redact applied to every string in it."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _scrubbed(v, redact) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrubbed(v, redact) for v in value]
    return value


async def _warm_up(url: str, model: str, plan: Plan, api_key: str) -> None:
    if plan.warmup:
        spec = LoadSpec(
            min(plan.warmup, 8),
            plan.warmup,
            plan.input_words,
            plan.output_tokens,
            plan.seed + 1,
            plan.request_timeout_s,
        )
        await run_load(url, model, spec, api_key=api_key)


def run_ab(
    plan: Plan, arm_a: arms_mod.Arm, arm_b: arms_mod.Arm, out_dir: Path, progress: bool
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "schema": 1,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {
            "mode": arm_a.mode,
            "arms": {"A": arm_a.describe(), "B": arm_b.describe()},
            "concurrency": plan.concurrency,
            "trials": plan.trials,
            "requests_per_c": f"{plan.requests_per_c} x C",
            "input_words": plan.input_words,
            "output_tokens": plan.output_tokens,
            "seed": plan.seed,
            "warmup": plan.warmup,
            "request_timeout_s": plan.request_timeout_s,
            "max_error_rate": plan.max_error_rate,
            "fresh_connections": plan.fresh_connections,
            "max_router_diff_rate": plan.max_router_diff_rate,
        },
        "router_settings": {"A": {}, "B": {}},
        "runs": [],
    }
    summary["router_settings_planned"] = check_router_settings(arm_a, arm_b)
    total = plan.trials * 2 * sum(plan.requests_per_c * c for c in plan.concurrency)
    bar = _progress(total, progress)
    raw = (out_dir / "requests.jsonl").open("w")
    try:
        for trial in range(1, plan.trials + 1):
            for arm in (arm_a, arm_b):
                bar.set_description(f"trial {trial} arm {arm.name}: preparing")
                knob = arm.prepare(trial)
                summary["router_settings"][arm.name][str(trial)] = arm.router_settings()
                try:
                    model = asyncio.run(
                        first_model_id(arm.url, plan.request_timeout_s, arm.api_key)
                    )
                except (TimeoutError, aiohttp.ClientError, OSError, RuntimeError) as exc:
                    raise arms_mod.ArmError(
                        f"arm {arm.name}: {arm.url} lists no model: {arm.redact(str(exc))}"
                    ) from exc
                asyncio.run(_warm_up(arm.url, model, plan, arm.api_key))
                for c in plan.concurrency:
                    bar.set_description(f"trial {trial} arm {arm.name} C{c}")
                    spec = LoadSpec(
                        c,
                        plan.requests_per_c * c,
                        plan.input_words,
                        plan.output_tokens,
                        plan.seed,
                        plan.request_timeout_s,
                        plan.fresh_connections,
                    )
                    before, error = _scrape_before(arm)
                    outputs, duration = asyncio.run(
                        run_load(
                            arm.url,
                            model,
                            spec,
                            on_done=lambda _o: bar.update(1),
                            api_key=arm.api_key,
                        )
                    )
                    records = [o.to_json() for o in outputs]
                    for index, record in enumerate(records):
                        tags = {"arm": arm.name, "trial": trial, "concurrency": c, "index": index}
                        raw.write(json.dumps({**tags, **record}) + "\n")
                    raw.flush()
                    run = {"arm": arm.name, "trial": trial, "concurrency": c, "knob": knob}
                    # Whether a key was sent, never the key.
                    run["api_key_sent"] = bool(arm.api_key)
                    run.update(summarize_run(records, duration))
                    run["router"] = _router_counts(arm, before, error)
                    summary["runs"].append(run)
                    # Written after every run so an interrupted A/B still leaves its evidence, with
                    # no secret of either arm in any string of it.
                    redact = arms_mod.redactor(arm_a, arm_b)
                    (out_dir / "summary.json").write_text(
                        json.dumps(_scrubbed(summary, redact), indent=2) + "\n"
                    )
    finally:
        raw.close()
        bar.close()
    return summary


def _concurrency_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"wants comma-separated whole numbers >= 1, got {text!r}")
    return values


def _at_least(minimum: int):
    def parse(text: str) -> int:
        if not text.lstrip("-").isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"wants a whole number >= {minimum}, got {text!r}")
        return int(text)

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench/ab",
        description="A/B two stack configurations at fixed concurrency. With --a/--b each trial "
        "applies the arm's env overlay, co-restarts the stack through launch/pd and verifies the "
        "overlay is live in the decode process; with --url-a/--url-b it compares two stacks that "
        "are already running. Arms alternate A B A B ... Results go to bench/results/<timestamp>/.",
    )
    arm = parser.add_argument_group("arms (either --a/--b or --url-a/--url-b)")
    arm.add_argument("--a", type=Path, help="env overlay of arm A (e.g. env/ab/A.env)")
    arm.add_argument("--b", type=Path, help="env overlay of arm B (e.g. env/ab/B.env)")
    arm.add_argument(
        "--env-dir",
        type=Path,
        default=Path("env"),
        help="base env directory the overlays apply to, and where the API key is read "
        "from (default: env)",
    )
    arm.add_argument("--sim", action="store_true", help="co-restart the simulated stack")
    arm.add_argument("--url-a", help="URL of an already running stack for arm A")
    arm.add_argument("--url-b", help="URL of an already running stack for arm B")
    parser.add_argument(
        "--concurrency",
        type=_concurrency_list,
        default=[64, 80, 96],
        help="comma-separated concurrency levels (default: 64,80,96)",
    )
    parser.add_argument(
        "--trials",
        type=_at_least(1),
        default=3,
        help="trials per arm; 2 or more for a confidence interval (default: 3)",
    )
    parser.add_argument(
        "--requests-per-c",
        type=_at_least(1),
        default=4,
        help="requests per run = this x C (default: 4)",
    )
    parser.add_argument(
        "--input-words",
        type=_at_least(1),
        default=512,
        help="words per seeded prompt (default: 512)",
    )
    parser.add_argument(
        "--output-tokens",
        type=_at_least(1),
        default=256,
        help="max_tokens with ignore_eos (default: 256)",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    parser.add_argument(
        "--warmup",
        type=_at_least(0),
        default=8,
        help="unrecorded requests per arm and trial before the runs (default: 8)",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="a request not done by then counts as an error (default: 600)",
    )
    parser.add_argument(
        "--max-error-rate",
        type=float,
        default=0.0,
        help="a run with a higher error fraction refuses its delta (default: 0)",
    )
    parser.add_argument(
        "--fresh-connections",
        action="store_true",
        help="a new connection per request, as sglang.bench_serving does (default: keep-alive)",
    )
    parser.add_argument(
        "--max-router-diff-rate",
        type=float,
        default=0.0,
        help="refuse the delta at a C when the arms' router sheds, or their router retries, "
        "differ by more than this fraction of the requests at that C (default: 0, any "
        "difference refuses)",
    )
    arm.add_argument(
        "--router-metrics-a",
        help="with --url-a: the router's Prometheus /metrics URL, so its counters are recorded "
        "(env arms read ROUTER_PROMETHEUS_PORT from their env)",
    )
    arm.add_argument("--router-metrics-b", help="with --url-b: as --router-metrics-a")
    parser.add_argument(
        "--out", type=Path, help="results directory (default: bench/results/<UTC timestamp>)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_api_key_arg(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.request_timeout_s <= 0:
        parser.error("--request-timeout-s must be > 0")
    if not 0 <= args.max_error_rate <= 1:
        parser.error("--max-error-rate must be within 0..1")
    if not 0 <= args.max_router_diff_rate <= 1:
        parser.error("--max-router-diff-rate must be within 0..1")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = args.out or RESULTS / stamp
    args.out_work = out_dir
    try:
        arm_a, arm_b = arms_mod.arms_from_args(args)
    except arms_mod.ArmError as exc:
        parser.error(str(exc))
    plan = Plan(
        args.concurrency,
        args.trials,
        args.requests_per_c,
        args.input_words,
        args.output_tokens,
        args.seed,
        args.warmup,
        args.request_timeout_s,
        args.max_error_rate,
        args.fresh_connections,
        args.max_router_diff_rate,
    )
    try:
        run_ab(plan, arm_a, arm_b, out_dir, progress=not args.no_progress)
    except arms_mod.ArmError as exc:
        print(f"bench/ab: {arms_mod.redactor(arm_a, arm_b)(str(exc))}", file=sys.stderr)
        if (out_dir / "summary.json").exists():
            print(render(out_dir), end="")
        print(f"bench/ab: stopped; partial results in {out_dir}", file=sys.stderr)
        return 1
    print(render(out_dir), end="")
    print(f"bench/ab: results in {out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
