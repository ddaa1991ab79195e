"""The one place that converts between protobuf messages and core types.

Servicers and clients call these functions at the gRPC boundary and work with
core types everywhere else. Malformed messages raise ValueError with a message
that names the field and the problem; conversion does not range-check values
(call SamplingParams.validate for that).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from dualpace.sampling import FinishReason, SamplingParams
from dualpace.wire.v1 import common_pb2

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
