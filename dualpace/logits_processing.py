"""The logits work around sampling: penalties, logit_bias and min_tokens before the draw
(definitions in dualpace/penalties.py), and log-probabilities of the raw logits
(dualpace/logprobs.py). Float32, on the device of the logits; rows that ask for none of it
cost nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dualpace.logprobs import PromptLogprobsChunk, TokenLogprobs
from dualpace.penalties import SamplingContext, has_penalties


def apply_penalties(scores: torch.Tensor, params: Sequence, contexts: Sequence[SamplingContext | None]) -> torch.Tensor:
    """scores [num_rows, vocab] float32 with each row's penalties applied (a new tensor when any
    row has some; `scores` itself is never written)."""
    rows = [i for i, (p, c) in enumerate(zip(params, contexts)) if c is not None and has_penalties(p)]
    if not rows:
        return scores
    scores = scores.clone()
    for row in rows:
        scores[row] = _penalized_row(scores[row], params[row], contexts[row])
    return scores


def _penalized_row(row: torch.Tensor, params, context: SamplingContext) -> torch.Tensor:
    device, vocab_size = row.device, row.shape[0]
    if params.logit_bias:
        token_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=device)
        biases = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)
        row = row.index_add(0, token_ids, biases)
    if context.suppressed_token_ids:
        suppressed = torch.tensor(context.suppressed_token_ids, dtype=torch.long, device=device)
        row = row.index_fill(0, suppressed[suppressed < vocab_size], -math.inf)
    uses_counts = params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
    if not uses_counts:
        return row
    output_ids = torch.tensor(context.penalty_output_token_ids, dtype=torch.long, device=device)
    counts = torch.bincount(output_ids, minlength=vocab_size)[:vocab_size].to(torch.float32)
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        prompt_ids = torch.tensor(list(context.penalty_prompt_token_ids), dtype=torch.long, device=device)
        seen[prompt_ids[prompt_ids < vocab_size]] = True
        penalty = params.repetition_penalty
        row = torch.where(seen, torch.where(row > 0, row / penalty, row * penalty), row)
    if params.frequency_penalty:
        row = row - params.frequency_penalty * counts
    if params.presence_penalty:
        row = row - params.presence_penalty * (counts > 0).to(torch.float32)
    return row


def raw_log_probs(scores: torch.Tensor, params: Sequence) -> tuple[list[int], torch.Tensor | None]:
    """(rows that asked for logprobs, their log_softmax [len(rows), vocab]) of the raw scores."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return rows, None
    return rows, torch.log_softmax(scores[rows], dim=1)


def token_logprobs(log_probs: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[TokenLogprobs]:
    """One entry per row of log_probs [num_rows, vocab]: token_ids[i]'s value and rank, and the
    num_top[i] most likely tokens of the row."""
    if log_probs.shape[0] == 0:
        return []
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=log_probs.device)
    chosen = log_probs.gather(1, ids[:, None])
    ranks = ((log_probs > chosen).sum(dim=1) + 1).tolist()
    max_top = min(max(num_top), log_probs.shape[1])
    top_values, top_ids = (torch.topk(log_probs, max_top, dim=1) if max_top else (None, None))
    chosen_values = chosen.squeeze(1).tolist()
    top_values = top_values.tolist() if top_values is not None else None
    top_ids = top_ids.tolist() if top_ids is not None else None
    entries = []
    for i, (token_id, k) in enumerate(zip(token_ids, num_top)):
        entries.append(TokenLogprobs(
            token_id=int(token_id), logprob=chosen_values[i], rank=ranks[i],
            top_token_ids=tuple(top_ids[i][:k]) if k else (), top_logprobs=tuple(top_values[i][:k]) if k else ()))
    return entries


def prompt_logprob_chunk(logits: torch.Tensor, start_pos: int, prompt_token_ids: Sequence[int],
                         num_top: int) -> PromptLogprobsChunk | None:
    """Prompt log-probabilities from a step's logits [n, vocab] over positions start_pos.. :
    row j predicts the token at start_pos + j + 1; entries for the prompt positions among those."""
    end = min(start_pos + logits.shape[0], len(prompt_token_ids) - 1)
    num_entries = end - start_pos
    if num_entries <= 0:
        return None
    log_probs = torch.log_softmax(logits[:num_entries].float(), dim=1)
    targets = prompt_token_ids[start_pos + 1 : end + 1]
    entries = token_logprobs(log_probs, targets, [num_top] * num_entries)
    return PromptLogprobsChunk(start_pos + 1, tuple(entries))
