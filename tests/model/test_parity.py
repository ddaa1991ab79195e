"""Greedy parity with Hugging Face transformers on the same checkpoint, in float32.

Acceptance: identical token ids for >= 32 new tokens and max |logit difference| < 1e-3
over the prompt, for tiny models of several shapes and for the default model.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from dualpace.kv.storage import KVStorage
from dualpace.model.loader import load_model
from dualpace.model.paged_forward import PagedForward, SequenceWork
from dualpace.sampling import SamplingParams
from tests.helpers import reference_tokens
from tests.model.hf_reference import hf_greedy, hf_prompt_logits, tensor_name_map_built_once

NUM_NEW_TOKENS = 32
LOGIT_TOLERANCE = 1e-3

TINY_PRESETS = ["tiny-llama", "tiny-llama-untied", "tiny-qwen2", "tiny-mistral", "tiny-llama3-rope", "tiny-qwen3",
                "tiny-phi3", "tiny-mistral-swa", "tiny-gemma3", "tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe"]


def prompt_logits(loaded, prompt_ids: list[int], block_size: int = 4) -> torch.Tensor:
    """Logits for every prompt position from our paged forward, with a scattered block table."""
    cfg = loaded.config
    num_blocks = -(-len(prompt_ids) // block_size)
    kv = KVStorage(cfg.num_layers, 2 * num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim,
                   loaded.model.dtype)
    block_ids = list(range(2 * num_blocks, 0, -2))  # out of order, non-contiguous
    return PagedForward(loaded.model, kv).forward([SequenceWork(prompt_ids, 0, block_ids, all_logits=True)])


def our_greedy(loaded, prompt_ids: list[int], num_new_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=num_new_tokens, ignore_eos=True)
    return reference_tokens(loaded, prompt_ids, params, block_size=4)


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tiny_model_matches_transformers(preset, synth_checkpoint):
    folder = synth_checkpoint(preset)
    loaded = load_model(str(folder), dtype="fp32")
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(preset)
    prompt_ids = [rng.randrange(loaded.config.vocab_size) for _ in range(23)]

    diff = (prompt_logits(loaded, prompt_ids) - hf_prompt_logits(hf_model, prompt_ids)).abs().max().item()
    assert diff < LOGIT_TOLERANCE, f"{preset}: max |logit diff| {diff}"
    assert our_greedy(loaded, prompt_ids, NUM_NEW_TOKENS) == hf_greedy(hf_model, prompt_ids, NUM_NEW_TOKENS)


def test_llama3_rope_scaling_is_exercised(synth_checkpoint):
    """The llama3 preset must actually change frequencies, or its parity test proves nothing."""
    from dualpace.model.rope import inverse_frequencies

    loaded = load_model(str(synth_checkpoint("tiny-llama3-rope")), dtype="fp32")
    cfg = loaded.config
    assert cfg.rope_scaling is not None
    plain = inverse_frequencies(dataclasses.replace(cfg, rope_scaling=None))
    assert not torch.allclose(inverse_frequencies(cfg), plain)


@pytest.mark.slow
def test_default_model_matches_transformers(default_model_fp32, default_model_path):
    with tensor_name_map_built_once():
        hf_model = AutoModelForCausalLM.from_pretrained(
            default_model_path.parent, gguf_file=default_model_path.name, dtype=torch.float32
        ).eval()
    tokenizer = default_model_fp32.tokenizer
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": "Write a short poem about the sea."}])
    diff = (prompt_logits(default_model_fp32, prompt_ids, block_size=16)
            - hf_prompt_logits(hf_model, prompt_ids)).abs().max().item()
    assert diff < LOGIT_TOLERANCE, f"max |logit diff| {diff}"
    assert our_greedy(default_model_fp32, prompt_ids, NUM_NEW_TOKENS) == hf_greedy(hf_model, prompt_ids, NUM_NEW_TOKENS)
