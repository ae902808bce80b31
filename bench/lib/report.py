"""A/B report from summary.json: per-concurrency comparison, Markdown table and PNG plots."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from bench.lib import router_counters
from bench.lib.stats import paired_delta_pct, verdict
from launch.pdlib.router_args import settings_differences

REFUSED = "refused"


def _trial_runs(summary: dict[str, Any], arm: str, c: int) -> list[dict[str, Any]]:
    runs = [r for r in summary["runs"] if r["arm"] == arm and r["concurrency"] == c]
    return sorted(runs, key=lambda r: r["trial"])


def refusal_reasons(summary: dict[str, Any], c: int) -> list[str]:
    """Why the delta at concurrency c must not be printed; empty when the evidence is complete."""
    cfg = summary["config"]
    reasons = []
    max_rate = float(cfg["max_error_rate"])
    for arm in ("A", "B"):
        runs = _trial_runs(summary, arm, c)
        if len(runs) < cfg["trials"]:
            reasons.append(f"arm {arm} has {len(runs)} of {cfg['trials']} trials at C{c}")
        for r in runs:
            if r["error_rate"] > max_rate:
                reasons.append(
                    f"arm {arm} trial {r['trial']} at C{c}: {r['errors']} of {r['requests']} "
                    f"requests failed ({r['error_rate']:.1%} > {max_rate:.1%})"
                )
            knob = r.get("knob") or {}
            if knob.get("required") and not knob.get("verified"):
                reasons.append(
                    f"arm {arm} trial {r['trial']}: knob not verified live in the decode process"
                    f" ({knob.get('detail') or 'no verification recorded'})"
                )
    reasons += _router_reasons(summary, c)
    if min(len(_trial_runs(summary, a, c)) for a in ("A", "B")) < 2 and not reasons:
        reasons.append(f"fewer than 2 trials per arm at C{c}: no confidence interval")
    return reasons


def _router_reasons(summary: dict[str, Any], c: int) -> list[str]:
    """The router's part of the evidence at C: it ran with the same settings in both arms of
    each trial, its counters were read where they could be, and the arms' sheds and retries
    differ by no more than the stated bound (an arm that shed or retried more did other work)."""
    reasons = []
    settings = summary.get("router_settings") or {}
    for trial in sorted(set(settings.get("A", {})) & set(settings.get("B", {})), key=int):
        a, b = settings["A"][trial], settings["B"][trial]
        differences = settings_differences(a, b)
        if differences:
            reasons.append(
                f"trial {trial}: the arms' routers ran with different routing settings "
                f"({'; '.join(differences)})"
            )
    totals = {}
    for arm in ("A", "B"):
        runs = _trial_runs(summary, arm, c)
        for r in runs:
            router = r.get("router") or {}
            if router.get("required") and not router.get("read"):
                reasons.append(
                    f"arm {arm} trial {r['trial']} at C{c}: router counters "
                    f"{router.get('detail', 'not read')}"
                )
            if router.get("reset"):
                reasons.append(
                    f"arm {arm} trial {r['trial']} at C{c}: the router restarted during the run "
                    "(its counters went down), so its decisions are unknown"
                )
        read = [r["router"] for r in runs if (r.get("router") or {}).get("read")]
        totals[arm] = (
            sum(router_counters.sheds(x) for x in read),
            sum(router_counters.retries(x) for x in read),
            sum(r["requests"] for r in runs),
        )
    bound = float(summary["config"].get("max_router_diff_rate", 0.0))
    requests = max(totals["A"][2], totals["B"][2], 1)
    for what, i in (("sheds", 0), ("retries", 1)):
        a, b = totals["A"][i], totals["B"][i]
        if abs(a - b) / requests > bound:
            reasons.append(
                f"router {what} at C{c}: A {a}, B {b} over {requests} requests per arm, a "
                f"difference of {abs(a - b) / requests:.2%} > the bound {bound:.2%} "
                f"(--max-router-diff-rate): the router took different decisions in the two "
                "arms, so the throughput delta is not the knob's alone"
            )
    return reasons


def compare(summary: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for c in summary["config"]["concurrency"]:
        a = _trial_runs(summary, "A", c)
        b = _trial_runs(summary, "B", c)
        row: dict[str, Any] = {
            "concurrency": c,
            "a_tok_s": [r["output_tok_s"] for r in a],
            "b_tok_s": [r["output_tok_s"] for r in b],
            "a_tpot_ms": [r["tpot_mean_s"] * 1000 for r in a],
            "b_tpot_ms": [r["tpot_mean_s"] * 1000 for r in b],
            "a_errors": sum(r["errors"] for r in a),
            "b_errors": sum(r["errors"] for r in b),
            "a_requests": sum(r["requests"] for r in a),
            "b_requests": sum(r["requests"] for r in b),
            "refusals": refusal_reasons(summary, c),
            "delta": None,
            "verdict": REFUSED,
        }
        if not row["refusals"]:
            try:
                d = paired_delta_pct(row["a_tok_s"], row["b_tok_s"])
            except ValueError as exc:
                row["refusals"].append(str(exc))
            else:
                row["delta"] = {
                    "mean_pct": d.mean_pct,
                    "ci_low_pct": d.ci_low_pct,
                    "ci_high_pct": d.ci_high_pct,
                    "trials": d.trials,
                }
                row["verdict"] = verdict(d)
        rows.append(row)
    return rows


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    m = sum(values) / len(values)
    if len(values) < 2:
        return f"{m:.1f} (n=1)"
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    return f"{m:.1f} ± {sd:.1f} (n={len(values)})"


def render_markdown(summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    cfg = summary["config"]
    lines = [
        "# A/B report",
        "",
        f"- A: {cfg['arms']['A']}",
        f"- B: {cfg['arms']['B']}",
        f"- mode: {cfg['mode']}; trials per arm: {cfg['trials']} (alternating A B A B ...)",
        f"- load: streaming chat, {cfg['requests_per_c']} requests per C at exactly C in flight, "
        f"{cfg['input_words']} input words, {cfg['output_tokens']} output tokens (ignore_eos), "
        f"seed {cfg['seed']}",
        f"- delta = (B - A) / A of output tok/s per trial pair; 95% CI from the trials; "
        f"max error rate {float(cfg['max_error_rate']):.1%}",
    ]
    if cfg["mode"] == "urls":
        lines.append(
            "- the arms are stacks that were already running: no knob was applied or verified"
        )
    lines += [
        "",
        "| C | A output tok/s | B output tok/s | delta % | 95% CI of delta | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["delta"] is None:
            delta, ci = "refused", "refused"
        else:
            d = row["delta"]
            delta = f"{d['mean_pct']:+.2f}"
            ci = f"[{d['ci_low_pct']:+.2f}, {d['ci_high_pct']:+.2f}]"
        lines.append(
            f"| {row['concurrency']} | {_mean_sd(row['a_tok_s'])} | {_mean_sd(row['b_tok_s'])} "
            f"| {delta} | {ci} | {row['verdict']} |"
        )
    lines += [
        "",
        "| C | A TPOT ms | B TPOT ms | A errors | B errors |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['concurrency']} | {_mean_sd(row['a_tpot_ms'])} | {_mean_sd(row['b_tpot_ms'])}"
            f" | {row['a_errors']}/{row['a_requests']} | {row['b_errors']}/{row['b_requests']} |"
        )
    refused = [r for r in rows if r["refusals"]]
    if refused:
        lines += ["", "## Deltas refused (incomplete evidence)", ""]
        for row in refused:
            for reason in row["refusals"]:
                lines.append(f"- C{row['concurrency']}: {reason}")
    lines += _router_section(summary)
    knob_lines = sorted(
        {
            f"- arm {r['arm']} trial {r['trial']}: {r['knob'].get('detail', '')}"
            for r in summary["runs"]
            if r.get("knob") and r["knob"].get("required")
        }
    )
    if knob_lines:
        lines += ["", "## Knob verification per trial", "", *knob_lines]
    return "\n".join(lines) + "\n"


ROUTER_COLUMNS = (
    ("admission_waits", "adm. waits"),
    ("admission_sheds", "adm. sheds"),
    ("overload_sheds", "overload sheds"),
    ("overload_fallbacks", "overload fallbacks"),
    ("retries", "retries"),
    ("retries_exhausted", "retries exhausted"),
    ("cb_transitions", "CB transitions"),
    ("router_errors", "router errors"),
    (router_counters.HTTP_ERRORS, "4xx/5xx"),
)


def _router_section(summary: dict[str, Any]) -> list[str]:
    runs = summary["runs"]
    read = [r for r in runs if (r.get("router") or {}).get("read")]
    lines = ["", "## Router decisions per run (smg counters over the measured window)", ""]
    if not read:
        unread = {(r.get("router") or {}).get("detail") for r in runs} - {None}
        detail = "; ".join(sorted(unread)) or "not recorded by this version of bench/ab"
        return lines + [f"- router counters not read: {detail}"]
    lines += [
        "| C | arm | trial | " + " | ".join(label for _, label in ROUTER_COLUMNS) + " |",
        "|---|---|---|" + "---|" * len(ROUTER_COLUMNS),
    ]
    for r in sorted(read, key=lambda r: (r["concurrency"], r["trial"], r["arm"])):
        counts = r["router"]["counts"]
        cells = " | ".join(str(counts.get(key, 0)) for key, _ in ROUTER_COLUMNS)
        lines.append(f"| {r['concurrency']} | {r['arm']} | {r['trial']} | {cells} |")
    flagged = [r for r in runs if (r.get("router") or {}).get("flags")]
    if flagged:
        lines += ["", "### Runs in which the router shed, retried or tripped", ""]
        for r in flagged:
            lines.append(
                f"- arm {r['arm']} trial {r['trial']} C{r['concurrency']}: "
                + "; ".join(r["router"]["flags"])
            )
    planned = summary.get("router_settings_planned")
    if planned:
        lines += [
            "",
            f"Both arms' routers: the same routing settings ({planned['source']}, read with "
            "smg's parser), checked again per trial from each router's command line.",
        ]
    return lines


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, label, name in (
        ("tok_s", "output tok/s", "throughput.png"),
        ("tpot_ms", "TPOT mean (ms)", "tpot.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm, offset, color in (("a", -0.15, "tab:blue"), ("b", 0.15, "tab:orange")):
            xs, ys, means = [], [], []
            for i, row in enumerate(rows):
                vals = [v for v in row[f"{arm}_{key}"] if not math.isnan(v)]
                xs += [i + offset] * len(vals)
                ys += vals
                means.append(sum(vals) / len(vals) if vals else math.nan)
            ax.scatter(xs, ys, color=color, alpha=0.5, s=18)
            ax.plot(
                [i + offset for i in range(len(rows))],
                means,
                "o-",
                color=color,
                label=f"{arm.upper()} (mean; dots are trials)",
            )
        ax.set_xticks(range(len(rows)), [f"C{r['concurrency']}" for r in rows])
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs concurrency, A beside B")
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def render(out_dir: Path) -> str:
    summary = json.loads((out_dir / "summary.json").read_text())
    rows = compare(summary)
    text = render_markdown(summary, rows)
    (out_dir / "report.md").write_text(text)
    (out_dir / "comparison.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, out_dir)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/report",
        description="Re-render report.md, comparison.json, throughput.png and tpot.png from a "
        "bench/ab results directory's summary.json.",
    )
    parser.add_argument("dir", type=Path, help="results directory written by bench/ab")
    args = parser.parse_args(argv)
    if not (args.dir / "summary.json").is_file():
        parser.error(f"{args.dir}: no summary.json here (is it a bench/ab results directory?)")
    print(render(args.dir), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
