"""Conversions for the log-probability and penalty fields: TokenLogprobs messages and
SamplingParams' fields 70-76. common.py calls the sampling-params half; the engine and router
message modules call the rest. Torch-free."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dualpace.logprobs import TokenLogprobs
from dualpace.wire.v1 import common_pb2


def extra_sampling_fields_to_pb(params, message: common_pb2.SamplingParams) -> None:
    """Write the logprobs, penalties and min_tokens of core SamplingParams into `message`."""
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        message.prompt_logprobs = params.prompt_logprobs
    message.presence_penalty = params.presence_penalty
    message.frequency_penalty = params.frequency_penalty
    message.repetition_penalty = params.repetition_penalty
    for token_id, bias in params.logit_bias:
        message.logit_bias[token_id] = bias
    message.min_tokens = params.min_tokens


def extra_sampling_fields_from_pb(message: common_pb2.SamplingParams) -> dict:
    """The same fields as SamplingParams keyword arguments; absent ones take the core defaults."""
    return {
        "logprobs": message.logprobs if message.HasField("logprobs") else None,
        "prompt_logprobs": message.prompt_logprobs if message.HasField("prompt_logprobs") else None,
        "presence_penalty": message.presence_penalty,
        "frequency_penalty": message.frequency_penalty,
        "repetition_penalty": message.repetition_penalty if message.HasField("repetition_penalty") else 1.0,
        "logit_bias": tuple(sorted(message.logit_bias.items())),
        "min_tokens": message.min_tokens,
    }


def token_logprobs_to_pb(entry: TokenLogprobs | None, token_id: int) -> common_pb2.TokenLogprobs:
    """One entry; None (this engine does not hold it) becomes rank 0."""
    if entry is None:
        return common_pb2.TokenLogprobs(token_id=token_id, rank=0)
    return common_pb2.TokenLogprobs(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank,
                                    top_token_ids=list(entry.top_token_ids), top_logprobs=list(entry.top_logprobs))


def token_logprobs_from_pb(message: common_pb2.TokenLogprobs) -> TokenLogprobs | None:
    if message.rank == 0:
        return None
    if len(message.top_token_ids) != len(message.top_logprobs):
        raise ValueError(f"logprobs: {len(message.top_token_ids)} top_token_ids but {len(message.top_logprobs)} "
                         "top_logprobs")
    return TokenLogprobs(message.token_id, message.logprob, message.rank, tuple(message.top_token_ids),
                         tuple(message.top_logprobs))


def logprobs_list_to_pb(entries: Sequence[TokenLogprobs | None], token_ids: Sequence[int]) -> list:
    """Entries aligned with token_ids; [] when none of them holds a value (logprobs not asked for)."""
    if not any(entry is not None for entry in entries):
        return []
    return [token_logprobs_to_pb(entry, token_id) for entry, token_id in zip(entries, token_ids, strict=True)]


def logprobs_list_from_pb(messages: Iterable[common_pb2.TokenLogprobs]) -> tuple[TokenLogprobs | None, ...]:
    return tuple(token_logprobs_from_pb(m) for m in messages)
