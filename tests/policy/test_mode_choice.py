"""The pure per-iteration Local / Assisted chooser, driven with made-up latencies."""

from __future__ import annotations

import pytest

from dualpace.policy.mode_choice import (
    BACKOFF_MAX_ITERATIONS,
    BACKOFF_MIN_ITERATIONS,
    EMA_WEIGHT,
    REPROBE_EVERY,
    AssistSetting,
    ExecutionMode,
    ModeChooser,
    batch_bucket,
)

LOCAL, ASSISTED = ExecutionMode.LOCAL, ExecutionMode.ASSISTED


def run(chooser: ModeChooser, latency: dict[ExecutionMode, float], n: int, batch: int = 4) -> list[ExecutionMode]:
    """n iterations as the runner does them: choose, then record the measured latency."""
    modes = []
    for _ in range(n):
        mode = chooser.choose(batch, decode_only=True)
        chooser.record(mode, batch, latency[mode])
        modes.append(mode)
    return modes


def locals_until_assisted(chooser: ModeChooser, limit: int = 10_000) -> int:
    """Choices of LOCAL before the next ASSISTED (decode-only batches)."""
    for count in range(limit):
        if chooser.choose(4, decode_only=True) == ASSISTED:
            return count
    raise AssertionError("never assisted again")


def test_batch_bucket_powers_of_two():
    assert [batch_bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 1, 2, 4, 4, 8, 8, 16, 64, 128]


@pytest.mark.parametrize("setting", list(AssistSetting))
def test_local_without_gpu_service_or_for_dense_batches(setting):
    no_gpu = ModeChooser(setting, assist_configured=False)
    assert {no_gpu.choose(b, decode_only=True) for b in (1, 4, 100)} == {LOCAL}
    with_gpu = ModeChooser(setting, assist_configured=True)
    with_gpu.latency_ms = {(LOCAL, 4): 10.0, (ASSISTED, 4): 1.0}
    assert with_gpu.choose(4, decode_only=False) == LOCAL  # a prefill chunk in the batch
    assert no_gpu.num_iterations == 3 and with_gpu.num_iterations == 1  # every iteration counts


def test_never_is_always_local():
    chooser = ModeChooser(AssistSetting.NEVER, assist_configured=True)
    chooser.latency_ms = {(LOCAL, 4): 10.0, (ASSISTED, 4): 1.0}
    assert set(run(chooser, {LOCAL: 10.0, ASSISTED: 1.0}, 3 * REPROBE_EVERY)) == {LOCAL}


def test_always_is_assisted_for_decode_batches_even_when_slower():
    chooser = ModeChooser(AssistSetting.ALWAYS, assist_configured=True)
    assert set(run(chooser, {LOCAL: 1.0, ASSISTED: 50.0}, 2 * REPROBE_EVERY + 1)) == {ASSISTED}


def test_auto_measures_each_mode_once_per_bucket_then_picks_the_faster():
    chooser = ModeChooser(AssistSetting.AUTO, assist_configured=True)
    latency = {LOCAL: 10.0, ASSISTED: 4.0}
    assert run(chooser, latency, 5, batch=3) == [LOCAL, ASSISTED, ASSISTED, ASSISTED, ASSISTED]
    assert run(chooser, latency, 1, batch=4) == [ASSISTED]  # 3 and 4 share a bucket
    assert run(chooser, latency, 3, batch=5) == [LOCAL, ASSISTED, ASSISTED]  # bucket 8 is measured afresh
    assert run(chooser, latency, 3, batch=1) == [LOCAL, ASSISTED, ASSISTED]
    assert set(chooser.latency_ms) == {(m, b) for m in (LOCAL, ASSISTED) for b in (1, 4, 8)}


def test_auto_picks_local_when_it_is_faster_or_equal():
    chooser = ModeChooser(AssistSetting.AUTO, assist_configured=True)
    assert run(chooser, {LOCAL: 3.0, ASSISTED: 9.0}, 4) == [LOCAL, ASSISTED, LOCAL, LOCAL]
    tie = ModeChooser(AssistSetting.AUTO, assist_configured=True)
    assert run(tie, {LOCAL: 5.0, ASSISTED: 5.0}, 4) == [LOCAL, ASSISTED, LOCAL, LOCAL]


def test_record_keeps_a_moving_average_per_mode_and_bucket():
    chooser = ModeChooser(AssistSetting.AUTO, assist_configured=True)
    chooser.record(LOCAL, 3, 10.0)
    assert chooser.latency_ms[(LOCAL, 4)] == 10.0
    chooser.record(LOCAL, 4, 20.0)
    assert chooser.latency_ms[(LOCAL, 4)] == pytest.approx((1 - EMA_WEIGHT) * 10.0 + EMA_WEIGHT * 20.0)
    chooser.record(LOCAL, 5, 1.0)
    assert chooser.latency_ms[(LOCAL, 8)] == 1.0 and chooser.latency_ms[(LOCAL, 4)] != 1.0
    assert (ASSISTED, 4) not in chooser.latency_ms


def test_auto_reprobes_the_slower_mode_every_reprobe_every_iterations():
    chooser = ModeChooser(AssistSetting.AUTO, assist_configured=True)
    modes = run(chooser, {LOCAL: 10.0, ASSISTED: 4.0}, 3 * REPROBE_EVERY)
    probes = [i + 1 for i, mode in enumerate(modes[2:], start=2) if mode == LOCAL]  # 1-based iteration numbers
    assert probes == [REPROBE_EVERY, 2 * REPROBE_EVERY, 3 * REPROBE_EVERY]
    slow_assist = ModeChooser(AssistSetting.AUTO, assist_configured=True)
    modes = run(slow_assist, {LOCAL: 2.0, ASSISTED: 9.0}, 2 * REPROBE_EVERY)
    assert [i + 1 for i, mode in enumerate(modes) if mode == ASSISTED] == [2, REPROBE_EVERY, 2 * REPROBE_EVERY]


def test_reprobes_notice_a_change():
    """Local is faster at first; then the GPU frees up and assisted becomes much faster."""
    chooser = ModeChooser(AssistSetting.AUTO, assist_configured=True)
    assert run(chooser, {LOCAL: 5.0, ASSISTED: 8.0}, REPROBE_EVERY - 1)[2:] == [LOCAL] * (REPROBE_EVERY - 3)
    modes = run(chooser, {LOCAL: 5.0, ASSISTED: 1.0}, 10 * REPROBE_EVERY)  # modes[j] is iteration REPROBE_EVERY + j
    probes = [j for j in range(0, len(modes), REPROBE_EVERY)]
    # before the switch: local, with assisted probes; the moving average catches up within a few probes
    switch = next(j for j, mode in enumerate(modes) if mode == ASSISTED and j not in probes)
    assert switch - 1 in probes and 0 < switch < 4 * REPROBE_EVERY
    assert all(mode == (ASSISTED if j in probes else LOCAL) for j, mode in enumerate(modes[:switch]))
    # after: assisted, with local probes
    assert all(mode == (LOCAL if j in probes else ASSISTED) for j, mode in enumerate(modes) if j >= switch)


def test_backoff_after_failure_grows_exponentially_to_the_max():
    chooser = ModeChooser(AssistSetting.ALWAYS, assist_configured=True)
    assert chooser.choose(4, decode_only=True) == ASSISTED
    expected = BACKOFF_MIN_ITERATIONS
    seen = []
    while True:
        chooser.record_assist_failure()  # the assisted iteration just chosen failed (and is redone locally)
        # locally for `expected` iterations counting the failed one, then assisted again
        assert locals_until_assisted(chooser) == expected - 1
        seen.append(expected)
        if expected == BACKOFF_MAX_ITERATIONS and seen.count(expected) == 2:
            break
        expected = min(2 * expected, BACKOFF_MAX_ITERATIONS)
    assert seen[:4] == [BACKOFF_MIN_ITERATIONS * 2**i for i in range(4)]
    assert seen[-2:] == [BACKOFF_MAX_ITERATIONS] * 2


def test_backoff_resets_after_a_successful_assisted_iteration():
    chooser = ModeChooser(AssistSetting.ALWAYS, assist_configured=True)
    for _ in range(3):
        assert chooser.choose(4, decode_only=True) == ASSISTED
        chooser.record_assist_failure()
        locals_until_assisted(chooser)
    chooser.record_assist_failure()
    assert locals_until_assisted(chooser) == 8 * BACKOFF_MIN_ITERATIONS - 1
    chooser.record(LOCAL, 4, 1.0)  # a local iteration does not reset it
    chooser.record(ASSISTED, 4, 1.0)  # the assisted iteration succeeded
    assert chooser.backoff_iterations == BACKOFF_MIN_ITERATIONS
    chooser.record_assist_failure()
    assert locals_until_assisted(chooser) == BACKOFF_MIN_ITERATIONS - 1


def test_local_iteration_does_not_reset_backoff():
    chooser = ModeChooser(AssistSetting.ALWAYS, assist_configured=True)
    chooser.choose(4, decode_only=True)
    chooser.record_assist_failure()
    chooser.record(LOCAL, 4, 1.0)
    assert chooser.backoff_iterations == 2 * BACKOFF_MIN_ITERATIONS


def test_backoff_applies_in_auto_and_counts_dense_iterations():
    chooser = ModeChooser(AssistSetting.AUTO, assist_configured=True)
    run(chooser, {LOCAL: 10.0, ASSISTED: 1.0}, 3)
    assert chooser.choose(4, decode_only=True) == ASSISTED
    chooser.record_assist_failure()
    for _ in range(BACKOFF_MIN_ITERATIONS - 1):  # prefill iterations spend the backoff too
        assert chooser.choose(4, decode_only=False) == LOCAL
    assert chooser.choose(4, decode_only=True) == ASSISTED


# -- seeding from a profile's cost model ---------------------------------------------------------

from dualpace.policy.mode_choice import batch_buckets, predicted_latencies


def test_buckets_cover_the_max_batch():
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(65) == [1, 2, 4, 8, 16, 32, 64, 128]


def test_predicted_latencies_per_bucket():
    predicted = predicted_latencies(lambda b: 10.0 * b, lambda b: 30.0 + b, 8)
    assert predicted == {(LOCAL, 1): 10.0, (ASSISTED, 1): 31.0, (LOCAL, 2): 20.0, (ASSISTED, 2): 32.0,
                         (LOCAL, 4): 40.0, (ASSISTED, 4): 34.0, (LOCAL, 8): 80.0, (ASSISTED, 8): 38.0}
    assert set(predicted_latencies(lambda b: 1.0, None, 2)) == {(LOCAL, 1), (LOCAL, 2)}


def seeded(local, assisted, max_batch=16):
    chooser = ModeChooser(AssistSetting.AUTO, assist_configured=True)
    chooser.seed(predicted_latencies(local, assisted, max_batch))
    return chooser


def test_seeded_chooser_picks_the_predicted_faster_mode_without_probing_first():
    # Local grows with the batch, assisted is flat: small batches local, large ones assisted.
    chooser = seeded(lambda b: 5.0 * b, lambda b: 22.0)
    assert chooser.choose(2, decode_only=True) == LOCAL  # bucket 2: 10 < 22
    assert chooser.choose(8, decode_only=True) == ASSISTED  # bucket 8: 40 > 22
    unseeded = ModeChooser(AssistSetting.AUTO, assist_configured=True)
    assert unseeded.choose(8, decode_only=True) == LOCAL  # measures local first


def test_measurements_take_over_from_the_prediction():
    chooser = seeded(lambda b: 5.0 * b, lambda b: 22.0)
    assert chooser.estimate_ms(ASSISTED, 8) == 22.0
    chooser.record(ASSISTED, 8, 90.0)  # the GPU is busy: assisted is really slow
    assert chooser.estimate_ms(ASSISTED, 8) == 90.0  # replaced, not averaged with the prediction
    assert chooser.choose(8, decode_only=True) == LOCAL
    chooser.record(LOCAL, 8, 41.0)
    assert chooser.estimate_ms(LOCAL, 8) == 41.0
    chooser.record(LOCAL, 8, 51.0)
    assert chooser.estimate_ms(LOCAL, 8) == pytest.approx((1 - EMA_WEIGHT) * 41.0 + EMA_WEIGHT * 51.0)


def test_seeded_device_wait_uses_the_predicted_local_latency():
    chooser = seeded(lambda b: 5.0 * b, lambda b: 22.0)
    assert chooser.max_device_wait_ms(16) == 80


def test_seed_does_not_override_settings_or_prefill():
    chooser = ModeChooser(AssistSetting.NEVER, assist_configured=True)
    chooser.seed(predicted_latencies(lambda b: 100.0, lambda b: 1.0, 8))
    assert chooser.choose(8, decode_only=True) == LOCAL
    chooser = seeded(lambda b: 100.0, lambda b: 1.0)
    assert chooser.choose(8, decode_only=False) == LOCAL


COOPERATIVE = ExecutionMode.COOPERATIVE


def test_cooperative_is_offered_only_where_the_server_joins():
    plain = ModeChooser(AssistSetting.AUTO, assist_configured=True)
    assert COOPERATIVE not in run(plain, {LOCAL: 50.0, ASSISTED: 30.0, COOPERATIVE: 1.0}, 200)
    assert ModeChooser(AssistSetting.ALWAYS, assist_configured=True).choose(4, decode_only=True) == ASSISTED


def test_always_means_cooperative_when_the_server_joins():
    gated = ModeChooser(AssistSetting.ALWAYS, assist_configured=True, cooperative_configured=True)
    assert set(run(gated, {LOCAL: 1.0, ASSISTED: 1.0, COOPERATIVE: 100.0}, 50)) == {COOPERATIVE}
    assert gated.max_join_wait_ms(4) == 0.0  # gated waits up to the stage timeout
    assert gated.choose(4, decode_only=False) == LOCAL  # prefills never join


def test_auto_measures_all_three_then_prefers_the_fastest_and_reprobes_the_others():
    chooser = ModeChooser(AssistSetting.AUTO, assist_configured=True, cooperative_configured=True)
    modes = run(chooser, {LOCAL: 50.0, ASSISTED: 30.0, COOPERATIVE: 20.0}, 4 * REPROBE_EVERY)
    assert modes[:3] == [LOCAL, COOPERATIVE, ASSISTED]
    assert modes.count(COOPERATIVE) >= 4 * REPROBE_EVERY - 8
    assert LOCAL in modes[3:] and ASSISTED in modes[3:]  # both others get re-probed


def test_a_staged_run_teaches_assisted_and_the_chooser_follows():
    chooser = ModeChooser(AssistSetting.AUTO, assist_configured=True, cooperative_configured=True)
    chooser.seed({(LOCAL, 4): 50.0, (ASSISTED, 4): 40.0, (COOPERATIVE, 4): 20.0})
    assert chooser.choose(4, decode_only=True) == COOPERATIVE
    assert chooser.max_join_wait_ms(4) == pytest.approx(30.0)  # its slack against local
    for _ in range(30):  # the GPU got busy: cooperative measured slow, staged runs recorded as assisted
        chooser.record(COOPERATIVE, 4, 80.0)
        chooser.record(ASSISTED, 4, 35.0)
    assert chooser.choose(4, decode_only=True) == ASSISTED
    assert chooser.max_join_wait_ms(4) == 0.0  # no slack left: never wait for a join


def test_cooperative_seed_values():
    predicted = predicted_latencies(lambda b: 10.0 * b, lambda b: 5.0, 4, cooperative_ms=lambda b: 3.0)
    assert predicted[(COOPERATIVE, 4)] == 3.0 and predicted[(LOCAL, 2)] == 20.0
    assert (COOPERATIVE, 1) not in predicted_latencies(lambda b: 1.0, None, 4)


def test_a_cooperative_request_run_staged_teaches_both_modes():
    chooser = ModeChooser(AssistSetting.AUTO, assist_configured=True, cooperative_configured=True)
    chooser.record_cooperative(4, 30.0, ran_staged=False)
    assert chooser.estimate_ms(ASSISTED, 4) is None and chooser.estimate_ms(COOPERATIVE, 4) == 30.0
    chooser.record_cooperative(4, 130.0, ran_staged=True)  # not taken in time: staged
    assert chooser.estimate_ms(ASSISTED, 4) == 130.0
    assert chooser.estimate_ms(COOPERATIVE, 4) == pytest.approx((1 - EMA_WEIGHT) * 30.0 + EMA_WEIGHT * 130.0)


def test_a_busy_refusal_is_learnt_as_a_latency_not_a_backoff():
    """A device mode refused because the GPU was busy past the budget (RESOURCE_EXHAUSTED) keeps
    the chooser on it while its learnt latency, the refusal and local redo included, still beats
    Local: a backoff ran batches whose Local iteration was 5x slower locally (simulated A10G)."""
    chooser = ModeChooser(AssistSetting.AUTO, assist_configured=True)
    chooser.seed({(LOCAL, 64): 540.0, (ASSISTED, 64): 110.0})
    assert chooser.choose(50, decode_only=True) == ASSISTED
    chooser.record(ASSISTED, 50, 110.0)  # measured once (the first measurement replaces the seed)
    assert chooser.choose(50, decode_only=True) == ASSISTED
    chooser.record_device_busy(ASSISTED, 50, 300.0 + 540.0)  # refused after its budget, redone locally
    assert chooser.backoff_until == 0
    assert chooser.estimate_ms(ASSISTED, 64) == pytest.approx((1 - EMA_WEIGHT) * 110.0 + EMA_WEIGHT * 840.0)
    assert chooser.choose(50, decode_only=True) == ASSISTED  # 256 ms learnt, still faster than 540 local
    for _ in range(10):  # refused every time: its latency rises past Local's, which then wins
        chooser.record_device_busy(ASSISTED, 50, 840.0)
    assert chooser.estimate_ms(ASSISTED, 64) > 540.0
    assert chooser.choose(50, decode_only=True) == LOCAL


def test_a_refused_cooperative_ask_is_learnt_as_cooperative_and_assisted():
    chooser = ModeChooser(AssistSetting.AUTO, assist_configured=True, cooperative_configured=True)
    chooser.record_device_busy(ExecutionMode.COOPERATIVE, 8, 200.0)
    assert chooser.latency_ms == {(ExecutionMode.COOPERATIVE, 8): 200.0, (ASSISTED, 8): 200.0}
    assert chooser.backoff_until == 0
    with pytest.raises(ValueError):
        chooser.record_device_busy(LOCAL, 8, 200.0)
