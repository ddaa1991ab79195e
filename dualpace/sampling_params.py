"""Sampling parameters, finish reasons and stop conditions: plain Python, no torch.

The pure schedulers and the router use these; dualpace.sampling adds the
(torch) sampler on top and re-exports them.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Collection
from dataclasses import dataclass

from dualpace.errors import InvalidArgument
from dualpace.guided_spec import GuidedSpec
from dualpace.logprobs import check_logprob_fields
from dualpace.penalties import check_penalty_fields

MAX_SEED = 2**63 - 1


class FinishReason(str, enum.Enum):
    """Why a sequence stopped generating."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached (or the context is full)
    ABORT = "abort"  # cancelled by the client or an operator
    ERROR = "error"  # the engine could not continue it (e.g. non-finite logits)


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each next token and when to stop. temperature 0 is greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None  # None: the engine picks one at admission and keeps it
    stop: tuple[str, ...] = ()  # stop strings, matched on detokenized text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    guided: GuidedSpec | None = None  # structured output: the grammar every output must match
    # Log-probabilities (dualpace/logprobs.py): None is off; k in [0, 20] adds the top-k alternatives.
    logprobs: int | None = None  # per generated token
    prompt_logprobs: int | None = None  # per prompt token (the first has none)
    # Penalties with vLLM's definitions (dualpace/penalties.py); the defaults are off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # EOS and stop token ids cannot end the output before this many tokens

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise InvalidArgument naming the first bad field; return self when valid."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgument("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument("temperature", f"must be finite and >= 0, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgument("top_k", f"must be an integer >= 0 (0 is off), got {self.top_k!r}")
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidArgument("seed", f"must be in [0, 2^63 - 1], got {self.seed!r}")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop", "stop strings must be non-empty")
        if vocab_size is not None:
            for token_id in self.stop_token_ids:
                if not 0 <= token_id < vocab_size:
                    raise InvalidArgument("stop_token_ids", f"id {token_id} is outside the vocabulary [0, {vocab_size})")
        check_logprob_fields(self)
        check_penalty_fields(self, vocab_size)
        return self


def stop_reason(
    token_id: int, num_generated: int, params: SamplingParams, eos_token_ids: Collection[int]
) -> FinishReason | None:
    """Why generation stops after token_id, or None to go on.

    num_generated counts the generated tokens including token_id. Stop strings
    are matched elsewhere, on detokenized text. Before min_tokens only the length ends it.
    """
    if num_generated <= params.min_tokens:
        return FinishReason.LENGTH if num_generated >= params.max_tokens else None
    if token_id in params.stop_token_ids:
        return FinishReason.STOP
    if not params.ignore_eos and token_id in eos_token_ids:
        return FinishReason.STOP
    if num_generated >= params.max_tokens:
        return FinishReason.LENGTH
    return None


def pick_seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh random one kept for the whole request."""
    if params.seed is not None:
        return params.seed
    return int.from_bytes(os.urandom(8), "little") & (2**63 - 1)
