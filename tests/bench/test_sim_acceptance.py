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


def test_gpu_wait_offload_slo_gives_the_slo_as_the_bound_to_the_policies_after_gpu_only(monkeypatch):
    small = acc.Case("tiny-a10g", "a10g_epyc_avx2_llama3_8b", "neo", "800:1200", "50:100", (0.5,))
    seen = []
    real_simulate = acc.simulate

    def spy(cost, config, specs, rate):
        seen.append((config.policy.value, config.gpu_wait_offload_ms, config.itl_target_ms))
        return real_simulate(cost, config, specs, rate)

    monkeypatch.setattr(acc, "simulate", spy)
    case = acc.run_case(small, "assumed", 6, 0, "slo")
    slo = case["slo_p99_itl_ms"]
    assert seen == [("gpu-only", None, None), ("gated", slo, slo), ("dualpace", slo, slo), ("dualpace", slo, slo)]
    assert case["gpu_wait_offload"] == "slo"
    seen.clear()
    acc.run_case(small, "assumed", 6, 0)
    assert [bound for _, bound, _ in seen] == [None, None, None, None]


def test_reuse_takes_the_rows_the_staged_refusal_does_not_touch_and_checks_the_report_matches(tmp_path, monkeypatch):
    small = acc.Case("tiny-a10g", "a10g_epyc_avx2_llama3_8b", "neo", "800:1200", "50:100", (0.5, 2.0))
    monkeypatch.setattr(acc, "CASES", (small,))
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    common = ["--cases", "tiny-a10g", "--variants", "assumed", "--num-requests", "10"]
    assert acc.main([*common, "--out", str(first)]) == 0
    assert acc.main([*common, "--staged-refusal", "begin", "--reuse", str(first), "--out", str(second)]) == 0
    (a,), (b,) = json.loads(first.read_text())["cases"], json.loads(second.read_text())["cases"]
    assert b["slo_p99_itl_ms"] == a["slo_p99_itl_ms"]
    for label in ("gpu-only", "gated (as built)", "dualpace (staged)"):
        assert b["runs"][label] == a["runs"][label]
    assert "--staged-refusal begin" in second.with_suffix(".md").read_text()
    assert acc.main([*common, "--seed", "1", "--reuse", str(first), "--out", str(second)]) == 2  # another seed
