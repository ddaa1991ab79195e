"""Hugging Face transformers as the reference implementation in parity tests."""

from __future__ import annotations

import torch


def hf_greedy(hf_model, prompt_ids: list[int], num_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers with a full forward each step: no EOS handling,
    no generation config, nothing but argmax over the reference logits."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_new_tokens):
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


def hf_prompt_logits(hf_model, prompt_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt_ids])).logits[0].float()
