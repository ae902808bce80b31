import copy
import json

from bench_harness import run_tool

from bench.lib.report import compare, render

# Output tok/s per (arm, trial, C) recorded from a sim A/B with the knob verified live.
TOK_S = {
    ("A", 64): [1510.2, 1498.7, 1523.9],
    ("B", 64): [1703.4, 1688.1, 1721.0],
    ("A", 80): [1790.0, 1812.5, 1801.1],
    ("B", 80): [1795.3, 1808.0, 1806.4],
    ("A", 96): [2010.4, 2022.8, 1999.9],
    ("B", 96): [2131.0, 2118.7, 2127.5],
}


def _summary():
    runs = []
    for (arm, c), values in TOK_S.items():
        for trial, tok_s in enumerate(values, 1):
            runs.append(
                {
                    "arm": arm,
                    "trial": trial,
                    "concurrency": c,
                    "output_tok_s": tok_s,
                    "tpot_mean_s": 64 / tok_s,
                    "errors": 0,
                    "requests": 4 * c,
                    "error_rate": 0.0,
                    "knob": {
                        "required": True,
                        "verified": True,
                        "detail": "SGLANG_SM120_MMA_TARGET_CTAS live in decode pid 42",
                    },
                }
            )
    return {
        "schema": 1,
        "config": {
            "mode": "co-restart",
            "arms": {"A": "env/ab/A.env", "B": "env/ab/B.env"},
            "concurrency": [64, 80, 96],
            "trials": 3,
            "requests_per_c": "4 x C",
            "input_words": 512,
            "output_tokens": 256,
            "seed": 0,
            "max_error_rate": 0.0,
        },
        "runs": runs,
    }


def test_complete_evidence_gives_delta_ci_and_verdict_per_concurrency():
    rows = {r["concurrency"]: r for r in compare(_summary())}
    assert rows[64]["verdict"] == "B faster"
    assert 12 < rows[64]["delta"]["mean_pct"] < 13.5
    assert rows[80]["verdict"] == "no detectable difference"
    assert rows[96]["verdict"] == "B faster"
    assert all(not r["refusals"] for r in rows.values())


def test_unverified_knob_refuses_the_delta_and_names_the_trial():
    summary = _summary()
    for run in summary["runs"]:
        if run["arm"] == "B" and run["trial"] == 2:
            run["knob"] = {
                "required": True,
                "verified": False,
                "detail": "SGLANG_SM120_MMA_TARGET_CTAS missing from decode pid 77",
            }
    rows = compare(summary)
    assert all(r["delta"] is None and r["verdict"] == "refused" for r in rows)
    assert any(
        "arm B trial 2: knob not verified" in reason and "pid 77" in reason
        for reason in rows[0]["refusals"]
    )


def test_errors_above_threshold_refuse_only_that_concurrency():
    summary = _summary()
    run = next(
        r for r in summary["runs"] if (r["arm"], r["trial"], r["concurrency"]) == ("A", 3, 96)
    )
    run.update(errors=5, error_rate=5 / 384)
    rows = {r["concurrency"]: r for r in compare(summary)}
    assert rows[96]["delta"] is None
    assert "arm A trial 3 at C96: 5 of 384 requests failed" in rows[96]["refusals"][0]
    assert rows[64]["delta"] is not None


def test_missing_trial_refuses_with_the_count():
    summary = _summary()
    summary["runs"] = [r for r in summary["runs"] if not (r["arm"] == "B" and r["trial"] == 3)]
    rows = compare(summary)
    assert "arm B has 2 of 3 trials at C64" in rows[0]["refusals"]


def test_report_cli_rerenders_table_and_plots(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(_summary()))
    result = run_tool("bench/report", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "| 64 |" in result.stdout and "B faster" in result.stdout
    assert (tmp_path / "report.md").read_text() == result.stdout
    for png in ("throughput.png", "tpot.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_shows_refusal_reasons_in_markdown(tmp_path):
    summary = copy.deepcopy(_summary())
    summary["runs"][0]["knob"]["verified"] = False
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    text = render(tmp_path)
    assert "## Deltas refused (incomplete evidence)" in text
    assert "| 64 |" in text and "| refused | refused | refused |" in text


def test_report_cli_rejects_a_directory_without_summary(tmp_path):
    result = run_tool("bench/report", str(tmp_path))
    assert result.returncode == 2
    assert "no summary.json" in result.stderr


def _with_router(summary, sheds_b=0, retries_b=0):
    from bench.lib.router_counters import COUNTERS, HTTP_ERRORS, flags

    for run in summary["runs"]:
        counts = {key: 0 for key in COUNTERS} | {HTTP_ERRORS: 0}
        if run["arm"] == "B" and run["concurrency"] == 64:
            counts.update(admission_sheds=sheds_b, retries=retries_b)
        run["router"] = {"required": True, "read": True, "counts": counts, "reset": []}
        run["router"]["flags"] = flags(run["router"])
    return summary


def test_an_arm_whose_router_shed_is_flagged_and_its_delta_refused(tmp_path):
    summary = _with_router(_summary(), sheds_b=3)
    rows = {r["concurrency"]: r for r in compare(summary)}
    assert rows[64]["verdict"] == "refused"
    reason = next(x for x in rows[64]["refusals"] if "router sheds" in x)
    assert "A 0, B 9" in reason and "--max-router-diff-rate" in reason
    assert rows[80]["verdict"] == "no detectable difference"  # no shed there
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    report = render(tmp_path)
    assert "- arm B trial 2 C64: router shed 3 request(s) (admission 3, overload 0)" in report
    # Within a stated bound the delta stands, and the flags stay in the report.
    summary["config"]["max_router_diff_rate"] = 0.02  # 9 of 768 is 1.2%
    rows = {r["concurrency"]: r for r in compare(summary)}
    assert rows[64]["verdict"] == "B faster"


def test_router_retries_differing_between_arms_refuse_the_delta():
    rows = {r["concurrency"]: r for r in compare(_with_router(_summary(), retries_b=1))}
    assert any("router retries at C64: A 0, B 3" in x for x in rows[64]["refusals"])


def test_unread_router_counters_refuse_the_delta_naming_the_run():
    summary = _with_router(_summary())
    run = next(r for r in summary["runs"] if r["arm"] == "A" and r["concurrency"] == 96)
    run["router"] = {"required": True, "read": False, "detail": "not read: connection refused"}
    rows = {r["concurrency"]: r for r in compare(summary)}
    assert any("router counters not read: connection refused" in x for x in rows[96]["refusals"])
    assert rows[64]["verdict"] == "B faster"


def test_routers_started_with_different_settings_refuse_every_delta_naming_the_flag():
    summary = _summary()
    same = {"source": "router pid 7 command line", "settings": {"worker_overload_shed": False}}
    summary["router_settings"] = {
        "A": {"1": same, "2": same},
        "B": {"1": same, "2": {**same, "settings": {"worker_overload_shed": True}}},
    }
    for row in compare(summary):
        assert row["verdict"] == "refused"
        assert any(
            "trial 2" in x and "--worker-overload-shed: A False, B True" in x
            for x in row["refusals"]
        )


def test_router_counters_are_read_from_smgs_exposition():
    from bench.lib.router_counters import delta, read

    text = (
        "# TYPE smg_worker_overload_shed_total counter\n"
        'smg_worker_overload_shed_total{stage="selection"} 2\n'
        'smg_worker_overload_shed_total{stage="pd_admission"} 1\n'
        "# TYPE smg_pd_admission_waits_total counter\n"
        "smg_pd_admission_waits_total 5\n"
        "# TYPE smg_http_responses_total counter\n"
        'smg_http_responses_total{path="/v1/chat/completions",status_code="503",error_code="x"} 3\n'
        'smg_http_responses_total{path="/v1/chat/completions",status_code="200",error_code=""} 9\n'
    )
    counts = read(text)
    assert counts["overload_sheds"] == 3 and counts["admission_waits"] == 5
    assert counts["http_error_responses"] == 3 and counts["retries"] == 0
    assert delta(counts, read(text.replace(" 5\n", " 7\n")))["counts"]["admission_waits"] == 2
    assert delta(counts, read(text.replace(" 5\n", " 1\n")))["reset"] == ["admission_waits"]
