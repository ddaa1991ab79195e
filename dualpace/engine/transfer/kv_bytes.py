"""A KV transfer's bytes <-> torch tensors (the torch half of kv_transfer.py)."""

from __future__ import annotations

import warnings

import torch

from dualpace.errors import InvalidArgument

# Set once here, not per call: warnings.catch_warnings is not thread-safe, and imports run in worker threads.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a CPU tensor (16-bit floats through an int16 view)."""
    tensor = tensor.contiguous().cpu()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def tensor_from_bytes(data: bytes, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = DTYPES_BY_NAME[dtype_name]
    expected = dtype.itemsize
    for dim in shape:
        expected *= dim
    if len(data) != expected:
        raise InvalidArgument("kv", f"holds {len(data)} bytes, expected {expected} for shape {list(shape)}")
    raw_dtype = torch.int16 if dtype in (torch.bfloat16, torch.float16) else dtype
    if not data:
        return torch.empty(shape, dtype=dtype)
    # A view of the received (read-only) bytes, no copy: it is only read, by the scatter into the
    # KV pool (torch's warning about writing to it is silenced below).
    return torch.frombuffer(data, dtype=raw_dtype).view(dtype).view(shape)
