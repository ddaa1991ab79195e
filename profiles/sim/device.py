"""The GPU as one shared resource: the GPU engine's iterations and Dense Assist's work on it.

Bookings, all in simulated ms:

- **engine iteration**: the GPU engine's iteration, `work_ms` of device time split into
  `num_layers` equal layers. It starts only when the device is free.
- **stage** (a staged Assisted CPU iteration, dualpace policy): one layer's dense work
  of an assisted iteration. Asked for while an engine iteration is on the device, it runs at
  the engine's next layer boundary (gpu_service: PagedForward.between_layers ->
  DeviceHandoff.yield_to_waiting) and the rest of the engine's iteration moves later by the
  stage's time; asked for during the engine's last layer, it runs at the iteration's end,
  before the engine's next iteration. Otherwise it runs at once.
- **block** (gated policy, hold "layer": gpu_service holds the device for a join it cannot
  take): one piece that starts once the device is free and keeps it for its whole length; no
  engine layer boundary is offered.

The engine's layers are not events: a stage request computes where the engine's iteration
stands (work done since it last resumed) and reschedules its end. Pure arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_EPS_MS = 1e-9


@dataclass
class _EngineRun:
    """The GPU engine's iteration on the device."""

    work_ms: float  # its own device time
    layer_ms: float
    resumed_at_ms: float  # when it last started or resumed running
    work_done_at_resume_ms: float
    end_ms: float  # when it finishes, stages inserted so far included


class SharedDevice:
    def __init__(self, num_layers: int):
        self.num_layers = max(1, num_layers)
        self.engine_run: _EngineRun | None = None
        self.held_until_ms = 0.0  # the end of the last stage or block
        self.last_user = ""  # "gpu" or "cpu": who last started on the device (the gated turn-taking)
        self.stage_wait_ms = 0.0  # total time stages waited for an engine layer boundary

    def free_at_ms(self) -> float:
        """When nothing booked is left on the device."""
        engine_end = self.engine_run.end_ms if self.engine_run is not None else 0.0
        return max(self.held_until_ms, engine_end)

    def wait_ms(self, now_ms: float) -> float:
        return max(0.0, self.free_at_ms() - now_ms)

    def engine_layer_ms(self) -> float:
        """The running engine iteration's layer time (0 when the engine is not on the device)."""
        return self.engine_run.layer_ms if self.engine_run is not None else 0.0

    # ------------------------------------------------------------------ engine

    def start_engine(self, now_ms: float, work_ms: float) -> float:
        """Put an engine iteration on the (free) device; returns its end."""
        assert self.wait_ms(now_ms) == 0.0, "the engine starts only on a free device"
        self.engine_run = _EngineRun(work_ms, work_ms / self.num_layers, now_ms, 0.0, now_ms + work_ms)
        self.last_user = "gpu"
        return self.engine_run.end_ms

    def engine_finished(self) -> None:
        self.engine_run = None

    # ------------------------------------------------------------------ assist

    def book_block(self, now_ms: float, held_ms: float) -> float:
        """Book held_ms in one piece from when the device is free; returns its start."""
        start_ms = max(now_ms, self.free_at_ms())
        self.held_until_ms = start_ms + held_ms
        self.last_user = "cpu"
        return start_ms

    def stage_start_ms(self, now_ms: float) -> float:
        """When a stage asked for at now_ms would start (nothing is booked)."""
        return self._place_stage(now_ms)[0]

    def _place_stage(self, now_ms: float) -> tuple[float, float | None]:
        """(the stage's start, the engine's work done at it when it goes inside the engine's iteration)."""
        start_ms = max(now_ms, self.held_until_ms)
        run = self.engine_run
        if run is None or run.end_ms <= start_ms + _EPS_MS:
            return start_ms, None
        start_ms = max(start_ms, run.resumed_at_ms)  # (with one CPU engine stages never overlap)
        work_ms = run.work_done_at_resume_ms + (start_ms - run.resumed_at_ms)
        boundary_ms = math.ceil(work_ms / run.layer_ms - _EPS_MS) * run.layer_ms if run.layer_ms > 0 else work_ms
        if boundary_ms >= run.work_ms - _EPS_MS:  # the last layer: no yield point before its end
            return run.end_ms, None
        return run.resumed_at_ms + (boundary_ms - run.work_done_at_resume_ms), boundary_ms

    def run_stage(self, now_ms: float, stage_ms: float) -> tuple[float, float | None]:
        """Run one assist stage as soon as the device is offered. Returns (the stage's end,
        the engine iteration's new end if the stage went inside it, else None)."""
        start_ms, boundary_ms = self._place_stage(now_ms)
        moved_end = None
        if boundary_ms is not None:
            run = self.engine_run
            run.work_done_at_resume_ms = boundary_ms
            run.resumed_at_ms = start_ms + stage_ms
            run.end_ms += stage_ms
            moved_end = run.end_ms
        self.stage_wait_ms += start_ms - now_ms
        self.held_until_ms = start_ms + stage_ms
        return self.held_until_ms, moved_end
