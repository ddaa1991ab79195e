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
    row has some; `scores` itself is never written). Batched over the rows that use them, and
    sparse: only the logits of biased, suppressed and already seen tokens are touched, each row's
    tokens addressed in one flat [rows * vocab] index."""
    rows = [i for i, (p, c) in enumerate(zip(params, contexts)) if c is not None and has_penalties(p)]
    if not rows:
        return scores
    device, vocab_size = scores.device, scores.shape[1]
    picked = [params[i] for i in rows]
    picked_contexts = [contexts[i] for i in rows]
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    block = scores.index_select(0, row_index)  # a copy
    flat = block.view(-1)
    bias_ids, bias_values = _flat_ids([[t for t, _ in p.logit_bias] for p in picked], vocab_size, device,
                                      [[b for _, b in p.logit_bias] for p in picked])
    if bias_ids.numel():
        flat.index_add_(0, bias_ids, bias_values)
    suppressed, _ = _flat_ids([c.suppressed_token_ids for c in picked_contexts], vocab_size, device)
    if suppressed.numel():
        flat.index_fill_(0, suppressed, -math.inf)

    def per_row(values: list[float], flat_ids: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=block.dtype, device=device)[flat_ids // vocab_size]

    output_ids, _ = _flat_ids([c.penalty_output_token_ids for c in picked_contexts], vocab_size, device)
    output_ids, counts = torch.unique(output_ids, return_counts=True)
    if any(p.repetition_penalty != 1.0 for p in picked):  # x / 1 and x * 1 are exact: rows at 1 stay as they are
        prompt_ids, _ = _flat_ids([c.penalty_prompt_token_ids for c in picked_contexts], vocab_size, device)
        seen = torch.unique(torch.cat([output_ids, prompt_ids]))
        values, repetition = flat[seen], per_row([p.repetition_penalty for p in picked], seen)
        flat[seen] = torch.where(values > 0, values / repetition, values * repetition)
    if output_ids.numel():
        frequency = per_row([p.frequency_penalty for p in picked], output_ids)
        presence = per_row([p.presence_penalty for p in picked], output_ids)
        flat[output_ids] = flat[output_ids] - frequency * counts.to(block.dtype) - presence
    return scores.index_copy(0, row_index, block)


def _flat_ids(per_row: Sequence[Sequence[int]], vocab_size: int, device: torch.device,
              values: Sequence[Sequence[float]] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row r's ids as r * vocab_size + id (ids past the logits' width dropped), and their values."""
    ids_parts, value_parts = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.float32)]
    for row, ids in enumerate(per_row):
        if len(ids) == 0:
            continue
        row_ids = torch.as_tensor(ids if isinstance(ids, list) else list(ids), dtype=torch.long)
        inside = row_ids < vocab_size
        ids_parts.append(row_ids[inside] + row * vocab_size)
        if values is not None:
            value_parts.append(torch.as_tensor(values[row], dtype=torch.float32)[inside])
    flat = torch.cat(ids_parts).to(device)
    return flat, (torch.cat(value_parts).to(device) if values is not None else None)


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
