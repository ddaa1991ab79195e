"""Validation of a generation request against a model; errors name the field."""

from __future__ import annotations

from collections.abc import Sequence

from dualpace.errors import InvalidArgument
from dualpace.guided_grammar import check_spec
from dualpace.sampling_params import SamplingParams


def validate_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_context_tokens: int,
    prompt_field: str = "prompt_token_ids",
) -> None:
    """Raise InvalidArgument for an empty or out-of-vocabulary prompt, bad sampling
    values, or a prompt (plus max_tokens) that does not fit in the context."""
    if len(prompt_token_ids) == 0:
        raise InvalidArgument(prompt_field, "the prompt is empty")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:  # C loops; the index below only then
        index, token_id = next((i, t) for i, t in enumerate(prompt_token_ids) if not 0 <= t < vocab_size)
        raise InvalidArgument(
            prompt_field, f"token id {token_id} at index {index} is outside the vocabulary [0, {vocab_size})"
        )
    params.validate(vocab_size)
    if params.guided is not None:
        if params.ignore_eos:  # the grammar's end is an end-of-sequence token: it must stop the output
            raise InvalidArgument("ignore_eos", "cannot be combined with a structured-output constraint")
        check_spec(params.guided, "guided")
    if len(prompt_token_ids) >= max_context_tokens:
        raise InvalidArgument(
            prompt_field,
            f"the prompt has {len(prompt_token_ids)} tokens; the model's context is {max_context_tokens} tokens",
        )
    if len(prompt_token_ids) + params.max_tokens > max_context_tokens:
        raise InvalidArgument(
            "max_tokens",
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"the model's context of {max_context_tokens} tokens",
        )
