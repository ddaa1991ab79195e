"""The simulator's prefix cache is the engines' own: with a shared system prompt the engines
find it cached, prefill only the questions, and simulated TTFT drops accordingly; with caching
off nothing is found; random prompts share nothing; a request whose prefix only the CPU engine
caches continues there (the router's host-tier rule) without a hand-off."""

from __future__ import annotations

import argparse

from bench.load.workloads import shared_prefix_requests
from dualpace.policy.policies import Policy
from profiles.sim import CPU, GPU, SimConfig, Simulator, simulate
from profiles.sim.results import summarize
from tests.profiles.test_simulator import REFERENCE, _specs
from dualpace.profile.cost_model import CostModel
from dualpace.profile.files import load_profile
from toolkit.workload import RequestSpec


def shared_prefix(num_requests: int = 40, system_len: int = 1000, rate: float = 4.0) -> list[RequestSpec]:
    args = argparse.Namespace(workload="shared-prefix", seed=0, vocab_size=32000, burstiness=1.0,
                              num_requests=num_requests, system_len=system_len, question_len="16:64",
                              output_len="32", trace=None, input_len=None)
    return shared_prefix_requests(args, rate)


def test_a_shared_system_prompt_is_prefilled_once():
    cost = CostModel(load_profile(REFERENCE))
    specs = shared_prefix()
    on = simulate(cost, SimConfig(), specs, 4.0)
    off = simulate(cost, SimConfig(prefix_caching=False), specs, 4.0)
    assert on.requests_completed == off.requests_completed == 40
    assert off.prefix_cache_hit_rate is None and off.prefill_tokens_saved == 0
    # All but the first request find the system prompt's full blocks (1000 tokens: 62 of 16).
    assert on.prefill_tokens_saved >= 39 * 992
    assert on.prefix_cache_hit_rate > 0.9
    assert on.p50_ttft_ms < off.p50_ttft_ms
    assert on.num_generated_tokens == off.num_generated_tokens


def test_random_prompts_share_nothing():
    result = simulate(CostModel(load_profile(REFERENCE)), SimConfig(), _specs(), 50.0)
    assert result.prefill_tokens_saved == 0 and result.prefix_cache_hit_rate == 0.0


def test_a_prefix_only_the_cpu_engine_caches_continues_there():
    cost = CostModel(load_profile(REFERENCE))
    history = tuple(range(1, 641))  # 40 blocks
    sim = Simulator(cost, SimConfig(policy=Policy.DUALPACE))
    cpu = sim.engines[CPU].scheduler
    # The CPU engine holds the history in its cache (as a host-tier import leaves it), the GPU engine does not.
    cpu.reserve_import("offer", len(history))
    cpu.commit_cache_import("offer", list(history))
    tracks = sim.run([RequestSpec(0, 0.0, history + (700, 701, 702), 8)])
    assert tracks[0].engines_seen == [CPU] and tracks[0].handoff_to is None
    result = summarize(sim, 1.0)
    assert result.prefill_tokens_saved == 640 and result.num_handoffs == 0
    assert sim.engines[GPU].num_iterations == 0
