"""The worker's pure parts, without Dynamo: request translation, finish/usage chunks, the error
table and the load signals."""

from __future__ import annotations

import pytest

from dualpace.errors import InvalidArgument
from dynamo_worker.errors import dynamo_error_name
from dynamo_worker.load import kv_block_size, llm_d_gauges, node_load
from dynamo_worker.requests import dynamo_chunk, node_request_from_dynamo


def test_greedy_request_with_stop_ids_and_max_tokens():
    request = {"token_ids": [3, 17, 42], "sampling_options": {"temperature": 0.0, "seed": 7, "top_k": -1},
               "stop_conditions": {"max_tokens": 5, "stop": ["never sent"], "stop_token_ids_hidden": [2],
                                   "stop_token_ids": [9], "ignore_eos": False}}
    node = node_request_from_dynamo(request, context_length=64)
    assert node.prompt_token_ids == [3, 17, 42]
    assert node.params.max_tokens == 5 and node.params.is_greedy and node.params.seed == 7
    assert node.params.top_k == 0 and node.params.stop_token_ids == (9, 2) and node.params.stop == ()


def test_unset_options_follow_openai_and_fill_the_context():
    node = node_request_from_dynamo({"token_ids": [1, 2]}, context_length=10)
    assert node.params.temperature == 1.0 and node.params.max_tokens == 8
    # max_tokens past the context is cut to what fits
    assert node_request_from_dynamo({"token_ids": [1], "stop_conditions": {"max_tokens": 99}}, 10).params.max_tokens == 9


@pytest.mark.parametrize("request_, field", [
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [1, -2]}, "token_ids"),
    ({"token_ids": "1 2"}, "token_ids"),
    ({"token_ids": list(range(10))}, "token_ids"),  # fills the whole context
    ({"token_ids": [1], "sampling_options": {"n": 2}}, "sampling_options.n"),
    ({"token_ids": [1], "sampling_options": {"temperature": "hot"}}, "sampling_options.temperature"),
    ({"token_ids": [1], "sampling_options": {"top_p": 0.0}}, "sampling_options.top_p"),
    ({"token_ids": [1], "sampling_options": {"repetition_penalty": 1.3}}, "sampling_options.repetition_penalty"),
    ({"token_ids": [1], "stop_conditions": {"max_tokens": 0}}, "stop_conditions.max_tokens"),
    ({"token_ids": [1], "stop_conditions": {"min_tokens": 3}}, "stop_conditions.min_tokens"),
    ({"token_ids": [1], "stop_conditions": "x"}, "stop_conditions"),
    ({"token_ids": [1], "output_options": {"logprobs": 2}}, "output_options.logprobs"),
])
def test_bad_input_names_the_field(request_, field):
    with pytest.raises(InvalidArgument) as caught:
        node_request_from_dynamo(request_, context_length=10)
    assert caught.value.field == field


def test_chunks_carry_finish_reason_and_usage_only_at_the_end():
    assert dynamo_chunk({"token_ids": [5], "finish_reason": None, "usage": None}, 3) == {"token_ids": [5], "index": 0}
    last = dynamo_chunk({"token_ids": [6], "finish_reason": "length",
                         "usage": {"prompt_tokens": 3, "completion_tokens": 2}}, 3)
    assert last["finish_reason"] == "length"
    assert last["completion_usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert dynamo_chunk({"token_ids": [], "finish_reason": "abort", "usage": None}, 3)["finish_reason"] == "cancelled"


def test_grpc_codes_keep_their_meaning():
    assert dynamo_error_name("INVALID_ARGUMENT", streamed_tokens=False) == "InvalidArgument"
    assert dynamo_error_name("UNAVAILABLE", streamed_tokens=False) == "WorkerUnavailable"
    assert dynamo_error_name("UNAVAILABLE", streamed_tokens=True) == "Disconnected"
    assert dynamo_error_name("RESOURCE_EXHAUSTED", streamed_tokens=False) == "WorkerUnavailable"
    assert dynamo_error_name("DATA_LOSS", streamed_tokens=True) == "Unknown"


def _engine(kind, used, total, running, waiting, healthy=True, block_size=16):
    return {"name": kind, "kind": kind, "healthy": healthy, "kv_blocks_used": used, "kv_blocks_total": total,
            "running": running, "waiting": waiting, "block_size": block_size}


def test_load_reports_both_tiers_and_llm_d_names_carry_the_gpu_tier():
    placements = {"engines": [_engine("gpu", 25, 100, 3, 1), _engine("cpu", 10, 400, 2, 0, block_size=32)]}
    load = node_load(placements)
    assert (load.num_running, load.num_waiting, load.num_active) == (5, 1, 6)
    assert load.gpu.usage_ratio == 0.25 and load.host.usage_ratio == 0.025
    assert kv_block_size(placements) == 16
    assert llm_d_gauges(load) == {"vllm:num_requests_running": 5.0, "vllm:num_requests_waiting": 1.0,
                                  "vllm:kv_cache_usage_perc": 0.25}


def test_an_unhealthy_engine_does_not_count():
    load = node_load({"engines": [_engine("gpu", 50, 100, 4, 0, healthy=False), _engine("cpu", 10, 100, 1, 0)]})
    assert load.gpu is None and load.num_running == 1
    assert llm_d_gauges(load)["vllm:kv_cache_usage_perc"] == 0.0
