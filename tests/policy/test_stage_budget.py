"""dualpace.policy.stage_budget: refusing a staged iteration at its begin."""

import pytest

from dualpace.policy.stage_budget import EngineStepProgress, forecast_stage_wait_ms, refuse_at_begin


def test_each_stage_waits_the_layer_less_the_cpu_side_for_the_steps_layers_left():
    step = EngineStepProgress(num_layers_left=10, layer_ms=15.0)
    assert forecast_stage_wait_ms(33, step, between_ms=3.0) == pytest.approx(10 * 12.0)
    assert forecast_stage_wait_ms(4, step, between_ms=3.0) == pytest.approx(4 * 12.0)  # fewer stages than layers
    assert forecast_stage_wait_ms(33, step, between_ms=20.0) == 0.0  # the CPU's part is the longer
    assert forecast_stage_wait_ms(33, None, between_ms=0.0) == 0.0  # no step in progress
    assert forecast_stage_wait_ms(33, EngineStepProgress(0, 15.0), between_ms=0.0) == 0.0


def test_refused_only_when_the_forecast_exceeds_a_budget():
    step = EngineStepProgress(num_layers_left=30, layer_ms=15.0)  # 30 x 12 = 360 ms
    assert refuse_at_begin(293.0, 33, step, between_ms=3.0)
    assert not refuse_at_begin(400.0, 33, step, between_ms=3.0)
    assert not refuse_at_begin(360.0, 33, step, between_ms=3.0)  # exactly the budget: it would still run
    assert not refuse_at_begin(None, 33, step, between_ms=3.0)  # no budget (`always`): never
    assert not refuse_at_begin(0, 33, step, between_ms=3.0)
    assert not refuse_at_begin(293.0, 33, None, between_ms=3.0)
