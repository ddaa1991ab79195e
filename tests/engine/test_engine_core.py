"""EngineCore with a real tiny model: continuous batching and preemption keep outputs exact."""

from __future__ import annotations

import random

import pytest

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.scheduler import SchedulerConfig
from dualpace.errors import InvalidArgument, Overloaded, RequestNotFound
from dualpace.sampling import FinishReason, SamplingParams
from tests.helpers import reference_tokens


def run_to_completion(core: EngineCore, max_steps: int = 5000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    for _ in range(max_steps):
        if not core.has_work:
            break
        _, events = core.step()
        for event in events:
            outputs.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.finish_reason is not None:
                finished[event.request_id] = event.finish_reason
    assert not core.has_work, "engine did not drain"
    return outputs


def solo(tiny, prompt: list[int], params: SamplingParams) -> list[int]:
    return reference_tokens(tiny, prompt, params)


def make_requests(vocab_size: int, count: int, seed: int = 0):
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True,
                                temperature=0.0 if i % 2 else 0.8, seed=i)
        requests.append((f"r{i}", prompt, params))
    return requests


@pytest.mark.parametrize("num_blocks, max_batch_tokens", [(512, 512), (24, 64), (9, 16)])
def test_concurrent_requests_equal_their_solo_runs(tiny, num_blocks, max_batch_tokens):
    """Ample KV; then a pool that forces waiting, chunked prefill and preemption by recompute."""
    core = EngineCore(tiny, EngineConfig(num_kv_blocks=num_blocks, block_size=8,
                                         scheduler=SchedulerConfig(max_batch_tokens=max_batch_tokens)))
    requests = make_requests(tiny.config.vocab_size, 32)
    for request_id, prompt, params in requests:
        core.add_request(request_id, prompt, params)
    outputs = run_to_completion(core)
    for request_id, prompt, params in requests:
        assert outputs[request_id] == solo(tiny, prompt, params), request_id
    assert core.scheduler.blocks.num_used_blocks == 0  # what is not free is cached prefix content
    assert core.scheduler.blocks.num_available_blocks == num_blocks
    if num_blocks == 9:
        assert core.scheduler.num_preemptions > 0


def test_abort_frees_blocks(tiny):
    core = EngineCore(tiny, EngineConfig(num_kv_blocks=64, block_size=8))
    core.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
    core.add_request("b", [6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    core.step()
    assert core.scheduler.blocks.num_used_blocks > 0
    event = core.abort("a")
    assert event.finish_reason == FinishReason.ABORT
    core.abort("b")
    assert core.scheduler.blocks.num_used_blocks == 0 and not core.has_work
    with pytest.raises(RequestNotFound):
        core.abort("a")


def test_bad_requests(tiny):
    core = EngineCore(tiny, EngineConfig(num_kv_blocks=4, block_size=8,
                                         scheduler=SchedulerConfig(max_waiting=1)))
    with pytest.raises(InvalidArgument, match="max_tokens"):
        core.add_request("big", [1] * 20, SamplingParams(max_tokens=20))  # 39 tokens > 4 blocks of 8
    core.add_request("x", [1], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidArgument, match="request_id"):
        core.add_request("x", [1], SamplingParams(max_tokens=4))
    with pytest.raises(Overloaded):
        core.add_request("y", [1], SamplingParams(max_tokens=4))
