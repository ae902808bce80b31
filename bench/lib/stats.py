"""The A/B delta and its confidence interval from paired trials."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def t95(df: int) -> float:
    """Two-sided 95% Student t critical value (scipy's t distribution)."""
    if df < 1:
        raise ValueError("a confidence interval needs at least two trials")
    from scipy.stats import t

    return float(t.ppf(0.975, df))


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
