"""The microbench's numbers after the timing: ratios per point, the issue's targets as pass or
fail, and the compact record of a GPU run that goes into bench/kernel/results/.

Pure functions of the microbench's JSON (no torch, no device), so the CPU tests check them.
"""

import json
import re
import time

MMA_FAMILY = ("mma", "mma-main", "mma-padded")
COMPACT_LIMIT_BYTES = 200_000
COMPACT_SCHEMA = "sm120pd-kernel-results/1"
# Row columns of the compact record; times are the median, min and max of microseconds per call.
COMPACT_COLUMNS = (
    "backend",
    "target",
    "graph",
    "graph_min",
    "graph_max",
    "eager",
    "eager_min",
    "eager_max",
    "host",
    "host_min",
    "host_max",
    "splits",
    "grid",
    "over_gather",
    "frac_copy",
    "new_vs_main",
)


def _median(row: dict, kind: str) -> float | None:
    summary = row.get(f"{kind}_us")
    return summary["median"] if summary else None


def derive(rows: list[dict], copy_gbps: float) -> None:
    """Add each row's ratios against the other rows of its point (in place).

    kv_gbps and frac_copy: KV bytes read over the graph-replay time, and that over the run's
    copy bandwidth. over_gather: graph time over the gather's. speedup_vs_triton/torch: their
    time over this row's, from graph replay (``*_eager`` from eager times). auto_vs_best_fixed:
    ``auto`` over the best fixed target of the same backend. new_vs_main (and _host, _eager):
    ``mma`` over ``mma-main`` at the same target. native_vs_padded: ``mma-padded`` over ``mma``.
    """
    times = {
        kind: {(r["backend"], r["target_ctas"]): _median(r, kind) for r in rows}
        for kind in ("graph", "eager", "host")
    }
    graph = times["graph"]
    for r in rows:
        key = (r["backend"], r["target_ctas"])
        us = graph.get(key)
        if us:
            gbps = r["kv_bytes"] / (us * 1e-6) / 1e9
            r["kv_gbps"] = round(gbps, 1)
            r["frac_copy"] = round(gbps / copy_gbps, 4) if copy_gbps else None
            gather = graph.get(("gather", None))
            if gather and r["backend"] != "gather":
                r["over_gather"] = round(us / gather, 3)
        for upstream in ("triton", "torch"):
            if r["backend"] == upstream:
                continue
            for kind, suffix in (("graph", ""), ("eager", "_eager")):
                mine, theirs = times[kind].get(key), times[kind].get((upstream, None))
                if mine and theirs:
                    r[f"speedup_vs_{upstream}{suffix}"] = round(theirs / mine, 3)
        if r["backend"] in MMA_FAMILY and r["target_ctas"] == "auto" and us:
            fixed = [
                t
                for (backend, target), t in graph.items()
                if backend == r["backend"] and target not in (None, "auto") and t
            ]
            if fixed:
                r["auto_vs_best_fixed"] = round(us / min(fixed), 3)
        if r["backend"] == "mma":
            for kind, suffix in (("graph", ""), ("eager", "_eager"), ("host", "_host")):
                new, old = times[kind].get(key), times[kind].get(("mma-main", r["target_ctas"]))
                if new and old:
                    r[f"new_vs_main{suffix}"] = round(new / old, 3)
        if r["backend"] == "mma-padded" and us:
            native = graph.get(("mma", r["target_ctas"]))
            if native:
                r["native_vs_padded"] = round(us / native, 3)


# --- the targets ------------------------------------------------------------------------


def _where(r: dict) -> str:
    return f"B={r['batch']} H={r['heads']} swa={r['swa']} extra={r['extra']}"


def _verdict(text: str, measured: list[tuple[dict, float]], ok, unit: str = "") -> dict:
    """pass when every measured point satisfies ``ok``; the worst value and the failures."""
    if not measured:
        return {"target": text, "status": "not measured", "points": 0}
    failing = [(r, v) for r, v in measured if not ok(v)]
    values = [v for _, v in measured]
    verdict = {
        "target": text,
        "status": "fail" if failing else "pass",
        "points": len(measured),
        "range": [min(values), max(values)],
    }
    if failing:
        verdict["failing"] = [f"{_where(r)}: {v}{unit}" for r, v in failing[:8]]
        if len(failing) > 8:
            verdict["failing"].append(f"... {len(failing) - 8} more")
    return verdict


def target_verdicts(rows: list[dict]) -> list[dict]:
    """The issue's targets for the mma kernel at ``auto``, each pass, fail or not measured."""
    auto = [r for r in rows if r.get("backend") == "mma" and r.get("target_ctas") == "auto"]

    def values(field: str, pick=lambda r: True):
        return [(r, r[field]) for r in auto if pick(r) and r.get(field) is not None]

    def graph(pick):
        return [(r, r["graph_us"]["median"]) for r in auto if pick(r) and r.get("graph_us")]

    def host(r):
        return r["host_us"]["median"] if r.get("host_us") else None

    def is_b1(r):
        return (r["batch"], r["heads"], r["swa"], r["extra"]) == (1, 16, 128, 512)

    def is_large(r):
        return r["batch"] >= 64 and r["heads"] == 16

    def faster_than(upstream: str):
        measured = []
        for r in auto:
            value = r.get(f"speedup_vs_{upstream}", r.get(f"speedup_vs_{upstream}_eager"))
            if value is not None:
                measured.append((r, value))
        return measured

    return [
        _verdict(
            "B=1, 16 heads, SWA 128 + 512 extra: <= 15 us per call (graph replay)",
            graph(is_b1),
            lambda v: v <= 15.0,
            " us",
        ),
        _verdict(
            "B>=64, 16 heads: within 1.5x of the gather (graph time over the gather's)",
            values("over_gather", is_large),
            lambda v: v <= 1.5,
            "x",
        ),
        _verdict(
            "B>=64, 16 heads: >= 50% of copy bandwidth (KV bytes over graph time)",
            values("frac_copy", is_large),
            lambda v: v >= 0.5,
        ),
        _verdict(
            "auto within 5% of the best fixed target at every point (graph time ratio)",
            values("auto_vs_best_fixed"),
            lambda v: v <= 1.05,
            "x",
        ),
        _verdict(
            "eager host time <= 30 us per call at every point",
            [(r, host(r)) for r in auto if host(r) is not None],
            lambda v: v <= 30.0,
            " us",
        ),
        _verdict(
            "faster than main's kernel at every point (mma over mma-main, graph time)",
            values("new_vs_main"),
            lambda v: v < 1.0,
            "x",
        ),
        _verdict(
            "faster than upstream triton at every point (its time over mma's; graph replay, "
            "eager where it was not captured)",
            faster_than("triton"),
            lambda v: v > 1.0,
            "x",
        ),
        _verdict(
            "faster than upstream torch at every point (its time over mma's; graph replay, "
            "eager where it was not captured)",
            faster_than("torch"),
            lambda v: v > 1.0,
            "x",
        ),
    ]


def verdict_lines(verdicts: list[dict]) -> list[str]:
    lines = []
    for v in verdicts:
        status = {"pass": "PASS", "fail": "FAIL"}.get(v["status"], "----")
        detail = (
            v["status"]
            if v["status"] == "not measured"
            else (f"{v['points']} point(s), {v['range'][0]} to {v['range'][1]}")
        )
        lines.append(f"  {status}  {v['target']}: {detail}")
        lines += [f"          {f}" for f in v.get("failing", [])]
    return lines


# --- the compact record ------------------------------------------------------------------------


def _grid(row: dict) -> str | None:
    launches = row.get("launches")
    if not launches:
        return None
    return " ".join("x".join(str(n) for n in launch["grid"]) for launch in launches)


def _compact_row(row: dict, spreads: bool) -> list:
    def times(kind: str) -> list:
        summary = row.get(f"{kind}_us") or {}
        triple = [summary.get("median"), summary.get("min"), summary.get("max")]
        return [_round(v) for v in (triple if spreads else [triple[0], None, None])]

    return [
        row["backend"],
        row.get("target_ctas"),
        *times("graph"),
        *times("eager"),
        *times("host"),
        row.get("splits"),
        _grid(row),
        row.get("over_gather"),
        row.get("frac_copy"),
        row.get("new_vs_main"),
    ]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _points(rows: list[dict], drop: set[tuple], spreads: bool) -> list[dict]:
    points: dict[tuple, dict] = {}
    for r in rows:
        if (r["backend"], r.get("target_ctas")) in drop or r["backend"] in drop:
            continue
        key = (r["batch"], r["heads"], r["swa"], r["extra"])
        point = points.setdefault(
            key,
            {
                "batch": r["batch"],
                "heads": r["heads"],
                "swa": r["swa"],
                "extra": r["extra"],
                "kv_bytes": r.get("kv_bytes"),
                "phase": r.get("phase"),
                "rows": [],
            },
        )
        if "error" in r:
            continue
        point["rows"].append(_compact_row(r, spreads))
    # The points timed first (the targets) lead; the rest by shape.
    return sorted(
        points.values(),
        key=lambda p: (p["phase"] != "first", p["heads"], p["extra"], p["swa"], p["batch"]),
    )


def compact_record(bench: dict, session: dict | None = None) -> dict:
    """A GPU run in at most COMPACT_LIMIT_BYTES of JSON: what the perf plan's figures cite.

    ``bench`` is bench/kernel/microbench's JSON; ``session`` the GPU session's facts (kind,
    versions, kit, parts, correctness counts, audit mismatches, Nsight Compute summary), when
    the run was a session. Rows that do not fit are dropped in this order, each step named in
    ``trimmed``: mma-padded rows, the min and max spreads, the fixed-target rows of mma-main.
    """
    session = session or {}
    rows = bench.get("results", [])
    errors: dict[str, str] = {}
    for r in rows:
        if "error" in r:
            errors.setdefault(r["backend"], r["error"][:300])
    header_keys = (
        "device",
        "capability",
        "sms",
        "copy_gbps",
        "versions",
        "kit",
        "baseline",
        "method",
        "command",
        "time",
    )
    record = {
        "schema": COMPACT_SCHEMA,
        "kind": session.get("kind", "microbench"),
        **{k: bench.get(k) for k in header_keys if bench.get(k) is not None},
        **{k: v for k, v in session.items() if k != "kind" and v is not None},
        "targets": target_verdicts(rows),
        "columns": list(COMPACT_COLUMNS),
        "errors": errors,
        "skipped_points": bench.get("skipped", []),
        "trimmed": [],
    }
    steps = [
        ("mma-padded rows", {"mma-padded"}, True),
        ("min and max spreads", {"mma-padded"}, False),
        (
            "fixed-target rows of mma-main",
            {"mma-padded"}
            | {("mma-main", r.get("target_ctas")) for r in rows if r["backend"] == "mma-main"}
            - {("mma-main", "auto")},
            False,
        ),
    ]
    record["points"] = _points(rows, set(), True)
    for name, drop, spreads in steps:
        if len(json.dumps(record, separators=(",", ":"))) <= COMPACT_LIMIT_BYTES:
            break
        record["trimmed"].append(name)
        record["points"] = _points(rows, drop, spreads)
    dropped = 0
    while record["points"] and len(json.dumps(record, separators=(",", ":"))) > COMPACT_LIMIT_BYTES:
        record["points"].pop()
        dropped += 1
    if dropped:
        record["trimmed"].append(f"the last {dropped} point(s)")
    return record


def compact_name(record: dict) -> str:
    """File name for bench/kernel/results/: time, device and kit label."""
    stamp = record.get("time") or time.strftime("%Y-%m-%dT%H:%M:%S")
    day = re.sub(r"[^0-9]", "", stamp[:16])
    device = (record.get("device") or "device").lower().replace("nvidia", "")
    slug = re.sub(r"[^a-z0-9]+", "-", device).strip("-") or "device"
    kit = record.get("kit") or {}
    label = kit.get("label", "installed") if isinstance(kit, dict) else str(kit)
    return f"{day[:8]}-{day[8:12]}-{slug}-{label}.json"


def write_compact(record: dict, path) -> int:
    """Write ``record`` as compact JSON; returns its size in bytes (refuses over the limit)."""
    text = json.dumps(record, separators=(",", ":")) + "\n"
    if len(text.encode()) > COMPACT_LIMIT_BYTES:
        raise ValueError(f"compact record is {len(text):,} bytes, over {COMPACT_LIMIT_BYTES:,}")
    with open(path, "w") as f:
        f.write(text)
    return len(text.encode())
