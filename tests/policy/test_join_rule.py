"""dualpace.policy.join_rule: when a cooperative CPU iteration joins a busy GPU step, on hand-built times."""

from __future__ import annotations

import pytest

from dualpace.policy.join_rule import JoinAction, JoinRule, join_action, meeting_point


def test_every_rule_joins_a_step_that_begins_within_one_gpu_layer():
    for rule in JoinRule:
        assert join_action(rule, 0.0, 0.0, 0.0) is JoinAction.JOIN_NEXT_STEP  # an idle GPU with work starts one now
        assert join_action(rule, 7.0, 7.5, 0.0) is JoinAction.JOIN_NEXT_STEP


def test_a_step_further_off_goes_staged_local_first_or_waits_within_the_slack():
    assert join_action("within-layer", 100.0, 7.5, 500.0) is JoinAction.STAGED
    assert join_action("meet", 100.0, 7.5, 0.0) is JoinAction.MEET
    assert join_action("slack", 100.0, 7.5, 120.0) is JoinAction.JOIN_NEXT_STEP
    assert join_action("slack", 100.0, 7.5, 80.0) is JoinAction.LOCAL
    assert join_action("slack", None, 0.0, 1e9) is JoinAction.LOCAL  # no GPU step is coming at all
    with pytest.raises(ValueError, match="join rule"):
        join_action("sometimes", 1.0, 1.0, 1.0)


def test_a_slower_cpu_is_met_by_the_next_step_where_the_gpu_catches_up():
    # the next step begins 40 ms after the CPU started; GPU layers of 5 ms, CPU layers of 10 ms:
    # the GPU begins layer k at 40 + 5k, the CPU is ready at 10k: at k = 7 the CPU waits 5 ms (one GPU
    # layer, the bound), at k = 8 they meet exactly; the first is taken (one more layer shared)
    point = meeting_point(40.0, 5.0, 0.0, 10.0, 32, 320.0)
    assert point.layer == 7 and point.cpu_wait_ms == pytest.approx(5.0)
    assert point.end_ms == pytest.approx(40.0 + 32 * 5.0)  # it ends with the step, sooner than 320 ms locally
    # the CPU has already passed layer 9: the first layer it can still wait at with at most one GPU layer
    late = meeting_point(40.0, 5.0, 0.0, 10.0, 32, 320.0, cpu_done_layers=9)
    assert late is None or late.layer >= 9


def test_the_wait_at_the_meeting_layer_is_at_most_one_gpu_layer():
    for layer0_ms in (0.0, 3.0, 17.0, 41.0, 90.0):
        point = meeting_point(layer0_ms, 7.0, 0.5, 9.0, 32, 1000.0)
        if point is not None:
            assert 0.0 <= point.cpu_wait_ms <= 7.0 + 1e-9


def test_a_faster_cpu_is_not_slowed_down_by_joining_a_running_step():
    # catching up with a step at layer 4 (began 28 ms ago, 7 ms layers) from 3 ms CPU layers ends with
    # the step, after the 96 ms the CPU needs alone: it stays local
    assert meeting_point(-28.0, 7.0, 0.1, 3.0, 32, 96.0) is None
    # the same step with a CPU too slow to finish before it: it catches up and shares the rest
    point = meeting_point(-28.0, 7.0, 0.1, 3.0, 32, 400.0)
    assert point is not None and point.layer == 7 and point.end_ms < 400.0


def test_joined_time_counts_against_joining():
    # without extra time per joined layer the meeting (layer 7) ends at 40 + 160 = 200 < 210; with 0.5 ms
    # per shared layer it ends at 212.5 (layer 7) or 212 (layer 8), and from layer 9 the step is past the CPU
    assert meeting_point(40.0, 5.0, 0.0, 10.0, 32, 210.0) is not None
    assert meeting_point(40.0, 5.0, 0.5, 10.0, 32, 210.0) is None


def test_bad_times_are_clear_errors():
    with pytest.raises(ValueError):
        meeting_point(0.0, -1.0, 0.0, 1.0, 32, 10.0)
    with pytest.raises(ValueError):
        meeting_point(float("nan"), 1.0, 0.0, 1.0, 32, 10.0)


def test_meet_net_joins_only_where_the_cpu_gains_more_tokens_than_the_gpu_loses():
    from dualpace.policy.join_rule import TokenRates

    # the meeting of the slower-CPU case ends at 200 ms instead of 320 and adds 0.5 ms to each of 25 layers
    many_gpu_rows = TokenRates(gpu_rows=64, gpu_step_ms=200.0, cpu_rows=4)
    few_gpu_rows = TokenRates(gpu_rows=2, gpu_step_ms=200.0, cpu_rows=4)
    assert meeting_point(40.0, 5.0, 0.5, 10.0, 32, 320.0, rates=many_gpu_rows) is None
    point = meeting_point(40.0, 5.0, 0.5, 10.0, 32, 320.0, rates=few_gpu_rows)
    assert point is not None and point.layer == 7
    # 4 CPU rows: 4 x (1/212.5 - 1/320) = 0.0063 tokens/ms gained; 2 GPU rows lose 2 x (1/200 - 1/212.5) = 0.0006
    assert few_gpu_rows.join_pays(212.5, 320.0, 12.5) and not many_gpu_rows.join_pays(212.5, 320.0, 12.5)


def test_no_meeting_takes_the_step_past_the_itl_target():
    # the slower-CPU meeting adds 0.5 ms to each of 25 layers (12.5 ms): a 150 ms step stays within a 165 ms
    # target, a 160 ms one would not; from layer 8 it adds 12 ms, still too much
    assert meeting_point(40.0, 5.0, 0.5, 10.0, 32, 320.0, max_step_ms=165.0, own_step_ms=150.0) is not None
    assert meeting_point(40.0, 5.0, 0.5, 10.0, 32, 320.0, max_step_ms=165.0, own_step_ms=160.0) is None
