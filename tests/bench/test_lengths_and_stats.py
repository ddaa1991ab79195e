"""The load generator's pure parts: SPECs, traces, seeded arrivals and lengths, statistics, accounting."""

from __future__ import annotations

import json
import statistics
from itertools import pairwise

import pytest

from bench.load.report import comparison_table, highest_rate_meeting, value_at_itl
from bench.load.stats import AccountingError, RequestRecord, summarize
from dualpace.errors import InvalidArgument
from dualpace.stats import percentile
from toolkit.workload import (
    LengthSpec,
    arrival_times,
    build_requests,
    load_trace,
    parse_length_spec,
    parse_rates,
)

# ---- SPECs ----

@pytest.mark.parametrize("text, expected", [
    ("128", LengthSpec("fixed", 128)),
    ("64:256", LengthSpec("uniform", 64, 256)),
    ("7:7", LengthSpec("uniform", 7, 7)),
    ("lognormal:100:0.5", LengthSpec("lognormal", 100.0, 0.5)),
])
def test_parse_length_spec(text, expected):
    assert parse_length_spec(text, "--input-len") == expected


@pytest.mark.parametrize("text", ["", "abc", "0", "-3", "5:2", "0:4", "1:2:3", "lognormal:100", "lognormal:x:1",
                                  "lognormal:0.5:1", "lognormal:100:-1", "uniform:1:2", "1.5"])
def test_bad_length_spec_names_the_flag(text):
    with pytest.raises(InvalidArgument) as info:
        parse_length_spec(text, "--output-len")
    assert info.value.field == "--output-len"


def test_uniform_is_inclusive_and_lognormal_mean():
    import random

    rng = random.Random(1)
    draws = [LengthSpec("uniform", 3, 5).sample(rng) for _ in range(2000)]
    assert set(draws) == {3, 4, 5}
    logn = [LengthSpec("lognormal", 200, 0.5).sample(rng) for _ in range(20000)]
    assert min(logn) >= 1
    assert abs(statistics.mean(logn) - 200) < 6


def test_parse_rates():
    assert parse_rates("0.5,1,inf") == [0.5, 1.0, float("inf")]
    for bad in ("", "a,b", "1,0", "-1"):
        with pytest.raises(InvalidArgument, match="--rates"):
            parse_rates(bad)


# ---- seeded determinism ----

def test_arrivals_are_seeded_and_scale_with_rate():
    a = arrival_times(200, 2.0, 1.0, seed=7)
    assert a == arrival_times(200, 2.0, 1.0, seed=7)
    assert a != arrival_times(200, 2.0, 1.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in pairwise(a))
    b = arrival_times(200, 4.0, 1.0, seed=7)
    assert b == pytest.approx([t / 2 for t in a])
    # mean gap is 1/rate for any burstiness; burstier means larger spread
    for burstiness in (0.25, 1.0, 4.0):
        t = arrival_times(4000, 5.0, burstiness, seed=3)
        assert t[-1] / 3999 == pytest.approx(0.2, rel=0.15)
    assert statistics.pstdev(gaps(arrival_times(4000, 5.0, 4.0, 3))) > statistics.pstdev(gaps(arrival_times(4000, 5.0, 0.25, 3)))
    assert arrival_times(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(InvalidArgument, match="--burstiness"):
        arrival_times(3, 1.0, 0.0, 0)


def test_requests_are_seeded_and_independent_of_rate():
    ins, outs = parse_length_spec("64:256", "--input-len"), parse_length_spec("lognormal:64:0.4", "--output-len")
    one = build_requests(30, 1.0, 1.0, 5, 500, ins, outs)
    again = build_requests(30, 1.0, 1.0, 5, 500, ins, outs)
    faster = build_requests(30, 8.0, 1.0, 5, 500, ins, outs)
    other = build_requests(30, 1.0, 1.0, 6, 500, ins, outs)
    assert one == again
    assert [(r.prompt_token_ids, r.output_len) for r in one] == [(r.prompt_token_ids, r.output_len) for r in faster]
    assert [r.prompt_token_ids for r in one] != [r.prompt_token_ids for r in other]
    assert all(64 <= r.input_len <= 256 and all(1 <= t < 500 for t in r.prompt_token_ids) for r in one)


def test_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"input_len": 5, "output_len": 3}) + "\n\n"
                    + json.dumps({"prompt_token_ids": [9, 8, 7], "output_len": 2}) + "\n")
    trace = load_trace(path)
    assert trace == [(5, 3), ((9, 8, 7), 2)]
    reqs = build_requests(5, 1.0, 1.0, 0, 500, trace=trace)
    assert [r.output_len for r in reqs] == [3, 2, 3, 2, 3]
    assert reqs[1].prompt_token_ids == (9, 8, 7) and reqs[0].input_len == 5
    bad = tmp_path / "bad.jsonl"
    for text, problem in [("{", "not JSON"), ('{"input_len": 3}', "output_len"),
                          ('{"output_len": 3}', "input_len"), ("", "no requests")]:
        bad.write_text(text + "\n")
        with pytest.raises(InvalidArgument, match=problem) as info:
            load_trace(bad)
        assert "--trace" in str(info.value)
    with pytest.raises(InvalidArgument, match="--trace"):
        load_trace(tmp_path / "missing.jsonl")


def gaps(times):
    return [y - x for x, y in pairwise(times)]


# ---- statistics on hand-made timings ----

def record(index, sent, token_times, end, status="OK", finish="length", input_len=10, output_len=None):
    r = RequestRecord(index, input_len, output_len or len(token_times), scheduled_s=sent, sent_s=sent,
                      messages=[(t, 1) for t in token_times], end_s=end, status=status,
                      finish_reason=finish if status == "OK" else None)
    return r


def test_percentile_matches_linear_interpolation():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([0, 10], 99) == pytest.approx(9.9)
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3


def test_summary_on_hand_made_timings():
    records = [
        # TTFT 0.1, gaps 0.05, 0.05, E2E 0.2
        record(0, 0.0, [0.1, 0.15, 0.2], 0.2),
        # TTFT 0.3, gaps 0.1, 0.3, E2E 0.7
        record(1, 1.0, [1.3, 1.4, 1.7], 1.7),
        # failed
        record(2, 1.0, [1.5], 1.6, status="UNAVAILABLE"),
        record(3, 1.2, [], 3.0, status="DEADLINE_EXCEEDED"),
    ]
    s = summarize(records, num_requests=5, duration_s=2.0, slo_ttft_ms=200, slo_itl_ms=400)
    acc = s["accounting"]
    assert (acc["planned"], acc["sent"], acc["completed"], acc["failed"], acc["not_sent"]) == (5, 4, 2, 2, 1)
    assert acc["line"].startswith("sent 4 = completed 2 + failed 2")
    assert s["failures"] == {"DEADLINE_EXCEEDED": 1, "UNAVAILABLE": 1}
    assert s["request_throughput_rps"] == 1.0
    assert s["output_token_throughput_tps"] == 3.0
    assert s["total_token_throughput_tps"] == 13.0
    assert s["ttft"]["mean_ms"] == 200.0 and s["ttft"]["p50_ms"] == 200.0
    assert s["ttft"]["p99_ms"] == pytest.approx(298.0)
    assert s["itl"]["count"] == 4
    assert s["itl"]["mean_ms"] == 125.0 and s["itl"]["p50_ms"] == 75.0 and s["itl"]["max_ms"] == 300.0
    assert s["tpot"]["mean_ms"] == pytest.approx((50 + 200) / 2)
    assert s["e2e"]["p50_ms"] == 450.0
    # request 1 misses the TTFT SLO (300 > 200 ms); request 0 meets both
    assert s["slo"]["requests_meeting"] == 1 and s["goodput_rps"] == 0.5
    assert summarize(records, 5, 2.0, slo_itl_ms=250)["slo"]["requests_meeting"] == 1  # request 1's gap 300
    assert summarize(records, 5, 2.0)["slo"]["requests_meeting"] == 2


def test_multi_token_messages_split_the_gap():
    r = RequestRecord(0, 4, 5, scheduled_s=0.0, sent_s=0.0, messages=[(0.1, 2), (0.4, 3)], end_s=0.4,
                      status="OK", finish_reason="length")
    assert r.ttft_s() == pytest.approx(0.1)
    assert r.itl_s() == pytest.approx([0.1, 0.1, 0.1])
    assert r.num_tokens == 5 and r.tpot_s() == pytest.approx(0.3 / 4)


def test_ok_without_finish_reason_is_a_failure_and_lost_requests_raise():
    s = summarize([record(0, 0.0, [0.1], 0.2, finish=None)], 1, 1.0)
    assert s["accounting"]["failed"] == 1 and s["failures"] == {"NO_FINISH_REASON": 1}
    lost = record(1, 0.0, [0.1], None)
    lost.status = None
    with pytest.raises(AccountingError):
        summarize([lost], 1, 1.0)
    with pytest.raises(AccountingError):
        summarize([record(0, 0.0, [0.1], 0.2)], 0, 1.0)  # more sent than planned


def test_empty_statistics_are_none():
    s = summarize([record(0, 0.0, [], 1.0, status="UNAVAILABLE")], 1, 1.0)
    assert s["ttft"]["p99_ms"] is None and s["itl"]["count"] == 0 and s["request_throughput_rps"] == 0


# ---- sweep comparison ----

def test_value_at_equal_itl_and_highest_rate():
    rows = [
        {"rate_rps": 1.0, "request_throughput_rps": 1.0, "itl_p99_ms": 100.0, "failed": 0},
        {"rate_rps": 2.0, "request_throughput_rps": 1.8, "itl_p99_ms": 200.0, "failed": 0},
        {"rate_rps": 4.0, "request_throughput_rps": 2.2, "itl_p99_ms": 600.0, "failed": 0},
    ]
    assert value_at_itl(rows, 150.0, "request_throughput_rps") == (pytest.approx(1.4), "interpolated")
    assert value_at_itl(rows, 400.0, "rate_rps") == (pytest.approx(3.0), "interpolated")
    assert value_at_itl(rows, 50.0, "rate_rps") == (None, "never under target")
    assert value_at_itl(rows, 1000.0, "request_throughput_rps") == (2.2, "all under target")
    assert highest_rate_meeting(rows, 250.0) == 2.0
    assert highest_rate_meeting(rows, 50.0) is None
    table = comparison_table({"a": rows, "b": rows[:1]}, 150.0)
    assert "| a | 1.400 |" in table and "| b |" in table and "all under target" in table


def test_a_lowest_rate_over_the_target_is_left_out_not_called_never_under():
    rows = [  # a measured dualpace sweep: its first rate over 1000 ms, the others under
        {"rate_rps": 1.0, "request_throughput_rps": 0.94, "itl_p99_ms": 1118.0, "failed": 0},
        {"rate_rps": 2.0, "request_throughput_rps": 1.80, "itl_p99_ms": 251.0, "failed": 0},
        {"rate_rps": 4.0, "request_throughput_rps": 1.70, "itl_p99_ms": 556.0, "failed": 0},
    ]
    value, how = value_at_itl(rows, 1000.0, "request_throughput_rps")
    assert value == 1.80 and how == "all under target; lowest 1 rate(s) over it, left out"
    assert "1.800 (all under target; lowest 1 rate(s) over it, left out)" in comparison_table({"d": rows}, 1000.0)
    assert value_at_itl(rows, 300.0, "rate_rps") == (pytest.approx(2.0 + 2 * 49 / 305),
                                                     "interpolated; lowest 1 rate(s) over it, left out")


def test_report_json_is_strict():
    from dualpace_cli.bench import strict_json

    value = strict_json({"rate": float("inf"), "rows": [{"x": float("nan"), "y": 1.5}], "t": (1, 2)})
    assert json.loads(json.dumps(value, allow_nan=False)) == {"rate": "inf", "rows": [{"x": "nan", "y": 1.5}],
                                                               "t": [1, 2]}
