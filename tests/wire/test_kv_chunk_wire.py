"""The hand-encoded ImportKv chunk is byte for byte what protobuf writes, from any buffers."""

from __future__ import annotations

import pytest
import torch

from dualpace.engine.transfer.kv_bytes import tensor_buffer, tensor_from_bytes
from dualpace.engine.transfer.kv_transfer import KvChunk
from dualpace.wire.engine_messages import kv_chunk_from_pb, kv_chunk_to_pb
from dualpace.wire.kv_chunk_wire import IMPORT_KV_METHOD, encode_kv_chunk_message, serialize_import_message
from dualpace.wire.v1 import engine_pb2


@pytest.mark.parametrize("seq, layer, start, end, size, crc", [
    (0, 0, 0, 1, 4, 0), (1, 2, 16, 32, 3 * 64 * 4 * 16, 0xFFFFFFFF), (300, 29, 1000, 1024, 200000, 12345),
    (5, 1, 0, 2, 0, 7),
])
def test_encoding_equals_protobuf(seq, layer, start, end, size, crc):
    k = bytes(i % 251 for i in range(size))
    v = bytes((3 * i) % 241 for i in range(size))
    chunk = KvChunk(seq, layer, start, end, k, v, crc)
    encoded = encode_kv_chunk_message(chunk)
    assert encoded == kv_chunk_to_pb(chunk).SerializeToString()
    assert kv_chunk_from_pb(engine_pb2.ImportKvMessage.FromString(encoded).chunk) == chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_buffers_round_trip(dtype):
    k = torch.randn(7, 3, 8).to(dtype)
    v = torch.randn(7, 3, 8).to(dtype)
    chunk = KvChunk(0, 1, 0, 7, tensor_buffer(k), tensor_buffer(v), 99)
    parsed = engine_pb2.ImportKvMessage.FromString(encode_kv_chunk_message(chunk)).chunk
    name = str(dtype).removeprefix("torch.")
    assert torch.equal(tensor_from_bytes(parsed.k, name, (7, 3, 8)), k)
    assert torch.equal(tensor_from_bytes(parsed.v, name, (7, 3, 8)), v)


def test_other_messages_serialize_as_before():
    prepare = engine_pb2.ImportKvMessage(prepare=engine_pb2.ImportKvPrepare())
    assert serialize_import_message(prepare) == prepare.SerializeToString()
    assert serialize_import_message(b"raw") == b"raw"
    assert IMPORT_KV_METHOD == "/dualpace.v1.Engine/ImportKv"


def test_a_batch_is_what_protobuf_writes_and_parses_back_to_its_chunks():
    from dualpace.wire.kv_chunk_wire import encode_chunk_batch

    chunks = [KvChunk(seq, seq % 3, 0, 2, bytes(range(seq, seq + 24)), bytes(24), 1000 + seq) for seq in range(5)]
    expected = engine_pb2.ImportKvMessage(chunk_batch=engine_pb2.KvChunkBatch(
        chunks=[kv_chunk_to_pb(chunk).chunk for chunk in chunks]))
    encoded = encode_chunk_batch(chunks)
    assert encoded == expected.SerializeToString()
    parsed = engine_pb2.ImportKvMessage.FromString(encoded).chunk_batch.chunks
    assert [kv_chunk_from_pb(chunk) for chunk in parsed] == chunks
