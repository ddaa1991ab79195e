"""The solo-turns comparison's pure pieces: the cold twin, a later turn's solo prompt, pair validity, medians."""

from __future__ import annotations

import pytest

from bench.load.workloads import cold_twin
from bench.prefix_cache import pair_row, solo_prompt, solo_summary


def test_cold_twin_changes_only_the_first_token_within_the_vocabulary():
    for first in (0, 1, 5, 498, 499):
        twin = cold_twin([first, 7, 8], 500)
        assert twin[1:] == [7, 8] and twin[0] != first and 1 <= twin[0] < 500
    with pytest.raises(ValueError):
        cold_twin([], 500)
    with pytest.raises(ValueError):
        cold_twin([1], 2)


def test_solo_prompt_is_the_uncached_tail_started_afresh():
    prompt = list(range(10, 60))  # 50 tokens, the first 32 cached
    solo = solo_prompt(prompt, 32, 500)
    assert len(solo) == 18 and solo[1:] == prompt[33:] and solo[0] != prompt[32]
    assert solo[:16] != prompt[:16]  # its first block is none of the turn's
    assert len(solo_prompt(prompt, 50, 500)) == 1  # a full hit still computes the last token
    assert len(solo_prompt(prompt, 0, 500)) == 50
    for bad in (-1, 51):
        with pytest.raises(ValueError):
            solo_prompt(prompt, bad, 500)


def side(ttft_ms: float, cached: int, engines=("gpu",), prompt_tokens: int = 100) -> dict:
    return {"prompt_tokens": prompt_tokens, "ttft_ms": ttft_ms, "cached_tokens": cached, "engines": list(engines)}


def test_pairs_are_valid_only_when_the_turn_hit_the_twin_missed_and_one_engine_served_both():
    assert pair_row(0, 2, side(300.0, 64), side(200.0, 0, prompt_tokens=36))["valid"]
    row = pair_row(0, 2, side(300.0, 64), side(200.0, 0, prompt_tokens=36))
    assert row["ratio"] == 1.5 and row["new_tokens"] == 36
    assert not pair_row(0, 2, side(300.0, 0), side(200.0, 0))["valid"]
    assert not pair_row(0, 2, side(300.0, 64), side(200.0, 16))["valid"]
    assert not pair_row(0, 2, side(300.0, 64), side(200.0, 0, engines=("cpu",)))["valid"]


def test_solo_summary_takes_medians_over_the_valid_pairs_only():
    pairs = [pair_row(0, 2, side(t, 64), side(s, 0)) for t, s in ((300.0, 200.0), (100.0, 100.0), (900.0, 300.0))]
    pairs.append(pair_row(1, 2, side(5000.0, 0), side(10.0, 0)))  # missed the cache: left out
    summary = solo_summary(pairs)
    assert summary["num_pairs"] == 4 and summary["num_valid_pairs"] == 3
    assert summary["ratio_p50"] == 1.5 and summary["ratio_min"] == 1.0 and summary["ratio_max"] == 3.0
    assert summary["turn_ttft_p50_ms"] == 300.0 and summary["solo_ttft_p50_ms"] == 200.0
    assert solo_summary([])["ratio_p50"] is None
