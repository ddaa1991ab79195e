"""One percentile for the whole project (bench reports, the simulator's results)."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """q in [0, 100]; linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
