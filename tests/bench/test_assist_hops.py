"""bench/assist_hops.py runs end to end (the tiny model's shapes, a few iterations): every layer's
round trip is split into the eight hops, and the marks of both processes pair up (no hop ends
before it starts, which a mark paired with the wrong message would show). No figure is asserted."""

from __future__ import annotations

from bench.assist_hops import HOPS, measure


def test_measure_splits_every_round_trip_into_ordered_hops(synth_checkpoint):
    result = measure(batch=3, model=str(synth_checkpoint("tiny-llama")), dtype="fp32", num_iterations=3,
                     num_warmup=1)
    assert result["num_round_trips"] == 3 * (3 - 1)  # iterations x (layers - 1)
    assert result["num_out_of_order"] == 0
    assert set(result["hops_us_p50"]) == set(HOPS) | {"total"}
    assert all(value >= 0 for value in result["hops_us_p50"].values())
    assert result["hops_us_p50"]["total"] <= result["total_us_p99"]


def test_stage_after_gaps_times_every_gap(synth_checkpoint):
    from bench.assist_hops import stage_after_gaps

    result = stage_after_gaps(gaps_us=(0, 50), batch=2, model=str(synth_checkpoint("tiny-llama")), dtype="fp32",
                              count=5)
    assert set(result["stage_us_p50_after_gap"]) == {"sleep_0us", "sleep_50us", "busy_50us"}
    assert all(value > 0 for value in result["stage_us_p50_after_gap"].values())
