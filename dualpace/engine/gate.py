"""How the GPU engine shares its device: iteration boundaries and per-layer handoff.

IterationGate lets work wait for an engine's iteration boundary. Used for the "gated"
baseline policy (NEO-like): a CPU-resident decode iteration may start only after the
GPU engine finishes its current iteration, so CPU requests advance at most once per
GPU iteration and wait behind long prefills. The DualPace policy never waits on it.

DeviceHandoff shares one device lock between the engine's step (which holds it for the
whole iteration) and short stages (a Dense Assist layer's dense work) that take it one
at a time. The engine's forward calls `yield_to_waiting()` between layers: when a stage
is waiting it releases the lock, lets every stage that was waiting take its turn, and
then re-acquires it. So a stage waits for at most one engine layer (plus the stages
ahead of it), never for a whole engine iteration, and the engine loses only the stages'
own device time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

HANDOFF_TIMEOUT_S = 1.0  # the engine waits at most this long for a waiting stage to take the lock


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


class DeviceHandoff:
    """Fair per-stage sharing of `lock` (the engine's step lock) with the engine's iteration.

    Stages call `acquire_stage(timeout_s)` / `release_stage()`; the lock holder (the engine's
    step thread) calls `yield_to_waiting()` at points where the device may change hands.
    A plain `lock.acquire()` (not counted as waiting) gets no handoff: it waits for the
    holder's release at the end of its iteration.
    """

    def __init__(self, lock: threading.Lock | None = None, finish_device_work: Callable[[], None] | None = None):
        self.lock = lock if lock is not None else threading.Lock()
        # Called before the lock changes hands, so the device is handed over when the holder's
        # work has run, not when it was launched (dualpace.model.device_sync; no-op off CUDA).
        self._finish_device_work = finish_device_work or (lambda: None)
        self._changed = threading.Condition()
        self._num_waiting = 0
        self._num_granted = 0  # stages that got the lock, ever
        self.num_handoffs = 0  # yields that handed the device over (for tests and metrics)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def acquire_stage(self, timeout_s: float) -> bool:
        """Take the lock for one stage, as soon as the holder yields or releases it;
        False if timeout_s passed first."""
        with self._changed:
            self._num_waiting += 1
        acquired = False
        try:
            acquired = self.lock.acquire(timeout=max(0.0, timeout_s))
        finally:
            with self._changed:
                self._num_waiting -= 1
                if acquired:
                    self._num_granted += 1
                self._changed.notify_all()
        return acquired

    def release_stage(self) -> None:
        self._finish_device_work()
        self.lock.release()

    def yield_to_waiting(self) -> None:
        """Called by the lock's holder: if stages wait, release the lock until each of them
        has had its turn (or HANDOFF_TIMEOUT_S passed), then take it back. Cheap otherwise."""
        with self._changed:
            if self._num_waiting == 0:
                return
            wanted = self._num_granted + self._num_waiting
        self.num_handoffs += 1
        self._finish_device_work()
        self.lock.release()
        try:
            with self._changed:
                self._changed.wait_for(lambda: self._num_granted >= wanted or self._num_waiting == 0,
                                       HANDOFF_TIMEOUT_S)
        finally:
            self.lock.acquire()
