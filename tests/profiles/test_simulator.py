import json

import pytest

from dualpace.policy.admission import GpuAdmission
from dualpace.policy.cooperative_plan import JoinHow
from dualpace.policy.mode_choice import ExecutionMode
from dualpace.policy.policies import Policy
from dualpace.profile.cost_model import CostModel, DecodeBatch
from dualpace.profile.files import parse_profile
from dualpace_cli.main import main
from profiles.sim import CPU, GPU, SimConfig, Simulator, simulate
from profiles.sim.device import SharedDevice
from profiles.sim.results import summarize
from tests.profiles.tiny import tiny_profile_dict
from toolkit.workload import RequestSpec, build_requests, parse_length_spec

REFERENCE = "profiles/reference/h100_sapphire_rapids_llama3_8b.json"


def _cost(**capacities) -> CostModel:
    data = tiny_profile_dict()
    data["capacities"].update(capacities)
    return CostModel(parse_profile(data))


def _specs(num: int = 20, rate: float = 50.0, seed: int = 0):
    return build_requests(num, rate, 1.0, seed, 100, parse_length_spec("8", "--input-len"),
                          parse_length_spec("4:12", "--output-len"))


@pytest.mark.parametrize("policy", list(Policy))
def test_all_requests_complete_and_deterministic(policy):
    cost = _cost(gpu_kv_blocks=16)  # a small GPU: the CPU engine gets work
    first = simulate(cost, SimConfig(policy=policy), _specs(), 50.0)
    again = simulate(cost, SimConfig(policy=policy), _specs(), 50.0)
    assert first == again
    assert first.requests_completed == first.num_requests == 20
    assert first.num_generated_tokens == sum(s.output_len for s in _specs())
    if policy is not Policy.GPU_ONLY:
        assert first.requests_touching_cpu > 0
    other_seed = simulate(cost, SimConfig(policy=policy), _specs(seed=1), 50.0)
    assert other_seed != first


def test_gpu_only_never_uses_a_cpu_engine():
    sim = Simulator(_cost(gpu_kv_blocks=16), SimConfig(policy=Policy.GPU_ONLY))
    tracks = sim.run(_specs())
    assert CPU not in sim.engines
    assert all(t.engines_seen == [GPU] for t in tracks)
    result = summarize(sim, 50.0)
    assert result.cpu_iterations == 0 and result.num_handoffs == 0 and result.num_migrations == 0


def test_gpu_only_preempts_by_recompute_and_still_finishes():
    cost = _cost(gpu_kv_blocks=12)  # 48 KV tokens: 8 requests of up to 20 tokens cannot all run
    specs = build_requests(8, float("inf"), 1.0, 0, 100, parse_length_spec("8", "i"), parse_length_spec("12", "o"))
    result = simulate(cost, SimConfig(policy=Policy.GPU_ONLY, itl_target_ms=None), specs)
    # optimistic admission (gpu-only's default, as vLLM V1): the pool overfills and the
    # scheduler preempts, yet every request completes with all its tokens
    assert result.num_preemptions > 0
    assert result.requests_completed == 8 and result.requests_rejected == 0
    assert result.num_generated_tokens == sum(s.output_len for s in specs)
    # the old reservation rule never overcommits, so it never preempts
    reserve = simulate(cost, SimConfig(policy=Policy.GPU_ONLY, gpu_admission=GpuAdmission.RESERVE), specs)
    assert reserve.num_preemptions == 0 and reserve.requests_completed == 8


def test_sim_cli_reports_preemptions_and_the_admission_mode(tmp_path, capsys):
    # 560 blocks of 16 tokens: four 2048-token prompts (512 blocks) fit beside the watermark,
    # but not their 256 output tokens each (4 x 16 more blocks): a decode must preempt
    out = tmp_path / "sweep.json"
    assert main(["sim", "--profile", REFERENCE, "--policy", "gpu-only", "--rates", "inf", "--num-requests", "12",
                 "--input-len", "2048", "--output-len", "256", "--gpu-kv-blocks", "560",
                 "--gpu-admission", "optimistic", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["gpu_admission"] == "optimistic"
    (row,) = data["results"]
    assert row["num_preemptions"] > 0 and row["requests_completed"] == 12
    assert "preemptions" in capsys.readouterr().out


def test_hand_computed_gpu_itl():
    # one request, prompt of 1 token, 3 tokens out, GPU only:
    # prefill(1) = 10 ms -> token 1; decode(batch 1, context 2) = 10 + 10 * 2/100 = 10.2; context 3: 10.3
    sim = Simulator(_cost(), SimConfig(policy=Policy.GPU_ONLY))
    (track,) = sim.run([RequestSpec(0, 0.0, (5,), 3)])
    assert track.token_times_ms == pytest.approx([10.0, 20.2, 30.5])


def test_hand_computed_cpu_itl_after_handoff():
    # The GPU holds 1 block (4 tokens): prompt 1 + 4 out needs 2 blocks, so admission places the
    # request on the CPU. Prefill on the GPU: 10 ms -> token 1. Hand-off of 1 KV token:
    # 2 ms + 32 B / 32000 B/s = 3 ms. CPU decode at context c: Local 30 + 0.1 c + 5, Assisted
    # 25 + 0.1 c -> Assisted (the device is free): 25.2, 25.3, 25.4.
    sim = Simulator(_cost(gpu_kv_blocks=1), SimConfig(policy=Policy.DUALPACE))
    (track,) = sim.run([RequestSpec(0, 0.0, (5,), 4)])
    assert track.engines_seen == [GPU, CPU]
    assert track.token_times_ms == pytest.approx([10.0, 38.2, 63.5, 88.9])
    assert sim.engines[CPU].num_assisted == 3 and sim.engines[CPU].num_local == 0


def test_cli_json_is_deterministic(capsys, tmp_path):
    argv = ["sim", "--profile", REFERENCE, "--policy", "dualpace", "--rate", "20", "--num-requests", "30",
            "--input-len", "lognormal:256:0.5", "--output-len", "16:48", "--seed", "3", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == first
    for key in ("throughput_tokens_per_s", "requests_per_s", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms",
                "p99_itl_ms", "requests_completed"):
        assert key in first
    assert first["requests_completed"] == 30


def test_cli_sweep_writes_json(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert main(["sim", "--profile", REFERENCE, "--policy", "gpu-only,gated", "--rates", "5,10",
                 "--num-requests", "10", "--input-len", "64", "--output-len", "8", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["simulated"] is True
    assert data["assist_device_hold"] == "cooperative"  # by default what the daemons run (joins), not the held gate
    assert [(r["policy"], r["rate"]) for r in data["results"]] == [
        ("gpu-only", 5.0), ("gpu-only", 10.0), ("gated", 5.0), ("gated", 10.0)]


def test_cli_bad_policy(capsys):
    assert main(["sim", "--profile", REFERENCE, "--policy", "neo"]) == 2
    assert "--policy" in capsys.readouterr().err


def test_the_default_hold_is_what_the_daemons_run_on_one_host_and_an_unknown_one_is_refused():
    assert SimConfig().assist_device_hold == "cooperative"
    with pytest.raises(ValueError, match="assist_device_hold"):
        SimConfig(assist_device_hold="iteration")


@pytest.mark.parametrize("policy", [Policy.DUALPACE, Policy.GATED])
def test_without_joins_dualpace_runs_staged_and_gated_holds_the_device(policy):
    """Hold "layer" (gpu_service on another host): no iteration joins a GPU step; dualpace's
    assisted iterations go stage by stage, gated's hold the device in one block each."""
    sim = Simulator(_cost(gpu_kv_blocks=16), SimConfig(policy=policy, assist_device_hold="layer"))
    blocks, stages = [], []
    book_block, run_stage = sim.device.book_block, sim.device.run_stage
    sim.device.book_block = lambda *a: blocks.append(a) or book_block(*a)
    sim.device.run_stage = lambda *a: stages.append(a) or run_stage(*a)
    sim.run(_specs(40))
    result = summarize(sim, 50.0)
    assert result.requests_completed == 40 and result.cpu_assisted_iterations > 0
    assert sim.num_joined_iterations == 0 and sim.num_cooperative_choices == 0
    assert (len(blocks), bool(stages)) == ((result.cpu_assisted_iterations, False) if policy is Policy.GATED
                                           else (0, True))


def test_stage_goes_at_the_engines_next_layer_boundary():
    device = SharedDevice(num_layers=4)
    assert device.start_engine(0.0, 40.0) == 40.0  # 4 layers of 10 ms
    # asked for mid-layer 1: runs at 20 (end of layer 1) for 2 ms; the engine ends 2 ms later
    assert device.run_stage(15.0, 2.0) == (22.0, 42.0)
    # the engine resumed at 22 with 20 ms done: at 25 it is 3 ms into layer 2, which ends at 32
    assert device.run_stage(25.0, 2.0) == (34.0, 44.0)
    # during the last layer there is no yield point: the stage goes at the iteration's end
    assert device.run_stage(41.0, 2.0) == (46.0, None)
    assert device.stage_wait_ms == pytest.approx(5.0 + 7.0 + 3.0)
    device.engine_finished()
    assert device.wait_ms(44.0) == 2.0  # the engine's next iteration waits for that stage
    assert device.run_stage(50.0, 2.0) == (52.0, None)  # an idle device: at once
    assert device.book_block(51.0, 5.0) == 52.0  # a block (gated) waits for the device to be free


def test_pure_imports():
    import subprocess
    import sys

    code = ("import sys, profiles.sim, dualpace.profile.cost_model, dualpace.profile.schema; "
            "print(sorted(m for m in ('torch', 'grpc', 'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cli_trace(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"input_len": 100, "output_len": 5}\n{"prompt_token_ids": [1, 2, 3], "output_len": 7}\n')
    assert main(["sim", "--profile", REFERENCE, "--policy", "gated", "--rate", "10", "--burstiness", "2",
                 "--num-requests", "4", "--trace", str(trace), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["requests_completed"] == 4 and result["num_generated_tokens"] == 5 + 7 + 5 + 7


@pytest.mark.parametrize("policy", [Policy.DUALPACE, Policy.GATED])
def test_cooperative_iterations_complete_and_never_book_the_device_apart(policy):
    """Hold "cooperative": an Assisted CPU iteration's rows ride in the GPU engine's next
    iteration (or go stage by stage when the GPU is idle); no block ever holds the device
    through the CPU's attention, and every request completes."""
    cost = _cost(gpu_kv_blocks=16)
    sim = Simulator(cost, SimConfig(policy=policy, assist_device_hold="cooperative"))
    sim.run(_specs(40))
    result = summarize(sim, 50.0)
    assert result.requests_completed == 40
    assert sim.pending_join is None
    if policy is Policy.GATED:  # NEO as designed: every decode-only CPU iteration is assisted
        assert result.cpu_assisted_iterations > 0
    assert sim.num_joined_iterations > 0
    assert sim.device.last_user != "cpu"  # no block bookings: the gated turn-taking is gone


def _pending(sim, batch: int, cpu_layer_ms: float):
    from profiles.sim.cooperative import PendingJoin

    separate_ms = sim._assist_device_ms(batch)
    return PendingJoin(batch=batch, device_ms=separate_ms, cpu_side_ms=cpu_layer_ms * sim.num_layers,
                       cpu_layer_ms=cpu_layer_ms)


def test_a_joined_step_pays_one_weight_read_for_both_batches():
    cost = _cost(gpu_kv_blocks=16)
    sim = Simulator(cost, SimConfig(policy=Policy.DUALPACE, assist_device_hold="cooperative"))
    contexts = [64] * 4
    sim.pending_join = _pending(sim, 4, cpu_layer_ms=0.0)
    layout, own_layer_ms = sim._plan_join(0, contexts)
    assert layout.how is JoinHow.JOINED and layout.d1_rows == 4 and layout.predicted_gpu_wait_ms == 0.0
    extra_ms = sim.num_layers * (layout.predicted_layer_ms - own_layer_ms)
    assert 0.0 <= extra_ms < sim._assist_device_ms(4)  # less than the rows' own dense pass


def test_a_slow_cpu_lengthens_every_layer_not_only_the_whole_step():
    """The CPU rows' post_attention(l) waits for their attention of layer l: a CPU slower than the
    GPU's attention window adds its excess in each layer, on top of S1's dense pass (the old
    what-if overlapped it with the whole step: max(gpu step, cpu side))."""
    cost = _cost(gpu_kv_blocks=16)
    sim = Simulator(cost, SimConfig(policy=Policy.GATED, assist_device_hold="cooperative"))
    contexts = [64] * 4
    gpu_ms = cost.gpu_iteration_ms(0, DecodeBatch.of(contexts))
    cpu_layer_ms = 10 * gpu_ms / sim.num_layers
    sim.pending_join = _pending(sim, 4, cpu_layer_ms)
    layout, own_layer_ms = sim._plan_join(0, contexts)
    assert layout.how is not JoinHow.STAGED  # gated never declines
    step_ms = gpu_ms + sim.num_layers * (layout.predicted_layer_ms - own_layer_ms)
    dense_s1_ms = sim._layer_costs.dense_ms(layout.d1_rows + 4)
    assert step_ms >= sim.num_layers * (cpu_layer_ms + dense_s1_ms) - 1e-9
    assert step_ms > max(gpu_ms, cpu_layer_ms * sim.num_layers)


def test_dualpace_declines_a_join_that_would_stall_the_gpu():
    cost = _cost(gpu_kv_blocks=16)
    sim = Simulator(cost, SimConfig(policy=Policy.DUALPACE, assist_device_hold="cooperative"))
    gpu_ms = cost.gpu_iteration_ms(0, DecodeBatch.of([64] * 4))
    sim.pending_join = _pending(sim, 4, cpu_layer_ms=10 * gpu_ms / sim.num_layers)
    assert sim._plan_join(0, [64] * 4)[0].how is JoinHow.STAGED
    assert sim._plan_join(0, [])[0].how is JoinHow.STAGED  # nothing to hide behind: staged, device free meanwhile


def test_join_counters_add_up_and_are_printed(capsys):
    """Every cooperative choice ends joined or declined to staged; a full join shares every
    layer; the CLI prints the counters."""
    num_layers = _cost().profile.model.num_layers
    for policy in (Policy.GATED, Policy.DUALPACE):
        r = simulate(_cost(gpu_kv_blocks=16), SimConfig(policy=policy), _specs(40, 50.0), 50.0)
        assert r.num_cooperative_choices > 0 and r.requests_completed == 40
        assert r.num_joined_iterations + r.num_joins_declined_to_staged == r.num_cooperative_choices, policy
        assert r.num_joined_layouts + r.num_split_layouts == r.num_joined_iterations
        assert r.num_layers_shared <= num_layers * r.num_joined_iterations
        if policy is Policy.GATED:
            assert r.num_joins_declined_to_staged == 0
            assert r.num_layers_shared == num_layers * r.num_joined_iterations
        if r.num_joined_iterations:
            assert r.mean_join_wait_ms >= 0
    assert main(["sim", "--profile", "profiles/reference/a10g_epyc_avx2_llama3_8b.json", "--policy", "gated",
                 "--num-requests", "12", "--rate", "2",
                 "--input-len", "800:1200", "--output-len", "50:100", "--gpu-kv-blocks", "200"]) == 0
    assert "layers shared" in capsys.readouterr().out


def test_a_handoff_waiting_for_its_gpu_prefill_counts_on_the_gpu_as_the_router_counts_it():
    """The relay starts a hand-off's move when its first token comes (router/relay.py), so until then
    the router's planner sees the request on the GPU engine, not migrating: its prompt's blocks
    count there, and the GPU requests already decoding move to the CPU under that pressure. The
    simulator marked it migrating from admission on, left the GPU looking emptier than the real
    router sees it and kept those requests on the GPU (seen against a real run: req-0..req-4)."""
    from dualpace.policy.migration_planner import plan_migrations
    from dualpace.policy.views import EngineView
    from profiles.sim.simulator import Track

    sim = Simulator(_cost(), SimConfig(policy=Policy.DUALPACE))
    decoding = sim.tracks["a"] = Track(RequestSpec(0, 0.0, tuple(range(28)), 24), "a", engine=GPU,
                                       token_times_ms=[float(t) for t in range(10)])
    waiting = sim.tracks["b"] = Track(RequestSpec(1, 0.0, tuple(range(32)), 8), "b", engine=GPU, handoff_to=CPU)
    routed = {r.request_id: r for r in sim._routed()}
    assert not routed["b"].migrating and routed["b"].engine == GPU
    views = {GPU: EngineView(GPU, "gpu", True, 16, 0, 4, 1, 1, 10.0, 10.0),
             CPU: EngineView(CPU, "cpu", True, 256, 0, 4, 0, 0, 20.0, 20.0)}
    (move,) = plan_migrations(list(routed.values()), views, Policy.DUALPACE, sim.migration)
    assert (move.request_id, move.source, move.target) == ("a", GPU, CPU)  # 10 + 8 of 16 blocks
    waiting.token_times_ms.append(11.0)
    waiting.migrating = True  # its hand-off started (Moves._move): now it is leaving the GPU
    assert {r.request_id: r.migrating for r in sim._routed()} == {"a": False, "b": True}
    decoding.migrating = True
    assert plan_migrations(sim._routed(), views, Policy.DUALPACE, sim.migration) == []


def _pump(sim, until_kind: str, name: str):
    """Run the simulator's queued calls until `name`'s iteration-end event; returns its time."""
    import heapq

    while sim._events:
        at_ms, _, kind, payload = heapq.heappop(sim._events)
        sim.now_ms = at_ms
        if kind == "call":
            payload()
        elif kind == until_kind and payload[0] == name and payload[1] == sim.engines[name].done_version:
            return at_ms
    raise AssertionError(f"no {until_kind} event for {name}")


def test_a_staged_iteration_whose_stage_waits_past_its_device_budget_is_redone_locally():
    """gpu_service charges each stage's wait for the engine's next layer boundary to the begin's
    max_device_wait_ms and refuses the stage when it runs out (RESOURCE_EXHAUSTED); cpu_service
    redoes the iteration locally and learns the whole of it as the assisted latency. Without that the simulated staged iteration rode
    out a whole long prefill step (820 ms gaps simulated where the real run had none)."""
    from dualpace.engine.request import EngineRequest
    from dualpace.sampling_params import SamplingParams

    sim = Simulator(_cost(), SimConfig(policy=Policy.DUALPACE, assist_device_hold="layer"))
    cpu = sim.engines[CPU]
    cpu.scheduler.add(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), seed=0))
    plan = cpu.scheduler.schedule()
    budget_ms = sim._stage_budget_ms(1)
    assert budget_ms is not None and budget_ms > 0
    assert sim.device.stage_start_ms(0.0) == 0.0
    sim.device.start_engine(0.0, 3000.0)  # a long prefill step: 2 layers of 1500 ms
    assert sim.device.stage_start_ms(10.0) == 1500.0  # its next layer boundary; nothing booked
    assert sim.device.engine_run.end_ms == 3000.0
    sim._start_staged(cpu, plan, 3.0, 25.0)  # 3 stages of 1 ms; the first runs at once (layer 0 begins)
    assert sim.device.engine_run.end_ms == 3001.0
    end_ms = _pump(sim, "done", CPU)
    refused_at_ms = 1.0 + 22.0 / 2 + budget_ms  # after the first stage and its CPU side, the budget's wait
    prefill_tokens, contexts, sampled = sim._plan_shape(plan)
    local_ms = sim.cost.cpu_iteration(DecodeBatch.of(contexts), prefill_tokens, sampled).local_ms
    assert end_ms == pytest.approx(refused_at_ms + local_ms)
    assert sim.num_staged_refusals == 1 and cpu.num_local == 1 and cpu.num_assisted == 0
    assert cpu.num_iterations == 1 and cpu.staged_batch is None
    # the busy GPU's refusal is learnt as the assisted iteration's latency (refusal and local
    # redo), not a backoff to Local (ModeChooser.record_device_busy, as cpu_service records it)
    assert sim.chooser.backoff_until <= sim.chooser.num_iterations
    assert sim.chooser.latency_ms[(ExecutionMode.ASSISTED, 1)] == pytest.approx(end_ms - sim.config.engine_overhead_ms)
    assert sim.device.engine_run.end_ms == 3001.0  # the stage that ran stays in the GPU's step


def test_a_moe_profile_simulates_with_the_cpu_cost_of_the_experts_selected():
    """The simulator runs a mixture-of-experts profile: its CPU engine's Local steps are priced
    along the bytes a batch reads (more than the batch's straight line between grid points)."""
    data = tiny_profile_dict()
    data["capacities"]["gpu_kv_blocks"] = 16
    data["tables"]["assist_ms"]["ms"] = [500.0, 500.0]  # assist never pays: the CPU runs Local
    dense = CostModel(parse_profile(data))
    data["model"]["moe"] = {"num_experts": 64, "num_experts_per_tok": 4, "dense_bytes": 1000, "expert_bytes": 100,
                            "num_sparse_layers": 2}
    moe = CostModel(parse_profile(data))
    assert moe.cpu_dense_ms(4) > dense.cpu_dense_ms(4)
    result = simulate(moe, SimConfig(policy=Policy.DUALPACE), _specs(), 50.0)
    assert result.requests_completed == result.num_requests == 20 and result.requests_touching_cpu > 0
    assert result != simulate(dense, SimConfig(policy=Policy.DUALPACE), _specs(), 50.0)
