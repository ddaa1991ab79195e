"""From a step's logits to its StepResult: sampling (with each row's penalties), the sampled
tokens' log-probabilities and the prompt chunks' ones. Every engine path ends here: the local
forward (ModelRunner), the CPU engine's local and assisted iterations, so the numbers are the
same wherever a request runs.
"""

from __future__ import annotations

import torch

from dualpace.engine.scheduler import ScheduledSequence, StepPlan, StepResult
from dualpace.guided_decoding import apply_masks
from dualpace.logits_processing import prompt_logprob_chunk
from dualpace.model.paged_forward import SequenceWork
from dualpace.sampling import sample_next_tokens


def needs_all_logits(sequence: ScheduledSequence) -> bool:
    """A prefill chunk whose prompt log-probabilities are wanted returns a logits row per token."""
    return sequence.context is not None and sequence.context.prompt_logprobs and len(sequence.token_ids) > 1


def step_work(plan: StepPlan) -> list[SequenceWork]:
    return [SequenceWork(list(s.token_ids), s.start_pos, list(s.block_ids), all_logits=needs_all_logits(s),
                         window_block_ids=None if s.window_block_ids is None else list(s.window_block_ids))
            for s in plan.sequences]


def needs_logits_here(plan: StepPlan) -> bool:
    """Whether some row needs more than a plain draw (penalties, log-probabilities), so that the
    sampling must run beside the request's state instead of on a remote device."""
    return any(s.context is not None or s.params.logprobs is not None for s in plan.sequences)


def sample_step(plan: StepPlan, logits: torch.Tensor, nan_logits_request: str | None = None,
                guided: tuple[list[int], torch.Tensor] | None = None) -> StepResult:
    """logits: the forward's rows for `plan` (one per sequence, one per token for
    needs_all_logits sequences). nan_logits_request: a test-only fault, that request's sampled
    row becomes NaN. guided: (indices into the sampled sequences, their token masks) of the rows
    under a structured-output constraint; their forbidden tokens are masked before sampling
    (so their log-probabilities are those of the constrained distribution)."""
    last_rows: list[int] = []
    prompt_chunks = {}
    row = 0
    for sequence in plan.sequences:
        num_rows = len(sequence.token_ids) if needs_all_logits(sequence) else 1
        context = sequence.context
        if context is not None and context.prompt_logprobs:
            chunk = prompt_logprob_chunk(logits[row:row + num_rows], sequence.start_pos, context.prompt_token_ids,
                                         sequence.params.prompt_logprobs)
            if chunk is not None:
                prompt_chunks[sequence.request_id] = chunk
        row += num_rows
        last_rows.append(row - 1)
    sampled = [(s, last_rows[i]) for i, s in enumerate(plan.sequences) if s.sample]
    if not sampled:
        return StepResult({}, prompt_logprobs=prompt_chunks)
    rows = logits[[r for _, r in sampled]]
    for i, (sequence, _) in enumerate(sampled):
        if sequence.request_id == nan_logits_request:
            rows[i] = float("nan")
    if guided is not None:
        rows = apply_masks(rows, guided[0], guided[1])
    sequences = [s for s, _ in sampled]
    result = sample_next_tokens(rows, [s.params for s in sequences], [s.seed for s in sequences],
                                [s.sample_position for s in sequences], [s.context for s in sequences])
    return StepResult(
        {s.request_id: (token_id if finite else None)
         for s, token_id, finite in zip(sequences, result.token_ids, result.finite)},
        logprobs={s.request_id: entry for s, entry in zip(sequences, result.logprobs) if entry is not None},
        prompt_logprobs=prompt_chunks,
    )
