"""Prometheus text exposition, read with prometheus_client's own parser."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families


def sample_sums(text: str) -> dict[str, float]:
    """Sum of the samples of each sample name (label sets added together; NaN skipped).

    Raises ValueError for text that is not the Prometheus text format.
    """
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not math.isnan(sample.value):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums
