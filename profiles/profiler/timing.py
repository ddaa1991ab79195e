"""Warm-up, repeats and robust statistics for one measured point."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """Latencies of one grid point in ms: the median is what a table stores."""

    median_ms: float
    min_ms: float
    max_ms: float
    num_repeats: int

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the point was."""
        return (self.max_ms - self.min_ms) / self.median_ms if self.median_ms > 0 else 0.0

    def as_dict(self) -> dict:
        return {"median_ms": round(self.median_ms, 4), "min_ms": round(self.min_ms, 4),
                "max_ms": round(self.max_ms, 4), "repeats": self.num_repeats}


def summarize(latencies_ms: list[float]) -> Sample:
    return Sample(statistics.median(latencies_ms), min(latencies_ms), max(latencies_ms), len(latencies_ms))


def measure(fn: Callable[[], object], warmup: int, repeats: int, setup: Callable[[], object] | None = None) -> Sample:
    """Run fn `warmup` times untimed, then `repeats` times timed (setup, untimed, before each)."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    latencies = []
    for _ in range(max(1, repeats)):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        latencies.append((time.perf_counter() - start) * 1e3)
    return summarize(latencies)
