"""The hand-encoded Dense Assist per-layer messages are protobuf's bytes; QkvReceiver reads them back."""

from __future__ import annotations

import pytest
import torch

from dualpace.engine.assist.assist_types import AssistAttentionOutput, AssistQkv
from dualpace.wire import assist_messages, assist_wire
from dualpace.wire.v1 import assist_pb2, common_pb2

DTYPES = (torch.bfloat16, torch.float32, torch.float16)
IDS = ((0, 0), (1, 3), (300, 29), (2**40, 0))


def _qkv(batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(batch, heads, 64).to(dtype) for heads in (9, 3, 3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", (0, 1, 8, 200))
def test_encoders_write_what_protobuf_writes(batch, dtype):
    q, k, v = _qkv(batch, dtype)
    output = torch.randn(batch, 576).to(dtype)
    for iteration_id, layer in IDS:
        assert assist_wire.encode_qkv_down(iteration_id, layer, q, k, v) == assist_messages.assist_down_to_pb(
            AssistQkv(iteration_id, layer, q, k, v)).SerializeToString()
        assert assist_wire.encode_attention_output_up(iteration_id, layer, output) == assist_messages.assist_up_to_pb(
            AssistAttentionOutput(iteration_id, layer, output)).SerializeToString()


def test_strided_tensors_are_encoded_as_their_contiguous_copies():
    q, k, v = (tensor.transpose(0, 1) for tensor in _qkv(4, torch.bfloat16))
    expected = assist_messages.assist_down_to_pb(AssistQkv(5, 2, q, k, v)).SerializeToString()
    assert assist_wire.encode_qkv_down(5, 2, q, k, v) == expected


def test_heads_kept_per_shape_follow_shape_dtype_and_field():
    # the same shapes in another dtype, a strided attention output, then the first shapes again:
    # every message is still protobuf's bytes (a head kept for one (field, dtype, shape) is not reused
    # for another)
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        q, k, v = _qkv(3, dtype)
        assert assist_wire.encode_qkv_down(7, 1, q, k, v) == assist_messages.assist_down_to_pb(
            AssistQkv(7, 1, q, k, v)).SerializeToString()
        output = torch.randn(576, 3).to(dtype).t()
        assert assist_wire.encode_attention_output_up(7, 1, output) == assist_messages.assist_up_to_pb(
            AssistAttentionOutput(7, 1, output)).SerializeToString()


def test_serializers_pass_bytes_and_serialize_messages():
    up = assist_pb2.AssistUp(begin=assist_pb2.AssistBegin(iteration_id=4))
    assert assist_wire.serialize_up(b"\x01") == b"\x01"
    assert assist_wire.serialize_up(up) == up.SerializeToString()
    down = assist_pb2.AssistDown(result=assist_pb2.AssistResult(iteration_id=4))
    assert assist_wire.serialize_down(down) == down.SerializeToString()


@pytest.mark.parametrize("dtype", DTYPES)
def test_receiver_reads_bit_exact_and_reuses_its_tensors(dtype):
    receiver = assist_wire.QkvReceiver()
    first = _qkv(8, dtype)
    message = assist_pb2.AssistDown.FromString(assist_wire.encode_qkv_down(7, 1, *first)).qkv
    got = receiver.qkv(message)
    assert (got.iteration_id, got.layer) == (7, 1)
    for sent, received in zip(first, (got.q, got.k, got.v)):
        assert received.dtype == dtype and torch.equal(received.view(torch.uint8), sent.view(torch.uint8))
    second = _qkv(8, dtype)
    again = receiver.qkv(assist_pb2.AssistDown.FromString(assist_wire.encode_qkv_down(7, 2, *second)).qkv)
    assert again.q.data_ptr() == got.q.data_ptr() and torch.equal(again.v, second[2])
    assert got.k.data_ptr() != got.v.data_ptr()  # same shape, separate tensors


def test_receiver_rejects_what_tensor_from_pb_rejects():
    receiver = assist_wire.QkvReceiver()
    good = common_pb2.Tensor(dtype="bfloat16", shape=[2, 3], data=bytes(12))
    with pytest.raises(ValueError, match="qkv.k: data is 11 bytes"):
        receiver.qkv(assist_pb2.AssistQkv(q=good, k=common_pb2.Tensor(dtype="bfloat16", shape=[2, 3], data=bytes(11)),
                                          v=good))
    with pytest.raises(ValueError, match="qkv.q: unknown dtype"):
        receiver.qkv(assist_pb2.AssistQkv(q=common_pb2.Tensor(dtype="int8", shape=[1], data=b"\x00"), k=good, v=good))
    with pytest.raises(ValueError, match="negative dimension"):
        receiver.qkv(assist_pb2.AssistQkv(q=common_pb2.Tensor(dtype="float32", shape=[-1], data=b""), k=good, v=good))
