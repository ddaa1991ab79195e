"""The one place that converts between protobuf messages and core types.

Servicers and clients call these functions at the gRPC boundary and work with
core types everywhere else. Malformed messages raise ValueError with a message
that names the field and the problem; conversion does not range-check values
(call SamplingParams.validate for that).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dualpace.sampling import FinishReason, SamplingParams
from dualpace.wire.v1 import assist_pb2, common_pb2

# ---- sampling parameters -------------------------------------------------

_DEFAULT_SAMPLING = SamplingParams()


def sampling_params_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    """Core SamplingParams -> message; every field is set explicitly."""
    message = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        message.seed = params.seed
    return message


def sampling_params_from_pb(message: common_pb2.SamplingParams) -> SamplingParams:
    """Message -> core SamplingParams; absent optional fields take the core defaults."""
    return SamplingParams(
        max_tokens=message.max_tokens if message.HasField("max_tokens") else _DEFAULT_SAMPLING.max_tokens,
        temperature=message.temperature,
        top_p=message.top_p if message.HasField("top_p") else _DEFAULT_SAMPLING.top_p,
        top_k=message.top_k,
        min_p=message.min_p,
        seed=message.seed if message.HasField("seed") else None,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
    )


# ---- finish reason --------------------------------------------------------

_FINISH_REASON_TO_PB: dict[FinishReason, int] = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_FINISH_REASON_FROM_PB: dict[int, FinishReason] = {value: reason for reason, value in _FINISH_REASON_TO_PB.items()}


def finish_reason_to_pb(reason: FinishReason | None) -> int:
    """Core FinishReason (None: not finished) -> FinishReason enum value."""
    if reason is None:
        return common_pb2.FINISH_REASON_UNSPECIFIED
    return _FINISH_REASON_TO_PB[reason]


def finish_reason_from_pb(value: int) -> FinishReason | None:
    """FinishReason enum value -> core FinishReason; UNSPECIFIED is None (not finished)."""
    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    try:
        return _FINISH_REASON_FROM_PB[value]
    except KeyError:
        raise ValueError(f"finish_reason: unknown enum value {value}") from None


# ---- token ids ------------------------------------------------------------

_MAX_TOKEN_ID = 2**32 - 1


def token_ids_to_list(token_ids: Iterable[int] | torch.Tensor, field: str = "token_ids") -> list[int]:
    """Token ids (ints or a 1-D integer tensor) -> a list of ints for a repeated uint32 field."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.is_floating_point() or token_ids.is_complex():
            raise ValueError(f"{field}: expected a 1-D integer tensor, got {token_ids.dtype} of shape {list(token_ids.shape)}")
        token_ids = token_ids.tolist()
    id_list = [int(token_id) for token_id in token_ids]
    for token_id in id_list:
        if not 0 <= token_id <= _MAX_TOKEN_ID:
            raise ValueError(f"{field}: token id {token_id} is outside [0, 2^32 - 1]")
    return id_list


def token_ids_to_pb(token_ids: Iterable[int] | torch.Tensor) -> common_pb2.TokenIds:
    """Token ids -> TokenIds message."""
    return common_pb2.TokenIds(token_ids=token_ids_to_list(token_ids))


def token_ids_from_pb(token_ids: common_pb2.TokenIds | Sequence[int]) -> list[int]:
    """TokenIds message (or a repeated uint32 field) -> list of ints."""
    if isinstance(token_ids, common_pb2.TokenIds):
        return list(token_ids.token_ids)
    return list(token_ids)


# ---- tensors --------------------------------------------------------------

# dtype name -> (torch dtype, integer dtype of the same width, its little-endian numpy code)
_TENSOR_DTYPES: dict[str, tuple[torch.dtype, torch.dtype, str]] = {
    "float32": (torch.float32, torch.int32, "<i4"),
    "bfloat16": (torch.bfloat16, torch.int16, "<i2"),
    "float16": (torch.float16, torch.int16, "<i2"),
}
_DTYPE_NAMES: dict[torch.dtype, str] = {torch_dtype: name for name, (torch_dtype, _, _) in _TENSOR_DTYPES.items()}


def tensor_to_pb(tensor: torch.Tensor) -> common_pb2.Tensor:
    """Torch tensor (any device, any strides) -> Tensor message, little-endian, C order.

    bfloat16 has no numpy type, so every dtype is serialized through an
    integer view of the same width: the bits are copied exactly.
    """
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise ValueError(f"tensor: dtype {tensor.dtype} is not supported; expected one of {sorted(_TENSOR_DTYPES)}")
    _, int_dtype, wire_int_dtype = _TENSOR_DTYPES[name]
    host_tensor = tensor.detach().to("cpu").contiguous()
    int_array = host_tensor.view(int_dtype).numpy()
    data = int_array.astype(wire_int_dtype, copy=False).tobytes(order="C")
    return common_pb2.Tensor(dtype=name, shape=list(host_tensor.shape), data=data)


def tensor_from_pb(
    message: common_pb2.Tensor,
    field: str = "tensor",
    expected_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """Tensor message -> a new CPU torch tensor that owns its memory.

    field names the message in errors. With expected_shape, the message's
    shape must equal it exactly. Raises ValueError for an unknown dtype, a
    negative dimension, or data whose length is not product(shape) * itemsize.
    """
    dtype_entry = _TENSOR_DTYPES.get(message.dtype)
    if dtype_entry is None:
        raise ValueError(f"{field}: unknown dtype {message.dtype!r}; expected one of {sorted(_TENSOR_DTYPES)}")
    torch_dtype, _, wire_int_dtype = dtype_entry
    shape = list(message.shape)
    if any(dim < 0 for dim in shape):
        raise ValueError(f"{field}: shape {shape} has a negative dimension")
    if expected_shape is not None and shape != list(expected_shape):
        raise ValueError(f"{field}: shape {shape} does not match the expected {list(expected_shape)}")
    itemsize_bytes = torch_dtype.itemsize
    expected_num_bytes = math.prod(shape) * itemsize_bytes
    if len(message.data) != expected_num_bytes:
        raise ValueError(
            f"{field}: data is {len(message.data)} bytes but shape {shape} of {message.dtype} "
            f"needs {expected_num_bytes} bytes ({itemsize_bytes} per element)"
        )
    wire_array = np.frombuffer(message.data, dtype=wire_int_dtype)
    native_array = wire_array.astype(wire_array.dtype.newbyteorder("="), copy=True)
    return torch.from_numpy(native_array).view(torch_dtype).reshape(shape)


# ---- Dense Assist ---------------------------------------------------------
# Core-side views of the DenseAssist stream messages (assist.proto): plain
# values and CPU torch tensors. Conversion checks structure (kinds set, seeds
# present, tensor encodings); the executor checks values against the model and
# the iteration in progress.


@dataclass(frozen=True)
class AssistBegin:
    """Starts an iteration. sampling: one (params, seed) per row, or None to get logits back."""

    iteration_id: int
    token_ids: list[int]
    positions: list[int]
    sampling: list[tuple[SamplingParams, int]] | None
    wait_for_engine_iteration: bool = False  # the gated (NEO-like) baseline policy
    max_device_wait_ms: int = 0  # 0: wait for the device as long as the server allows


@dataclass(frozen=True)
class AssistAttentionOutput:
    """The CPU's attention output for one layer, [batch, num_heads * head_dim]."""

    iteration_id: int
    layer: int
    attention_output: torch.Tensor


@dataclass(frozen=True)
class AssistQkv:
    """q [batch, num_heads, head_dim], k and v [batch, num_kv_heads, head_dim] of one layer, RoPE applied."""

    iteration_id: int
    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class AssistResult:
    """An iteration's outcome: sampled token ids, or float32 logits [batch, vocab] (exactly one is set)."""

    iteration_id: int
    token_ids: list[int] | None = None
    logits: torch.Tensor | None = None


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
