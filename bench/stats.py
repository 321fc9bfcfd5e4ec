"""The benchmark's one percentile, shared by every program that reports latencies (bench/measure.py,
bench/live.py, bench/neighbours.py), so their figures are read the same way; and its one reading
of the gateway's `Server-Timing` header."""

from __future__ import annotations

import contextlib


def percentile(values: list[float], p: float) -> float:
    """The `p`th percentile of `values` by nearest rank (the value at index ⌊n·p/100⌋ of the
    sorted values, the largest for p = 100); 0.0 when there are none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


def server_timing(header: str) -> dict[str, float]:
    """A `Server-Timing` header's durations by name (`host;dur=12.5, gate;dur=3` -> {"host": 12.5,
    "gate": 3.0}); a metric without a readable duration is left out."""
    out = {}
    for metric in header.split(","):
        name, *params = (p.strip() for p in metric.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if key == "dur" and name:
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
    return out
