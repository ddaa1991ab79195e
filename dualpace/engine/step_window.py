"""The recent step latencies behind an engine's reported ITL percentiles (LoadSnapshot
itl_p50_ms / itl_p99_ms, which the router's admission and migration planner decide on).

Only steps that did work count: an empty step (no request could run: every one paused for a
migration, or waiting for KV) takes next to no time and produces no token, so counting it would
pull the figures below what any stream sees between two of its tokens. Pure (no clock): the
loop measures and records.
"""

from __future__ import annotations

import statistics
from collections import deque

NUM_RECENT_STEPS = 256  # window of step latencies behind the ITL percentiles


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank value at `fraction` (0..1) of the sorted values; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class StepLatencyWindow:
    def __init__(self, num_steps: int = NUM_RECENT_STEPS) -> None:
        self._step_ms: deque[float] = deque(maxlen=num_steps)
        self.num_empty_skipped = 0

    def record(self, step_ms: float, is_empty: bool) -> None:
        """One step's duration; an empty step (a plan with no work) is not counted."""
        if is_empty:
            self.num_empty_skipped += 1
            return
        self._step_ms.append(step_ms)

    def __len__(self) -> int:
        return len(self._step_ms)

    @property
    def p50_ms(self) -> float:
        return round(statistics.median(self._step_ms), 3) if self._step_ms else 0.0

    @property
    def p99_ms(self) -> float:
        return round(percentile(list(self._step_ms), 0.99), 3)
