"""The router's host-tier rule: continue on the CPU engine only when it caches clearly more of
the prompt than any GPU engine, the rest is short, and it could take the request anyway."""

from __future__ import annotations

import pytest

from dualpace.policy.admission import AdmissionConfig
from dualpace.policy.host_tier import HostTierRule, continue_on_host_tier
from dualpace.policy.views import Policy, RoutedRequest
from tests.policy.test_admission import cpu, gpu

RULE = HostTierRule(min_gain_tokens=64, max_suffix_tokens=256)
ENGINES = {"gpu": gpu(), "cpu": cpu()}


def choose(cached, num_prompt_tokens=1000, engines=ENGINES, config=AdmissionConfig(), placed=(), rule=RULE):
    return continue_on_host_tier(num_prompt_tokens, 32, engines, list(placed), config, cached, rule)


def test_a_history_only_the_cpu_engine_holds_continues_there():
    assert choose({"gpu": 0, "cpu": 960}) == "cpu"
    assert choose({"cpu": 800}) == "cpu"  # 200 new tokens: within max_suffix_tokens


@pytest.mark.parametrize("cached", [
    {"gpu": 960, "cpu": 960},  # the GPU engine holds it too: the usual placement
    {"gpu": 920, "cpu": 960},  # less than min_gain_tokens more
    {"gpu": 0, "cpu": 700},  # 300 tokens left to prefill: better on the GPU
    {"gpu": 0, "cpu": 0},
])
def test_no_continuation_without_a_clear_gain(cached):
    assert choose(cached) is None


def test_the_cpu_engine_must_be_able_to_take_it():
    cached = {"cpu": 960}
    assert choose(cached, engines={"gpu": gpu(), "cpu": cpu(healthy=False)}) is None
    assert choose(cached, engines={"gpu": gpu(), "cpu": cpu(total=40)}) is None  # no KV room (16-token blocks)
    assert choose(cached, engines={"gpu": gpu(), "cpu": cpu(p50=90.0)}, config=AdmissionConfig(itl_target_ms=50)) is None
    full = [RoutedRequest(f"r{i}", "cpu", 10, 1, 10) for i in range(2)]
    assert choose(cached, config=AdmissionConfig(cpu_max_running=2), placed=full) is None


def test_only_the_dualpace_policy_and_only_when_enabled():
    cached = {"cpu": 960}
    assert choose(cached, config=AdmissionConfig(policy=Policy.GATED)) is None
    assert choose(cached, config=AdmissionConfig(policy=Policy.GPU_ONLY)) is None
    assert choose(cached, rule=HostTierRule(enabled=False)) is None


def test_the_cpu_engine_with_the_longest_prefix_wins():
    engines = {"gpu": gpu(), "cpu-a": cpu("cpu-a"), "cpu-b": cpu("cpu-b")}
    assert choose({"cpu-a": 800, "cpu-b": 960}, engines=engines) == "cpu-b"


def test_bad_rules_are_refused():
    with pytest.raises(ValueError, match="min_gain_tokens"):
        HostTierRule(min_gain_tokens=0)
