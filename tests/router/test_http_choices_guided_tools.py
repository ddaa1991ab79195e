"""n / best_of / several prompts, structured outputs and tool calls through the router's HTTP
front, with the official `openai` client against `dualpace up` on the tiny model, whose chat
template tests/router/conftest.py replaces by a tool-aware one (ChatML with Hermes-style
<tool_call> blocks): the tiny checkpoint's own template has no tool support."""

from __future__ import annotations

import json
import math
import time

import pytest

from tests.router.test_http_api import client, placements, raw  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

# Bounded everywhere, so every document the grammar allows closes within max_tokens.
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "colour"], "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10}},
                   "required": ["city"], "additionalProperties": False}}}
LONG_PROMPT = "The committee met on a grey morning to discuss the budget for the coming year. " * 4


def test_n_choices_are_distinct_repeatable_and_index_zero_is_the_single_answer(client, model_folder):
    args = {"model": model_folder, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0,
            "seed": 11, "extra_body": {"ignore_eos": True}}
    three = client.completions.create(n=3, **args)
    again = client.completions.create(n=3, **args)
    texts = [c.text for c in sorted(three.choices, key=lambda c: c.index)]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert len(set(texts)) == 3  # distinct choices
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]  # repeatable
    assert client.completions.create(**args).choices[0].text == texts[0]  # seed + 0
    assert three.usage.completion_tokens == 36 and three.usage.prompt_tokens == again.usage.prompt_tokens

    streamed = list(client.completions.create(n=3, stream=True, **args))
    by_index = {i: "".join(c.choices[0].text for c in streamed if c.choices[0].index == i) for i in range(3)}
    assert [by_index[i] for i in range(3)] == texts


def test_n_choices_share_the_prompt_blocks(up, client, model_folder):
    """While the three choices run, their engine holds fewer KV blocks than three separate
    requests would: each of those alone holds at least its whole prompt's blocks."""
    stream = client.completions.create(model=model_folder, prompt=LONG_PROMPT, n=3, max_tokens=120, temperature=1.0,
                                       seed=3, stream=True, extra_body={"ignore_eos": True})
    seen = set()
    for chunk in stream:
        seen.add(chunk.choices[0].index)
        if seen == {0, 1, 2}:
            break
    deadline = time.monotonic() + 20
    while True:  # the engines' load reports come every few steps: wait for one with all three
        now = placements(up)
        # all three have streamed, so their prompt is in blocks; a report from before that (the three
        # admitted, the prefill under way: seen with 6 of 11 blocks) is an old one: wait for the next
        holders = [e for e in now["engines"] if e["running"] >= 3 and now["requests"]
                   and e["kv_blocks_used"] >= math.ceil(now["requests"][0]["prompt_tokens"] / e["block_size"])]
        if holders:
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    stream.close()
    engine = holders[0]
    prompt_tokens = now["requests"][0]["prompt_tokens"]
    assert prompt_tokens > 4 * engine["block_size"]
    prompt_blocks = math.ceil(prompt_tokens / engine["block_size"])
    assert engine["kv_blocks_used"] < 3 * prompt_blocks, (engine, now["requests"])  # separate: 3 prompts at least

    deadline = time.monotonic() + 20  # closing the stream aborted all three choices in their engines
    while (held := placements(up))["requests"] or any(e["kv_blocks_used"] for e in held["engines"]):
        assert time.monotonic() < deadline, f"a closed request's choices still run: {held}"
        time.sleep(0.05)


def test_a_list_of_prompts_is_answered_prompt_major(client, model_folder):
    prompts = ["The capital of France is", "Two plus two is"]
    args = {"model": model_folder, "max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    batch = client.completions.create(prompt=prompts, n=2, **args)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(prompt=p, **args).choices[0].text for p in prompts]
    assert [c.text for c in batch.choices] == [singles[0], singles[0], singles[1], singles[1]]  # greedy


def test_json_schema_answers_validate_on_20_seeded_samples(client, model_folder):
    answer = client.chat.completions.create(
        model=model_folder, messages=[{"role": "user", "content": "A person, as JSON."}], n=20, seed=0,
        temperature=1.0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert len(answer.choices) == 20
    documents = set()
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice  # the grammar closed the document
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        documents.add(choice.message.content)
    assert len(documents) > 1


def test_guided_choice_and_regex(client, model_folder):
    base = {"model": model_folder, "prompt": "Answer:", "max_tokens": 16, "temperature": 1.0, "seed": 2}
    picked = client.completions.create(**base, n=4, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert all(c.text in ("yes", "no", "maybe") for c in picked.choices)
    dated = client.completions.create(**base, extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]"})
    assert len(dated.choices[0].text) == 7 and dated.choices[0].text.startswith("20")


def test_tool_call_round_trip(client, model_folder):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=model_folder, messages=messages, tools=[WEATHER_TOOL],
                                           tool_choice="required", temperature=0, max_tokens=160)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear"})}]
    second = client.chat.completions.create(model=model_folder, messages=messages, tools=[WEATHER_TOOL],
                                            tool_choice="none", temperature=0, max_tokens=6,
                                            extra_body={"ignore_eos": True})
    assert second.choices[0].finish_reason == "length" and second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens

    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(client.chat.completions.create(model=model_folder, messages=messages[:1], tools=[WEATHER_TOOL],
                                                 tool_choice=named, temperature=0, max_tokens=160, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_calls = [t for d in deltas for t in (d.tool_calls or [])]
    assert [t.function.name for t in streamed_calls] == ["get_weather"]
    assert json.loads(streamed_calls[0].function.arguments) == arguments  # greedy: the same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 1000}, "n"),
    ("/v1/completions", {"n": 2, "best_of": 1}, "best_of"),
    ("/v1/completions", {"n": 2, "best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"best_of": 65}, "best_of"),
    ("/v1/completions", {"prompt": ["a", [1, "x"]]}, "prompt[1]"),
    ("/v1/completions", {"guided_regex": "a("}, "guided_regex"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ("/v1/chat/completions", {"tools": [WEATHER_TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
])
def test_bad_new_fields_are_400_naming_them_and_the_router_stays_healthy(up, model_folder, path, fields, param):
    body = {"model": model_folder, "max_tokens": 4}
    body |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    body |= fields
    status, answer = raw(up, "POST", path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and param in answer["error"]["message"]
    status, health = raw(up, "GET", "/health")
    assert status == 200 and health["status"] == "ok"
