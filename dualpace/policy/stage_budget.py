"""Refusing a staged Dense Assist iteration at its begin when the GPU engine's step in
progress already makes its device-wait budget run out.

A staged iteration (gpu_service/dense_assist.py) takes the device for one stage per layer, each
at the GPU engine's next layer boundary while the engine's step runs. The waits of all its
stages add up against the begin's max_device_wait_ms; past it a stage is refused
(RESOURCE_EXHAUSTED) and the CPU engine redoes the iteration locally, after waiting out the
whole budget for nothing. When the waits the step in progress alone will cause already exceed
the budget, refusing at the begin gives the same outcome without that wait.

The forecast counts only what the step in progress makes sure: while it runs, the CPU's part
between two stages (`between_ms`: its attention and the round trip) overlaps the engine's
layer, so each stage waits about `layer_ms - between_ms` (nothing when the CPU's part is the
longer), for as many stages as the step has layers left. Nothing is forecast past the step's
end (the device may be free then), so the rule refuses only iterations the budget would have
refused anyway. Pure arithmetic (used by profiles/sim and meant for gpu_service alike).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStepProgress:
    """Where the GPU engine's step in progress stands: its layers not yet run and their time."""

    num_layers_left: int
    layer_ms: float


def forecast_stage_wait_ms(num_stages: int, step: EngineStepProgress | None, between_ms: float) -> float:
    """The device wait the iteration's stages will spend in the step in progress (0 without one)."""
    if step is None or step.num_layers_left <= 0 or num_stages <= 0:
        return 0.0
    per_stage_ms = max(0.0, step.layer_ms - max(0.0, between_ms))
    return min(num_stages, step.num_layers_left) * per_stage_ms


def refuse_at_begin(budget_ms: float | None, num_stages: int, step: EngineStepProgress | None,
                    between_ms: float) -> bool:
    """True when the begin should be refused now: the forecast wait exceeds the budget (None or 0: no budget)."""
    if not budget_ms:
        return False
    return forecast_stage_wait_ms(num_stages, step, between_ms) > budget_ms
