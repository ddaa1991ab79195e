"""Traces with arrival times: written by bench.compare_policies, replayed by `dualpace sim --trace`."""

import json

import pytest

from dualpace.errors import InvalidArgument
from dualpace.policy.policies import Policy
from dualpace.profile.cost_model import CostModel
from dualpace.profile.files import parse_profile
from dualpace_cli.main import main
from profiles.sim import SimConfig, Simulator
from tests.profiles.tiny import tiny_profile_dict
from toolkit.workload import (
    build_requests,
    load_trace,
    parse_length_spec,
    trace_has_arrivals,
    write_trace,
)


def _specs(num=12, rate=5.0, seed=3):
    return build_requests(num, rate, 1.0, seed, 100, parse_length_spec("4:12", "i"), parse_length_spec("3:9", "o"))


def test_written_trace_replays_the_same_requests_at_the_same_times(tmp_path):
    specs = _specs()
    path = tmp_path / "t.jsonl"
    write_trace(path, specs)
    trace = load_trace(path)
    assert trace_has_arrivals(trace)
    # rate, burstiness and seed no longer matter: the trace gives everything
    again = build_requests(len(specs), 123.0, 4.0, 99, 100, trace=trace)
    assert [(s.index, s.prompt_token_ids, s.output_len) for s in again] == \
        [(s.index, s.prompt_token_ids, s.output_len) for s in specs]
    assert [s.arrival_s for s in again] == pytest.approx([s.arrival_s for s in specs], abs=1e-9)
    assert len(build_requests(5, 1.0, 1.0, 0, 100, trace=trace)) == 5
    with pytest.raises(InvalidArgument, match="--num-requests"):
        build_requests(len(specs) + 1, 1.0, 1.0, 0, 100, trace=trace)


def test_arrivals_are_relative_to_the_first_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"input_len": 3, "output_len": 2, "arrival_s": t}) + "\n" for t in (10, 10.5, 12)))
    reqs = build_requests(3, 1.0, 1.0, 0, 100, trace=load_trace(path))
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 2.0]


@pytest.mark.parametrize("lines, problem", [
    ([{"input_len": 3, "output_len": 2, "arrival_s": 0}, {"input_len": 3, "output_len": 2}], "arrival_s missing"),
    ([{"input_len": 3, "output_len": 2, "arrival_s": 1}, {"input_len": 3, "output_len": 2, "arrival_s": 0.5}],
     "back in time"),
    ([{"input_len": 3, "output_len": 2, "arrival_s": -1}], "arrival_s must be"),
    ([{"input_len": 3, "output_len": 2, "arrival_s": "soon"}], "arrival_s must be"),
])
def test_bad_arrivals_name_the_line(tmp_path, lines, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(InvalidArgument, match=problem) as info:
        load_trace(path)
    assert "bad.jsonl:" in str(info.value)


def test_traces_without_arrivals_are_unchanged(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"input_len": 5, "output_len": 3}) + "\n")
    trace = load_trace(path)
    assert trace == [(5, 3)] and not trace_has_arrivals(trace)
    assert len(build_requests(4, 1.0, 1.0, 0, 100, trace=trace)) == 4  # cycles through the lines


def test_sim_cli_replays_a_trace_with_arrivals(tmp_path, capsys):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(tiny_profile_dict()))
    trace = tmp_path / "t.jsonl"
    write_trace(trace, _specs())
    common = ["sim", "--profile", str(profile), "--policy", "dualpace", "--trace", str(trace), "--json",
              "--gpu-kv-blocks", "8", "--cpu-kv-blocks", "64"]
    assert main([*common, "--rate", "1"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main([*common, "--rate", "50", "--seed", "7"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["requests_completed"] == first["num_requests"] == 12  # every line, by default
    for key in ("throughput_tokens_per_s", "p99_itl_ms", "p99_ttft_ms"):
        assert first[key] == second[key]  # the rate label differs, the replay does not


def test_kv_block_overrides_replace_the_profiles_capacities():
    cost = CostModel(parse_profile(tiny_profile_dict()))
    sim = Simulator(cost, SimConfig(policy=Policy.DUALPACE, gpu_kv_blocks=3, cpu_kv_blocks=40))
    assert sim.engines["gpu0"].scheduler.blocks.num_total_blocks == 3
    assert sim.engines["cpu0"].scheduler.blocks.num_total_blocks == 40


def test_sim_uses_the_cost_model_as_the_routers_predictor():
    cost = CostModel(parse_profile(tiny_profile_dict()))
    sim = Simulator(cost, SimConfig(policy=Policy.DUALPACE, itl_target_ms=50.0))
    assert sim.admission.predictor is cost and sim.migration.predictor is cost
    assert sim.migration.cpu_itl_target_ms == 50.0


def test_engine_overhead_delays_each_iteration_end():
    # GPU only, prompt of 1 token, 3 tokens out (test_simulator.test_hand_computed_gpu_itl: 10, 20.2, 30.5 ms);
    # 2 ms of host time per iteration: every iteration ends 2 ms later
    cost = CostModel(parse_profile(tiny_profile_dict()))
    from toolkit.workload import RequestSpec

    sim = Simulator(cost, SimConfig(policy=Policy.GPU_ONLY, engine_overhead_ms=2.0))
    (track,) = sim.run([RequestSpec(0, 0.0, (5,), 3)])
    assert track.token_times_ms == pytest.approx([12.0, 24.2, 36.5])
    with pytest.raises(ValueError):
        SimConfig(engine_overhead_ms=-1.0)


def test_router_views_are_snapshots_at_most_one_interval_old():
    cost = CostModel(parse_profile(tiny_profile_dict()))
    sim = Simulator(cost, SimConfig(policy=Policy.DUALPACE, view_interval_ms=100.0))
    gpu = sim.engines["gpu0"]
    assert sim._view(gpu, 0.0).kv_blocks_used == 0
    from dualpace.engine.request import EngineRequest
    from dualpace.sampling_params import SamplingParams

    gpu.scheduler.add(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), seed=0))
    gpu.scheduler.schedule()  # blocks allocated for the prefill
    assert gpu.scheduler.blocks.num_used_blocks > 0
    sim.now_ms = 99.0
    assert sim._view(gpu, 0.0).kv_blocks_used == 0  # the router has not heard yet
    sim.now_ms = 100.0
    assert sim._view(gpu, 0.0).kv_blocks_used == gpu.scheduler.blocks.num_used_blocks
    fresh = Simulator(cost, SimConfig(policy=Policy.DUALPACE, view_interval_ms=0.0))
    fresh.engines["gpu0"].scheduler.add(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True),
                                                      seed=0))
    fresh._view(fresh.engines["gpu0"], 0.0)
    fresh.engines["gpu0"].scheduler.schedule()
    assert fresh._view(fresh.engines["gpu0"], 0.0).kv_blocks_used > 0  # 0: always the current state
