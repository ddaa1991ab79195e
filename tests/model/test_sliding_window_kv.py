"""A prompt longer than the sliding window, served by the engine (scheduler, runner, paged KV) on a
model whose every layer slides (tiny Mistral with a window of 12): greedy-identical to transformers
in fp32 on the torch stages (the GPU engine's path) and the CPU kernels (CPU local), while the blocks
no window reaches any more go back to the pool during the run (counted), and a later request reuses
the cached prefix the window needs."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.scheduler import SchedulerConfig
from dualpace.model import cpu_kernels
from dualpace.model.loader import load_model
from dualpace.sampling import SamplingParams
from tests.model.family_checkpoints import write_family_checkpoint
from tests.model.hf_reference import hf_greedy

WINDOW = 12  # tests/model/family_checkpoints.py, mistral-swa
BLOCK_SIZE = 4
PROMPT_LENGTH = 23
NUM_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def mistral_swa(tmp_path_factory):
    folder = write_family_checkpoint("mistral-swa", tmp_path_factory.mktemp("mistral-swa"))
    loaded = load_model(str(folder), dtype="fp32")
    assert loaded.config.window_of_every_layer == WINDOW
    rng = random.Random("swa")
    prompt = [rng.randrange(5, loaded.config.vocab_size) for _ in range(PROMPT_LENGTH)]
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return loaded, prompt, hf_greedy(hf_model, prompt, NUM_NEW_TOKENS)


def run(core: EngineCore, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    """The request's tokens and the most blocks the pool had in use after any step."""
    core.add_request(request_id, prompt, SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True))
    tokens, most_used = [], 0
    for _ in range(4 * NUM_NEW_TOKENS):
        if not core.has_work:
            break
        _, events = core.step()
        tokens += [t for event in events for t in event.new_token_ids]
        most_used = max(most_used, core.scheduler.blocks.num_used_blocks)
    assert not core.has_work
    return tokens, most_used


@pytest.mark.parametrize("kernels_on", [True, False], ids=["cpu-kernels", "torch-stages"])
def test_a_prompt_longer_than_the_window_decodes_exactly_and_frees_blocks(mistral_swa, kernels_on):
    loaded, prompt, expected = mistral_swa
    enabled = cpu_kernels._state.get("enabled", True)
    cpu_kernels.set_enabled(kernels_on)
    try:
        core = EngineCore(loaded, EngineConfig(num_kv_blocks=64, block_size=BLOCK_SIZE, prefix_caching=False))
        tokens, most_used = run(core, "long", prompt)
    finally:
        cpu_kernels.set_enabled(enabled)
    assert tokens == expected
    # the last step computed every token but the last sampled one; its next query sees from there - 11
    num_computed = PROMPT_LENGTH + NUM_NEW_TOKENS - 1
    assert core.scheduler.num_window_released_blocks == (num_computed - WINDOW + 1) // BLOCK_SIZE == 10
    # held at most: the window's blocks (3, or 4 when it straddles), the block being filled, one appended
    assert most_used <= WINDOW // BLOCK_SIZE + 2 < -(-(PROMPT_LENGTH + NUM_NEW_TOKENS) // BLOCK_SIZE)
    assert core.scheduler.blocks.num_used_blocks == 0 and core.scheduler.blocks.num_free_blocks == 64


def test_a_request_longer_than_the_pool_is_served_in_chunks_under_the_window(mistral_swa):
    """7 blocks of 4 tokens, 8 tokens a step: the request's 55 tokens would need 14 blocks, but
    admission reserves its first chunk only and the window releases behind each chunk."""
    loaded, prompt, expected = mistral_swa
    core = EngineCore(loaded, EngineConfig(num_kv_blocks=7, block_size=BLOCK_SIZE, prefix_caching=False,
                                           scheduler=SchedulerConfig(max_batch_tokens=8)))
    tokens, most_used = run(core, "long", prompt)
    assert tokens == expected
    assert most_used <= -(-(WINDOW - 1 + 8) // BLOCK_SIZE) + 1 == 6
    assert core.scheduler.num_preemptions == 0


def test_a_cached_prefix_serves_through_the_window_after_its_early_blocks_are_gone(mistral_swa):
    """The rule: a cached prefix of k blocks is reused when the blocks the next query's window reaches
    are still in the pool; the earlier ones need not be. Here the first request's two leading blocks
    (released first, so evicted first) are taken by an allocation; the plain match then finds nothing,
    the window's match all 5 matchable blocks, of which it needs blocks 2..4."""
    loaded, prompt, expected = mistral_swa
    core = EngineCore(loaded, EngineConfig(num_kv_blocks=64, block_size=BLOCK_SIZE))
    assert run(core, "first", prompt)[0] == expected
    blocks = core.scheduler.blocks
    prompt_hashes = core.scheduler.prefix_cache.hasher.chain(prompt)
    assert len(blocks.match_prefix(prompt_hashes)) == 5
    blocks.allocate("squeeze", (blocks.num_free_blocks + 2) * BLOCK_SIZE)  # evicts the two least recently freed
    blocks.free("squeeze")
    assert blocks.match_prefix(prompt_hashes) == [] and len(blocks.match_prefix(prompt_hashes[2:3])) == 1
    assert run(core, "again", prompt)[0] == expected
    assert core.scheduler.num_prefix_hit_tokens == 5 * BLOCK_SIZE


def test_a_table_with_released_entries_gives_the_same_logits(mistral_swa):
    """What every path's step tensors do with FREED_BLOCK_ID (the GPU engine, CPU local, and the
    CPU side of Dense Assist all build them with build_step_tensors): a decode and a prefill chunk
    whose leading blocks were released compute what the full table computes."""
    from dualpace.kv.block_table import FREED_BLOCK_ID
    from dualpace.kv.storage import KVStorage
    from dualpace.model.paged_forward import PagedForward, SequenceWork

    loaded, prompt, _ = mistral_swa
    cfg = loaded.config
    forward = PagedForward(loaded.model, KVStorage(cfg.num_layers, 16, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                                                   loaded.model.dtype))
    table = list(range(7))  # 28 slots
    forward.forward([SequenceWork(prompt[:16], 0, table)])
    # a chunk from 16 first sees 16 - 12 + 1 = 5: block 0 may be gone; a decode at 19 sees 8..: blocks 0 and 1
    for start, end, num_released in ((16, 20, 1), (19, 20, 2)):
        released = [FREED_BLOCK_ID] * num_released + table[num_released:]
        full = forward.forward([SequenceWork(prompt[start:end], start, table)])
        again = forward.forward([SequenceWork(prompt[start:end], start, released)])
        # masked keys add exact zeros, but the fused prefill kernel's blocking may round differently
        assert torch.allclose(full, again, rtol=0, atol=1e-5) and torch.equal(full.argmax(-1), again.argmax(-1))
    with pytest.raises(ValueError, match="returned to the pool"):
        forward.forward([SequenceWork(prompt[4:6], 4, released)])


async def test_a_request_with_released_blocks_migrates_and_continues_exactly(mistral_swa):
    """The source has released blocks when it pauses (block size 4); the transfer carries their
    positions as filler, and the target (block size 8) releases its own from the commit on."""
    from dualpace.engine.transfer.migration import migrate_out
    from tests.engine.test_migration import started, stop, wait_tokens
    from tests.helpers import data_socket_send

    loaded, prompt, expected = mistral_swa
    source, target = await started(loaded, "src", block_size=BLOCK_SIZE), await started(loaded, "dst", block_size=8)
    channel = await source[0].add_request("m", prompt, SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True))
    await wait_tokens(channel, 10)
    released_at_source = source[0].core.scheduler.num_window_released_blocks
    await migrate_out(source[0], "m", data_socket_send(target[0]))
    assert channel.migrated_to == "dst"
    released_on_target = target[0].core.scheduler.num_window_released_blocks
    emitted = len(channel.output_token_ids)
    rest = [t async for update in target[0].channel("m").follow(emitted) for t in update.new_token_ids]
    await stop(source, target)
    assert released_at_source >= (PROMPT_LENGTH + 10 - 1 - WINDOW + 1) // BLOCK_SIZE
    assert released_on_target >= (PROMPT_LENGTH + 10 - 1 - WINDOW + 1) // 8  # from the commit on
    assert channel.output_token_ids + rest == expected
