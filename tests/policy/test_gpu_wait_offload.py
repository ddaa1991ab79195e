"""Admission's time rule (dualpace.policy.admission): dualpace places a new request on the CPU
engine when the GPU engine's predicted prefill wait exceeds the offload bound, and only then."""

from __future__ import annotations

import math

import pytest

from dualpace.policy.admission import AdmissionConfig, Placement, admit, gpu_prefill_wait_ms
from dualpace.policy.policies import Policy
from dualpace.policy.views import EngineView, RoutedRequest

BS = 16


def view(name, kind, total, running=0):
    return EngineView(name, kind, True, total, 0, BS, running, 0, 10.0, 20.0)


ENGINES = {"gpu": view("gpu", "gpu", 10_000), "cpu": view("cpu", "cpu", 10_000)}


class PrefillPerToken:
    """GPU prefill 0.1 ms per token; CPU ITL 10 ms per sequence held (Local: local_ms_per_sequence)."""

    def __init__(self, cpu_ms_per_sequence=10.0, transfer_ms=1.0, local_ms_per_sequence=None):
        self.cpu_ms_per_sequence, self.transfer_ms = cpu_ms_per_sequence, transfer_ms
        self.local_ms_per_sequence = cpu_ms_per_sequence if local_ms_per_sequence is None else local_ms_per_sequence
        self.prefill_calls = []
        self.local_calls = 0

    def itl_ms(self, kind, context_tokens, local_only=False):
        if kind == "gpu":
            return 1.0 * len(context_tokens)
        self.local_calls += local_only
        return (self.local_ms_per_sequence if local_only else self.cpu_ms_per_sequence) * len(context_tokens)

    def kv_transfer_ms(self, num_tokens):
        return self.transfer_ms

    def prefill_ms(self, kind, num_tokens):
        self.prefill_calls.append((kind, num_tokens))
        return 0.1 * num_tokens


def unstarted(count, prompt=500, engine="gpu"):
    return [RoutedRequest(f"{engine}-q{i}", engine, prompt, 0, 64) for i in range(count)]


def config(predictor=None, target=100.0, **kwargs):
    kwargs.setdefault("gpu_wait_offload_ms", 100.0)
    return AdmissionConfig(itl_target_ms=target, predictor=predictor or PrefillPerToken(), **kwargs)


def test_prefill_wait_sums_the_unstarted_prompts_on_that_engine():
    predictor = PrefillPerToken()
    placed = unstarted(2) + [RoutedRequest("decoding", "gpu", 4000, 5, 64), RoutedRequest("c", "cpu", 900, 0, 64)]
    # 500 + 500 tokens at 0.1 ms; the decoding request and the CPU's request do not count
    assert gpu_prefill_wait_ms(ENGINES["gpu"], placed, predictor) == pytest.approx(100.0)
    assert sorted(predictor.prefill_calls) == [("gpu", 500), ("gpu", 500)]


@pytest.mark.parametrize("num_queued, expected", [(0, "gpu"), (2, "gpu"), (3, "cpu"), (5, "cpu")])
def test_dualpace_offloads_once_the_gpu_prefill_wait_exceeds_the_bound(num_queued, expected):
    # num_queued 500-token prompts ahead (50 ms each): 100 ms with two (not above the 100 ms
    # bound), 150 with three; this request's own prefill runs on the GPU on either path
    placement, name = admit(3000, 64, ENGINES, unstarted(num_queued), 0, config())
    assert (placement.value, name) == (expected, expected)


def test_the_offload_is_priced_local():
    # Assisted would fit (10 ms per sequence), Local would not (60 ms x 2 sequences)
    slow_local = PrefillPerToken(local_ms_per_sequence=60.0)
    placed = unstarted(3) + unstarted(1, engine="cpu")
    assert admit(300, 64, ENGINES, placed, 0, config(slow_local)) == (Placement.GPU, "gpu")
    assert slow_local.local_calls == 1
    assert admit(300, 64, ENGINES, placed, 0, config(PrefillPerToken(local_ms_per_sequence=50.0))) == (
        Placement.CPU, "cpu")


def test_the_bound_decides_and_the_rule_is_off_by_default():
    assert admit(300, 64, ENGINES, unstarted(1), 0, config(gpu_wait_offload_ms=40.0)) == (Placement.CPU, "cpu")
    assert admit(300, 64, ENGINES, unstarted(5), 0, config(gpu_wait_offload_ms=math.inf)) == (Placement.GPU, "gpu")
    assert admit(300, 64, ENGINES, unstarted(5), 0, config(gpu_wait_offload_ms=None)) == (Placement.GPU, "gpu")


def test_the_cpu_engine_must_be_within_its_itl_target():
    # the CPU engine holds 9: with one more its predicted ITL is 100 ms (within), with 10 held 110 ms
    within = unstarted(3) + unstarted(9, engine="cpu")
    assert admit(300, 64, ENGINES, within, 0, config()) == (Placement.CPU, "cpu")
    over = unstarted(3) + unstarted(10, engine="cpu")
    assert admit(300, 64, ENGINES, over, 0, config()) == (Placement.GPU, "gpu")


def test_the_cpu_engine_cap_still_binds():
    placed = unstarted(3) + unstarted(2, engine="cpu")
    assert admit(300, 64, ENGINES, placed, 0, config(PrefillPerToken(1.0), cpu_max_running=2)) == (Placement.GPU, "gpu")


def test_no_offload_on_time_when_the_hand_off_alone_exceeds_the_itl_target():
    # the gRPC case: moving the prompt's KV takes longer than one ITL target
    fits, too_slow = config(PrefillPerToken(transfer_ms=100.0)), config(PrefillPerToken(transfer_ms=100.1))
    assert admit(300, 64, ENGINES, unstarted(5), 0, fits) == (Placement.CPU, "cpu")
    assert admit(300, 64, ENGINES, unstarted(5), 0, too_slow) == (Placement.GPU, "gpu")


@pytest.mark.parametrize("policy", [Policy.GATED, Policy.GPU_ONLY])
def test_only_dualpace_offloads_on_time(policy):
    assert admit(300, 64, ENGINES, unstarted(5), 0, config(policy=policy)) == (Placement.GPU, "gpu")


def test_without_a_profile_or_a_target_nothing_changes():
    placed = unstarted(5)
    assert admit(300, 64, ENGINES, placed, 0, AdmissionConfig(itl_target_ms=100.0)) == (Placement.GPU, "gpu")
    assert admit(300, 64, ENGINES, placed, 0, config(target=None)) == (Placement.GPU, "gpu")


def test_a_bad_bound_is_refused():
    with pytest.raises(ValueError, match="gpu_wait_offload_ms"):
        AdmissionConfig(gpu_wait_offload_ms=-1.0)
    with pytest.raises(ValueError, match="gpu_wait_offload_ms"):
        AdmissionConfig(gpu_wait_offload_ms=math.nan)
