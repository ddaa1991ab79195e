"""Prefix caching keeps outputs exact (fp32, a real tiny model): a hit on the GPU engine, a hit on
the CPU engine's runner, a request migrated mid-generation (exported from shared blocks, and its
imported blocks then cached on the target), and a pool too small for the load.

The reference is the offline generator, which recomputes every prompt (it matches Hugging Face
token for token, see tests/model/test_parity.py), and an engine with caching off.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from dualpace.policy.mode_choice import AssistSetting, ModeChooser
from cpu_service.runner import CpuRunner
from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.loop import EngineLoop
from dualpace.engine.transfer.migration import migrate_out
from dualpace.engine.scheduler import SchedulerConfig
from dualpace.generation import OfflineGenerator
from dualpace.sampling import SamplingParams
from tests.engine.test_engine_core import run_to_completion
from tests.engine.test_migration import stop, wait_tokens
from tests.helpers import data_socket_send

BLOCK_SIZE = 8


def shared_prefix_requests(vocab_size: int, count: int, prefix_tokens: int = 37, seed: int = 19):
    """Requests that share a system prompt, each with its own question; greedy and seeded sampling."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(prefix_tokens)]
    requests = []
    for i in range(count):
        question = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(max_tokens=rng.randint(4, 14), ignore_eos=True,
                                temperature=0.0 if i % 3 else 0.7, seed=i)
        requests.append((f"r{i}", system + question, params))
    return requests


def reference(tiny, requests) -> dict[str, list[int]]:
    generator = OfflineGenerator(tiny)
    return {rid: generator.generate([prompt], [params])[0].output_token_ids for rid, prompt, params in requests}


def make_core(tiny, caching: bool, kind: str = "gpu", num_blocks: int = 128, max_batch_tokens: int = 64):
    config = EngineConfig(name=kind, kind=kind, num_kv_blocks=num_blocks, block_size=BLOCK_SIZE,
                          scheduler=SchedulerConfig(max_batch_tokens=max_batch_tokens), prefix_caching=caching)
    runner = None
    if kind == "cpu":
        runner = CpuRunner(tiny, num_blocks, BLOCK_SIZE, ModeChooser(AssistSetting.NEVER, assist_configured=False))
    return EngineCore(tiny, config, runner)


def serve(core: EngineCore, requests, first_alone: bool = True) -> dict[str, list[int]]:
    """The first request alone (it fills the cache), then all the others at once."""
    outputs = {}
    batches = [requests[:1], requests[1:]] if first_alone else [requests]
    for batch in batches:
        for rid, prompt, params in batch:
            core.add_request(rid, prompt, params)
        outputs.update(run_to_completion(core))
    return outputs


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_a_hit_gives_the_outputs_of_a_full_recompute(tiny, kind):
    requests = shared_prefix_requests(tiny.config.vocab_size, 6)
    expected = reference(tiny, requests)
    cached_core, plain_core = make_core(tiny, True, kind), make_core(tiny, False, kind)
    assert serve(cached_core, requests) == expected
    assert serve(plain_core, requests) == expected
    scheduler = cached_core.scheduler
    assert scheduler.num_prefix_hit_tokens >= 5 * 32  # every later request reused the 4 system blocks
    assert plain_core.scheduler.num_prefix_hit_tokens == 0
    assert scheduler.blocks.num_used_blocks == 0 and scheduler.blocks.num_cached_blocks > 0


def test_under_a_pool_too_small_every_request_completes_identically(tiny):
    requests = shared_prefix_requests(tiny.config.vocab_size, 10, seed=7)
    expected = reference(tiny, requests)
    core = make_core(tiny, True, num_blocks=10, max_batch_tokens=16)  # a request needs up to 8 blocks
    assert serve(core, requests, first_alone=False) == expected
    scheduler = core.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.blocks.num_evictions > 0
    assert scheduler.num_prefix_hit_tokens > 0
    assert scheduler.blocks.num_used_blocks == 0


async def test_migrated_mid_generation_from_shared_blocks_and_cached_on_the_target(tiny):
    source, target = EngineLoop(make_core(tiny, True, "gpu")), EngineLoop(make_core(tiny, True, "cpu"))
    pairs = [(loop, asyncio.create_task(loop.run())) for loop in (source, target)]
    try:
        requests = shared_prefix_requests(tiny.config.vocab_size, 3, seed=5)
        requests = [(rid, prompt, SamplingParams(max_tokens=20, ignore_eos=True, temperature=params.temperature,
                                                 seed=params.seed)) for rid, prompt, params in requests]
        expected = reference(tiny, requests)
        (first_id, first_prompt, first_params), (moved_id, moved_prompt, moved_params) = requests[:2]
        first = await source.add_request(first_id, first_prompt, first_params)
        await wait_tokens(first, first_params.max_tokens)
        moved = await source.add_request(moved_id, moved_prompt, moved_params)  # hits the first's blocks
        await wait_tokens(moved, 5)
        await migrate_out(source, moved_id, data_socket_send(target))
        emitted = len(moved.output_token_ids)
        rest = [t async for update in target.channel(moved_id).follow(emitted) for t in update.new_token_ids]
        assert moved.output_token_ids + rest == expected[moved_id]
        assert target.channel(moved_id).num_cached_tokens == 32  # reported where it finished
        assert source.load().kv_blocks_used == 0 and source.load().kv_blocks_cached > 0
        # The imported blocks are the target's cache now: a request with the same prefix hits them.
        third_id, third_prompt, third_params = requests[2]
        third = await target.add_request(third_id, third_prompt, third_params)
        await wait_tokens(third, third_params.max_tokens)
        assert third.output_token_ids == expected[third_id]
        assert target.core.scheduler.num_prefix_hit_tokens >= 32
        assert target.load().kv_blocks_used == 0
    finally:
        await stop(*pairs)
