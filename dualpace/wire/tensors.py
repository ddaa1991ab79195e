"""Conversion of tensors (common.proto Tensor) <-> CPU torch tensors, bit-exact."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np
import torch

from dualpace.wire.v1 import common_pb2

# dtype name -> (torch dtype, integer dtype of the same width, its little-endian numpy code)
_TENSOR_DTYPES: dict[str, tuple[torch.dtype, torch.dtype, str]] = {
    "float32": (torch.float32, torch.int32, "<i4"),
    "bfloat16": (torch.bfloat16, torch.int16, "<i2"),
    "float16": (torch.float16, torch.int16, "<i2"),
}
_DTYPE_NAMES: dict[torch.dtype, str] = {torch_dtype: name for name, (torch_dtype, _, _) in _TENSOR_DTYPES.items()}
# The wire is little-endian: on such a host the bytes go as they are (no byte-order pass, fewer
# temporaries; a Dense Assist layer over gRPC converts four tensors each way).
_NATIVE_IS_WIRE = sys.byteorder == "little"


def tensor_to_pb(tensor: torch.Tensor) -> common_pb2.Tensor:
    """Torch tensor (any device, any strides) -> Tensor message, little-endian, C order.

    bfloat16 has no numpy type, so every dtype is serialized through an
    integer view of the same width: the bits are copied exactly.
    """
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise ValueError(f"tensor: dtype {tensor.dtype} is not supported; expected one of {sorted(_TENSOR_DTYPES)}")
    _, int_dtype, wire_int_dtype = _TENSOR_DTYPES[name]
    host_tensor = tensor.detach()
    if not (host_tensor.is_cpu and host_tensor.is_contiguous()):
        host_tensor = host_tensor.to("cpu").contiguous()
    int_array = host_tensor.view(int_dtype).numpy()
    if not _NATIVE_IS_WIRE:
        int_array = int_array.astype(wire_int_dtype, copy=False)
    return common_pb2.Tensor(dtype=name, shape=list(host_tensor.shape), data=int_array.tobytes(order="C"))


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
    if _NATIVE_IS_WIRE and expected_num_bytes:  # one copy, into memory the tensor owns
        return torch.frombuffer(bytearray(message.data), dtype=torch_dtype).view(shape)
    wire_array = np.frombuffer(message.data, dtype=wire_int_dtype)
    native_array = wire_array.astype(wire_array.dtype.newbyteorder("="), copy=True)
    return torch.from_numpy(native_array).view(torch_dtype).reshape(shape)
