"""An ImportKv chunk message encoded straight from the KV buffers (the sender's fast path).

`engine_pb2.ImportKvMessage(chunk=...).SerializeToString()` copies K and V twice on the
way (into the message, then into the serialized string), after the tensor -> bytes copy
before it. Here the protobuf encoding of an ImportKvMessage carrying one KvChunk is built by
hand and joined once with K and V taken as buffers (memoryviews of the exported tensors):
one copy from the gathered KV into the bytes gRPC sends. The bytes are exactly what
SerializeToString writes for the same chunk (tests/wire/test_kv_chunk_wire.py), so the
target parses them with the generated class as before. Several chunks may go as one
KvChunkBatch message (`encode_chunk_batch`), also one copy.
"""

from __future__ import annotations

from dualpace.engine.transfer.kv_transfer import KvChunk
from dualpace.wire.v1 import engine_pb2

_VARINT, _LENGTH_DELIMITED = 0, 2
_CHUNK_FIELD = engine_pb2.ImportKvMessage.DESCRIPTOR.fields_by_name["chunk"].number
_FIELDS = {name: field.number for name, field in engine_pb2.KvChunk.DESCRIPTOR.fields_by_name.items()}
IMPORT_KV_METHOD = "/{}/{}".format(*engine_pb2.DESCRIPTOR.services_by_name["Engine"]
                                   .methods_by_name["ImportKv"].full_name.rsplit(".", 1))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field_number: int, wire_type: int) -> bytes:
    return _varint(field_number << 3 | wire_type)


_BATCH_KEY = _key(engine_pb2.ImportKvMessage.DESCRIPTOR.fields_by_name["chunk_batch"].number, _LENGTH_DELIMITED)
# the batch's body is ImportKvMessage(chunk) messages end to end: the two fields share a number
assert engine_pb2.KvChunkBatch.DESCRIPTOR.fields_by_name["chunks"].number == _CHUNK_FIELD


def _scalar(name: str, value: int) -> bytes:
    return _key(_FIELDS[name], _VARINT) + _varint(value) if value else b""  # proto3: zero is not written


def _length(name: str, size: int) -> bytes:
    return _key(_FIELDS[name], _LENGTH_DELIMITED) + _varint(size)


def encode_kv_chunk_message(chunk: KvChunk) -> bytes:
    """The serialized ImportKvMessage(chunk=KvChunk(...)) for `chunk`, whose k and v may be any
    contiguous byte buffers; they are copied once, into the result."""
    return b"".join(kv_chunk_message_parts(chunk))


def encode_chunk_batch(chunks: list[KvChunk]) -> bytes:
    """The serialized ImportKvMessage(chunk_batch=KvChunkBatch(chunks=[...])): KvChunkBatch.chunks has
    ImportKvMessage.chunk's field number, so its body is the chunks' messages end to end; k and v are
    copied once, into the result."""
    parts = [part for chunk in chunks for part in kv_chunk_message_parts(chunk)]
    return b"".join([_BATCH_KEY, _varint(sum(map(len, parts))), *parts])


def kv_chunk_message_parts(chunk: KvChunk) -> list:
    """encode_kv_chunk_message's bytes in pieces (k and v as memoryviews over the chunk's buffers)."""
    k, v = memoryview(chunk.k).cast("B"), memoryview(chunk.v).cast("B")
    head = b"".join([_scalar("seq", chunk.seq), _scalar("layer", chunk.layer),
                     _scalar("token_start", chunk.token_start), _scalar("token_end", chunk.token_end)])
    k_key = _length("k", len(k)) if len(k) else b""
    v_key = _length("v", len(v)) if len(v) else b""
    tail = _scalar("crc32", chunk.crc32)
    body_size = len(head) + len(k_key) + len(k) + len(v_key) + len(v) + len(tail)
    prefix = _key(_CHUNK_FIELD, _LENGTH_DELIMITED) + _varint(body_size) + head + k_key
    return [prefix, k, v_key, v, tail]


def serialize_import_message(message: engine_pb2.ImportKvMessage | bytes) -> bytes:
    """The ImportKv request serializer: chunks come pre-encoded (bytes), the rest as messages."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def decode_kv_chunk_message(data: bytes) -> KvChunk:
    """The chunk in a serialized ImportKvMessage, as the target's servicer reads it (benchmarks)."""
    from dualpace.wire.engine_messages import kv_chunk_from_pb

    return kv_chunk_from_pb(engine_pb2.ImportKvMessage.FromString(data).chunk)
