"""Penalties, logit_bias and min_tokens: their limits and the per-row state the sampler needs
(torch-free; dualpace/logits_processing.py applies them to the logits).

Definitions (vLLM's, applied in vLLM's order to the float32 logits of each row):
1. logit_bias: logit[t] += bias[t];
2. min_tokens: while fewer than min_tokens tokens were generated, EOS (unless ignore_eos) and the
   stop_token_ids get -inf;
3. repetition_penalty r (> 0, 1 is off) over the tokens of the prompt and the output:
   logit = logit / r where logit > 0, else logit * r;
4. frequency_penalty f and presence_penalty p (in [-2, 2]) over the output tokens only:
   logit[t] -= f * count[t] + p * (count[t] > 0).
Then temperature and the filters, as without them.

The state is the request's tokens, which travel with it: a migrated request carries its prompt
and output ids, and a request re-submitted after an engine failure (prompt + output so far as
its new prompt) carries num_prior_output_tokens, so the counts are rebuilt exactly.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from dualpace.errors import InvalidArgument
from dualpace.logprobs import wants_prompt_logprobs

PENALTY_LIMIT = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
LOGIT_BIAS_LIMIT = 100.0  # each bias lies in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300


@dataclass(frozen=True)
class SamplingContext:
    """A row's tokens so far, for the penalties and prompt log-probabilities of one step. The
    sequences are the request's own lists, read during the step only."""

    prompt_token_ids: Sequence[int]  # the engine request's prompt
    output_token_ids: Sequence[int]
    num_prior_output_tokens: int  # the prompt's last tokens that were output before a re-submission
    suppressed_token_ids: tuple[int, ...]  # min_tokens not reached: these cannot be drawn
    prompt_logprobs: bool  # the step returns the log-probabilities of the prompt tokens it computes

    @property
    def penalty_prompt_token_ids(self) -> Sequence[int]:
        return self.prompt_token_ids[: len(self.prompt_token_ids) - self.num_prior_output_tokens]

    @property
    def penalty_output_token_ids(self) -> list[int]:
        prior = self.prompt_token_ids[len(self.prompt_token_ids) - self.num_prior_output_tokens:]
        return [*prior, *self.output_token_ids]


def has_penalties(params) -> bool:
    """Whether the request changes the logits before sampling (any field of this module set)."""
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0
            or bool(params.logit_bias) or params.min_tokens > 0)


def context_for(request, eos_token_ids: Collection[int]) -> SamplingContext | None:
    """The context of an engine request's next step, or None when it needs none (the usual case)."""
    params = request.params
    prompt_logprobs = wants_prompt_logprobs(params, request.output_token_ids)
    if not prompt_logprobs and not has_penalties(params):
        return None
    suppressed: tuple[int, ...] = ()
    if len(request.output_token_ids) < params.min_tokens:
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        suppressed = tuple(sorted(stop_ids))
    return SamplingContext(request.prompt_token_ids, request.output_token_ids,
                           getattr(request, "num_prior_output_tokens", 0), suppressed, prompt_logprobs)


def check_penalty_fields(params, vocab_size: int | None) -> None:
    """InvalidArgument naming the first bad field of this module's."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not _is_number(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
            raise InvalidArgument(name, f"must be a number in [-2, 2], got {value!r}")
    if not _is_number(params.repetition_penalty) or params.repetition_penalty <= 0:
        raise InvalidArgument("repetition_penalty", f"must be a number > 0 (1 is off), got {params.repetition_penalty!r}")
    if isinstance(params.min_tokens, bool) or not isinstance(params.min_tokens, int) or params.min_tokens < 0:
        raise InvalidArgument("min_tokens", f"must be an integer >= 0, got {params.min_tokens!r}")
    if params.min_tokens > params.max_tokens:
        raise InvalidArgument("min_tokens", f"{params.min_tokens} is more than max_tokens ({params.max_tokens})")
    if len(params.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument("logit_bias", f"has {len(params.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
    seen = set()
    for token_id, bias in params.logit_bias:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0 or (
                vocab_size is not None and token_id >= vocab_size):
            limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise InvalidArgument("logit_bias", f"token id {token_id!r} is outside the vocabulary {limit}")
        if token_id in seen:
            raise InvalidArgument("logit_bias", f"token id {token_id} appears twice")
        seen.add(token_id)
        if not _is_number(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise InvalidArgument("logit_bias", f"the bias of token {token_id} must be in [-100, 100], got {bias!r}")


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
