"""The benchmark's one percentile, shared by every program that reports latencies (bench/measure.py,
bench/live.py), so their figures are read the same way."""

from __future__ import annotations


def percentile(values: list[float], p: float) -> float:
    """The `p`th percentile of `values` by nearest rank (the value at index ⌊n·p/100⌋ of the
    sorted values, the largest for p = 100); 0.0 when there are none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]
