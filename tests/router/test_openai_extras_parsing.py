"""The pure parsing behind n, several prompts, structured outputs and tool calls (no daemons)."""

from __future__ import annotations

import json

import pytest

from dualpace.errors import InvalidArgument
from dualpace.guided_grammar import check_spec
from dualpace.guided_spec import GuidedKind
from router import openai_schema as schema
from router.fan_out import choice_request_id, derived_seed
from router.openai_choices import best_indices
from router.openai_tools import ToolCallStream, parse_tools, split_tool_calls

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


def _chat(**fields):
    return schema.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_n_and_a_list_of_prompts():
    parsed = schema.parse_completion({"model": "m", "prompt": ["a", [5, 6]], "n": 3, "seed": 4, "max_tokens": 2})
    assert parsed.n == 3 and [c.text for c in parsed.clients] == ["a", None]
    assert parsed.clients[1].prompt_token_ids == [5, 6] and parsed.clients[1].params.seed == 4
    assert schema.parse_completion({"model": "m", "prompt": ["only"]}).clients[0].text == "only"
    assert schema.parse_completion({"model": "m", "prompt": "x", "n": 2, "best_of": 2}).n == 2
    assert [derived_seed(2**63 - 1, i) for i in range(2)] == [2**63 - 1, 0]
    assert choice_request_id("r", 0, 1) == "r" and choice_request_id("r", 2, 3) == "r-2"


def test_best_of_asks_the_engine_for_logprobs_and_ranks_by_them():
    ranked = schema.parse_completion({"model": "m", "prompt": ["a", "b"], "n": 1, "best_of": 3})
    assert ranked.best_of == 3 and ranked.candidates == 3 and ranked.hides_logprobs
    assert all(c.params.logprobs == 0 for c in ranked.clients)  # the sampled tokens' logprobs, for ranking
    shown = schema.parse_completion({"model": "m", "prompt": "a", "n": 2, "best_of": 4, "logprobs": 2})
    assert shown.client.params.logprobs == 2 and not shown.hides_logprobs
    plain = schema.parse_completion({"model": "m", "prompt": "a", "n": 2, "best_of": 2})
    assert plain.best_of is None and plain.candidates == 2 and plain.client.params.logprobs is None
    # prompt-major groups of best_of; the n highest of each, best first, ties to the lower index
    assert best_indices([-3.0, -1.0, -2.0, -0.5, -0.5, -9.0], 2, 3) == [1, 2, 3, 4]
    for fields in ({"best_of": 2, "stream": True}, {"best_of": 65}, {"n": 3, "best_of": 2}):
        with pytest.raises(InvalidArgument) as error:
            schema.parse_completion({"model": "m", "prompt": "a", **fields})
        assert error.value.field == "best_of"


def test_response_format_and_guided_fields_become_one_spec():
    schema_object = {"type": "object", "properties": {"a": {"type": "integer"}}}
    parsed = _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema_object}})
    guided = parsed.client.params.guided
    assert guided.kind == GuidedKind.JSON_SCHEMA and json.loads(guided.spec) == schema_object
    assert parsed.renamed["guided"] == "response_format"
    assert _chat(response_format={"type": "text"}).client.params.guided is None
    assert _chat(response_format={"type": "json_object"}).client.params.guided.spec == '{"type": "object"}'
    choice = _chat(guided_choice=['say "hi"', "no"]).client.params.guided
    assert choice.kind == GuidedKind.LARK
    check_spec(choice, "guided_choice")  # the escaped literals compile
    with pytest.raises(InvalidArgument) as both:
        _chat(guided_regex="a", guided_json={"type": "object"})
    assert both.value.field == "guided_regex"  # the later of the two in GUIDED_FIELDS
    structured = _chat(structured_outputs={"regex": "[0-9]+"})
    assert structured.client.params.guided.kind == GuidedKind.REGEX and structured.renamed["guided"] == "structured_outputs"
    for bad, field in (({"choice": []}, "structured_outputs.choice"), ({"yaml": "x"}, "structured_outputs")):
        with pytest.raises(InvalidArgument) as refused:
            _chat(structured_outputs=bad)
        assert refused.value.field == field
    with pytest.raises(InvalidArgument) as forced:
        _chat(tools=[TOOL], tool_choice="required", guided_regex="a")
    assert forced.value.field == "tool_choice"


def test_tools_and_tool_choice():
    assert parse_tools(None, None) is None
    assert parse_tools([TOOL], None).choice == "auto" and parse_tools([TOOL], None).guided() is None
    assert not parse_tools([TOOL], "none").parses_calls
    named = parse_tools([TOOL], {"type": "function", "function": {"name": "lookup"}})
    check_spec(named.guided(), "tool_choice")
    with pytest.raises(InvalidArgument) as twice:
        parse_tools([TOOL, TOOL], "auto")
    assert twice.value.field == "tools[1].function.name"
    with pytest.raises(InvalidArgument):
        parse_tools(None, "required")


def test_messages_with_tool_calls_reach_the_template_with_object_arguments():
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    parsed = schema.parse_chat({"model": "m", "tools": [TOOL], "messages": [
        {"role": "user", "content": "find x"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "found"}]})
    assistant, tool = parsed.client.messages[1:]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"q": "x"} and assistant["content"] == ""
    assert tool == {"role": "tool", "content": "found", "tool_call_id": "call_1"}
    with pytest.raises(InvalidArgument) as bad:
        schema.parse_chat({"model": "m", "messages": [
            {"role": "assistant", "tool_calls": [{**call, "function": {"name": "lookup", "arguments": "{"}}]}]})
    assert bad.value.field == "messages[0].tool_calls[0].function.arguments"


def test_calls_are_split_from_the_content_whole_and_streamed():
    text = 'Let me look.<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'
    content, calls = split_tool_calls(text)
    assert content == "Let me look." and calls[0]["function"] == {"name": "lookup", "arguments": '{"q": "x"}'}
    assert split_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert split_tool_calls("plain") == ("plain", [])

    stream = ToolCallStream()
    pieces = [stream.feed(text[i:i + 3]) for i in range(0, len(text), 3)]
    assert "".join(pieces) == "Let me look."  # the partial "<to..." was held back, then the calls
    assert stream.finish() == "" and stream.calls[0]["function"]["name"] == "lookup"
    plain = ToolCallStream()
    assert plain.feed("a <") == "a " and plain.feed("b") == "<b" and plain.finish() == ""


def test_stream_options_continuous_usage_and_stop_token_ids():
    guidellm = _chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
                     stop=None, ignore_eos=True, max_completion_tokens=8, stop_token_ids=[3, 4])
    assert guidellm.include_usage and guidellm.continuous_usage
    assert guidellm.client.params.stop == () and guidellm.client.params.stop_token_ids == (3, 4)
    assert guidellm.client.params.ignore_eos and guidellm.client.params.max_tokens == 8
    # As vLLM: continuous usage needs include_usage.
    assert not _chat(stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage
    for fields, param in (({"stream": True, "stream_options": {"continuous_usage_stats": 1}},
                           "stream_options.continuous_usage_stats"),
                          ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
                          ({"stop_token_ids": 5}, "stop_token_ids")):
        with pytest.raises(schema.ApiError) as caught:
            _chat(**fields)
        assert caught.value.param == param
