"""Conversion of the types every service shares (common.proto): sampling parameters, finish
reasons, token ids. The wire layer is this module plus one per service (engine_messages,
router_messages, assist_messages) and tensors.py; servicers and client handles convert there
and work with core types everywhere else.

Malformed messages raise ValueError with a message that names the field and the problem;
conversion does not range-check values (call SamplingParams.validate for that). Torch-free:
the router imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

from dualpace.guided_spec import GuidedKind, GuidedSpec
from dualpace.sampling_params import FinishReason, SamplingParams
from dualpace.wire.logprob_messages import extra_sampling_fields_from_pb, extra_sampling_fields_to_pb
from dualpace.wire.v1 import common_pb2

# ---- sampling parameters -------------------------------------------------

_DEFAULT_SAMPLING = SamplingParams()


def sampling_params_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    """Core SamplingParams -> message; every field is set explicitly."""
    message = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        message.seed = params.seed
    if params.guided is not None:
        message.guided.CopyFrom(common_pb2.GuidedDecoding(
            kind=_GUIDED_KIND_TO_PB[params.guided.kind], spec=params.guided.spec,
            num_output_tokens_in_prompt=params.guided.num_output_tokens_in_prompt))
    extra_sampling_fields_to_pb(params, message)
    return message


def sampling_params_from_pb(message: common_pb2.SamplingParams) -> SamplingParams:
    """Message -> core SamplingParams; absent optional fields take the core defaults."""
    return SamplingParams(
        max_tokens=message.max_tokens if message.HasField("max_tokens") else _DEFAULT_SAMPLING.max_tokens,
        temperature=message.temperature,
        top_p=message.top_p if message.HasField("top_p") else _DEFAULT_SAMPLING.top_p,
        top_k=message.top_k,
        min_p=message.min_p,
        seed=message.seed if message.HasField("seed") else None,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        guided=_guided_from_pb(message.guided) if message.HasField("guided") else None,
        **extra_sampling_fields_from_pb(message),
    )


_GUIDED_KIND_TO_PB: dict[GuidedKind, int] = {
    GuidedKind.JSON_SCHEMA: common_pb2.GUIDED_KIND_JSON_SCHEMA,
    GuidedKind.REGEX: common_pb2.GUIDED_KIND_REGEX,
    GuidedKind.LARK: common_pb2.GUIDED_KIND_LARK,
}
_GUIDED_KIND_FROM_PB: dict[int, GuidedKind] = {value: kind for kind, value in _GUIDED_KIND_TO_PB.items()}


def _guided_from_pb(message: common_pb2.GuidedDecoding) -> GuidedSpec:
    if message.kind not in _GUIDED_KIND_FROM_PB:
        raise ValueError(f"sampling.guided.kind: unknown or unset ({message.kind})")
    return GuidedSpec(_GUIDED_KIND_FROM_PB[message.kind], message.spec, message.num_output_tokens_in_prompt)


# ---- finish reason --------------------------------------------------------

_FINISH_REASON_TO_PB: dict[FinishReason, int] = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_FINISH_REASON_FROM_PB: dict[int, FinishReason] = {value: reason for reason, value in _FINISH_REASON_TO_PB.items()}


def finish_reason_to_pb(reason: FinishReason | None) -> int:
    """Core FinishReason (None: not finished) -> FinishReason enum value."""
    if reason is None:
        return common_pb2.FINISH_REASON_UNSPECIFIED
    return _FINISH_REASON_TO_PB[reason]


def finish_reason_from_pb(value: int) -> FinishReason | None:
    """FinishReason enum value -> core FinishReason; UNSPECIFIED is None (not finished)."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    try:
        return _FINISH_REASON_FROM_PB[value]
    except KeyError:
        raise ValueError(f"finish_reason: unknown enum value {value}") from None


# ---- token ids ------------------------------------------------------------

_MAX_TOKEN_ID = 2**32 - 1


def token_ids_to_list(token_ids: Iterable[int], field: str = "token_ids") -> list[int]:
    """Token ids (ints or a 1-D integer torch tensor) -> a list of ints for a repeated uint32 field."""
    torch = sys.modules.get("torch")  # a tensor can only come from a process that loaded torch
    if torch is not None and isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.is_floating_point() or token_ids.is_complex():
            raise ValueError(f"{field}: expected a 1-D integer tensor, got {token_ids.dtype} of shape {list(token_ids.shape)}")
        token_ids = token_ids.tolist()
    id_list = [int(token_id) for token_id in token_ids]
    for token_id in id_list:
        if not 0 <= token_id <= _MAX_TOKEN_ID:
            raise ValueError(f"{field}: token id {token_id} is outside [0, 2^32 - 1]")
    return id_list


def token_ids_to_pb(token_ids: Iterable[int]) -> common_pb2.TokenIds:
    """Token ids -> TokenIds message."""
    return common_pb2.TokenIds(token_ids=token_ids_to_list(token_ids))


def token_ids_from_pb(token_ids: common_pb2.TokenIds | Sequence[int]) -> list[int]:
    """TokenIds message (or a repeated uint32 field) -> list of ints."""
    if isinstance(token_ids, common_pb2.TokenIds):
        return list(token_ids.token_ids)
    return list(token_ids)
