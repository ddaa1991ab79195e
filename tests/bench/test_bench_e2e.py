"""`dualpace bench` end to end: a real `dualpace up` (tiny model) and 10 requests at a high rate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from toolkit.processes import start_up

START_TIMEOUT_S = 60.0
BENCH_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def router(synth_checkpoint):
    try:
        up = start_up("--model", str(synth_checkpoint("tiny-llama")), "--dtype", "fp32", "--threads-per-engine", "1",
                      timeout_s=START_TIMEOUT_S)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield up.address
    up.stop(timeout_s=30)


def bench(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dualpace", "bench", *argv], capture_output=True, text=True,
                          timeout=BENCH_TIMEOUT_S, check=False)


def test_bench_accounts_for_every_request(router, tmp_path):
    out = tmp_path / "bench.json"
    done = bench("--router", router, "--rate", "50", "--num-requests", "10", "--input-len", "4:12",
                 "--output-len", "3:8", "--seed", "1", "--timeout-s", "45", "--slo-ttft-ms", "60000",
                 "--slo-itl-ms", "60000", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    summary = report["summary"]
    acc = summary["accounting"]
    assert (acc["planned"], acc["sent"], acc["completed"], acc["failed"], acc["not_sent"]) == (10, 10, 10, 0, 0)
    assert "sent 10 = completed 10 + failed 0" in done.stderr
    for key in ("request_throughput_rps", "output_token_throughput_tps", "goodput_rps", "failures", "duration_s"):
        assert key in summary
    for metric in ("ttft", "itl", "tpot", "e2e"):
        assert set(summary[metric]) >= {"mean_ms", "p50_ms", "p99_ms"}
        assert summary[metric]["p50_ms"] is not None
    assert summary["goodput_rps"] == summary["request_throughput_rps"] > 0
    requests = report["requests"]
    assert len(requests) == 10 and all(r["status"] == "OK" and r["finish_reason"] == "length" for r in requests)
    assert all(r["tokens"] == r["output_len"] for r in requests)  # ignore_eos, max_tokens = output length
    assert summary["output_tokens"] == sum(r["output_len"] for r in requests)
    # every token is counted against the engine that sent it (up names them gpu and cpu)
    assert set(summary["tokens_by_engine"]) <= {"gpu", "cpu"}
    assert sum(summary["tokens_by_engine"].values()) == summary["output_tokens"]


def test_bench_flag_errors_name_the_flag(router, tmp_path):
    done = bench("--router", router, "--rate", "5", "--num-requests", "2", "--input-len", "9:3",
                 "--output-len", "4", "--out", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "--input-len" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_shared_prefix_and_multi_turn_workloads_hit_the_prefix_cache(router, tmp_path):
    out = tmp_path / "shared.json"
    done = bench("--router", router, "--workload", "shared-prefix", "--system-len", "40", "--question-len", "3:9",
                 "--rate", "inf", "--num-requests", "6", "--output-len", "4", "--timeout-s", "45", "--out", str(out))
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())["summary"]
    assert summary["accounting"]["completed"] == 6 and summary["workload"] == "shared-prefix"
    assert summary["prefix_cache_hit_rate"] > 0  # requests after the first reuse the system prompt's blocks
    assert "prefix-cache hit rate" in done.stderr

    out = tmp_path / "turns.json"
    done = bench("--router", router, "--workload", "multi-turn", "--system-len", "24", "--question-len", "5",
                 "--num-turns", "3", "--rate", "inf", "--num-requests", "6", "--output-len", "6",
                 "--timeout-s", "45", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    rows = report["requests"]
    assert report["summary"]["accounting"]["completed"] == 6
    assert [r["input_len"] for r in rows[:3]] == [24 + 5, 24 + 5 + 6 + 5, 24 + 2 * (5 + 6) + 5]  # history resent
    assert all(r["cached_tokens"] > 0 for r in rows if r["index"] % 3 > 0)
    assert len(report["summary"]["ttft_p50_ms_by_turn"]) == 3
