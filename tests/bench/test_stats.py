import math

import pytest
import scipy.stats

from bench.lib.metrics import percentile, summarize_run
from bench.lib.stats import paired_delta_pct, t95, verdict

# Output tok/s of three alternating trial pairs, recorded from a sim A/B.
A = [1510.2, 1498.7, 1523.9]
B = [1703.4, 1688.1, 1721.0]


def test_paired_delta_matches_t_interval_of_per_trial_deltas():
    d = paired_delta_pct(A, B)
    deltas = [(b - a) / a * 100 for a, b in zip(A, B, strict=True)]
    low, high = scipy.stats.t.interval(
        0.95, len(deltas) - 1, loc=sum(deltas) / 3, scale=scipy.stats.sem(deltas)
    )
    assert d.mean_pct == pytest.approx(sum(deltas) / 3)
    assert d.ci_low_pct == pytest.approx(low, rel=1e-3)
    assert d.ci_high_pct == pytest.approx(high, rel=1e-3)
    assert verdict(d) == "B faster"


def test_overlapping_trials_give_no_detectable_difference():
    d = paired_delta_pct([100.0, 104.0, 97.0], [101.0, 99.0, 100.5])
    assert d.ci_low_pct < 0 < d.ci_high_pct
    assert verdict(d) == "no detectable difference"


def test_slower_b_is_called_slower():
    assert verdict(paired_delta_pct(B, A)) == "B slower"


@pytest.mark.parametrize(
    "df, value", [(1, 12.706), (2, 4.303), (5, 2.571), (10, 2.228), (30, 2.042), (1000, 1.962)]
)
def test_t_critical_values_are_the_two_sided_95_percent_ones(df, value):
    assert t95(df) == pytest.approx(value, abs=1e-3)


def test_t_needs_a_degree_of_freedom():
    with pytest.raises(ValueError, match="at least two trials"):
        t95(0)


def test_delta_needs_equal_and_at_least_two_trials():
    with pytest.raises(ValueError, match="differ in count"):
        paired_delta_pct([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least two"):
        paired_delta_pct([1.0], [1.0])


def test_percentile_matches_numpy_linear_method():
    import numpy as np

    values = [0.3, 0.1, 0.9, 0.5, 0.7, 0.2]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 50))


def _record(success=True, ttft=0.1, latency=1.1, tokens=11, error=""):
    itl = [0.1] * (tokens - 1) if success else []
    return {
        "success": success,
        "ttft_s": ttft,
        "latency_s": latency,
        "output_tokens": tokens,
        "itl_s": itl,
        "error": error,
    }


def test_failed_requests_are_counted_and_add_no_throughput():
    records = [_record(), _record(), _record(success=False, tokens=0, error="timeout after 5 s")]
    s = summarize_run(records, duration_s=2.0)
    assert (s["requests"], s["completed"], s["errors"]) == (3, 2, 1)
    assert s["error_rate"] == pytest.approx(1 / 3)
    assert s["output_tok_s"] == pytest.approx(22 / 2.0)
    assert s["request_s"] == pytest.approx(1.0)
    assert s["tpot_mean_s"] == pytest.approx(0.1)
    assert s["first_errors"] == ["timeout after 5 s"]


def test_summary_rejects_a_nonpositive_duration():
    with pytest.raises(ValueError, match="positive"):
        summarize_run([_record()], 0.0)
