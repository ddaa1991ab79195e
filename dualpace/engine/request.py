"""A request as an engine holds it: tokens so far, sampling state and KV progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dualpace.logprobs import TokenLogprobs
from dualpace.sampling_params import FinishReason, SamplingParams


class RequestState(str, enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute its KV
    RUNNING = "running"  # scheduled every step until it finishes
    PAUSED = "paused"  # held at a step boundary (e.g. while its KV is exported); keeps its blocks
    FINISHED = "finished"


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # fixed at admission; sampling is a function of (seed, position)
    output_token_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in this engine's cache
    finish_reason: FinishReason | None = None
    arrival_index: int = 0  # order of arrival, for first-come first-served and preemption
    num_preemptions: int = 0
    num_cached_tokens: int | None = None  # prompt tokens whose KV came from the prefix cache, set at admission
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hashes of its full blocks so far
    # Re-submitted after an engine failure: the prompt's last tokens were output before (penalties count them so).
    num_prior_output_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # positions 1.. while being computed
    # Moved elsewhere right after its first token (the hand-off): paused in the step that samples it.
    hold_after_first_token: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def guided_token_ids(self) -> tuple[int, ...]:
        """The tokens generated under params.guided so far, any re-submitted as prompt included."""
        num_in_prompt = min(self.params.guided.num_output_tokens_in_prompt, len(self.prompt_token_ids))
        prompt_tail = self.prompt_token_ids[len(self.prompt_token_ids) - num_in_prompt:]
        return tuple(prompt_tail) + tuple(self.output_token_ids)


@dataclass(frozen=True)
class RequestEvent:
    """What one step (or a command) did to a request, for its output stream."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    migrated_to: str | None = None  # set when the request now lives in another engine
    num_cached_tokens: int | None = None  # with new tokens: prompt tokens served from the prefix cache
    logprobs: tuple[TokenLogprobs | None, ...] = ()  # per new token when the request asked for them
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # with the first token, when asked for
    held: bool = False  # with the first token: the request is now paused for its hand-off (hold_after_first_token)
