"""Conversions for the dualpace.v1.Assist service: Dense Assist core types <-> protobuf."""

from __future__ import annotations

from dualpace.engine.assist_types import AssistAttentionOutput, AssistBegin, AssistQkv, AssistResult
from dualpace.wire.common import (
    sampling_params_from_pb,
    sampling_params_to_pb,
    token_ids_from_pb,
    token_ids_to_list,
    token_ids_to_pb,
)
from dualpace.wire.tensors import tensor_from_pb, tensor_to_pb
from dualpace.wire.v1 import assist_pb2


def assist_up_to_pb(item: AssistBegin | AssistAttentionOutput) -> assist_pb2.AssistUp:
    """Core begin / attention output -> AssistUp; each row's seed is written into its SamplingParams."""
    if isinstance(item, AssistBegin):
        begin = assist_pb2.AssistBegin(
            iteration_id=item.iteration_id,
            token_ids=token_ids_to_list(item.token_ids),
            positions=token_ids_to_list(item.positions, field="positions"),
            return_logits=item.sampling is None,
            wait_for_engine_iteration=item.wait_for_engine_iteration,
            max_device_wait_ms=item.max_device_wait_ms,
        )
        for params, seed in item.sampling or ():
            row = sampling_params_to_pb(params)
            row.seed = seed
            begin.sampling.append(row)
        return assist_pb2.AssistUp(begin=begin)
    return assist_pb2.AssistUp(
        attention_output=assist_pb2.AssistAttentionOutput(
            iteration_id=item.iteration_id,
            layer=item.layer,
            attention_output=tensor_to_pb(item.attention_output),
        )
    )


def assist_up_from_pb(message: assist_pb2.AssistUp) -> AssistBegin | AssistAttentionOutput:
    """AssistUp -> core begin / attention output.

    Raises ValueError naming the field when no kind is set, when return_logits
    is set together with sampling entries, when a sampling entry has no seed,
    or when the tensor is malformed.
    """
    kind = message.WhichOneof("kind")
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
        )
    if kind == "attention_output":
        output = message.attention_output
        return AssistAttentionOutput(
            iteration_id=output.iteration_id,
            layer=output.layer,
            attention_output=tensor_from_pb(output.attention_output, field="attention_output.attention_output"),
        )
    raise ValueError("kind: an AssistUp must set begin or attention_output")


def assist_down_to_pb(item: AssistQkv | AssistResult) -> assist_pb2.AssistDown:
    """Core qkv / result -> AssistDown (tensors are copied to the host if needed)."""
    if isinstance(item, AssistQkv):
        return assist_pb2.AssistDown(
            qkv=assist_pb2.AssistQkv(
                iteration_id=item.iteration_id,
                layer=item.layer,
                q=tensor_to_pb(item.q),
                k=tensor_to_pb(item.k),
                v=tensor_to_pb(item.v),
            )
        )
    if (item.token_ids is None) == (item.logits is None):
        raise ValueError("result: exactly one of token_ids and logits must be set")
    result = assist_pb2.AssistResult(iteration_id=item.iteration_id)
    if item.token_ids is not None:
        result.sampled.CopyFrom(token_ids_to_pb(item.token_ids))
    else:
        result.logits.CopyFrom(tensor_to_pb(item.logits))
    return assist_pb2.AssistDown(result=result)


def assist_down_from_pb(message: assist_pb2.AssistDown) -> AssistQkv | AssistResult:
    """AssistDown -> core qkv / result. Raises ValueError naming the field when malformed."""
    kind = message.WhichOneof("kind")
    if kind == "qkv":
        qkv = message.qkv
        return AssistQkv(
            iteration_id=qkv.iteration_id,
            layer=qkv.layer,
            q=tensor_from_pb(qkv.q, field="qkv.q"),
            k=tensor_from_pb(qkv.k, field="qkv.k"),
            v=tensor_from_pb(qkv.v, field="qkv.v"),
        )
    if kind == "result":
        result = message.result
        output = result.WhichOneof("output")
        if output == "sampled":
            return AssistResult(iteration_id=result.iteration_id, token_ids=token_ids_from_pb(result.sampled))
        if output == "logits":
            return AssistResult(
                iteration_id=result.iteration_id, logits=tensor_from_pb(result.logits, field="result.logits")
            )
        raise ValueError("result.output: must set sampled or logits")
    raise ValueError("kind: an AssistDown must set qkv or result")
