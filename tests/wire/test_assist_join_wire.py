"""The cooperative-execution fields of assist.proto (band 170-179) through dualpace.wire."""

import pytest

from dualpace.engine.assist.assist_types import (
    AssistBegin,
    AssistJoinInfo,
    AssistResult,
    AssistShmAnswer,
    JoinHow,
)
from dualpace.sampling_params import SamplingParams
from dualpace.wire import assist_messages
from dualpace.wire.v1 import assist_pb2


def test_begin_join_fields_round_trip_through_bytes():
    begin = AssistBegin(iteration_id=7, token_ids=[3, 4], positions=[10, 11],
                        sampling=[(SamplingParams(), 1), (SamplingParams(), 2)],
                        join_engine_iteration=True, max_join_wait_us=1500, expected_layer_us=420)
    back = assist_messages.begin_from_bytes(assist_messages.begin_to_bytes(begin))
    assert back.join_engine_iteration is True
    assert (back.max_join_wait_us, back.expected_layer_us) == (1500, 420)
    assert back.token_ids == [3, 4]


def test_begin_without_join_fields_reads_as_no_join():
    message = assist_pb2.AssistUp(begin=assist_pb2.AssistBegin(iteration_id=1, token_ids=[1], positions=[0],
                                                               return_logits=True))
    begin = assist_messages.assist_up_from_pb(message)
    assert (begin.join_engine_iteration, begin.max_join_wait_us, begin.expected_layer_us) == (False, 0, 0)


@pytest.mark.parametrize("accepts_join", [True, False])
def test_shm_answer_accepts_join_round_trips(accepts_join):
    answer = AssistShmAnswer(accepted=True, token=b"t" * 16, max_batch_rows=8, accepts_join=accepts_join)
    back = assist_messages.assist_down_from_pb(assist_messages.assist_down_to_pb(answer))
    assert back == answer


def test_result_join_info_round_trips_and_is_none_when_absent():
    info = AssistJoinInfo(how=JoinHow.SPLIT, engine_step_id=42, gpu_wait_us=17, step_start_ns=100, step_end_ns=250)
    with_info = assist_messages.assist_down_from_pb(
        assist_messages.assist_down_to_pb(AssistResult(iteration_id=3, token_ids=[5, 6], join_info=info)))
    assert with_info.join_info == info and with_info.token_ids == [5, 6]
    without = assist_messages.assist_down_from_pb(
        assist_messages.assist_down_to_pb(AssistResult(iteration_id=3, token_ids=[5])))
    assert without.join_info is None


def test_join_info_bytes_round_trip_and_empty_payload():
    info = AssistJoinInfo(how=JoinHow.JOINED, engine_step_id=9, step_start_ns=1, step_end_ns=2)
    assert assist_messages.join_info_from_bytes(assist_messages.join_info_to_bytes(info)) == info
    assert assist_messages.join_info_from_bytes(b"") is None


def test_join_info_bad_bytes_and_unknown_how_are_clear_errors():
    with pytest.raises(ValueError, match="join_info"):
        assist_messages.join_info_from_bytes(b"\xff\xff\xff")
    unknown = assist_pb2.AssistJoinInfo(how=99).SerializeToString()
    with pytest.raises(ValueError, match="join_info.how"):
        assist_messages.join_info_from_bytes(unknown)
