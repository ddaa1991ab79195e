"""The router's host-tier rule: continue on the CPU engine only when it caches clearly more of
the prompt than any GPU engine, the rest is short, and it could take the request anyway."""

from __future__ import annotations

import pytest

from dualpace.policy.admission import AdmissionConfig
from dualpace.policy.host_tier import (
    HostTierChoice,
    HostTierPlacement,
    HostTierRule,
    continue_on_host_tier,
    place_host_prefix,
)
from dualpace.policy.policies import Policy
from dualpace.policy.views import RoutedRequest
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


class Costs:
    """A profile's figures, linear: ms per prefill token per kind, per transferred token, ITL per kind."""

    def __init__(self, gpu_prefill=0.1, cpu_prefill=2.0, transfer=0.01, gpu_itl=10.0, cpu_itl=40.0):
        self.per_token = {"gpu": gpu_prefill, "cpu": cpu_prefill}
        self.transfer, self.itl = transfer, {"gpu": gpu_itl, "cpu": cpu_itl}

    def gpu_prefill_ms(self, num_tokens):
        return self.per_token["gpu"] * num_tokens

    def cpu_prefill_ms(self, num_tokens):
        return self.per_token["cpu"] * num_tokens

    def kv_transfer_ms(self, num_tokens):
        return 1.0 + self.transfer * num_tokens

    def itl_ms(self, kind, context_tokens):
        return self.itl[kind]


def place(cached, num_prompt_tokens=1000, engines=ENGINES, config=AdmissionConfig(), rule=RULE):
    return place_host_prefix(num_prompt_tokens, 32, engines, [], config, cached, rule)


def test_a_long_new_message_copies_the_prefix_back_to_the_gpu_engine():
    placement = place({"gpu": 0, "cpu": 700})  # 300 new tokens: too many for the CPU engine to prefill
    assert placement == HostTierPlacement(HostTierChoice.COPY_TO_GPU, "cpu", "gpu", 700)
    assert place({"cpu": 960}).choice is HostTierChoice.CONTINUE_ON_CPU  # no profile: continue when allowed
    assert place({"cpu": 700}, rule=HostTierRule(copy_back=False)) is None
    assert place({"cpu": 700}, engines={"gpu": gpu(total=40), "cpu": cpu()}) is None  # no room on the GPU engine
    assert place({"cpu": 700}, config=AdmissionConfig(policy=Policy.GATED)) is None


def test_with_a_profile_the_cheaper_completion_wins():
    fast_copy = AdmissionConfig(predictor=Costs())
    # CPU: 40 tokens x 2 ms + 32 x 40 ms ITL = 1360 ms; copy: 1 + 9.6 + 4 + 32 x 10 = 335 ms.
    assert place({"cpu": 960}, config=fast_copy).choice is HostTierChoice.COPY_TO_GPU
    slow_gpu_decode = AdmissionConfig(predictor=Costs(gpu_itl=60.0))  # copy: 1935 ms
    assert place({"cpu": 960}, config=slow_gpu_decode).choice is HostTierChoice.CONTINUE_ON_CPU
    # A transfer dearer than recomputing the prefix: never copy; the CPU engine continues, or recompute.
    dear_link = AdmissionConfig(predictor=Costs(transfer=1.0))
    assert place({"cpu": 960}, config=dear_link).choice is HostTierChoice.CONTINUE_ON_CPU
    assert place({"cpu": 700}, config=dear_link) is None
    assert place({"cpu": 700}, config=fast_copy).choice is HostTierChoice.COPY_TO_GPU


def test_on_the_reference_h100_profile_an_idle_gpu_engine_gets_the_copy():
    from dualpace.profile.cost_model import CostModel
    from dualpace.profile.files import load_profile

    costs = CostModel(load_profile("profiles/reference/h100_sapphire_rapids_llama3_8b.json"))
    placement = place({"cpu": 960}, config=AdmissionConfig(predictor=costs))
    assert placement.choice is HostTierChoice.COPY_TO_GPU  # 3.5 ms of transfer beats a 40-token CPU prefill
    # A GPU engine without room leaves the CPU engine, which needs no copy at all.
    full_gpu = {"gpu": gpu(total=40), "cpu": cpu()}
    assert place({"cpu": 960}, engines=full_gpu, config=AdmissionConfig(predictor=costs)).choice \
        is HostTierChoice.CONTINUE_ON_CPU
