"""Conversions for the dualpace.v1.Assist service: Dense Assist core types <-> protobuf."""

from __future__ import annotations

from dualpace.engine.assist.assist_types import (
    AssistBegin,
    AssistJoinInfo,
    AssistResult,
    AssistShmAnswer,
    AssistShmOffer,
    JoinHow,
)
from dualpace.wire.common import (
    sampling_params_from_pb,
    sampling_params_to_pb,
    token_ids_from_pb,
    token_ids_to_list,
    token_ids_to_pb,
)
from dualpace.wire.tensors import tensor_from_pb, tensor_to_pb
from dualpace.wire.v1 import assist_pb2


def assist_up_to_pb(item: AssistBegin | AssistShmOffer) -> assist_pb2.AssistUp:
    """Core begin / shm offer -> AssistUp; each row's seed is written into its SamplingParams."""
    if isinstance(item, AssistShmOffer):
        return assist_pb2.AssistUp(shm_offer=assist_pb2.AssistShmOffer(
            boot_id=item.boot_id, path=item.path, size_bytes=item.size_bytes, token=item.token, tcp=item.tcp))
    begin = assist_pb2.AssistBegin(
        iteration_id=item.iteration_id,
        token_ids=token_ids_to_list(item.token_ids),
        positions=token_ids_to_list(item.positions, field="positions"),
        return_logits=item.sampling is None,
        wait_for_engine_iteration=item.wait_for_engine_iteration,
        max_device_wait_ms=item.max_device_wait_ms,
        join_engine_iteration=item.join_engine_iteration,
        max_join_wait_us=item.max_join_wait_us,
        expected_layer_us=item.expected_layer_us,
    )
    for params, seed in item.sampling or ():
        row = sampling_params_to_pb(params)
        row.seed = seed
        begin.sampling.append(row)
    return assist_pb2.AssistUp(begin=begin)


def assist_up_from_pb(message: assist_pb2.AssistUp) -> AssistBegin | AssistShmOffer:
    """AssistUp -> core begin / shm offer.

    Raises ValueError naming the field when no kind is set, when return_logits
    is set together with sampling entries, or when a sampling entry has no seed.
    """
    kind = message.WhichOneof("kind")
    if kind == "shm_offer":
        offer = message.shm_offer
        return AssistShmOffer(boot_id=offer.boot_id, path=offer.path, size_bytes=offer.size_bytes, token=offer.token,
                              tcp=offer.tcp)
    if kind == "begin":
        begin = message.begin
        sampling = None
        if begin.return_logits:
            if begin.sampling:
                raise ValueError("begin.sampling: must be empty when return_logits is set")
        else:
            sampling = []
            for row, params in enumerate(begin.sampling):
                if not params.HasField("seed"):
                    raise ValueError(f"begin.sampling[{row}].seed: must be set for assisted sampling")
                sampling.append((sampling_params_from_pb(params), params.seed))
        return AssistBegin(
            iteration_id=begin.iteration_id,
            token_ids=list(begin.token_ids),
            positions=list(begin.positions),
            sampling=sampling,
            wait_for_engine_iteration=begin.wait_for_engine_iteration,
            max_device_wait_ms=begin.max_device_wait_ms,
            join_engine_iteration=begin.join_engine_iteration,
            max_join_wait_us=begin.max_join_wait_us,
            expected_layer_us=begin.expected_layer_us,
        )
    raise ValueError("kind: an AssistUp must set begin or shm_offer")


def assist_down_to_pb(item: AssistResult | AssistShmAnswer) -> assist_pb2.AssistDown:
    """Core result / shm answer -> AssistDown (tensors are copied to the host if needed)."""
    if isinstance(item, AssistShmAnswer):
        return assist_pb2.AssistDown(shm_answer=assist_pb2.AssistShmAnswer(
            accepted=item.accepted, token=item.token, reason=item.reason, max_batch_rows=item.max_batch_rows,
            accepts_join=item.accepts_join, tcp_port=item.tcp_port, tcp_ticket=item.tcp_ticket, tcp_tls=item.tcp_tls))
    if (item.token_ids is None) == (item.logits is None):
        raise ValueError("result: exactly one of token_ids and logits must be set")
    result = assist_pb2.AssistResult(iteration_id=item.iteration_id)
    if item.token_ids is not None:
        result.sampled.CopyFrom(token_ids_to_pb(item.token_ids))
    else:
        result.logits.CopyFrom(tensor_to_pb(item.logits))
    if item.join_info is not None:
        result.join_info.CopyFrom(join_info_to_pb(item.join_info))
    return assist_pb2.AssistDown(result=result)


def assist_down_from_pb(message: assist_pb2.AssistDown) -> AssistResult | AssistShmAnswer:
    """AssistDown -> core result / shm answer. Raises ValueError naming the field when malformed."""
    kind = message.WhichOneof("kind")
    if kind == "shm_answer":
        answer = message.shm_answer
        return AssistShmAnswer(accepted=answer.accepted, token=answer.token, reason=answer.reason,
                               max_batch_rows=answer.max_batch_rows, accepts_join=answer.accepts_join,
                               tcp_port=answer.tcp_port, tcp_ticket=answer.tcp_ticket, tcp_tls=answer.tcp_tls)
    if kind == "result":
        result = message.result
        output = result.WhichOneof("output")
        join_info = join_info_from_pb(result.join_info) if result.HasField("join_info") else None
        if output == "sampled":
            return AssistResult(iteration_id=result.iteration_id, token_ids=token_ids_from_pb(result.sampled),
                                join_info=join_info)
        if output == "logits":
            return AssistResult(iteration_id=result.iteration_id,
                                logits=tensor_from_pb(result.logits, field="result.logits"), join_info=join_info)
        raise ValueError("result.output: must set sampled or logits")
    raise ValueError("kind: an AssistDown must set result or shm_answer")


def begin_to_bytes(begin: AssistBegin) -> bytes:
    """A begin as the bytes of its AssistUp (what a shared-memory slot carries)."""
    return assist_up_to_pb(begin).SerializeToString()


def begin_from_bytes(data: bytes) -> AssistBegin:
    """The inverse of begin_to_bytes; ValueError naming the field when the bytes are no begin."""
    try:
        message = assist_pb2.AssistUp.FromString(data)
    except Exception as exc:  # protobuf's DecodeError
        raise ValueError(f"begin: undecodable bytes in the shared-memory slot ({exc})") from None
    if message.WhichOneof("kind") != "begin":
        raise ValueError("begin: the shared-memory slot holds no begin")
    return assist_up_from_pb(message)


def join_info_to_pb(info: AssistJoinInfo) -> assist_pb2.AssistJoinInfo:
    return assist_pb2.AssistJoinInfo(engine_step_id=info.engine_step_id, how=int(info.how),
                                     gpu_wait_us=info.gpu_wait_us, step_start_ns=info.step_start_ns,
                                     step_end_ns=info.step_end_ns)


def join_info_from_pb(message: assist_pb2.AssistJoinInfo) -> AssistJoinInfo:
    """AssistJoinInfo -> core; ValueError naming the field for a JoinHow this side does not know."""
    try:
        how = JoinHow(message.how)
    except ValueError:
        raise ValueError(f"join_info.how: unknown value {message.how}") from None
    return AssistJoinInfo(how=how, engine_step_id=message.engine_step_id, gpu_wait_us=message.gpu_wait_us,
                          step_start_ns=message.step_start_ns, step_end_ns=message.step_end_ns)


def join_info_to_bytes(info: AssistJoinInfo) -> bytes:
    """A join info as the payload of a shared-memory result slot."""
    return join_info_to_pb(info).SerializeToString()


def join_info_from_bytes(data: bytes) -> AssistJoinInfo | None:
    """The inverse of join_info_to_bytes; None for an empty payload (an older server); ValueError if undecodable."""
    if not data:
        return None
    try:
        message = assist_pb2.AssistJoinInfo.FromString(data)
    except Exception as exc:  # protobuf's DecodeError
        raise ValueError(f"join_info: undecodable bytes in the shared-memory result slot ({exc})") from None
    return join_info_from_pb(message)
