"""Hugging Face transformers as the reference implementation in parity tests."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch


@contextmanager
def tensor_name_map_built_once() -> Iterator[None]:
    """transformers loading a GGUF file without its repeated work: it builds gguf's tensor-name map
    once per module it walks (~400 times for SmolLM2, ~5 s). The map is a function of its arguments
    alone, so the model is the same. (The file itself is parsed once: tests/gguf_cache.py.)"""
    import gguf

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


def hf_greedy(hf_model, prompt_ids: list[int], num_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers, stepping with its own KV cache: no EOS handling, no
    generation config, nothing but argmax over the reference logits."""
    new_ids: list[int] = []
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt_ids]), use_cache=True)
        while True:
            new_ids.append(int(out.logits[0, -1].argmax()))
            if len(new_ids) == num_new_tokens:
                return new_ids
            out = hf_model(torch.tensor([new_ids[-1:]]), cache=out.cache, use_cache=True)


def hf_prompt_logits(hf_model, prompt_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt_ids])).logits[0].float()


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """Log-probabilities [len(token_ids) - 1, vocab] transformers gives tokens 1.. from one pass: for a
    prompt, what its prompt_logprobs are checked against (each row sees every KV entry before it, where
    greedy tokens of a tiny random model, one token repeated, would not show a wrong one)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids[:-1]])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_logprobs_match(entries, reference: torch.Tensor, atol: float = 1e-4) -> None:
    """Each TokenLogprobs (of a request asked for top-k logprobs) against the reference row."""
    assert len(entries) == reference.shape[0]
    for position, (entry, row) in enumerate(zip(entries, reference)):
        assert entry is not None and entry.top_token_ids, position
        want = row[list(entry.top_token_ids)]
        got = torch.tensor(entry.top_logprobs)
        assert torch.allclose(got, want, rtol=0, atol=atol), (position, got, want)
        assert abs(entry.logprob - float(row[entry.token_id])) <= atol, position
