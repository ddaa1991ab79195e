"""The pure pieces of logprobs and penalties: validation naming the field, the wire round trip,
prompt-logprob merging, min_tokens in stop conditions and stop strings, the HTTP field parsing,
the Dense Assist server refusing rows it cannot penalize, and the sampler's raw logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from dualpace.errors import InvalidArgument
from dualpace.logprobs import PromptLogprobsChunk, TokenLogprobs, merge_prompt_logprobs
from dualpace.penalties import SamplingContext
from dualpace.sampling import SamplingParams, sample_next_tokens
from dualpace.sampling_params import FinishReason, stop_reason
from dualpace.wire.common import sampling_params_from_pb, sampling_params_to_pb
from dualpace.wire.logprob_messages import logprobs_list_from_pb, logprobs_list_to_pb
from router import openai_schema
from router.text_stream import TextStream


@pytest.mark.parametrize(("fields", "name"), [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"prompt_logprobs": 99}, "prompt_logprobs"),
    ({"presence_penalty": 2.01}, "presence_penalty"), ({"frequency_penalty": math.nan}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 17}, "min_tokens"),
    ({"logit_bias": ((5, 100.5),)}, "logit_bias"), ({"logit_bias": ((600, 1.0),)}, "logit_bias"),
    ({"logit_bias": ((5, 1.0), (5, 2.0))}, "logit_bias"),
    ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias"),
])
def test_bad_values_name_their_field(fields, name):
    with pytest.raises(InvalidArgument) as raised:
        SamplingParams(max_tokens=16, **fields).validate(vocab_size=512)
    assert raised.value.field == name


def test_sampling_fields_round_trip_the_wire():
    params = SamplingParams(max_tokens=9, logprobs=0, prompt_logprobs=20, presence_penalty=-2.0,
                            frequency_penalty=1.5, repetition_penalty=1.25, logit_bias=((3, -100.0), (7, 0.5)),
                            min_tokens=4)
    assert sampling_params_from_pb(sampling_params_to_pb(params)) == params
    assert sampling_params_from_pb(sampling_params_to_pb(SamplingParams())) == SamplingParams()


def test_logprob_entries_round_trip_with_holes():
    entry = TokenLogprobs(5, -0.25, 2, (4, 5), (-0.125, -0.25))
    assert logprobs_list_from_pb(logprobs_list_to_pb([entry, None], [5, 9])) == (entry, None)
    assert logprobs_list_to_pb([None, None], [1, 2]) == []  # not asked for: nothing on the wire


def test_prompt_chunks_merge_once():
    entries = [TokenLogprobs(t, -1.0, 1) for t in range(6)]
    collected: list = []
    merge_prompt_logprobs(collected, PromptLogprobsChunk(1, tuple(entries[:3])))
    merge_prompt_logprobs(collected, PromptLogprobsChunk(1, tuple(entries[:2])))  # recomputed after a preemption
    merge_prompt_logprobs(collected, PromptLogprobsChunk(2, tuple(entries[1:6])))
    assert collected == entries
    with pytest.raises(ValueError):
        merge_prompt_logprobs(collected, PromptLogprobsChunk(9, tuple(entries)))


def test_min_tokens_defers_stop_tokens_but_not_the_length():
    params = SamplingParams(max_tokens=5, min_tokens=3, stop_token_ids=(7,))
    assert stop_reason(7, 3, params, {2}) is None and stop_reason(2, 2, params, {2}) is None
    assert stop_reason(7, 4, params, {2}) == FinishReason.STOP
    assert stop_reason(1, 5, SamplingParams(max_tokens=5, min_tokens=5), set()) == FinishReason.LENGTH


class _CharTokenizer:
    def decode(self, token_ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + t) for t in token_ids)


def test_stop_strings_wait_for_min_tokens():
    early = TextStream(_CharTokenizer(), [0], ("b",), min_tokens=3)
    assert early.push([1]) == ("b", False)  # "b" before min_tokens: no stop
    assert early.push([2, 1]) == ("c", True)  # the 3rd token reached it: the next "b" stops
    assert TextStream(_CharTokenizer(), [0], ("b",)).push([2, 1]) == ("c", True)


def test_sampler_masks_min_tokens_and_reports_raw_logprobs():
    logits = torch.tensor([[0.0, 5.0, 1.0, -1.0]])
    params = [SamplingParams(logprobs=2, min_tokens=1)]
    context = [SamplingContext([0], [], 0, (1,), False)]
    result = sample_next_tokens(logits, params, [0], [1], context)
    assert result.token_ids == [2]  # token 1 (the stop token) is masked
    raw = torch.log_softmax(logits[0], dim=0)
    entry = result.logprobs[0]
    assert entry.token_id == 2 and entry.rank == 2 and abs(entry.logprob - float(raw[2])) < 1e-6
    assert entry.top_token_ids == (1, 2)  # the raw distribution, before the mask


def test_http_fields_parse_into_sampling_params():
    chat = openai_schema.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                     "logprobs": True, "top_logprobs": 3, "logit_bias": {"5": -2},
                                     "presence_penalty": 0.5, "min_tokens": 1, "repetition_penalty": 1.1})
    params = chat.client.params
    assert (params.logprobs, params.logit_bias, params.presence_penalty, params.min_tokens,
            params.repetition_penalty) == (3, ((5, -2.0),), 0.5, 1, 1.1)
    assert chat.renamed["logprobs"] == "top_logprobs"
    completion = openai_schema.parse_completion({"model": "m", "prompt": "x", "logprobs": 2, "echo": True})
    assert completion.echo and completion.client.params.prompt_logprobs == 2
    with pytest.raises(openai_schema.ApiError) as raised:
        openai_schema.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})
    assert raised.value.param == "top_logprobs"
    with pytest.raises(openai_schema.ApiError) as raised:
        openai_schema.parse_completion({"model": "m", "prompt": "x", "logit_bias": {"a": 1}})
    assert raised.value.param == "logit_bias"


def test_dense_assist_refuses_rows_it_cannot_penalize():
    from gpu_service.dense_assist import AssistSession

    with pytest.raises(InvalidArgument) as raised:
        AssistSession._check_sampling([(SamplingParams(presence_penalty=1.0), 1)], 1, 512)
    assert raised.value.field == "begin.sampling[0]"
    AssistSession._check_sampling([(SamplingParams(), 1)], 1, 512)
