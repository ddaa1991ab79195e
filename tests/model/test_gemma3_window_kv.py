"""A prompt longer than the sliding window, served by the engine on a model that mixes sliding and
global layers (the tiny-gemma3 preset: layers 0, 1 and 3 slide over 12 tokens, layer 2 sees everything). The
sliding layers hold a KV pool of their own, which returns the blocks no window reaches any more
(counted) while the global layer's pool keeps every block; greedy output stays identical to
transformers in fp32 on the torch stages (the GPU engine's path) and the CPU kernels (CPU local),
for a request longer than the sliding pool could hold alone, and across a migration. The tiny
model's greedy tokens repeat one token with a wide margin (so they barely show what the window
holds): the prompt is prefilled in chunks of 8 tokens, each attending to the earlier ones through the
pools, and its top-5 prompt log-probabilities are compared with transformers' too (as are the new
tokens')."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from dualpace.engine.core import EngineConfig, EngineCore, kv_pool_sizes
from dualpace.engine.scheduler import SchedulerConfig
from dualpace.model import cpu_kernels
from dualpace.model.loader import load_model
from dualpace.sampling import SamplingParams
from tests.model.hf_reference import assert_logprobs_match, hf_greedy, hf_logprobs

WINDOW = 12  # dualpace/model/synth.py, tiny-gemma3
BLOCK_SIZE = 4
PROMPT_LENGTH = 40  # 5 chunks of 8: the 4th and 5th read tokens the pools' tables hold in other blocks
NUM_NEW_TOKENS = 32
NUM_BLOCKS_OF_REQUEST = -(-(PROMPT_LENGTH + NUM_NEW_TOKENS - 1) // BLOCK_SIZE)  # 18: every token but the last
PARAMS = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5, prompt_logprobs=5)
CHUNKED = SchedulerConfig(max_batch_tokens=8)  # the prompt in 3 chunks: later ones read the pools


@pytest.fixture(scope="module")
def gemma3(synth_checkpoint):
    folder = synth_checkpoint("tiny-gemma3")
    loaded = load_model(str(folder), dtype="fp32")
    assert loaded.config.sliding_window == WINDOW and loaded.config.window_layers == (True, True, False, True)
    rng = random.Random("gemma3")
    prompt = [rng.randrange(5, loaded.config.vocab_size) for _ in range(PROMPT_LENGTH)]
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = hf_greedy(hf_model, prompt, NUM_NEW_TOKENS)
    return loaded, prompt, (expected, hf_logprobs(hf_model, prompt + expected))


def run(core: EngineCore, request_id: str, prompt: list[int], params: SamplingParams = PARAMS,
        ) -> tuple[tuple[list, list], int, int]:
    """The request's (tokens, prompt and output logprobs) and the most blocks each pool (global,
    sliding) had in use after any step."""
    core.add_request(request_id, prompt, params)
    tokens, logprobs, most_global, most_sliding = [], [], 0, 0
    for _ in range(4 * NUM_NEW_TOKENS):
        if not core.has_work:
            break
        _, events = core.step()
        for event in events:
            tokens += event.new_token_ids
            logprobs += [*(event.prompt_logprobs or ()), *event.logprobs]
        most_global = max(most_global, core.scheduler.blocks.num_used_blocks)
        most_sliding = max(most_sliding, core.scheduler.window_blocks.num_used_blocks)
    assert not core.has_work
    return (tokens, logprobs), most_global, most_sliding


def assert_exact(output: tuple[list, list], expected: tuple[list, torch.Tensor]) -> None:
    """Greedy tokens equal; the log-probabilities of prompt tokens 1.. and of each new token too."""
    assert output[0] == expected[0]
    assert_logprobs_match(output[1], expected[1])


@pytest.mark.parametrize("kernels_on", [True, False], ids=["cpu-kernels", "torch-stages"])
def test_sliding_layers_free_their_blocks_and_decode_exactly(gemma3, kernels_on):
    loaded, prompt, expected = gemma3
    enabled = cpu_kernels._state.get("enabled", True)
    cpu_kernels.set_enabled(kernels_on)
    try:
        core = EngineCore(loaded, EngineConfig(num_kv_blocks=64, block_size=BLOCK_SIZE, scheduler=CHUNKED))
        output, most_global, most_sliding = run(core, "long", prompt)
    finally:
        cpu_kernels.set_enabled(enabled)
    assert_exact(output, expected)
    scheduler = core.scheduler
    # the last step computed every token but the last sampled one; its next query sees from there - 11
    num_computed = PROMPT_LENGTH + NUM_NEW_TOKENS - 1
    assert scheduler.num_window_released_blocks == (num_computed - WINDOW + 1) // BLOCK_SIZE == 15
    # the sliding pool held a window and a chunk (SlidingWindowBlocks.num_blocks_held_at_most: 6 blocks);
    # the global pool every block of the request, none released
    assert most_sliding <= -(-(WINDOW - 1 + 8) // BLOCK_SIZE) + 1 == 6 < NUM_BLOCKS_OF_REQUEST == most_global
    for pool in (scheduler.blocks, scheduler.window_blocks):
        assert pool.num_used_blocks == 0 and pool.num_available_blocks == pool.num_total_blocks


def test_a_cached_prefix_serves_from_both_pools(gemma3):
    """The prompt's 9 full blocks stay cached in both pools after a first request (the sliding pool's
    released ones too, until evicted); the next request of the same prompt starts after them. The
    window of its next query (at 36) reaches blocks 6..8 only: with the sliding pool's first 6
    blocks evicted, the same prefix still serves, and output stays exact."""
    loaded, prompt, (expected_tokens, expected_logprobs) = gemma3
    core = EngineCore(loaded, EngineConfig(num_kv_blocks=64, block_size=BLOCK_SIZE, scheduler=CHUNKED))
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)  # prompt logprobs: no reuse
    scheduler = core.scheduler
    for attempt in ("first", "again", "after-eviction"):
        if attempt == "after-eviction":
            sliding = scheduler.window_blocks
            sliding.allocate("squeeze", (sliding.num_free_blocks + 6) * BLOCK_SIZE)
            sliding.free("squeeze")
            assert len(sliding.match_prefix(scheduler.prefix_cache.hasher.chain(prompt))) == 0
        hits_before = scheduler.num_prefix_hit_tokens
        output, _, _ = run(core, attempt, prompt, params)
        assert_exact(output, (expected_tokens, expected_logprobs[PROMPT_LENGTH - 1:]))
        assert scheduler.num_prefix_hit_tokens - hits_before == (0 if attempt == "first" else 9 * BLOCK_SIZE)


def test_decode_steps_through_static_buffers_read_both_pools(gemma3):
    """The GPU engine's decode steps replay CUDA graphs over static buffers, which carry the sliding
    pool's slots and tables beside the global ones (each pool with its scratch block); run eagerly
    on those buffers here, they decode exactly as the plain steps do."""
    from dualpace.engine.runner import ModelRunner

    loaded, prompt, expected = gemma3
    config = EngineConfig(num_kv_blocks=64, block_size=BLOCK_SIZE, scheduler=CHUNKED)
    num_blocks, num_window_blocks = kv_pool_sizes(loaded.config, config)
    runner = ModelRunner(loaded, num_blocks, BLOCK_SIZE, decode_graph_batch=4, num_window_blocks=num_window_blocks)
    assert (runner.kv.num_blocks, runner.kv.num_window_blocks) == (num_blocks + 1, num_window_blocks + 1)
    core = EngineCore(loaded, config, runner)
    output, _, _ = run(core, "static", prompt)
    assert_exact(output, expected)
    assert runner.decode_graphs.num_static_steps == NUM_NEW_TOKENS - 1


def test_the_pools_split_the_budget_by_bytes(gemma3):
    """8 blocks of all 4 layers: the sliding pool gets what one running sequence needs under the window
    (3 blocks + 1) plus a step of 8 tokens (2), and the global layer the bytes the other 3 layers leave."""
    loaded, _, _ = gemma3
    config = EngineConfig(num_kv_blocks=8, block_size=BLOCK_SIZE,
                          scheduler=SchedulerConfig(max_batch_tokens=8, max_running=1))
    assert kv_pool_sizes(loaded.config, config) == (8 + 3 * (8 - 6), 6)
    core = EngineCore(loaded, config)
    kv = core.runner.kv
    assert [layer.shape[0] for layer in kv.k] == [6, 6, 14, 6] == [layer.shape[0] for layer in kv.v]
    assert sum(layer.shape[0] for layer in kv.k) == 4 * 8  # the same bytes as 8 blocks of every layer
    assert not core.moves_kv


def test_a_request_longer_than_the_sliding_pool_is_served(gemma3):
    """The request's 71 computed tokens need 18 blocks; the sliding pool has 6 (and the global one
    18): admission reserves the first chunk there, and the window releases behind each chunk."""
    loaded, prompt, expected = gemma3
    core = EngineCore(loaded, EngineConfig(num_kv_blocks=9, block_size=BLOCK_SIZE,
                                           scheduler=SchedulerConfig(max_batch_tokens=8, max_running=1)))
    assert core.scheduler.window_blocks.num_total_blocks == 6 < NUM_BLOCKS_OF_REQUEST
    assert core.scheduler.blocks.num_total_blocks == 9 + 3 * (9 - 6) == NUM_BLOCKS_OF_REQUEST
    output, most_global, most_sliding = run(core, "long", prompt)
    assert_exact(output, expected)
    assert most_sliding <= 6 and most_global == NUM_BLOCKS_OF_REQUEST
    assert core.scheduler.num_preemptions == 0


def test_two_requests_share_both_pools_and_a_preempted_one_recomputes_exactly(gemma3):
    """16 blocks of budget, 2 running: a sliding pool of 10 blocks, a global one of 34, which cannot hold
    both requests' 18 blocks: they run together until one is preempted (freeing its blocks in both
    pools) and recomputed; both decode exactly."""
    loaded, prompt, expected = gemma3
    core = EngineCore(loaded, EngineConfig(num_kv_blocks=16, block_size=BLOCK_SIZE,
                                           scheduler=SchedulerConfig(max_batch_tokens=8, max_running=2)))
    scheduler = core.scheduler
    assert (scheduler.blocks.num_total_blocks, scheduler.window_blocks.num_total_blocks) == (34, 10)
    core.add_request("a", prompt, PARAMS)
    core.add_request("b", prompt, PARAMS)
    tokens, logprobs, most_together = {"a": [], "b": []}, {"a": [], "b": []}, 0
    for _ in range(8 * NUM_NEW_TOKENS):
        if not core.has_work:
            break
        plan, events = core.step()
        most_together = max(most_together, len(plan.sequences))
        for event in events:
            tokens[event.request_id] += event.new_token_ids
            logprobs[event.request_id] += [*(event.prompt_logprobs or ()), *event.logprobs]
    for name in ("a", "b"):
        assert_exact((tokens[name], logprobs[name]), expected)
    assert most_together == 2 and scheduler.num_preemptions >= 1
    assert scheduler.blocks.num_used_blocks == scheduler.window_blocks.num_used_blocks == 0


async def test_a_request_migrates_mid_generation_and_continues_exactly(gemma3):
    """The sliding layers' pool cannot travel in a transfer's one slot list: the request moves without
    KV and the target recomputes it, both its pools rebuilt by the prefill there."""
    from dualpace.engine.transfer.migration import migrate_out
    from tests.engine.test_migration import started, stop, wait_tokens
    from tests.helpers import data_socket_send

    loaded, prompt, expected = gemma3
    source, target = await started(loaded, "src", block_size=BLOCK_SIZE), await started(loaded, "dst", block_size=8)
    channel = await source[0].add_request("m", prompt, PARAMS)
    await wait_tokens(channel, 10)
    released_at_source = source[0].core.scheduler.num_window_released_blocks
    stats = await migrate_out(source[0], "m", data_socket_send(target[0]))
    assert channel.migrated_to == "dst" and stats.total_bytes == 0
    emitted = len(channel.output_token_ids)
    updates = [update async for update in target[0].channel("m").follow(emitted)]
    rest = [t for update in updates for t in update.new_token_ids]
    rest_logprobs = [entry for update in updates for entry in update.logprobs]
    released_on_target = target[0].core.scheduler.num_window_released_blocks
    for loop, _ in (source, target):
        for pool in loop.core.scheduler.pools:
            assert pool.num_used_blocks == 0
    await stop(source, target)
    assert released_at_source >= (PROMPT_LENGTH + 10 - 1 - WINDOW + 1) // BLOCK_SIZE
    assert released_on_target >= (PROMPT_LENGTH + NUM_NEW_TOKENS - 1 - WINDOW + 1) // 8 - 1
    assert_exact((channel.output_token_ids + rest, [*channel.prompt_logprobs, *channel.token_logprobs,
                                                   *rest_logprobs]), expected)
