"""Log-probabilities of generated and prompt tokens: the types and the bookkeeping (torch-free;
the router and the pure scheduler use them; dualpace/logits_processing.py computes them).

What they are: log_softmax of the model's raw logits in float32, before logit_bias, min_tokens,
the penalties, temperature and the top-k/top-p/min-p filters — vLLM's default ("raw" logprobs).
So they describe the model's distribution, and the sampled token's entry is its log-probability
under that distribution whatever the sampler then did to the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dualpace.errors import InvalidArgument

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit; vLLM's default cap)


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability, its rank and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    rank: int  # 1: the most likely token (1 + how many tokens are strictly more likely)
    top_token_ids: tuple[int, ...] = ()  # most likely first
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class PromptLogprobsChunk:
    """Prompt log-probabilities computed in one step: entries[i] is the prompt token at position
    first_position + i (position 0, the first prompt token, has none)."""

    first_position: int
    entries: tuple[TokenLogprobs, ...]


def check_logprob_fields(params) -> None:
    """InvalidArgument naming logprobs or prompt_logprobs when out of [0, MAX_LOGPROBS]."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
            raise InvalidArgument(name, f"must be an integer in [0, {MAX_LOGPROBS}] (or unset), got {value!r}")


def wants_prompt_logprobs(params, output_token_ids: Sequence[int]) -> bool:
    """Whether a step over the request's prompt must compute prompt log-probabilities: asked for,
    and not delivered yet (they go out with the first token, so a request with output has them)."""
    return params.prompt_logprobs is not None and not output_token_ids


def merge_prompt_logprobs(collected: list[TokenLogprobs], chunk: PromptLogprobsChunk) -> None:
    """Append the chunk's entries that `collected` (positions 1, 2, ...) lacks; a recomputed
    chunk (after a preemption) adds nothing twice."""
    skip = len(collected) + 1 - chunk.first_position
    if skip < 0:
        raise ValueError(f"prompt logprobs from position {chunk.first_position} after {len(collected)} entries")
    collected.extend(chunk.entries[skip:])


def prompt_logprobs_with_first_token(request) -> tuple[TokenLogprobs, ...] | None:
    """What an engine request's first token's event carries: every prompt token's entry, when
    they were asked for (None otherwise, and with every later token)."""
    if request.params.prompt_logprobs is None or len(request.output_token_ids) != 1:
        return None
    return tuple(request.prompt_logprobs)
