"""Where a greedy output reaches a near-tie of its two most likely tokens (see near_tie_finder)."""

from __future__ import annotations

from collections.abc import Callable

import torch

NEAR_TIE_LOGIT_GAP = 1e-4


def near_tie_finder() -> Callable[..., int | None]:
    """near_tie_finder()(folder, prompt, tokens) -> the first index i of `tokens` (a greedy output
    of `prompt`) where the two most likely next tokens' fp32 logits (Hugging Face transformers, one
    forward over prompt + tokens) are within NEAR_TIE_LOGIT_GAP, else None. Greedy outputs are
    equal token for token up to there on every path; at such a tie, rounding of the order in which
    a product was summed (a prefill's GEMM or a decode's GEMV, a batch or a lone row) may pick
    either, and the two outputs legitimately part from then on."""
    from transformers import AutoModelForCausalLM

    models: dict[str, object] = {}

    def find(folder: str, prompt: list[int], tokens: list[int]) -> int | None:
        if folder not in models:
            models[folder] = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            logits = models[folder](torch.tensor([list(prompt) + list(tokens)])).logits[0, len(prompt) - 1:-1]
        top2 = torch.topk(logits, 2, dim=-1).values
        ties = ((top2[:, 0] - top2[:, 1]) < NEAR_TIE_LOGIT_GAP).nonzero()
        return int(ties[0]) if ties.numel() else None

    return find
