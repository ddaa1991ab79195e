"""The cooperative step planner (dualpace.policy.cooperative_plan) on hand-built per-layer costs."""

import pytest

from dualpace.policy.cooperative_plan import (JoinHow, LayerCosts, LayerTimes, OwnRows, RemoteJoin,
                                              join_wait_bound_ms, own_step_layer_ms, plan_layout)
from dualpace.policy.policies import Policy
from dualpace.profile.cost_model import layer_costs, layer_costs_measured

# A GPU layer: dense 1.0 ms flat up to 64 rows, then 1/64 ms a row (memory-bound, then compute-bound);
# attention 0.001 ms per KV token per layer.
COSTS = layer_costs(32, {1: 1.0, 64: 1.0, 128: 2.0, 1024: 16.0}, 0.001)


def test_joined_when_the_cpu_fits_the_gpus_attention_window():
    own = OwnRows(0, [500] * 8)  # attend(D) = 4 ms per layer
    layout = plan_layout("dualpace", own, [RemoteJoin(4, expected_layer_ms=3.0)], COSTS)
    assert layout.how is JoinHow.JOINED and layout.d1_rows == 8
    assert layout.predicted_layer_ms == pytest.approx(1.0 + 4.0)  # one dense pass for 12 rows
    assert layout.predicted_gpu_wait_ms == 0.0
    # the same step staged would pay the remote rows' own dense pass per layer
    assert own_step_layer_ms(own, COSTS) + COSTS.dense_ms(4) > layout.predicted_layer_ms


def test_split_with_prefills_covers_the_cpu_with_the_prefill_layer():
    own = OwnRows(1024, [500] * 8)
    layout = plan_layout("gated", own, [RemoteJoin(4, expected_layer_ms=10.0)], COSTS)
    assert layout.how is JoinHow.SPLIT
    assert layout.predicted_gpu_wait_ms == 0.0  # the prefill's layer (> 16 ms) covers 10 ms of CPU attention
    same_for_dualpace = plan_layout("dualpace", own, [RemoteJoin(4, 10.0)], COSTS)
    assert same_for_dualpace.how is JoinHow.SPLIT


def test_dualpace_declines_to_staged_when_the_cpu_is_much_slower():
    own = OwnRows(0, [100] * 4)  # attend(D) = 0.4 ms: nothing to hide 20 ms of CPU attention behind
    layout = plan_layout(Policy.DUALPACE, own, [RemoteJoin(4, expected_layer_ms=20.0)], COSTS)
    assert layout.how is JoinHow.STAGED and layout.d1_rows == 0 and layout.predicted_gpu_wait_ms == 0.0
    assert layout.predicted_layer_ms == pytest.approx(own_step_layer_ms(own, COSTS) + 1.0)


def test_gated_never_stages_and_minimises_the_gpu_wait():
    own = OwnRows(0, [100] * 4)
    join = RemoteJoin(4, expected_layer_ms=2.0)
    gated = plan_layout("gated", own, [join], COSTS)
    assert gated.how is not JoinHow.STAGED
    # a split (the own decodes' dense pass in S0) covers 1.4 of the 2 ms; joined covers only 0.4
    assert gated.how is JoinHow.SPLIT and gated.d1_rows == 0  # ties: the fewest own rows in S1
    assert gated.predicted_gpu_wait_ms == pytest.approx(32 * (2.0 - 1.0 - 0.4))
    joined_wait_ms = 32 * (2.0 - 0.4)
    assert gated.predicted_gpu_wait_ms < joined_wait_ms
    dualpace = plan_layout("dualpace", own, [join], COSTS)
    assert dualpace.predicted_layer_ms <= gated.predicted_layer_ms  # dualpace takes the shorter step


def test_gated_with_no_own_rows_runs_the_join_alone():
    layout = plan_layout("gated", OwnRows(), [RemoteJoin(2, 0.5)], COSTS)
    assert layout.how is JoinHow.JOINED and layout.predicted_layer_ms == pytest.approx(1.5)
    assert plan_layout("dualpace", OwnRows(), [RemoteJoin(2, 0.5)], COSTS).how is JoinHow.STAGED


def test_several_joins_share_s1_and_wait_for_the_slowest():
    own = OwnRows(0, [1000] * 8)  # attend(D) = 8 ms
    layout = plan_layout("dualpace", own, [RemoteJoin(2, 3.0), RemoteJoin(3, 8.5)], COSTS)
    assert layout.how is JoinHow.JOINED and layout.d1_rows == 8
    assert layout.predicted_layer_ms == pytest.approx(1.0 + 8.5)  # one dense pass over 13 rows
    assert layout.predicted_gpu_wait_ms == pytest.approx(32 * 0.5)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="policy"):
        plan_layout("neo", OwnRows(), [RemoteJoin(1, 1.0)], COSTS)
    with pytest.raises(ValueError, match="at least one join"):
        plan_layout("gated", OwnRows(), [], COSTS)
    with pytest.raises(ValueError, match="num_rows"):
        RemoteJoin(0, 1.0)
    with pytest.raises(ValueError, match="strictly increasing"):
        LayerCosts(32, (4, 2), (1.0, 1.0), 0.0)
    with pytest.raises(ValueError):
        OwnRows(-1)


def test_join_wait_bound_is_two_layers_of_the_cpu_or_the_floor():
    assert join_wait_bound_ms(400, min_ms=0.5) == pytest.approx(0.8)
    assert join_wait_bound_ms(100, min_ms=0.5) == 0.5
    with pytest.raises(ValueError):
        join_wait_bound_ms(-1, 0.5)


def test_layer_times_ema_replace_the_seed_where_measured():
    times = LayerTimes()
    times.record_dense(3, 2.0)  # bucket 4
    times.record_dense(4, 3.0)
    times.record_attention(1000, 0.5)
    times.record_dense(0, 9.0)  # ignored
    assert times.dense_layer_ms_by_rows == {4: pytest.approx(0.8 * 2.0 + 0.2 * 3.0)}
    costs = layer_costs_measured(times, COSTS)
    assert costs.num_layers == 32 and costs.dense_ms(4) == pytest.approx(2.2)
    assert costs.dense_ms(64) == 1.0  # from the seed
    assert costs.attention_layer_ms_per_kv_token == pytest.approx(0.0005)
    assert layer_costs_measured(LayerTimes(), None) is None
