"""Gemma 3 (sliding layers with a KV pool of their own) on every path, daemons as real processes: the
tiny-gemma3 preset (window 12) decodes a prompt longer than its window greedy-identical to
transformers (fp32) on the GPU engine, on the CPU engine Local and Assisted (Dense Assist: attention
on the CPU's two pools), and across migrations both ways (such a request moves without KV and the
target recomputes it). The top-5 log-probabilities of every token, the prompt's included (prefilled
in chunks that read the pools), are compared with transformers' too: the tiny model's greedy
tokens repeat one token."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from dualpace.sampling import FinishReason, SamplingParams
from tests.cpu_service.conftest import ENGINE_FLAGS
from dualpace.model.synth import write_synthetic_checkpoint
from dualpace.wire.engine_messages import generate_update_from_pb
from tests.model.hf_reference import assert_logprobs_match, hf_greedy, hf_logprobs
from toolkit.engine_client import EngineClient
from toolkit.processes import start_all, start_daemon

NUM_NEW_TOKENS = 32
SLOW_STEPS = {"DUALPACE_FAULT_STEP_DELAY_MS": "5"}  # a test-only fault: still decoding when moved
# 4 running, 16 tokens a step: the sliding pool holds 4 * (2 + 1) + 2 = 14 blocks of 8 tokens, the
# global layer 64 + 3 * 50 (dualpace.engine.sliding_window.split_kv_blocks)
POOL_FLAGS = ("--kv-blocks", "64", "--max-running", "4", "--max-batch-tokens", "16")
PROMPT_LENGTH = 40  # 3 chunks: the later ones read the earlier through the pools


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    write_synthetic_checkpoint("tiny-gemma3", folder, seed=0)
    started = start_all(
        gpu=lambda: start_daemon("gpu_service", "--model", str(folder), *ENGINE_FLAGS, *POOL_FLAGS, env=SLOW_STEPS),
        local=lambda: start_daemon("cpu_service", "--model", str(folder), *ENGINE_FLAGS, *POOL_FLAGS,
                                   "--assist", "never", env=SLOW_STEPS))
    gpu, local = started["gpu"], started["local"]
    assisted = start_daemon("cpu_service", "--model", str(folder), *ENGINE_FLAGS, *POOL_FLAGS,
                            "--assist", "always", "--gpu-service", gpu.address)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    yield reference, gpu, local, assisted
    for daemon in (assisted, local, gpu):
        assert daemon.stop() == 0, daemon.log()
    assert "iterations now run assisted" in assisted.log()
    assert "redoing it locally" not in assisted.log()


class Stream:
    """A client's view of one request: its tokens and their log-probabilities, the prompt's first."""

    def __init__(self, reference, prompt: list[int]):
        self.reference, self.prompt = reference, prompt
        self.tokens: list[int] = []
        self.logprobs: list = []

    def read(self, responses, stop_after_tokens: int | None = None):
        """Read updates (no gap, no repeat) until a finish, a migration or `stop_after_tokens`; the last."""
        for response in responses:
            update = generate_update_from_pb(response)
            assert update.first_token_index == len(self.tokens)
            self.tokens += update.new_token_ids
            self.logprobs += [*(update.prompt_logprobs or ()), *update.logprobs]
            if update.finish_reason is not None or update.migrated_to is not None:
                return update
            if stop_after_tokens is not None and len(self.tokens) >= stop_after_tokens:
                return None
        raise AssertionError("stream ended without a finish or a migration")

    def check(self) -> None:
        assert self.tokens == hf_greedy(self.reference, self.prompt, len(self.tokens))
        assert_logprobs_match(self.logprobs, hf_logprobs(self.reference, self.prompt + self.tokens))


def _prompt(name: str) -> list[int]:
    rng = random.Random(name)
    return [rng.randrange(5, 512) for _ in range(PROMPT_LENGTH)]  # longer than the window of 12


def _params(num_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=num_tokens, ignore_eos=True, logprobs=5, prompt_logprobs=5)


@pytest.mark.parametrize("engine", ["gpu", "cpu-local"])
def test_engine_alone_matches_transformers(daemons, engine):
    reference, gpu, local, _ = daemons
    client = EngineClient((gpu if engine == "gpu" else local).address)
    stream = Stream(reference, _prompt(f"gemma3-{engine}"))
    assert stream.read(client.stream(f"alone-{engine}", stream.prompt, _params(NUM_NEW_TOKENS))).finish_reason \
        == FinishReason.LENGTH
    stream.check()
    assert client.wait_idle().kv_blocks_used == 0


def test_assisted_cpu_decode_matches_transformers(daemons):
    """Prefilled and first token on the GPU engine, moved (without KV), decoded with Dense Assist."""
    reference, gpu, _, assisted = daemons
    gpu_client, cpu_client = EngineClient(gpu.address), EngineClient(assisted.address)
    stream = Stream(reference, _prompt("gemma3-assisted"))
    responses = gpu_client.stream("assisted", stream.prompt, _params(NUM_NEW_TOKENS))
    assert stream.read(responses, stop_after_tokens=1) is None
    assert gpu_client.migrate("assisted", cpu_client.address).target_engine == "cpu"
    assert stream.read(responses).migrated_to == cpu_client.address
    assert stream.read(cpu_client.resume("assisted", len(stream.tokens))).finish_reason == FinishReason.LENGTH
    stream.check()


def test_migrations_both_ways_match_transformers(daemons):
    reference, gpu, local, _ = daemons
    gpu_client, cpu_client = EngineClient(gpu.address), EngineClient(local.address)
    stream = Stream(reference, _prompt("gemma3-migrated"))
    responses = gpu_client.stream("both-ways", stream.prompt, _params(3 * NUM_NEW_TOKENS))
    stream.read(responses, stop_after_tokens=5)
    gpu_client.migrate("both-ways", cpu_client.address)
    assert stream.read(responses).migrated_to == cpu_client.address
    responses = cpu_client.resume("both-ways", len(stream.tokens))
    stream.read(responses, stop_after_tokens=20)
    cpu_client.migrate("both-ways", gpu_client.address)
    assert stream.read(responses).migrated_to == gpu_client.address
    assert stream.read(gpu_client.resume("both-ways", len(stream.tokens))).finish_reason == FinishReason.LENGTH
    stream.check()
    assert gpu_client.wait_idle().kv_blocks_used == 0 and cpu_client.wait_idle().kv_blocks_used == 0


def test_gpu_service_given_a_host_tier_serves_without_it(tmp_path):
    """`dualpace up` passes --host-tier by default: for a model whose sliding layers hold a KV pool of
    their own (which no transfer carries) gpu_service serves without the host tier and says why, rather
    than exiting. The address is never dialled."""
    write_synthetic_checkpoint("tiny-gemma3", tmp_path, seed=0)
    gpu = start_daemon("gpu_service", "--model", str(tmp_path), *ENGINE_FLAGS, "--prefix-caching", "on",
                       "--host-tier", "127.0.0.1:9")
    try:
        client = EngineClient(gpu.address)
        updates = [generate_update_from_pb(r) for r in client.stream("a", _prompt("host-tier"), _params(4))]
        assert updates[-1].finish_reason == FinishReason.LENGTH
        assert sum(len(u.new_token_ids) for u in updates) == 4
        client.close()
    finally:
        assert gpu.stop() == 0, gpu.log()
    assert "--host-tier off: this model's sliding layers hold a KV pool of their own" in gpu.log()
