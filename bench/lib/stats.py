"""The A/B delta and its confidence interval from paired trials."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Two-sided 95% Student t critical values by degrees of freedom. Between listed values and past
# the table the next smaller listed df is used: the interval comes out slightly wider, never
# narrower.
_T95 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    16: 2.120,
    17: 2.110,
    18: 2.101,
    19: 2.093,
    20: 2.086,
    25: 2.060,
    30: 2.042,
}


def t95(df: int) -> float:
    if df < 1:
        raise ValueError("a confidence interval needs at least two trials")
    if df in _T95:
        return _T95[df]
    return _T95[max(k for k in _T95 if k < df)]


@dataclass(frozen=True)
class Delta:
    """B relative to A in percent, with the 95% CI of the mean of per-trial deltas."""

    mean_pct: float
    ci_low_pct: float
    ci_high_pct: float
    trials: int


def paired_delta_pct(a: Sequence[float], b: Sequence[float]) -> Delta:
    """Trial i of A and trial i of B ran back to back, so their ratio cancels slow drift."""
    if len(a) != len(b):
        raise ValueError(f"paired trials differ in count: A has {len(a)}, B has {len(b)}")
    if len(a) < 2:
        raise ValueError("a confidence interval needs at least two trials per arm")
    if any(x <= 0 for x in a):
        raise ValueError("arm A has a trial with zero throughput; a relative delta is undefined")
    deltas = [(y - x) / x * 100 for x, y in zip(a, b, strict=True)]
    n = len(deltas)
    m = sum(deltas) / n
    sd = math.sqrt(sum((d - m) ** 2 for d in deltas) / (n - 1))
    half = t95(n - 1) * sd / math.sqrt(n)
    return Delta(m, m - half, m + half, n)


def verdict(delta: Delta, higher_is_better: bool = True) -> str:
    if delta.ci_low_pct > 0:
        return "B faster" if higher_is_better else "B slower"
    if delta.ci_high_pct < 0:
        return "B slower" if higher_is_better else "B faster"
    return "no detectable difference"
