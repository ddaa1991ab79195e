"""The offline generator: batching, chunked prefill and seeded sampling are consistent."""

from __future__ import annotations

import random

import torch

from dualpace.generation import OfflineGenerator
from dualpace.kv.storage import KVStorage
from dualpace.model.paged_forward import PagedForward, SequenceWork
from dualpace.sampling import FinishReason, SamplingParams


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def test_batched_decode_equals_each_alone(tiny):
    prompts = random_prompts(tiny.config.vocab_size, [3, 17, 1, 40, 9, 25, 64, 5])
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    together = OfflineGenerator(tiny, block_size=8).generate(prompts, [params] * len(prompts))
    for prompt, seq in zip(prompts, together):
        alone = OfflineGenerator(tiny, block_size=8).generate([prompt], [params])[0]
        assert seq.output_token_ids == alone.output_token_ids
        assert len(seq.output_token_ids) == 24 and seq.finish_reason == FinishReason.LENGTH


def test_chunked_prefill_equals_single_prefill(tiny):
    cfg = tiny.config
    prompt = random_prompts(cfg.vocab_size, [37])[0]
    block_size = 4

    def run(chunks: list[int]) -> torch.Tensor:
        kv = KVStorage(cfg.num_layers, 12, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        forward = PagedForward(tiny.model, kv)
        block_ids = list(range(11, 1, -1))
        start, rows = 0, []
        for size in chunks:
            rows.append(forward.forward([SequenceWork(prompt[start:start + size], start, block_ids, all_logits=True)]))
            start += size
        return torch.cat(rows)

    whole = run([37])
    # Logits here are O(10); different chunking changes only the float summation order.
    assert (run([10, 1, 20, 6]) - whole).abs().max() < 2e-4
    assert (run([1] * 37) - whole).abs().max() < 2e-4


def test_mixed_prefill_and_decode_step(tiny):
    """A step holding a decode token and a prefill chunk gives each what it gets alone."""
    cfg = tiny.config
    a, b = random_prompts(cfg.vocab_size, [9, 14], seed=3)
    kv = KVStorage(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    forward = PagedForward(tiny.model, kv)
    blocks_a, blocks_b = [0, 1, 2], [5, 4, 3, 6]
    forward.forward([SequenceWork(a[:8], 0, blocks_a)])
    mixed = forward.forward([SequenceWork(a[8:], 8, blocks_a), SequenceWork(b, 0, blocks_b)])
    kv_alone = KVStorage(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    alone = PagedForward(tiny.model, kv_alone)
    expect_a = alone.forward([SequenceWork(a, 0, blocks_a)])
    expect_b = alone.forward([SequenceWork(b, 0, blocks_b)])
    assert torch.allclose(mixed[0], expect_a[0], atol=2e-4)
    assert torch.allclose(mixed[1], expect_b[0], atol=2e-4)


def test_same_seed_same_tokens_and_different_seed_differs(tiny):
    prompt = random_prompts(tiny.config.vocab_size, [12], seed=5)[0]

    def sample(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=32, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)
        return OfflineGenerator(tiny).generate([prompt], [params])[0].output_token_ids

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_continuing_from_a_prefix_reproduces_the_uninterrupted_run(tiny):
    prompt = random_prompts(tiny.config.vocab_size, [10], seed=9)[0]
    params = SamplingParams(max_tokens=30, temperature=0.9, top_k=50, seed=1234, ignore_eos=True)
    full = OfflineGenerator(tiny).generate([prompt], [params])[0].output_token_ids
    cut = 13
    rest = SamplingParams(max_tokens=30 - cut, temperature=0.9, top_k=50, seed=1234, ignore_eos=True)
    continued = OfflineGenerator(tiny).generate([prompt + full[:cut]], [rest])[0].output_token_ids
    assert continued == full[cut:]


def test_eos_stops_unless_ignored(tiny):
    prompt = random_prompts(tiny.config.vocab_size, [6], seed=2)[0]
    greedy = OfflineGenerator(tiny).generate([prompt], [SamplingParams(max_tokens=8, ignore_eos=True)])[0]
    stop_id = greedy.output_token_ids[3]
    params = SamplingParams(max_tokens=8, stop_token_ids=(stop_id,))
    stopped = OfflineGenerator(tiny).generate([prompt], [params])[0]
    assert stopped.finish_reason == FinishReason.STOP
    assert stopped.output_token_ids == greedy.output_token_ids[: greedy.output_token_ids.index(stop_id) + 1]
