"""The router's OpenAI-compatible HTTP API end to end: the official `openai` client against
`dualpace up` (three real daemons on the tiny model)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from dualpace.wire.router_messages import placements_to_dict
from dualpace.wire.v1 import router_pb2, router_pb2_grpc
from tests.helpers import wait_for
from toolkit.engine_client import EngineClient

openai = pytest.importorskip("openai")

LONG_MAX_TOKENS = 400  # a stream that outlives the client that drops it
STEPS_SLACK = 20
HANG_GUARD_S = 60.0


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=up.http, api_key="any", max_retries=0, timeout=30)


def raw(up, method: str, path: str, body: dict | None = None) -> tuple[int, dict | str]:
    """(status, decoded JSON or text) for a request without the openai client."""
    base = up.http.removesuffix("/v1")
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, payload = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read().decode()
    try:
        return status, json.loads(payload)
    except json.JSONDecodeError:
        return status, payload


def placements(up) -> dict:
    with grpc.insecure_channel(up.router) as channel:
        reply = router_pb2_grpc.RouterStub(channel).ListPlacements(router_pb2.ListPlacementsRequest(), timeout=5)
    return placements_to_dict(reply)


def engine_steps(up) -> int:
    """The steps both engines have run (num_iterations: steps with work)."""
    total = 0
    for module in ("gpu_service", "cpu_service"):
        engine = EngineClient(up.child_addresses[module])
        try:
            total += engine.load().num_iterations
        finally:
            engine.close()
    return total


def test_models_health_and_metrics(up, client, model_folder):
    assert [m.id for m in client.models.list().data] == [model_folder]
    status, body = raw(up, "GET", "/health")
    assert status == 200 and body["status"] == "ok"
    assert set(body["engines"]) == {"gpu", "cpu"}
    status, text = raw(up, "GET", "/metrics")
    assert status == 200 and "dualpace_http_requests_total" in text

    # The names llm-d's endpoint picker scrapes, beside the dualpace_ ones. Once the requests of the
    # modules before (the same `dualpace up`) have left the engines' load reports: nothing running.
    def scraped() -> dict[str, float]:
        text = raw(up, "GET", "/metrics")[1]
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("vllm:")}

    values = wait_for(scraped, lambda v: v["vllm:num_requests_running"] == v["vllm:num_requests_waiting"] == 0, 30.0,
                      interval_s=0.1)
    assert values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0, values
    assert 0.0 <= values["vllm:kv_cache_usage_perc"] <= 1.0


def test_chat_whole_and_streamed(client, model_folder):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model=model_folder, messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens >= 1 and whole.usage.prompt_tokens > 0
    assert whole.id.startswith("chatcmpl-")

    chunks = list(client.chat.completions.create(model=model_folder, messages=messages, max_completion_tokens=8,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content  # greedy: the same answer either way
    assert reasons == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_resent_prompt_reports_cached_tokens_and_the_same_answer(client, model_folder):
    system = "You answer in one short sentence, politely and without any lists. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
    answers = [client.chat.completions.create(model=model_folder, messages=messages, max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True}) for _ in range(2)]
    assert answers[0].usage.prompt_tokens > 32
    first, second = (a.usage.prompt_tokens_details.cached_tokens for a in answers)
    assert first == 0 or first == second  # the module's earlier requests do not share this prefix
    assert 0 < second < answers[1].usage.prompt_tokens and second % 16 == 0  # whole blocks of 16
    assert answers[1].choices[0].message.content == answers[0].choices[0].message.content


def test_completions_greedy_equal_streamed_and_whole(client, model_folder):
    args = {"model": model_folder, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**args)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    assert whole.choices[0].text

    chunks = list(client.completions.create(**args, stream=True))
    assert len(chunks) >= 2  # streamed, not one message at the end
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sampling_fields_and_stop(client, model_folder):
    base = {"model": model_folder, "prompt": "Once upon a time", "max_tokens": 10,
            "extra_body": {"ignore_eos": True, "top_k": 20, "min_p": 0.01}}
    first = client.completions.create(**base, temperature=0.8, top_p=0.9, seed=7)
    again = client.completions.create(**base, temperature=0.8, top_p=0.9, seed=7)
    assert first.choices[0].text == again.choices[0].text  # seeded sampling is reproducible
    text = first.choices[0].text
    if len(text) >= 3:  # stop at a piece of the seeded answer: it ends there, without the stop string
        stop = text[1:3]
        stopped = client.completions.create(**base, temperature=0.8, top_p=0.9, seed=7, stop=[stop])
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].text == text[:text.index(stop)]


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"temperature": -1}, "temperature"),
    ("/v1/completions", {"top_p": 2}, "top_p"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"temprature": 0.5}, "temprature"),
    ("/v1/chat/completions", {"messages": None}, "messages"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_fields_are_400_naming_them(up, model_folder, path, fields, param):
    body = {"model": model_folder, "max_tokens": 4}
    body |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    body |= fields
    body = {k: v for k, v in body.items() if v is not None}
    status, answer = raw(up, "POST", path, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == param and param in error["message"]
    assert error["type"] == "invalid_request_error"


def test_openai_client_sees_errors(client, model_folder):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model_folder, messages=[{"role": "user", "content": "hi"}], n=0)
    assert bad.value.status_code == 400 and "n" == bad.value.body["param"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)


def test_client_closing_a_stream_aborts_the_request(up, client, model_folder):
    stream = client.completions.create(model=model_folder, prompt="Count with me:", max_tokens=LONG_MAX_TOKENS,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for index, chunk in enumerate(stream):
        if index == 3:
            request_id = chunk.id
            break
    steps_before = engine_steps(up)
    held = placements(up)
    assert [r["request_id"] for r in held["requests"]] == [request_id]
    generated = held["requests"][0]["generated_tokens"]
    assert generated < LONG_MAX_TOKENS // 2
    stream.close()

    now = wait_for(lambda: placements(up), lambda p: not p["requests"] and not any(e["kv_blocks_used"]
                                                                                 for e in p["engines"]), HANG_GUARD_S)
    assert not now["requests"] and not any(e["kv_blocks_used"] for e in now["engines"]), now
    # Aborted, not run to its end: the engines ran fewer steps since than the tokens it had left
    # to make (one a step; STEPS_SLACK for tokens made before the placements above were read).
    assert engine_steps(up) - steps_before < LONG_MAX_TOKENS - generated - STEPS_SLACK
    status, metrics = raw(up, "GET", "/metrics")
    assert status == 200
    assert 'dualpace_http_requests_total{endpoint="/v1/completions",status="client_closed"} 1.0' in metrics
