"""Hugging Face transformers as the reference implementation in parity tests."""

from __future__ import annotations

import torch


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
