"""Conversions for the dualpace.v1.Router service: router types <-> protobuf."""

from __future__ import annotations

from dualpace.client_request import ClientRequest
from dualpace.engine.load import RequestSummary
from dualpace.sampling_params import FinishReason
from dualpace.wire.common import (
    finish_reason_from_pb,
    finish_reason_to_pb,
    sampling_params_from_pb,
    sampling_params_to_pb,
    token_ids_to_list,
)
from dualpace.wire.engine_messages import ENGINE_KIND_FROM_PB, ENGINE_KIND_TO_PB, request_state_to_pb
from dualpace.wire.logprob_messages import logprobs_list_to_pb, token_logprobs_to_pb
from dualpace.wire.v1 import common_pb2, router_pb2


def client_request_from_pb(message: router_pb2.GenerateRequest) -> ClientRequest:
    kind = message.WhichOneof("prompt")
    return ClientRequest(
        request_id=message.request_id if message.HasField("request_id") else None,
        text=message.text if kind == "text" else None,
        prompt_token_ids=token_ids_to_list(message.prompt_token_ids.token_ids, field="prompt_token_ids")
        if kind == "prompt_token_ids" else None,
        messages=[{"role": m.role, "content": m.content} for m in message.messages.messages]
        if kind == "messages" else None,
        params=sampling_params_from_pb(message.sampling),
    )


def generate_response_to_pb(request_id: str, token_ids: list[int], text: str, engine: str,
                            finish_reason: FinishReason | None, num_prompt_tokens: int,
                            num_completion_tokens: int, num_cached_tokens: int = 0, logprobs=(),
                            prompt_logprobs=None) -> router_pb2.GenerateResponse:
    """logprobs: per token_ids entry (or empty); prompt_logprobs: on the first message, when asked for."""
    message = router_pb2.GenerateResponse(
        request_id=request_id, token_ids=token_ids, text=text, engine=engine,
        finish_reason=finish_reason_to_pb(finish_reason), logprobs=logprobs_list_to_pb(logprobs, token_ids),
        prompt_logprobs=[token_logprobs_to_pb(entry, entry.token_id) for entry in prompt_logprobs or ()])
    if finish_reason is not None:
        message.usage.prompt_tokens = num_prompt_tokens
        message.usage.completion_tokens = num_completion_tokens
        message.usage.cached_tokens = num_cached_tokens
    return message


def engine_placement_to_pb(view, healthy: bool, prefix_index_blocks: int = 0) -> router_pb2.EnginePlacement:
    return router_pb2.EnginePlacement(
        name=view.name, kind=ENGINE_KIND_TO_PB.get(view.kind, common_pb2.ENGINE_KIND_UNSPECIFIED), healthy=healthy,
        kv_blocks_total=view.kv_blocks_total, kv_blocks_used=view.kv_blocks_used, num_running=view.num_running,
        num_waiting=view.num_waiting, itl_p50_ms=view.itl_p50_ms, itl_p99_ms=view.itl_p99_ms,
        block_size=view.block_size,
        kv_blocks_cached=view.kv_blocks_cached,
        prefix_index_blocks=prefix_index_blocks,
    )


def request_placement_to_pb(engine: str, info: RequestSummary) -> router_pb2.RequestPlacement:
    """From an engine's summary of one request it holds."""
    return router_pb2.RequestPlacement(request_id=info.request_id, engine=engine, state=request_state_to_pb(info.state),
                                       prompt_tokens=info.prompt_tokens, generated_tokens=info.generated_tokens,
                                       kv_blocks=info.kv_blocks)


def waiting_placement_to_pb(request_id: str, engine: str, prompt_tokens: int,
                            generated_tokens: int) -> router_pb2.RequestPlacement:
    """A request the router holds paused until `engine`, which failed under it, is back."""
    return router_pb2.RequestPlacement(request_id=request_id, engine=engine,
                                       state=common_pb2.REQUEST_STATE_WAITING_FOR_ENGINE,
                                       prompt_tokens=prompt_tokens, generated_tokens=generated_tokens)


_OUTCOMES = {
    "in_progress": router_pb2.MIGRATION_OUTCOME_IN_PROGRESS,
    "committed": router_pb2.MIGRATION_OUTCOME_COMMITTED,
    "failed": router_pb2.MIGRATION_OUTCOME_FAILED,
}


def migration_to_pb(record) -> router_pb2.Migration:
    return router_pb2.Migration(request_id=record.request_id, from_engine=record.source, to_engine=record.target,
                                outcome=_OUTCOMES[record.outcome], timestamp_unix_ms=record.timestamp_unix_ms,
                                detail=record.detail)


# ---- client side: `dualpace client` and `dualpace-router placement` ---------------------------


def client_request_to_pb(request: ClientRequest) -> router_pb2.GenerateRequest:
    """The client's request -> GenerateRequest (exactly one prompt form must be set)."""
    message = router_pb2.GenerateRequest(sampling=sampling_params_to_pb(request.params))
    if request.request_id is not None:
        message.request_id = request.request_id
    if request.text is not None:
        message.text = request.text
    elif request.prompt_token_ids is not None:
        message.prompt_token_ids.token_ids.extend(request.prompt_token_ids)
    elif request.messages is not None:
        message.messages.messages.extend(
            router_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in request.messages)
    else:
        raise ValueError("prompt: set one of text, prompt_token_ids or messages")
    return message


def generate_response_to_dict(message: router_pb2.GenerateResponse) -> dict:
    """One streamed GenerateResponse as plain JSON-ready data; finish_reason is None until the last
    message, which also carries usage."""
    reason = finish_reason_from_pb(message.finish_reason)
    return {
        "request_id": message.request_id,
        "token_ids": list(message.token_ids),
        "text": message.text,
        "engine": message.engine,
        "finish_reason": reason.value if reason is not None else None,
        "usage": {"prompt_tokens": message.usage.prompt_tokens,
                  "completion_tokens": message.usage.completion_tokens,
                  "cached_tokens": message.usage.cached_tokens}
        if message.HasField("usage") else None,
    }


def _enum_label(enum_type, value: int, prefix: str) -> str:
    """REQUEST_STATE_RUNNING -> "running"; an unknown number -> "unknown(7)"."""
    try:
        name = enum_type.Name(value)
    except ValueError:
        return f"unknown({value})"
    return name.removeprefix(prefix).lower()


def placements_to_dict(message: router_pb2.Placements) -> dict:
    """ListPlacements' answer as plain JSON-ready data: engines (kind "gpu" | "cpu"), requests
    (state lower-case: waiting, running, paused, migrating, finished, or waiting_for_engine: paused in
    the router until the engine that failed under it is back) and migrations (outcome
    lower-case: in_progress, committed, failed)."""
    return {
        "engines": [
            {
                "name": engine.name,
                "kind": ENGINE_KIND_FROM_PB.get(engine.kind, "unspecified"),
                "healthy": engine.healthy,
                "kv_blocks_total": engine.kv_blocks_total,
                "kv_blocks_used": engine.kv_blocks_used,
                "kv_blocks_cached": engine.kv_blocks_cached,
                "prefix_index_blocks": engine.prefix_index_blocks,
                "running": engine.num_running,
                "waiting": engine.num_waiting,
                "itl_p50_ms": engine.itl_p50_ms,
                "itl_p99_ms": engine.itl_p99_ms,
                "block_size": engine.block_size,
            }
            for engine in message.engines
        ],
        "requests": [
            {
                "request_id": request.request_id,
                "engine": request.engine,
                "state": _enum_label(common_pb2.RequestState, request.state, "REQUEST_STATE_"),
                "prompt_tokens": request.prompt_tokens,
                "generated_tokens": request.generated_tokens,
                "kv_blocks": request.kv_blocks,
            }
            for request in message.requests
        ],
        "migrations": [
            {
                "request_id": migration.request_id,
                "from_engine": migration.from_engine,
                "to_engine": migration.to_engine,
                "outcome": _enum_label(router_pb2.MigrationOutcome, migration.outcome, "MIGRATION_OUTCOME_"),
                "timestamp_unix_ms": migration.timestamp_unix_ms,
                "detail": migration.detail,
            }
            for migration in message.migrations
        ],
    }
