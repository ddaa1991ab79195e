"""GPU admission modes (dualpace.policy.admission.GpuAdmission): RESERVE counts every placed
request at prompt + max_tokens; OPTIMISTIC (vLLM V1, gpu-only's default) counts the KV
allocated now plus a watermark and leaves running out of KV to the engine's preemption."""

from __future__ import annotations

import pytest

from dualpace.policy.admission import AdmissionConfig, GpuAdmission, Placement, admit
from dualpace.policy.policies import Policy
from dualpace.policy.views import RoutedRequest
from tests.policy.test_admission import BS, cpu, gpu

OPTIMISTIC = AdmissionConfig(policy=Policy.GPU_ONLY)
RESERVE_GPU_ONLY = AdmissionConfig(policy=Policy.GPU_ONLY, gpu_admission=GpuAdmission.RESERVE)


def long_outputs(count: int) -> list[RoutedRequest]:
    """`count` placed GPU requests holding 1 block now and 30 blocks once they finish."""
    return [RoutedRequest(f"r{i}", "gpu", BS, 0, BS * 29) for i in range(count)]


@pytest.mark.parametrize(("policy", "expected"), [(Policy.GPU_ONLY, GpuAdmission.OPTIMISTIC),
                                                  (Policy.DUALPACE, GpuAdmission.RESERVE),
                                                  (Policy.GATED, GpuAdmission.RESERVE)])
def test_default_mode_per_policy(policy, expected):
    assert AdmissionConfig(policy=policy).resolved_gpu_admission is expected


def test_explicit_mode_overrides_the_policy_default():
    assert RESERVE_GPU_ONLY.resolved_gpu_admission is GpuAdmission.RESERVE
    dualpace = AdmissionConfig(gpu_admission=GpuAdmission.OPTIMISTIC)
    assert dualpace.resolved_gpu_admission is GpuAdmission.OPTIMISTIC


def test_optimistic_admits_what_reserve_queues():
    # 4 placed requests will need 120 of 100 blocks at the end, but hold 4 now.
    engines = {"gpu": gpu(total=100)}
    placed = long_outputs(4)
    assert admit(BS, BS * 29, engines, placed, 0, RESERVE_GPU_ONLY) == (Placement.WAIT, None)
    assert admit(BS, BS * 29, engines, placed, 0, OPTIMISTIC) == (Placement.GPU, "gpu")


def test_optimistic_counts_only_the_prompt_against_the_kv_allocated_now():
    # 100 blocks, 1% watermark = 1 block. A 10-block prompt with a 1000-token output.
    prompt, max_tokens = BS * 10, 1000
    assert admit(prompt, max_tokens, {"gpu": gpu(used=89)}, [], 0, OPTIMISTIC) == (Placement.GPU, "gpu")
    assert admit(prompt, max_tokens, {"gpu": gpu(used=90)}, [], 0, OPTIMISTIC) == (Placement.WAIT, None)


def test_optimistic_watermark_fraction_is_configurable():
    config = AdmissionConfig(policy=Policy.GPU_ONLY, gpu_kv_watermark_fraction=0.1)  # 10 blocks
    assert admit(BS * 10, 10, {"gpu": gpu(used=80)}, [], 0, config) == (Placement.GPU, "gpu")
    assert admit(BS * 10, 10, {"gpu": gpu(used=81)}, [], 0, config) == (Placement.WAIT, None)


def test_optimistic_uses_the_larger_of_snapshot_and_placed_footprint():
    # The snapshot lags: 95 blocks of placed prompts the engine has not reported yet.
    placed = [RoutedRequest(f"p{i}", "gpu", BS * 19, 0, 1) for i in range(5)]
    assert admit(BS * 5, 1, {"gpu": gpu(used=0)}, placed, 0, OPTIMISTIC) == (Placement.WAIT, None)
    assert admit(BS * 4, 1, {"gpu": gpu(used=0)}, placed, 0, OPTIMISTIC) == (Placement.GPU, "gpu")


def test_optimistic_idle_engine_takes_a_request_that_fits_the_whole_pool():
    assert admit(BS * 99, BS, {"gpu": gpu(used=0)}, [], 0, OPTIMISTIC) == (Placement.GPU, "gpu")
    assert admit(BS * 99, BS + 1, {"gpu": gpu(used=0)}, [], 0, OPTIMISTIC) == (Placement.REJECT, None)


def test_optimistic_still_never_uses_the_cpu_under_gpu_only():
    engines = {e.name: e for e in (gpu(used=99), cpu())}
    assert admit(BS * 5, 10, engines, [], 0, OPTIMISTIC) == (Placement.WAIT, None)


def test_dualpace_keeps_reserve_and_spills_to_the_cpu():
    engines = {e.name: e for e in (gpu(total=100), cpu())}
    assert admit(BS, BS * 29, engines, long_outputs(3), 0, AdmissionConfig()) == (Placement.CPU, "cpu")


@pytest.mark.parametrize("kwargs", [{"gpu_admission": "optimistic"}, {"gpu_kv_watermark_fraction": 1.0},
                                    {"gpu_kv_watermark_fraction": -0.1}, {"gpu_kv_reserve_fraction": 1.5}])
def test_bad_config_is_a_clear_error(kwargs):
    with pytest.raises(ValueError, match="gpu_"):
        AdmissionConfig(**kwargs)
