"""What one engine step runs and what it produced: the scheduler's plan and the runner's result
(pure data; dualpace.engine.scheduler makes plans and applies results)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpace.logprobs import PromptLogprobsChunk, TokenLogprobs
from dualpace.penalties import SamplingContext
from dualpace.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's work in a step: compute `token_ids` at positions start_pos...,
    and when `sample` is set, draw the token at position start_pos + len(token_ids)."""

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    sample: bool
    params: SamplingParams
    seed: int
    # With params.guided and sample set: the tokens generated under the constraint before the
    # one to draw (dualpace/guided_decoding.py rebuilds the grammar's state from them).
    guided_token_ids: tuple[int, ...] = ()
    context: SamplingContext | None = None  # penalties' tokens and prompt logprobs, when the request uses them
    # The sliding layers' block table where they have a pool of their own (a model mixing sliding and
    # global layers, Gemma 3); None: every layer reads block_ids.
    window_block_ids: tuple[int, ...] | None = None

    @property
    def sample_position(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    sequences: tuple[ScheduledSequence, ...]
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences


@dataclass(frozen=True)
class StepResult:
    """Sampled token per sequence that had `sample` set; None where its logits were not finite.
    `apply` ends such a request alone with FinishReason.ERROR (the only error it produces) and frees its blocks."""

    sampled_token_ids: dict[str, int | None]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # sampled tokens' (when asked for)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)  # prompt chunks' (when asked for)
