"""bench/sim_acceptance.py: the SLO rule, the max rate under it, and one small real case end to end."""

from __future__ import annotations

import json

import pytest

from bench import sim_acceptance as acc


def _row(rate, itl, ttft=100.0, tps=None):
    return {"rate": rate, "p99_itl_ms": itl, "p50_ttft_ms": ttft, "throughput_tokens_per_s": tps or 100 * rate}


def test_slo_is_100_ms_unless_gpu_only_floor_reaches_it():
    assert acc.slo_for([_row(2, 120), _row(1, 40)]) == (100.0, "100 ms")
    assert acc.slo_for([_row(1, 99)]) == (100.0, "100 ms")
    slo, rule = acc.slo_for([_row(1, 232), _row(2, 400)])
    assert slo == 464.0 and "232" in rule


def test_max_rate_interpolates_to_the_first_miss_and_the_tighter_bound_decides():
    rows = [_row(1, 50), _row(2, 90), _row(3, 130)]
    rate, how = acc.max_rate(rows, 100.0)
    assert how == "interpolated" and rate == pytest.approx(2 + 0.1 / (0.1 + 0.3))
    # ITL holds everywhere, TTFT breaks at rate 3: its bound decides
    rate, _ = acc.max_rate([_row(1, 50), _row(2, 50, ttft=1000), _row(3, 50, ttft=4000)], 100.0, ttft_bound_ms=2000)
    assert rate == pytest.approx(2 + 0.5 / (0.5 + 1.0))
    assert acc.max_rate([_row(1, 150)], 100.0) == (None, "no swept rate meets it")
    assert acc.max_rate([_row(1, 10), _row(2, 20)], 100.0) == (2, "every swept rate meets it")


def test_gain_and_verdict_say_how_far_below_the_paper():
    assert acc.gain(110, 100) == 10.0 and acc.gain(None, 100) is None
    assert "2.9 pts below" in acc._verdict(4.0, "vs NEO")
    assert "within" in acc._verdict(20.0, "vs vLLM")


def test_one_small_case_runs_and_writes_json_and_markdown(tmp_path, monkeypatch):
    small = acc.Case("tiny-a10g", "a10g_epyc_avx2_llama3_8b", "neo", "800:1200", "50:100", (0.5, 2.0))
    monkeypatch.setattr(acc, "CASES", (small,))
    out = tmp_path / "acc.json"
    assert acc.main(["--cases", "tiny-a10g", "--variants", "measured_overheads", "--num-requests", "12",
                     "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (case,) = report["cases"]
    assert case["profile"] == "a10g_epyc_avx2_llama3_8b_measured_overheads"
    assert set(case["runs"]) == {"gpu-only", "gated (as built)", "dualpace", "dualpace (staged)"}
    assert case["slo_p99_itl_ms"] > 100  # the A10G's floor (a 2048-token step with prefill) is above 50 ms
    assert all(r["requests_completed"] == 12 for rows in case["runs"].values() for r in rows)
    assert "| tiny-a10g (neo) | measured_overheads |" in out.with_suffix(".md").read_text()


def test_unknown_case_is_a_clear_error(capsys):
    assert acc.main(["--cases", "nope"]) == 2
    assert "unknown case" in capsys.readouterr().err
