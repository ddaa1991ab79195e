"""Dense Assist's per-layer messages on the gRPC stream, without protobuf objects on the hot path.

Per layer an AssistDown carries q, k, v and an AssistUp the attention output. Built through the
generated classes (`tensor_to_pb` per tensor, the message, then gRPC's SerializeToString) and
read back the same way (`tensor_from_pb`: checks, a bytearray, `torch.frombuffer`, a view), the
four conversions cost 40-45 µs a layer on an idle host, several times that under load. Here:

- `encode_qkv_down` / `encode_attention_output_up` write the serialized message by hand, each
  tensor's bytes read straight from its memory (`ctypes.string_at`) after a head (key, lengths,
  dtype, shape) kept per shape, and the whole message joined once (-45% for q/k/v
  against joining each field in turn); the bytes
  are exactly what SerializeToString writes (tests/wire/test_assist_wire.py), so the peer may
  parse them with the generated classes;
- `serialize_up` / `serialize_down` are the stream's serializers: bytes pass as they are,
  messages are serialized;
- `QkvReceiver` copies a parsed AssistQkv's q, k, v into tensors it keeps per shape (one memmove
  each, no allocation): the next layer reuses them, so they are valid until the caller's attend
  returns, as the shared-memory ring's views are.

On a big-endian host (the wire is little-endian) everything goes through dualpace.wire.tensors.
"""

from __future__ import annotations

import ctypes
import sys

import torch

from dualpace.engine.assist_types import AssistQkv
from dualpace.wire.tensors import tensor_to_pb
from dualpace.wire.v1 import assist_pb2, common_pb2

_NATIVE_IS_WIRE = sys.byteorder == "little"
_DTYPE_NAMES = {torch.float32: b"float32", torch.bfloat16: b"bfloat16", torch.float16: b"float16"}
_DTYPES = {name.decode(): dtype for dtype, name in _DTYPE_NAMES.items()}
_VARINT, _LENGTH_DELIMITED = 0, 2
ASSIST_METHOD = "/{}/{}".format(*assist_pb2.DESCRIPTOR.services_by_name["DenseAssist"]
                                .methods_by_name["Assist"].full_name.rsplit(".", 1))


def _number(message, field: str) -> int:
    return message.DESCRIPTOR.fields_by_name[field].number


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


_T_DTYPE, _T_SHAPE, _T_DATA = (_key(_number(common_pb2.Tensor, f), _LENGTH_DELIMITED) for f in ("dtype", "shape", "data"))
_ITERATION, _LAYER = (_key(_number(assist_pb2.AssistQkv, f), _VARINT) for f in ("iteration_id", "layer"))
assert (_ITERATION, _LAYER) == tuple(_key(_number(assist_pb2.AssistAttentionOutput, f), _VARINT)
                                     for f in ("iteration_id", "layer"))
_Q, _K, _V = (_key(_number(assist_pb2.AssistQkv, f), _LENGTH_DELIMITED) for f in ("q", "k", "v"))
_OUTPUT = _key(_number(assist_pb2.AssistAttentionOutput, "attention_output"), _LENGTH_DELIMITED)
_DOWN_QKV = _key(_number(assist_pb2.AssistDown, "qkv"), _LENGTH_DELIMITED)
_UP_OUTPUT = _key(_number(assist_pb2.AssistUp, "attention_output"), _LENGTH_DELIMITED)
_dtype_fields: dict[torch.dtype, bytes] = {dtype: _T_DTYPE + _varint(len(name)) + name
                                          for dtype, name in _DTYPE_NAMES.items()}
_shape_fields: dict[tuple[int, ...], bytes] = {}


def _shape_field(shape: tuple[int, ...]) -> bytes:
    field = _shape_fields.get(shape)
    if field is None:
        packed = b"".join(_varint(dim) for dim in shape)
        field = _T_SHAPE + _varint(len(packed)) + packed if shape else b""
        if len(_shape_fields) < 1024:  # a handful of shapes per stream in practice
            _shape_fields[shape] = field
    return field


def _tensor(tensor: torch.Tensor) -> bytes:
    """A serialized common.Tensor of `tensor` (any device and strides; bytes copied once)."""
    dtype_field = _dtype_fields.get(tensor.dtype)
    if dtype_field is None or not _NATIVE_IS_WIRE:
        return tensor_to_pb(tensor).SerializeToString()  # raises for an unknown dtype, swaps bytes if needed
    if not (tensor.is_cpu and tensor.is_contiguous()):
        tensor = tensor.detach().to("cpu").contiguous()
    num_bytes = tensor.nbytes
    data = ctypes.string_at(tensor.data_ptr(), num_bytes) if num_bytes else b""
    data_key = _T_DATA + _varint(num_bytes) if num_bytes else b""
    return b"".join((dtype_field, _shape_field(tuple(tensor.shape)), data_key, data))


_heads: dict[tuple[bytes, torch.dtype, tuple[int, ...]], tuple[bytes, int]] = {}


def _head(key: bytes, tensor: torch.Tensor) -> tuple[bytes, int] | None:
    """The bytes before a tensor's data in field `key` holding its common.Tensor (the key, the field's
    length, dtype, shape and the data's key), and the field's length in bytes; None where the tensor
    is not plain CPU memory in a dtype written by hand. Kept per (key, dtype, shape): a stream's
    layers repeat a few shapes."""
    shape = tuple(tensor.shape)
    cached = _heads.get((key, tensor.dtype, shape))
    if cached is not None:
        return cached
    dtype_field = _dtype_fields.get(tensor.dtype)
    if dtype_field is None or not _NATIVE_IS_WIRE:
        return None
    num_bytes = tensor.nbytes
    fields = dtype_field + _shape_field(shape) + (_T_DATA + _varint(num_bytes) if num_bytes else b"")
    head = key + _varint(len(fields) + num_bytes) + fields
    made = head, len(head) + num_bytes
    if len(_heads) < 1024:
        _heads[(key, tensor.dtype, shape)] = made
    return made


def _tensor_field(key: bytes, tensor: torch.Tensor, parts: list[bytes]) -> int:
    """Append field `key` holding a serialized common.Tensor of `tensor` to parts (its head, then its
    bytes, to be joined once with the rest of the message); returns the field's length in bytes."""
    head = _head(key, tensor) if tensor.is_cpu and tensor.is_contiguous() else None
    if head is None:  # another device, strides or dtype: through _tensor
        body = _tensor(tensor)
        prefix = key + _varint(len(body))
        parts += (prefix, body)
        return len(prefix) + len(body)
    parts.append(head[0])
    if tensor.nbytes:
        parts.append(ctypes.string_at(tensor.data_ptr(), tensor.nbytes))
    return head[1]


def _ids(iteration_id: int, layer: int) -> bytes:
    return ((_ITERATION + _varint(iteration_id) if iteration_id else b"")
            + (_LAYER + _varint(layer) if layer else b""))


def encode_qkv_down(iteration_id: int, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bytes:
    """The serialized AssistDown(qkv=AssistQkv(iteration_id, layer, q, k, v)), joined once."""
    ids = _ids(iteration_id, layer)
    parts = [b"", ids]  # parts[0]: the qkv field's key and length, known once the tensors are in
    num_bytes = len(ids) + _tensor_field(_Q, q, parts) + _tensor_field(_K, k, parts) + _tensor_field(_V, v, parts)
    parts[0] = _DOWN_QKV + _varint(num_bytes)
    return b"".join(parts)


def encode_attention_output_up(iteration_id: int, layer: int, attention_output: torch.Tensor) -> bytes:
    """The serialized AssistUp(attention_output=AssistAttentionOutput(iteration_id, layer, output)), joined once."""
    ids = _ids(iteration_id, layer)
    parts = [b"", ids]  # parts[0]: the attention_output field's key and length
    num_bytes = len(ids) + _tensor_field(_OUTPUT, attention_output, parts)
    parts[0] = _UP_OUTPUT + _varint(num_bytes)
    return b"".join(parts)


# The stream's deserializers (the generated parsers themselves; named here so that code outside
# dualpace/wire, a timing probe say, can wrap them without importing protobuf).
parse_up = assist_pb2.AssistUp.FromString
parse_down = assist_pb2.AssistDown.FromString


def serialize_up(message: assist_pb2.AssistUp | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def serialize_down(message: assist_pb2.AssistDown | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class QkvReceiver:
    """Reads AssistQkv messages into tensors kept per (dtype, shape) and reused layer after layer."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def qkv(self, message: assist_pb2.AssistQkv) -> AssistQkv:
        """The message's q, k, v in this receiver's tensors (overwritten by the next call); ValueError
        naming the field for an unknown dtype or data whose length does not fit the shape."""
        return AssistQkv(message.iteration_id, message.layer, self._into(message.q, "qkv.q", 0),
                         self._into(message.k, "qkv.k", 1), self._into(message.v, "qkv.v", 2))

    def _into(self, message: common_pb2.Tensor, field: str, slot: int) -> torch.Tensor:
        key = (message.dtype, tuple(message.shape), slot)
        target = self._buffers.get(key)
        if target is None:
            dtype = _DTYPES.get(message.dtype)
            if dtype is None or not _NATIVE_IS_WIRE:
                from dualpace.wire.tensors import tensor_from_pb  # checks, names the field, swaps bytes
                return tensor_from_pb(message, field=field)
            if any(dim < 0 for dim in key[1]):
                raise ValueError(f"{field}: shape {list(key[1])} has a negative dimension")
            if len(self._buffers) >= 96:  # shapes change with the batch; keep a bounded few
                self._buffers.clear()
            target = self._buffers[key] = torch.empty(key[1], dtype=dtype)
        data = message.data
        if len(data) != target.nbytes:
            raise ValueError(f"{field}: data is {len(data)} bytes but shape {list(key[1])} of {message.dtype} "
                             f"needs {target.nbytes} bytes ({target.element_size()} per element)")
        if data:
            ctypes.memmove(target.data_ptr(), data, len(data))
        return target
