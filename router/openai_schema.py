"""OpenAI-compatible request parsing for the router's HTTP front (response shapes: openai_responses).

Pure: JSON-ready dicts in, a ClientRequest (the same one the gRPC Router API builds) out; no aiohttp, no sockets. Validation the router already does
(dualpace.validation via router.prompts.prepare_prompt) is not repeated here; this module
checks what only the HTTP shape has: JSON types, OpenAI fields DualPace does not support
(suffix, the deprecated functions, ...) and fields nobody defined. Errors are `ApiError`, which
renders as OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import grpc

from dualpace.client_request import ClientRequest
from dualpace.errors import DualPaceError, InvalidArgument, Overloaded, Unavailable
from dualpace.sampling_params import SamplingParams
from dualpace.serve.status import status_for
from router import openai_logprobs
from router.openai_choices import num_choices, ranked_params, split_prompts
from router.openai_guided import with_guided
from router.openai_messages import chat_messages
from router.openai_tools import ToolSetup, parse_tools

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 1024  # without max_tokens a chat turn runs to EOS, the context end or this cap
OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI samples by default; send temperature 0 for greedy
MAX_CHOICES = 64  # n times the number of prompts, per request: each choice is an engine request

# Fields clients commonly send that change nothing here.
_IGNORED = frozenset({"user", "store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                      "safety_identifier"})


class ApiError(Exception):
    """An error answer: HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, problem: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {problem}" if param else problem, param=param, code=code)


def unsupported(param: str, problem: str = "is not supported by DualPace") -> ApiError:
    return invalid(param, problem, code="unsupported_parameter")


# gRPC codes an engine may answer with (relayed by the router) -> HTTP status.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def error_for(exc: BaseException, renamed: Mapping[str, str] | None = None) -> ApiError:
    """The HTTP answer for an exception from parsing, prepare_prompt or the relay.

    InvalidArgument -> 400 with param = its field (renamed to the OpenAI name, e.g. text -> prompt);
    Overloaded -> 429; Unavailable -> 503; other errors go through the gRPC status table
    (dualpace.serve.status), so the HTTP and gRPC fronts agree; anything unknown is a 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidArgument):
        field = (renamed or {}).get(exc.field, exc.field)
        return invalid(field, exc.problem)
    if isinstance(exc, Overloaded):
        return ApiError(429, str(exc), type="overloaded_error", code="overloaded")
    if isinstance(exc, Unavailable):
        return ApiError(503, str(exc), type="unavailable_error", code="unavailable")
    code, message = status_for(exc)
    status = _HTTP_STATUS.get(code, 500)
    if status == 500:
        return ApiError(500, message, type="server_error", code="internal_error")
    kind = {429: "overloaded_error", 503: "unavailable_error", 504: "timeout_error"}.get(status, "invalid_request_error")
    if isinstance(exc, (DualPaceError, grpc.aio.AioRpcError)):
        return ApiError(status, message, type=kind, code=code.name.lower())
    return ApiError(status, message, type=kind)


# ---------------------------------------------------------------------- requests


@dataclass(frozen=True)
class ParsedRequest:
    """One /v1/completions or /v1/chat/completions body, checked."""

    chat: bool
    model: str
    client: ClientRequest  # max_tokens is final unless default_max_tokens
    stream: bool
    include_usage: bool
    default_max_tokens: bool  # chat without max_tokens: the router fits it to the prompt
    renamed: Mapping[str, str]  # core field name -> the name the client used
    n: int = 1  # choices per prompt (router/fan_out.py)
    extra_clients: tuple[ClientRequest, ...] = ()  # /v1/completions with a list of prompts: the 2nd on
    tools: ToolSetup | None = None  # chat with tools: calls are parsed from the output
    echo: bool = False  # completions: each prompt comes back before its choices' text
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids (router/openai_logprobs.py)
    best_of: int | None = None  # completions: > n runs this many candidates per prompt, answers the n best
    hides_logprobs: bool = False  # best_of > n without logprobs: asked of the engine for ranking only
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's): usage so far on every chunk

    @property
    def candidates(self) -> int:
        """Engine requests per prompt: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def clients(self) -> tuple[ClientRequest, ...]:
        return (self.client, *self.extra_clients)


class _Body:
    """Typed reads of a JSON object; remembers which keys were read."""

    def __init__(self, body: Any):
        if not isinstance(body, dict):
            raise invalid(None, "the request body must be a JSON object")
        self.body = body
        self.read: set[str] = set()

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def raw(self, name: str) -> Any:
        self.read.add(name)
        return self.body.get(name)

    def number(self, name: str, default: float) -> float:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise invalid(name, f"must be a number, got {value!r}")
        return float(value)

    def integer(self, name: str, default: int | None) -> int | None:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(name, f"must be an integer, got {value!r}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(name, f"must be true or false, got {value!r}")
        return value

    def string(self, name: str) -> str:
        value = self.raw(name)
        if not isinstance(value, str) or not value:
            raise invalid(name, "is required: a non-empty string" if value is None else f"must be a string, got {value!r}")
        return value

    def reject_unknown(self) -> None:
        unknown = sorted(set(self.body) - self.read - _IGNORED)
        if unknown:
            raise invalid(unknown[0], "unrecognized request argument", code="unknown_parameter")


def _stop(body: _Body) -> tuple[str, ...]:
    value = body.raw("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid("stop", "must be a string or a list of strings")
    return tuple(value)


def _stop_token_ids(body: _Body) -> tuple[int, ...]:
    """vLLM's stop_token_ids: these ids end the output too (also with ignore_eos)."""
    value = body.raw("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise invalid("stop_token_ids", "must be a list of token ids")
    return tuple(value)


def _unsupported_fields(body: _Body, chat: bool) -> None:
    """OpenAI fields that would change the answer in ways DualPace cannot produce: a clear 400."""
    if chat:
        if body.raw("functions"):
            raise unsupported("functions", "the deprecated functions field is not supported: send tools")
        if body.raw("function_call") not in (None, "none"):
            raise unsupported("function_call", "the deprecated function_call field is not supported: send tool_choice")
    else:
        if body.raw("suffix") not in (None, ""):
            raise unsupported("suffix")


def _sampling(body: _Body, max_tokens: int, chat: bool = False) -> SamplingParams:
    seed = body.integer("seed", None)
    try:  # logprobs, echo, penalties (router/openai_logprobs.py)
        extra = openai_logprobs.sampling_fields(body, chat)
    except InvalidArgument as exc:
        raise invalid(exc.field, exc.problem) from None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.number("temperature", OPENAI_DEFAULT_TEMPERATURE),
        top_p=body.number("top_p", 1.0),
        top_k=body.integer("top_k", 0),  # the rest: not OpenAI fields (vLLM accepts the same names)
        min_p=body.number("min_p", 0.0),
        seed=seed,
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=body.boolean("ignore_eos", False),
        **extra,
    )


def _stream(body: _Body) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous usage): vLLM's continuous_usage_stats counts only
    with include_usage, as there."""
    stream = body.boolean("stream", False)
    options = body.raw("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise invalid("stream_options", "is only allowed when stream is true")
    if not isinstance(options, dict):
        raise invalid("stream_options", "must be an object")
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name, False)
        if not isinstance(value, bool):
            raise invalid(f"stream_options.{name}", "must be true or false")
        flags.append(value)
    include_usage, continuous = flags
    return stream, include_usage, include_usage and continuous


def _max_tokens(body: _Body, names: tuple[str, ...], default: int | None) -> tuple[int | None, str]:
    """The first of `names` the client set (and its name), else the default."""
    for name in names:
        if body.has(name):
            value = body.integer(name, None)
            if value < 1:
                raise invalid(name, f"must be an integer >= 1, got {value}")
            for other in names:
                body.raw(other)
            return value, name
        body.raw(name)
    return default, names[-1]


def _request_id(body: _Body) -> str | None:
    value = body.raw("request_id")  # not an OpenAI field; vLLM takes it too. Checked by request_id_for.
    if value is not None and not isinstance(value, str):
        raise invalid("request_id", "must be a string")
    return value


def parse_completion(raw: Any) -> ParsedRequest:
    """A /v1/completions body: prompt as a string, token ids, or a list of either (several prompts)."""
    body = _Body(raw)
    model = body.string("model")
    prompt = body.raw("prompt")
    prompts = split_prompts(prompt)
    if prompts is not None:
        parsed = [parse_completion({**raw, "prompt": one}) for one in prompts]  # each checked alike
        n = num_choices(body.integer("n", 1), body.integer("best_of", None), len(prompts), MAX_CHOICES)
        return replace(parsed[0], n=n, extra_clients=tuple(p.client for p in parsed[1:]))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # ["text"] or [[ids]]: a batch of one
    text, ids = None, None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    elif prompt is None:
        raise invalid("prompt", "is required: a string or a list of token ids")
    else:
        raise invalid("prompt", "must be a string or a list of token ids")
    _unsupported_fields(body, chat=False)
    stream, include_usage, continuous_usage = _stream(body)
    max_tokens, _ = _max_tokens(body, ("max_tokens",), COMPLETION_DEFAULT_MAX_TOKENS)
    renamed = {"text": "prompt", "prompt_token_ids": "prompt", **openai_logprobs.RENAMED_COMPLETION}
    params = with_guided(body.raw, _sampling(body, max_tokens), renamed)
    best_of = body.integer("best_of", None)
    n = num_choices(body.integer("n", 1), best_of, 1, MAX_CHOICES)
    params, hides_logprobs = ranked_params(n, best_of, stream, params)
    request_id = _request_id(body)
    body.reject_unknown()
    client = ClientRequest(request_id=request_id, text=text, prompt_token_ids=ids, messages=None, params=params)
    return ParsedRequest(False, model, client, stream, include_usage, False, renamed, n=n,
                         echo=body.boolean("echo", False),
                         tokens_as_ids=body.boolean("return_tokens_as_token_ids", False),
                         best_of=best_of if best_of != n else None, hides_logprobs=hides_logprobs,
                         continuous_usage=continuous_usage)


def parse_chat(raw: Any) -> ParsedRequest:
    """A /v1/chat/completions body; the prompt is rendered by the model's chat template."""
    body = _Body(raw)
    model = body.string("model")
    messages = chat_messages(body.raw("messages"))
    _unsupported_fields(body, chat=True)
    stream, include_usage, continuous_usage = _stream(body)
    max_tokens, name = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    tools = parse_tools(body.raw("tools"), body.raw("tool_choice"))
    renamed = {"max_tokens": name, **openai_logprobs.RENAMED_CHAT}
    params = with_guided(body.raw, _sampling(body, max_tokens if max_tokens is not None else 1, chat=True), renamed,
                         tools.guided() if tools is not None else None)
    n = num_choices(body.integer("n", 1), None, 1, MAX_CHOICES)
    request_id = _request_id(body)
    body.reject_unknown()
    client = ClientRequest(request_id=request_id, text=None, prompt_token_ids=None, messages=messages, params=params,
                           tools=tools.tools if tools is not None else None)
    return ParsedRequest(True, model, client, stream, include_usage, max_tokens is None, renamed, n=n, tools=tools,
                         tokens_as_ids=body.boolean("return_tokens_as_token_ids", False),
                         continuous_usage=continuous_usage)
