"""OpenAI response shapes for the router's HTTP front: JSON-ready dicts, no I/O."""

from __future__ import annotations

from dualpace.sampling_params import FinishReason


def finish_reason_text(reason: FinishReason | None) -> str | None:
    """OpenAI's names: stop, length; an operator abort shows as "abort"."""
    return None if reason is None else reason.value


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def completion(response_id: str, created: int, model: str, text: str, finish_reason: str | None,
               usage_: dict) -> dict:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_}


def completion_chunk(response_id: str, created: int, model: str, text: str, finish_reason: str | None,
                     with_usage: bool) -> dict:
    chunk = {"id": response_id, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def chat_completion(response_id: str, created: int, model: str, text: str, finish_reason: str | None,
                    usage_: dict) -> dict:
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage_}


def chat_chunk(response_id: str, created: int, model: str, delta: dict, finish_reason: str | None,
               with_usage: bool) -> dict:
    chunk = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(chat: bool, response_id: str, created: int, model: str, usage_: dict) -> dict:
    """The last chunk with stream_options.include_usage: no choices, the request's usage."""
    return {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage_}


def model_card(model_id: str, created: int, max_model_len: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "dualpace",
            "max_model_len": max_model_len}
