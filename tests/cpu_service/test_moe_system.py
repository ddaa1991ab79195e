"""Mixture-of-experts models on every path, daemons as real processes: tiny Mixtral, Qwen2-MoE and
Qwen3-MoE checkpoints made with transformers' own classes (tests/model/family_checkpoints.py) decode greedy-identical to transformers (fp32) on
the GPU engine, on the CPU engine Local and Assisted (Dense Assist: the GPU runs the routed experts
of the CPU's rows, attention stays on the CPU), and across migrations both ways."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from dualpace.sampling import FinishReason, SamplingParams
from tests.cpu_service.conftest import ENGINE_FLAGS
from tests.cpu_service.test_cpu_service_system import handoff
from tests.model.hf_reference import hf_greedy
from tests.model.family_checkpoints import write_family_checkpoint
from toolkit.engine_client import EngineClient, read_until
from toolkit.processes import start_all, start_daemon

NUM_NEW_TOKENS = 32
SLOW_STEPS = {"DUALPACE_FAULT_STEP_DELAY_MS": "5"}  # a test-only fault: still decoding when moved


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def family(request, tmp_path_factory):
    folder = write_family_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    started = start_all(
        gpu=lambda: start_daemon("gpu_service", "--model", str(folder), *ENGINE_FLAGS, "--kv-blocks", "64",
                                 env=SLOW_STEPS),
        local=lambda: start_daemon("cpu_service", "--model", str(folder), *ENGINE_FLAGS, "--kv-blocks", "256",
                                   "--assist", "never", env=SLOW_STEPS))
    gpu, local = started["gpu"], started["local"]
    assisted = start_daemon("cpu_service", "--model", str(folder), *ENGINE_FLAGS, "--kv-blocks", "256",
                            "--assist", "always", "--gpu-service", gpu.address)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    yield request.param, reference, gpu, local, assisted
    for daemon in (assisted, local, gpu):
        assert daemon.stop() == 0, daemon.log()
    assert "iterations now run assisted" in assisted.log()
    assert "redoing it locally" not in assisted.log()


def _prompt(name: str) -> list[int]:
    rng = random.Random(name)
    return [rng.randrange(5, 512) for _ in range(13)]  # the checkpoints' vocabulary, special tokens apart


def _greedy(num_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=num_tokens, ignore_eos=True)


@pytest.mark.parametrize("engine", ["gpu", "cpu-local"])
def test_engine_alone_matches_transformers(family, engine):
    name, reference, gpu, local, _ = family
    client = EngineClient((gpu if engine == "gpu" else local).address)
    prompt = _prompt(f"{name}-{engine}")
    tokens: list[int] = []
    assert read_until(client.stream(f"alone-{engine}", prompt, _greedy(NUM_NEW_TOKENS)), tokens).finish_reason \
        == FinishReason.LENGTH
    assert tokens == hf_greedy(reference, prompt, NUM_NEW_TOKENS)


def test_assisted_cpu_decode_matches_transformers(family):
    name, reference, gpu, _, assisted = family
    prompt = _prompt(f"{name}-assisted")
    tokens = handoff(EngineClient(gpu.address), EngineClient(assisted.address), "assisted", prompt,
                     _greedy(NUM_NEW_TOKENS))
    assert tokens == hf_greedy(reference, prompt, NUM_NEW_TOKENS)


def test_migrations_both_ways_match_transformers(family):
    name, reference, gpu, local, _ = family
    gpu_client, cpu_client = EngineClient(gpu.address), EngineClient(local.address)
    prompt, num_tokens = _prompt(f"{name}-migrated"), 3 * NUM_NEW_TOKENS
    tokens: list[int] = []
    responses = gpu_client.stream("both-ways", prompt, _greedy(num_tokens))
    read_until(responses, tokens, stop_after_tokens=5)
    gpu_client.migrate("both-ways", cpu_client.address)
    assert read_until(responses, tokens).migrated_to == cpu_client.address
    responses = cpu_client.resume("both-ways", len(tokens))
    read_until(responses, tokens, stop_after_tokens=20)
    cpu_client.migrate("both-ways", gpu_client.address)
    assert read_until(responses, tokens).migrated_to == gpu_client.address
    assert read_until(gpu_client.resume("both-ways", len(tokens)), tokens).finish_reason == FinishReason.LENGTH
    assert tokens == hf_greedy(reference, prompt, num_tokens)
