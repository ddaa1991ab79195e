"""The simulator's staged iteration refused at its begin (SimConfig.refuse_staged_at_begin):
the step in progress alone would exhaust its device budget, so it is redone locally at once."""

import pytest

from dualpace.engine.request import EngineRequest
from dualpace.policy.mode_choice import ExecutionMode
from dualpace.policy.policies import Policy
from dualpace.profile.cost_model import DecodeBatch
from dualpace.sampling_params import SamplingParams
from profiles.sim import CPU, SimConfig, Simulator
from tests.profiles.test_simulator import _cost, _pump


def _staged_in_a_long_step(refuse_at_begin: bool):
    sim = Simulator(_cost(), SimConfig(policy=Policy.DUALPACE, assist_device_hold="layer",
                                       refuse_staged_at_begin=refuse_at_begin))
    cpu = sim.engines[CPU]
    cpu.scheduler.add(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), seed=0))
    plan = cpu.scheduler.schedule()
    budget_ms = sim._stage_budget_ms(1)
    num_layers = sim.num_layers
    sim.device.start_engine(0.0, 2 * budget_ms * num_layers)  # each layer waits 2 x the budget
    sim.now_ms = 1.0  # inside layer 0: all layers left
    assert sim.device.engine_layers_left(1.0) == num_layers
    sim._start_staged(cpu, plan, 0.1 * (num_layers + 1), 1.0 + 0.1 * (num_layers + 1))
    end_ms = _pump(sim, "done", CPU)
    prefill_tokens, contexts, sampled = sim._plan_shape(plan)
    local_ms = sim.cost.cpu_iteration(DecodeBatch.of(contexts), prefill_tokens, sampled).local_ms
    return sim, cpu, budget_ms, local_ms, end_ms


def test_a_begin_whose_step_alone_exhausts_the_budget_is_refused_at_once():
    sim, cpu, budget_ms, local_ms, end_ms = _staged_in_a_long_step(refuse_at_begin=True)
    assert end_ms == pytest.approx(1.0 + local_ms + sim.config.engine_overhead_ms)  # no wait at all
    assert sim.num_staged_refusals == 1 and sim.num_staged_refusals_at_begin == 1
    assert cpu.num_local == 1 and cpu.num_assisted == 0 and cpu.staged_batch is None
    assert sim.chooser.latency_ms[(ExecutionMode.ASSISTED, 1)] == pytest.approx(local_ms)


def test_without_the_rule_the_same_begin_waits_out_its_budget():
    sim, cpu, budget_ms, local_ms, end_ms = _staged_in_a_long_step(refuse_at_begin=False)
    assert end_ms > 1.0 + budget_ms + local_ms - 1e-6
    assert sim.num_staged_refusals == 1 and sim.num_staged_refusals_at_begin == 0
