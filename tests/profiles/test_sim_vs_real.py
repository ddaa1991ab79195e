"""bench.compare_policies' simulator comparison: the same requests, the deployment's configuration."""

import json

import pytest

from bench.compare_policies import (
    largest_gaps,
    measured_engine_overhead_ms,
    sim_comparison,
    sim_config,
)
from bench.load.stats import RequestRecord
from tests.profiles.tiny import tiny_profile_dict
from toolkit.workload import build_requests, parse_length_spec, write_trace

CONFIG = {"gpu_kv_blocks": 8, "cpu_kv_blocks": 64, "admission_itl_target_ms": None, "vocab_size": 100,
          "num_requests": 6, "burstiness": 1.0, "seed": 0, "input_len": "4:8", "output_len": "3:6"}


def _report(policy: str, **run_extra) -> dict:
    row = {"rate_rps": 5.0, "request_throughput_rps": 2.0, "output_token_throughput_tps": 10.0,
           "itl_p99_ms": 50.0, "itl_p50_ms": 20.0, "ttft_p50_ms": 30.0}
    return {"config": dict(CONFIG), "policies": {policy: {"rows": [row], "runs": [{"rate_rps": 5.0, **run_extra}]}}}


def test_sim_config_mirrors_the_started_deployment():
    config = sim_config({**CONFIG, "admission_itl_target_ms": 80.0}, "gated", engine_overhead_ms=1.5)
    assert config.policy.value == "gated"
    assert config.gpu_scheduler.max_batch_tokens == 512 and config.gpu_scheduler.max_running == 64
    assert config.cpu_scheduler.max_running == 64
    assert (config.gpu_kv_blocks, config.cpu_kv_blocks, config.itl_target_ms, config.engine_overhead_ms) == \
        (8, 64, 80.0, 1.5)
    assert config.assist_device_hold == "cooperative"  # gated as the daemons run it (joins), not held


@pytest.mark.parametrize("with_trace", [False, True])
def test_comparison_simulates_the_runs_requests(tmp_path, with_trace):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(tiny_profile_dict()))
    trace_dir = None
    if with_trace:
        trace_dir = tmp_path / "traces"
        trace_dir.mkdir()
        specs = build_requests(6, 5.0, 1.0, 0, 100, parse_length_spec("4:8", "i"), parse_length_spec("3:6", "o"))
        write_trace(trace_dir / "trace_r5.jsonl", specs)
    rows, table = sim_comparison(_report("dualpace", load_average_1m={"before": 1.0, "after": 2.0}),
                                 str(profile), str(trace_dir) if trace_dir else None)
    (row,) = rows
    assert row["sim_tps"] > 0 and row["sim_itl_p99_ms"] is not None
    assert row["err_tps_pct"] == pytest.approx(round(100 * (row["sim_tps"] - 10.0) / 10.0, 1))
    assert "| dualpace | 5 | 1.0-2.0 |" in table


def test_measured_engine_overhead_is_cpu_time_minus_simulated_busy_time(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(tiny_profile_dict()))
    (row,) = measured_engine_overhead_ms(_report("gpu-only", cpu_s={"gpu_service": 5.0}), str(profile))
    expected = (5000.0 - 1000 * row["simulated_busy_s"]) / row["iterations"]
    assert row["overhead_ms_per_iteration"] == pytest.approx(expected, abs=0.01)
    assert measured_engine_overhead_ms(_report("gpu-only"), str(profile)) == []  # no CPU accounting


def test_largest_gaps_say_where_they_happened():
    a = RequestRecord(0, 4, 3, scheduled_s=0.0, sent_s=10.0, messages=[(10.1, 1), (10.2, 1), (10.7, 1)],
                      engines=["gpu", "cpu"])
    b = RequestRecord(1, 4, 2, scheduled_s=0.0, sent_s=10.05, messages=[(10.3, 1), (10.35, 0), (10.4, 1)])
    gaps = largest_gaps([a, b], count=2)
    assert gaps[0] == {"gap_ms": 500.0, "request": 0, "token": 2, "tokens_in_message": 1, "engines": "gpu -> cpu",
                       "at_s": 0.2}
    assert gaps[1]["gap_ms"] == 100.0 and len(gaps) == 2


@pytest.mark.parametrize("policy", ["gpu-only", "dualpace"])
def test_comparison_says_where_the_tokens_were_decoded(tmp_path, policy):
    """Real tokens by the GPU engine (the load generator's tokens_by_engine) beside the simulated
    ones: gpu-only decodes every token there; dualpace hands requests to the CPU engine."""
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(tiny_profile_dict()))
    summary = {"tokens_by_engine": {"gpu": 7, "cpu": 20}}
    (row,), table = sim_comparison(_report(policy, summary=summary), str(profile))
    assert row["real_gpu_engine_tokens"] == 7
    from profiles.sim import simulate

    specs = build_requests(6, 5.0, 1.0, 0, 100, parse_length_spec("4:8", "i"), parse_length_spec("3:6", "o"))
    from dualpace.profile.cost_model import CostModel
    from dualpace.profile.files import load_profile

    sim = simulate(CostModel(load_profile(str(profile))), sim_config(CONFIG, policy), specs, 5.0)
    assert row["sim_gpu_engine_tokens"] == sim.num_gpu_engine_tokens
    assert 0 < sim.num_gpu_engine_tokens <= sim.num_generated_tokens
    # all of them unless a request decoded on the CPU engine
    assert (sim.num_gpu_engine_tokens == sim.num_generated_tokens) == (sim.requests_touching_cpu == 0)
    assert f"| 7 / {sim.num_gpu_engine_tokens} |" in table
