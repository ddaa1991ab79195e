"""Bad input on both fronts of the router, then a bounded fuzz of both.

The two cases found by hand: a prompt holding a lone UTF-16 surrogate ("\\ud800") and a chat
role outside system/user/assistant/tool. Each gets a 400 naming the field on the OpenAI front,
and INVALID_ARGUMENT naming it on the gRPC front (where a lone surrogate can only arrive as
bytes that are not UTF-8: protobuf's own parser refuses them, and the server names the field
instead of answering INTERNAL). Then hypothesis generates requests over both schemas (wrong
types, out-of-range numbers, odd unicode, huge lists, unknown fields): every answer is a 4xx
naming a field (or INVALID_ARGUMENT / another client-side code) or a success, never a 5xx or
INTERNAL, and the router stays healthy and serves a valid request exactly afterwards.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dualpace.wire.v1 import common_pb2, router_pb2
from router.http_api import MAX_BODY_BYTES
from router.prompt_work import PromptLimits
from tests.reliability.conftest import (
    RouterStream,
    prompt_for,
)
from tests.reliability.system_specs import EngineSpec, SystemSpec

HANG_GUARD_S = 60.0
MAX_PROMPT_CHARS = 100_000
GENERATE = "/dualpace.v1.Router/Generate"
FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\[\]]*: ")  # "field: problem", as every InvalidArgument reads
CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION}


SYSTEM = SystemSpec(
    engines=(EngineSpec("gpu", "gpu", ("--name", "gpu-fuzz", "--kv-blocks", "128", "--block-size", "8")),),
    router_flags=("--policy", "gpu-only", "--no-migrate", "--http-listen", "127.0.0.1:0",
                  "--max-prompt-chars", str(MAX_PROMPT_CHARS)))


def post(http: str, path: str, body: bytes) -> tuple[int, dict | str]:
    request = urllib.request.Request(http + path, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HANG_GUARD_S) as response:
            status, payload = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read().decode()
    try:
        return status, json.loads(payload)
    except json.JSONDecodeError:
        return status, payload


def post_json(http: str, path: str, body) -> tuple[int, dict | str]:
    return post(http, path, json.dumps(body).encode())  # ensure_ascii: a lone surrogate travels as \ud800


def grpc_raw(channel: grpc.Channel, data: bytes) -> grpc.RpcError | None:
    """A Generate call with hand-made bytes (what a client with a lenient encoder sends)."""
    call = channel.unary_stream(GENERATE, request_serializer=lambda b: b,
                                response_deserializer=router_pb2.GenerateResponse.FromString)
    try:
        for _ in call(data, timeout=HANG_GUARD_S):
            pass
    except grpc.RpcError as exc:
        return exc
    return None


def grpc_generate(channel: grpc.Channel, request: router_pb2.GenerateRequest) -> grpc.RpcError | None:
    return grpc_raw(channel, request.SerializeToString())


SAMPLING = common_pb2.SamplingParams(max_tokens=2, ignore_eos=True)
LONE_SURROGATE_UTF8 = b"\xed\xa0\x80"  # what "\ud800" becomes through a lenient (surrogatepass) encoder


def with_text(raw: bytes) -> bytes:
    """GenerateRequest bytes with `text` (field 2) set to raw bytes, and a valid sampling."""
    return bytes([0x12, len(raw)]) + raw + router_pb2.GenerateRequest(sampling=SAMPLING).SerializeToString()


# ---------------------------------------------------------------------- the two cases found by hand


def test_lone_surrogate_prompt_is_400_naming_prompt(system):
    http, model = system.http, system.folder
    for body in ({"model": model, "prompt": "\ud800", "max_tokens": 2},
                 {"model": model, "prompt": "ok \udfff then", "max_tokens": 2}):
        status, answer = post_json(http, "/v1/completions", body)
        assert status == 400, answer
        assert answer["error"]["param"] == "prompt" and "surrogate" in answer["error"]["message"]
    status, answer = post_json(http, "/v1/chat/completions",
                               {"model": model, "messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 2})
    assert status == 400 and answer["error"]["param"] == "messages[0].content", answer


def test_unknown_chat_role_is_400_naming_it(system):
    http, model = system.http, system.folder
    messages = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}]
    status, answer = post_json(http, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 2})
    assert status == 400, answer
    assert answer["error"]["param"] == "messages[1].role" and "wizard" in answer["error"]["message"]


def test_grpc_front_names_the_same_fields(system):
    channel = system.channel
    error = grpc_raw(channel, with_text(LONE_SURROGATE_UTF8))
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details().startswith("text: is not valid UTF-8"), error.details()
    chat = router_pb2.GenerateRequest(sampling=SAMPLING, messages=router_pb2.ChatMessages(messages=[
        router_pb2.ChatMessage(role="user", content="hi"), router_pb2.ChatMessage(role="wizard", content="x")]))
    error = grpc_generate(channel, chat)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details().startswith("messages[1].role:"), error.details()
    # A bad byte deep inside: the nested field is named.
    good = chat.SerializeToString().replace(b"wizard", b"wiz\xffrd")
    error = grpc_raw(channel, good)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details().startswith("messages.messages[1].role: is not valid UTF-8"), error.details()
    # Not a message at all: INVALID_ARGUMENT naming the request, not INTERNAL.
    error = grpc_raw(channel, b"\x12\xff\xff\xff\xff\x0f")
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error


def test_oversized_prompt_is_refused_naming_the_limit(system):
    """Refused before tokenizing (router/prompt_work.py), on both fronts."""
    channel, http, model = system.channel, system.http, system.folder
    error = grpc_generate(channel, router_pb2.GenerateRequest(text="word " * (MAX_PROMPT_CHARS // 4),
                                                              sampling=SAMPLING))
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details().startswith("text: ") and "--max-prompt-chars" in error.details(), error.details()
    status, answer = post_json(http, "/v1/completions", {"model": model, "prompt": "w" * (MAX_PROMPT_CHARS + 1),
                                                         "max_tokens": 2})
    assert status == 400 and answer["error"]["param"] == "prompt", answer
    assert f"at most {MAX_PROMPT_CHARS}" in answer["error"]["message"]


def test_a_request_over_the_receive_bound_is_refused_before_the_router_reads_it(system):
    """gRPC's core refuses it (RESOURCE_EXHAUSTED naming the bound): decoding megabytes would stall
    the router's event loop, and with it every stream (router/prompt_work.py)."""
    channel, http, model = system.channel, system.http, system.folder
    bound = PromptLimits(MAX_PROMPT_CHARS).receive_bytes
    error = grpc_generate(channel, router_pb2.GenerateRequest(text="w" * bound, sampling=SAMPLING))
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert "larger than max" in error.details() and f"vs. {bound})" in error.details(), error.details()


def test_an_http_body_declared_too_large_is_refused_unread(system):
    """The 413 comes from the Content-Length alone: the body never arrives, so a router that
    waited to read it would not answer at all (within the hang guard)."""
    channel, http, model = system.channel, system.http, system.folder
    host, port = http.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=HANG_GUARD_S) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n{{\"model\": ".encode())
        status_line = sock.makefile("rb").readline()
    assert status_line.split()[1:2] == [b"413"], status_line


# ---------------------------------------------------------------------- the fuzz

ODD_TEXT = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),
    st.sampled_from(["", "\x00", "\u202e", "\ufeff", "\U0010ffff"]),
    st.builds(lambda char, count: char * count, st.sampled_from(["a", "🙂", "\u0301"]), st.sampled_from([200, 5000])),
)
JSON_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                        st.floats(allow_nan=True, allow_infinity=True), ODD_TEXT)
JSON_VALUE = st.recursive(JSON_SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                               st.dictionaries(ODD_TEXT, inner, max_size=4)),
                          max_leaves=12)
NUMBER = st.one_of(st.integers(min_value=-10, max_value=10**12), st.floats(allow_nan=True, allow_infinity=True),
                   ODD_TEXT, st.none(), st.booleans(), st.lists(st.integers(), max_size=3))
PROMPT = st.one_of(ODD_TEXT, st.lists(st.integers(min_value=-5, max_value=10**9), max_size=50),
                   st.builds(lambda token_id: [token_id] * 20000, st.integers(min_value=0, max_value=400)),
                   JSON_VALUE)
MESSAGE = st.one_of(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant",
                                                                              "developer", "tool", "wizard", ""]),
                                                             JSON_VALUE),
                                           "content": st.one_of(ODD_TEXT, JSON_VALUE)}), JSON_VALUE)
FIELDS = {"max_tokens": NUMBER, "temperature": NUMBER, "top_p": NUMBER, "top_k": NUMBER, "min_p": NUMBER,
          "seed": NUMBER, "stop": st.one_of(ODD_TEXT, st.lists(ODD_TEXT, max_size=5), JSON_VALUE),
          "stream": JSON_VALUE, "n": NUMBER, "logprobs": JSON_VALUE, "ignore_eos": JSON_VALUE,
          "max_completion_tokens": NUMBER, "frobnicate": JSON_VALUE, "model": JSON_VALUE,
          "top_logprobs": NUMBER, "echo": JSON_VALUE, "presence_penalty": NUMBER, "frequency_penalty": NUMBER,
          "repetition_penalty": NUMBER, "min_tokens": NUMBER, "best_of": NUMBER,
          "return_tokens_as_token_ids": JSON_VALUE,
          "logit_bias": st.one_of(st.dictionaries(ODD_TEXT, NUMBER, max_size=3), JSON_VALUE)}


def http_bodies(chat: bool):
    required = {"messages": st.one_of(st.lists(MESSAGE, max_size=4), JSON_VALUE)} if chat else {"prompt": PROMPT}
    return st.fixed_dictionaries(required, optional=FIELDS)


def assert_client_error_or_success(status: int, answer) -> None:
    assert status < 500, (status, answer)
    if status >= 400:
        error = answer["error"]
        # A 400 names its field, or says the body itself is not a JSON object.
        assert error["param"] or status in (404, 429) or "request body" in error["message"], answer
        assert error["param"] is None or str(error["param"]) in error["message"], answer


FUZZ = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@FUZZ
@given(body=st.one_of(http_bodies(chat=False), JSON_VALUE))
def test_fuzz_completions(system, body):
    http, model = system.http, system.folder
    if isinstance(body, dict) and "model" not in body:
        body = {**body, "model": model}
    assert_client_error_or_success(*post_json(http, "/v1/completions", body))


@FUZZ
@given(body=http_bodies(chat=True))
def test_fuzz_chat(system, body):
    http, model = system.http, system.folder
    body = {"model": model, **body} if "model" not in body else body
    assert_client_error_or_success(*post_json(http, "/v1/chat/completions", body))


@FUZZ
@given(data=st.one_of(st.binary(max_size=200), st.builds(with_text, st.binary(max_size=100))))
def test_fuzz_grpc_bytes(system, data):
    channel = system.channel
    error = grpc_raw(channel, data)
    if error is not None:
        assert error.code() in CLIENT_CODES, (error.code(), error.details(), data)
        assert FIELD.match(error.details()), error.details()


SIGNED = st.integers(min_value=-2**31, max_value=2**31 - 1)
FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True)


@FUZZ
@given(text=st.one_of(st.none(), st.text(max_size=60)),
       ids=st.one_of(st.none(), st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40)),
       roles=st.one_of(st.none(), st.lists(st.tuples(st.text(max_size=10), st.text(max_size=30)), max_size=4)),
       max_tokens=SIGNED, temperature=FLOATS, top_p=FLOATS, top_k=SIGNED, request_id=st.one_of(st.none(),
                                                                                                st.text(max_size=20)))
def test_fuzz_grpc_messages(system, text, ids, roles, max_tokens, temperature, top_p, top_k, request_id):
    channel = system.channel
    request = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=True))
    if text is not None:
        request.text = text.encode("utf-8", "replace").decode("utf-8")
    elif ids is not None:
        request.prompt_token_ids.token_ids.extend(ids)
    elif roles is not None:
        request.messages.messages.extend(router_pb2.ChatMessage(
            role=role.encode("utf-8", "replace").decode(), content=content.encode("utf-8", "replace").decode())
            for role, content in roles)
    if request_id is not None:
        request.request_id = request_id.encode("utf-8", "replace").decode()
    error = grpc_generate(channel, request)
    if error is not None:
        assert error.code() in CLIENT_CODES, (error.code(), error.details(), request)
        assert FIELD.match(error.details()) or error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()


def test_router_is_healthy_and_exact_after_the_fuzz(system, reference):
    """Last in this module."""
    channel, http, model = system.channel, system.http, system.folder
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    stream = RouterStream.run(system.stub, "after-fuzz", prompt_for(4), 6)
    assert stream.wait(HANG_GUARD_S) and stream.error is None, stream.error
    assert stream.tokens == reference(prompt_for(4), 6)
    code, answer = post_json(http, "/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 3})
    assert code == 200, answer
