"""Dynamo's request dict -> DualPace's prompt ids and SamplingParams, and the chunks back.

Pure: no grpc, no Dynamo. Dynamo's frontend has already tokenized the prompt, and it matches
stop strings on the text itself, so `stop_conditions.stop` is not forwarded. Options DualPace
does not implement are refused with InvalidArgument naming the field, never ignored."""

from __future__ import annotations

from dataclasses import dataclass

from dualpace.errors import InvalidArgument
from dualpace.sampling_params import SamplingParams

OPENAI_DEFAULT_TEMPERATURE = 1.0  # the frontend leaves temperature unset when the client did
# DualPace's finish reasons -> the names Dynamo's engine outputs use.
FINISH_REASON_TO_DYNAMO = {"stop": "stop", "length": "length", "abort": "cancelled", "error": "error"}
# Options that are fine while they hold their neutral value.
_NEUTRAL_SAMPLING = {"n": (None, 1), "best_of": (None, 1), "use_beam_search": (None, False),
                     "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                     "repetition_penalty": (None, 1, 1.0), "length_penalty": (None, 1, 1.0)}


@dataclass(frozen=True)
class NodeRequest:
    """What the node's router receives for one Dynamo request."""

    prompt_token_ids: list[int]
    params: SamplingParams


def _number(options: dict, name: str, section: str, default, kind=float):
    value = options.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise InvalidArgument(f"{section}.{name}", f"must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def _section(request: dict, name: str) -> dict:
    value = request.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(name, f"must be an object, got {type(value).__name__}")
    return value


def _token_ids(value, field: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in value):
        raise InvalidArgument(field, "must be a list of non-negative integer token ids")
    return list(value)


def node_request_from_dynamo(request: dict, context_length: int) -> NodeRequest:
    """Translate and validate one request; InvalidArgument names the first bad field."""
    if not isinstance(request, dict):
        raise InvalidArgument("request", f"must be an object, got {type(request).__name__}")
    prompt = _token_ids(request.get("token_ids"), "token_ids")
    if not prompt:
        raise InvalidArgument("token_ids", "the prompt is empty")
    if len(prompt) >= context_length:
        raise InvalidArgument("token_ids", f"the prompt has {len(prompt)} tokens; the context holds {context_length}")
    sampling = _section(request, "sampling_options")
    stop = _section(request, "stop_conditions")
    output = _section(request, "output_options")
    for name, neutral in _NEUTRAL_SAMPLING.items():
        if sampling.get(name) not in neutral:
            raise InvalidArgument(f"sampling_options.{name}", f"is not supported by DualPace (got {sampling[name]!r})")
    if output.get("logprobs") is not None or output.get("prompt_logprobs") is not None:
        raise InvalidArgument("output_options.logprobs", "logprobs are not supported by DualPace")
    if _number(stop, "min_tokens", "stop_conditions", 0, int) > 0:
        raise InvalidArgument("stop_conditions.min_tokens", "is not supported by DualPace")
    room = context_length - len(prompt)
    max_tokens = _number(stop, "max_tokens", "stop_conditions", room, int)
    stop_ids = [*_token_ids(stop.get("stop_token_ids") or [], "stop_conditions.stop_token_ids"),
                *_token_ids(stop.get("stop_token_ids_hidden") or [], "stop_conditions.stop_token_ids_hidden")]
    ignore_eos = stop.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise InvalidArgument("stop_conditions.ignore_eos", f"must be true or false, got {ignore_eos!r}")
    params = SamplingParams(
        max_tokens=min(max_tokens, room) if max_tokens >= 1 else max_tokens,
        temperature=_number(sampling, "temperature", "sampling_options", OPENAI_DEFAULT_TEMPERATURE),
        top_p=_number(sampling, "top_p", "sampling_options", 1.0),
        top_k=max(0, _number(sampling, "top_k", "sampling_options", 0, int)),  # vLLM's -1 is "off" too
        min_p=_number(sampling, "min_p", "sampling_options", 0.0),
        seed=_number(sampling, "seed", "sampling_options", None, int),
        stop_token_ids=tuple(dict.fromkeys(stop_ids)), ignore_eos=bool(ignore_eos))
    try:
        params.validate()
    except InvalidArgument as exc:
        section = "stop_conditions" if exc.field == "max_tokens" else "sampling_options"
        raise InvalidArgument(f"{section}.{exc.field}", exc.problem) from None
    return NodeRequest(prompt, params)


def dynamo_chunk(piece: dict, num_prompt_tokens: int) -> dict:
    """One streamed piece from the router (generate_response_to_dict) -> a Dynamo GenerateChunk."""
    chunk = {"token_ids": list(piece["token_ids"]), "index": 0}
    reason = piece.get("finish_reason")
    if reason is not None:
        chunk["finish_reason"] = FINISH_REASON_TO_DYNAMO.get(reason, "error")
        usage = piece.get("usage") or {}
        completion = usage.get("completion_tokens", 0)
        prompt = usage.get("prompt_tokens") or num_prompt_tokens
        chunk["completion_usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion}
    return chunk
