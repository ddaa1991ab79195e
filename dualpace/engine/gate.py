"""IterationGate: lets work wait for an engine's iteration boundary.

Used for the "gated" baseline policy (NEO-like): a CPU-resident decode iteration
may start only after the GPU engine finishes its current iteration, so CPU
requests advance at most once per GPU iteration and wait behind long prefills.
The DualPace policy never waits on it.
"""

from __future__ import annotations

import threading


class IterationGate:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._num_finished = 0
        self._in_step = False

    def step_started(self) -> None:
        with self._changed:
            self._in_step = True

    def step_finished(self) -> None:
        with self._changed:
            self._in_step = False
            self._num_finished += 1
            self._changed.notify_all()

    def wait_turn(self, timeout_s: float) -> bool:
        """Return once no iteration is in flight (at once if the engine is idle);
        False if the timeout passed first."""
        with self._changed:
            if not self._in_step:
                return True
            start = self._num_finished
            return self._changed.wait_for(lambda: self._num_finished > start, timeout_s)
